"""Fixed-order row and column sums for the norms and softmax, and the fused RMSNorm
forward/backward rows. Host side: ``rlkernels.ops.norms``."""
from __future__ import annotations

from ._triton import tl, triton

if triton is not None:

    @triton.jit
    def pairwise_sum_1024(x):
        # A fixed pairwise tree over lane *indices*: each level adds x[2i] + x[2i+1].
        # tl.sum's own tree follows the register layout, which Triton derives from how
        # the arguments specialize (R and strides divisible by 16 or not), so a padded
        # row could be summed in another order (seen on H100). A two-element sum is
        # commutative, so this tree has one result whatever the layout.
        x = tl.sum(tl.reshape(x, (512, 2)), axis=1)
        x = tl.sum(tl.reshape(x, (256, 2)), axis=1)
        x = tl.sum(tl.reshape(x, (128, 2)), axis=1)
        x = tl.sum(tl.reshape(x, (64, 2)), axis=1)
        x = tl.sum(tl.reshape(x, (32, 2)), axis=1)
        x = tl.sum(tl.reshape(x, (16, 2)), axis=1)
        x = tl.sum(tl.reshape(x, (8, 2)), axis=1)
        x = tl.sum(tl.reshape(x, (4, 2)), axis=1)
        x = tl.sum(tl.reshape(x, (2, 2)), axis=1)
        return tl.sum(x, axis=0)

    @triton.jit
    def pairwise_row_sums(x, ROWS: tl.constexpr, WIDTH: tl.constexpr):
        # pairwise_sum_1024 of each row of x [ROWS, WIDTH] (WIDTH a power of two, 2..1024)
        # padded with zero lanes: the tree's first levels over WIDTH lanes are the same
        # pairs, and the levels above them add +0.0 to one value, which leaves it alone
        # (a sum of squares is never -0.0).
        if WIDTH >= 1024:
            x = tl.sum(tl.reshape(x, (ROWS, 512, 2)), axis=2)
        if WIDTH >= 512:
            x = tl.sum(tl.reshape(x, (ROWS, 256, 2)), axis=2)
        if WIDTH >= 256:
            x = tl.sum(tl.reshape(x, (ROWS, 128, 2)), axis=2)
        if WIDTH >= 128:
            x = tl.sum(tl.reshape(x, (ROWS, 64, 2)), axis=2)
        if WIDTH >= 64:
            x = tl.sum(tl.reshape(x, (ROWS, 32, 2)), axis=2)
        if WIDTH >= 32:
            x = tl.sum(tl.reshape(x, (ROWS, 16, 2)), axis=2)
        if WIDTH >= 16:
            x = tl.sum(tl.reshape(x, (ROWS, 8, 2)), axis=2)
        if WIDTH >= 8:
            x = tl.sum(tl.reshape(x, (ROWS, 4, 2)), axis=2)
        if WIDTH >= 4:
            x = tl.sum(tl.reshape(x, (ROWS, 2, 2)), axis=2)
        return tl.sum(x, axis=1)

    @triton.jit
    def rms_rstd(sum_sq, N, eps):
        # div_rn: a plain fp32 '/' compiles to an approximate division on NVIDIA GPUs.
        return tl.rsqrt(tl.math.div_rn(sum_sq, N * 1.0) + eps)

    @triton.jit
    def rms_scale(x, rstd, w, dt: tl.constexpr, KEEP_FP32: tl.constexpr, HAS_W: tl.constexpr):
        # The normed value in fp32, before its rounding to the output's dtype.
        xhat = x.to(tl.float32) * rstd
        if KEEP_FP32:
            h = xhat
        else:
            # HF rounds xhat to the input dtype before the weight multiply.
            h = xhat.to(dt).to(tl.float32)
        if HAS_W:
            # One fp32 product rounded once to the promoted dtype, as torch's mul.
            h = w.to(tl.float32) * h
        return h

    @triton.jit
    def row_dot_kernel(a_ptr, b_ptr, out_ptr, R, stride_a, stride_b,
                        HAS_B: tl.constexpr, BLOCK: tl.constexpr):
        # One row per program; lanes accumulate tile by tile in ascending order.
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, R, BLOCK):
            idx = start + offs
            mask = idx < R
            a = tl.load(a_ptr + row * stride_a + idx.to(tl.int64), mask=mask, other=0.0).to(tl.float32)
            if HAS_B:
                b = tl.load(b_ptr + row * stride_b + idx.to(tl.int64), mask=mask, other=0.0).to(tl.float32)
                a = a * b
            acc += a
        tl.store(out_ptr + row, pairwise_sum_1024(acc))

    @triton.jit
    def rms_norm_fwd_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, r_ptr, s_ptr, N, stride_x, stride_y, stride_r, stride_s,
                            eps, HAS_W: tl.constexpr, KEEP_FP32: tl.constexpr, ADD: tl.constexpr,
                            BLOCK: tl.constexpr):
        # One row per program. The sum of squares is row_dot_kernel's order (lanes stepped
        # tile by tile, then pairwise_sum_1024), so the row's bits depend on the row alone.
        # ADD: the row normed is x + r rounded to x's dtype (torch's add of the residual),
        # stored to s; both passes form it from x and r, the same bits each time.
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        x_row = x_ptr + row * stride_x
        y_row = y_ptr + row * stride_y
        r_row = r_ptr + row * stride_r
        s_row = s_ptr + row * stride_s
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, N, BLOCK):
            idx = start + offs
            x = tl.load(x_row + idx.to(tl.int64), mask=idx < N, other=0.0)
            if ADD:
                x = (x.to(tl.float32) + tl.load(r_row + idx.to(tl.int64), mask=idx < N, other=0.0).to(tl.float32)
                     ).to(x_ptr.dtype.element_ty)
                tl.store(s_row + idx.to(tl.int64), x, mask=idx < N)
            x = x.to(tl.float32)
            acc += x * x
        rstd = rms_rstd(pairwise_sum_1024(acc), N, eps)
        for start in range(0, N, BLOCK):
            idx = start + offs
            mask = idx < N
            x = tl.load(x_row + idx.to(tl.int64), mask=mask, other=0.0)
            if ADD:
                x = (x.to(tl.float32) + tl.load(r_row + idx.to(tl.int64), mask=mask, other=0.0).to(tl.float32)
                     ).to(x_ptr.dtype.element_ty)
            w = x
            if HAS_W:
                w = tl.load(w_ptr + idx.to(tl.int64), mask=mask, other=0.0)
            h = rms_scale(x, rstd, w, x_ptr.dtype.element_ty, KEEP_FP32, HAS_W)
            tl.store(y_row + idx.to(tl.int64), h.to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(rstd_ptr + row, rstd)

    @triton.jit
    def _rms_bwd_terms(g_row, x_row, w_ptr, idx, mask, rstd, HAS_W: tl.constexpr):
        # (g * w, xhat) of one tile of a row, in fp32: both passes of the backward read them alike.
        gw = tl.load(g_row + idx.to(tl.int64), mask=mask, other=0.0).to(tl.float32)
        if HAS_W:
            gw = gw * tl.load(w_ptr + idx.to(tl.int64), mask=mask, other=0.0).to(tl.float32)
        xhat = tl.load(x_row + idx.to(tl.int64), mask=mask, other=0.0).to(tl.float32) * rstd
        return gw, xhat

    @triton.jit
    def rms_norm_bwd_kernel(g_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, N, stride_g, stride_x, stride_dx,
                            HAS_W: tl.constexpr, BLOCK: tl.constexpr):
        # grad_x of one row: gw = g * w, dot = sum(gw * xhat) / N (row_dot_kernel's order),
        # dx = rstd * (gw - xhat * dot). Two passes over the row's tiles.
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        g_row = g_ptr + row * stride_g
        x_row = x_ptr + row * stride_x
        rstd = tl.load(rstd_ptr + row)
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, N, BLOCK):
            idx = start + offs
            gw, xhat = _rms_bwd_terms(g_row, x_row, w_ptr, idx, idx < N, rstd, HAS_W)
            acc += gw * xhat
        dot = tl.math.div_rn(pairwise_sum_1024(acc), N * 1.0)
        for start in range(0, N, BLOCK):
            idx = start + offs
            mask = idx < N
            gw, xhat = _rms_bwd_terms(g_row, x_row, w_ptr, idx, mask, rstd, HAS_W)
            dx = rstd * (gw - xhat * dot)
            tl.store(dx_ptr + row * stride_dx + idx.to(tl.int64), dx.to(dx_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def col_partial_kernel(a_ptr, x_ptr, rstd_ptr, part_ptr, M, N, stride_a, stride_x,
                           NORM: tl.constexpr, KEEP_FP32: tl.constexpr, ROWS: tl.constexpr,
                           UNROLL: tl.constexpr, BLOCK_N: tl.constexpr):
        # part[p, cols] = sum of v[r, cols] over rows r in [p*ROWS, (p+1)*ROWS) n [0, M),
        # ascending from 0.0 in fp32, one sequential chain per column. v = a, or with NORM
        # the RMSNorm dW term a * h, h = x * rstd (rounded to x's dtype unless KEEP_FP32).
        # The blocks are fixed multiples of ROWS from row 0, so the order depends on M alone.
        # Rows past M (in the last chunk) load 0 and add exactly 0.0: the chain never holds
        # -0.0 (it starts at +0.0), so x + 0.0 == x.
        p = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < N
        cols = cols.to(tl.int64)
        row0 = p * ROWS
        n_rows = tl.minimum(M - row0, ROWS)
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for i in range(0, n_rows, UNROLL):
            # The unrolled chunk issues its loads together; the adds stay in row order.
            for j in tl.static_range(UNROLL):
                r = row0 + i + j
                # One vector comparison: the interpreter turns a vector & scalar mask into ints.
                m = cols < tl.where(r < M, N, 0)
                v = tl.load(a_ptr + r * stride_a + cols, mask=m, other=0.0).to(tl.float32)
                if NORM:
                    rs = tl.load(rstd_ptr + r, mask=r < M, other=0.0)
                    h = tl.load(x_ptr + r * stride_x + cols, mask=m, other=0.0).to(tl.float32) * rs
                    if not KEEP_FP32:
                        h = h.to(x_ptr.dtype.element_ty).to(tl.float32)
                    v = v * h
                acc += v
        tl.store(part_ptr + p * N + cols, acc, mask=cmask)

    @triton.jit
    def col_finish_kernel(part_ptr, out_ptr, P, N, UNROLL: tl.constexpr, BLOCK_N: tl.constexpr):
        # out[cols] = sum over p of part[p, cols], p ascending from 0.0 in fp32 (one chain
        # per column), rounded once to out's dtype. Masked partials past P add exactly 0.0.
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < N
        cols = cols.to(tl.int64)
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for i in range(0, P, UNROLL):
            for j in tl.static_range(UNROLL):
                q = tl.cast(i + j, tl.int64)
                acc += tl.load(part_ptr + q * N + cols, mask=cols < tl.where(q < P, N, 0), other=0.0)
        tl.store(out_ptr + cols, acc.to(out_ptr.dtype.element_ty), mask=cmask)
else:  # pragma: no cover - the torch backend still imports without Triton
    pairwise_sum_1024 = pairwise_row_sums = rms_rstd = rms_scale = None
    row_dot_kernel = rms_norm_fwd_kernel = rms_norm_bwd_kernel = None
    col_partial_kernel = col_finish_kernel = None
