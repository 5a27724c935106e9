"""Kernels of the LM head's forward statistics pass, shared by the fused log-prob and the
fused sampler: the logits tile (the canonical D-chain, then z / T), the per-row online
statistics in the LSE order, the split merge and the row finish. Host side:
``rlkernels.ops.lm_head.statistics``."""
from __future__ import annotations

from ._triton import tl, triton
from .cuda_math import tanhf
from .lse import lse_step, merge_mass, tile_mass
from .tiles import grouped_tile

# The ``TEMP`` constexpr of the logits kernels: how z / T is computed (scale_by_temperature).
TEMP_NONE, TEMP_DIVIDE, TEMP_RECIPROCAL = 0, 1, 2

if triton is not None:

    @triton.jit
    def scale_by_temperature(x, temperature, TEMP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr):
        """x / T as torch divides an fp32 tensor by a Python float on the device the host
        named (``TEMP``): TEMP_DIVIDE, the correctly rounded quotient (``temperature`` = T);
        TEMP_RECIPROCAL, a multiply by ``temperature`` = fl(1 / T), which is what ATen does
        on CUDA; TEMP_NONE, x itself."""
        if TEMP == 1:
            # div_rn wants operands of one shape: broadcast T explicitly.
            x = tl.math.div_rn(x, tl.zeros((BLOCK_M, BLOCK_V), tl.float32) + temperature)
        elif TEMP == 2:
            x = x * temperature
        return x

    @triton.jit
    def model_logits(x, logit_scale, cap_arg, cap, SCALE: tl.constexpr, CAP: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr):
        """The model's logits from the head's raw ones (``ops.lm_head.config.LogitTransform``):
        x * scale where SCALE, then cap * tanh(x / cap) where CAP (the division's ``TEMP``
        mode, ``cap_arg`` its argument), each rounded to fp32 as torch's ops on the device.
        Returns them and the tanh, the backward's slope (x itself without a cap)."""
        if SCALE:
            x = x * logit_scale
        t = x
        if CAP != 0:
            t = tanhf(scale_by_temperature(x, cap_arg, CAP, BLOCK_M, BLOCK_V))
            x = t * cap
        return x, t

    @triton.jit
    def scores(x, temperature, logit_scale, cap_arg, cap, TEMP: tl.constexpr, SCALE: tl.constexpr,
               CAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr):
        """z = model_logits(x) / T [BLOCK_M, BLOCK_V] from raw fp32 logits: the scores every
        kernel of the pass computes (the soft-cap's tanh dropped)."""
        z, _ = model_logits(x, logit_scale, cap_arg, cap, SCALE, CAP, BLOCK_M, BLOCK_V)
        return scale_by_temperature(z, temperature, TEMP, BLOCK_M, BLOCK_V)

    @triton.jit
    def scores_kernel(x_ptr, z_ptr, N, V, stride_x, stride_z, temperature, logit_scale, cap_arg, cap,
                      TEMP: tl.constexpr, SCALE: tl.constexpr, CAP: tl.constexpr, BLOCK_V: tl.constexpr):
        """z = model_logits(x) / T over stored raw logits [N, V] fp32: the scores the fused
        kernels compute from them, for a step that needs them whole (the truncation's
        threshold). One row's BLOCK_V columns per program."""
        row = tl.program_id(0).to(tl.int64)
        offs_v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
        ok = (offs_v < V)[None, :]
        x = tl.load(x_ptr + row * stride_x + offs_v[None, :], mask=ok, other=0.0)
        z = scores(x, temperature, logit_scale, cap_arg, cap, TEMP, SCALE, CAP, 1, BLOCK_V)
        tl.store(z_ptr + row * stride_z + offs_v[None, :], z, mask=ok)

    @triton.jit
    def logits_tile(h_ptr, w_ptr, b_ptr, rm, offs_v, m0, v_lo, V, D, temperature, logit_scale, cap_arg, cap,
                     stride_hn, stride_hd, stride_wv, stride_wd,
                     HAS_BIAS: tl.constexpr, TEMP: tl.constexpr, SCALE: tl.constexpr, CAP: tl.constexpr,
                     IEEE: tl.constexpr, EVEN_D: tl.constexpr,
                     TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr):
        """z[BLOCK_M, BLOCK_V] = model_logits(h[rm] @ W[offs_v]^T + b) / T, the raw logits by the
        canonical ascending D-chain; returned with the soft-cap's tanh (``model_logits``).

        With TMA, h_ptr/w_ptr are descriptors and (m0, v_lo) the tile's first row and column.
        """
        rv = (offs_v % V).to(tl.int64)  # columns past V re-read valid rows of W; masked by the caller
        offs_k = tl.arange(0, BLOCK_K)
        if not TMA:
            h_ptrs = h_ptr + rm[:, None] * stride_hn + offs_k[None, :].to(tl.int64) * stride_hd
            w_ptrs = w_ptr + offs_k[:, None].to(tl.int64) * stride_wd + rv[None, :] * stride_wv
        acc = tl.zeros((BLOCK_M, BLOCK_V), dtype=tl.float32)
        for k in range(0, tl.cdiv(D, BLOCK_K)):
            if TMA:
                # Rows past N, columns past V and the D tail arrive as zeros (never stored,
                # masked by the caller, or adding exactly 0 to the chain).
                h = h_ptr.load([m0, k * BLOCK_K])
                w = w_ptr.load([v_lo, k * BLOCK_K]).T
            elif EVEN_D:
                h = tl.load(h_ptrs)
                w = tl.load(w_ptrs)
            else:
                k_left = D - k * BLOCK_K
                h = tl.load(h_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
                w = tl.load(w_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
            if IEEE:
                acc = tl.dot(h, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(h, w, acc)
            if not TMA:
                h_ptrs += BLOCK_K * stride_hd
                w_ptrs += BLOCK_K * stride_wd
        if HAS_BIAS:
            b = tl.load(b_ptr + rv)
            acc = acc + b.to(tl.float32)[None, :]
        acc, t = model_logits(acc, logit_scale, cap_arg, cap, SCALE, CAP, BLOCK_M, BLOCK_V)
        acc = scale_by_temperature(acc, temperature, TEMP, BLOCK_M, BLOCK_V)
        return acc, t

    @triton.jit
    def keep_above(z, threshold_ptr, rm, THRESHOLD: tl.constexpr):
        """z with the logits below each row's threshold (``threshold_ptr[rm]``, fp32) set
        to -inf where THRESHOLD: the kept set {v : z_v >= tau}, the truncated distribution's
        support. A NaN logit is never below it, so a NaN row stays NaN (and refused)."""
        if THRESHOLD:
            tau = tl.load(threshold_ptr + rm)
            z = tl.where(z < tau[:, None], float("-inf"), z)
        return z

    @triton.jit
    def online_stats(m_i, s_i, u_i, z, live):
        """The running (max m, s = sum e^(z-m), u = sum e^(z-m) (z-m)) of each row after one
        tile of logits ``z`` (-inf on columns past V or below a threshold, ``live`` [BLOCK_M
        or 1, BLOCK_V] False there), and the tile's own mass: (m, s) by the LSE chain's step,
        u beside it with its tile sum in fixed point too (e (z - m) lies in [-1/e, 0]), so no
        sum follows the register layout."""
        m_new, m_ref, alpha, e, d, mass, s_new = lse_step(m_i, s_i, z)
        ed = e * tl.where(live, d, 0.0)
        # Before the first tile s == 0 and m_i = -inf: the rescale term must be 0, not NaN.
        shift = tl.where(s_i > 0, m_i - m_ref, 0.0)
        u_i = alpha * (u_i + shift * s_i) + tile_mass(ed)
        return m_new, s_new, u_i, mass

    @triton.jit
    def fwd_partial_kernel(
        h_ptr, w_ptr, b_ptr, z_ptr, t_ptr, m_ptr, s_ptr, u_ptr, zt_ptr, tile_m_ptr, tile_s_ptr, threshold_ptr,
        tile_max_ptr, N, V, D, temperature, logit_scale, cap_arg, cap,
        stride_hn, stride_hd, stride_wv, stride_wd, stride_zn,
        HAS_BIAS: tl.constexpr, TEMP: tl.constexpr, SCALE: tl.constexpr, CAP: tl.constexpr,
        IEEE: tl.constexpr, EVEN_D: tl.constexpr,
        TMA: tl.constexpr, SPLIT_V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr,
        BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, STORE_TILES: tl.constexpr, ENTROPY: tl.constexpr,
        LOGITS: tl.constexpr, TARGET: tl.constexpr, THRESHOLD: tl.constexpr, SKIP: tl.constexpr,
    ):
        """Online (m, s, u) of one token block over one split of SPLIT_V columns, and z_target.

        LOGITS: the raw logits h W^T + b are read from ``z_ptr`` ([N, V] fp32, row stride
        ``stride_zn``: the same canonical chain, computed by the GEMM) instead of computed
        here; every step after them is the same code, so the same bits.
        Without ENTROPY, u is not computed (stored as 0): (m, s) are the same chain.
        STORE_TILES: every tile's running max after it and its own sum of e^(z - that max)
        too, at [row, split * SPLIT_V / BLOCK_V + tile] (the sampler's first level).
        Without TARGET (the sampler, which has none yet), ``t_ptr`` and ``zt_ptr`` are unused.
        THRESHOLD: the statistics of the truncated distribution, each row's logits below
        ``threshold_ptr[row]`` left out (``keep_above``); a target left out has logit -inf.
        SKIP (with LOGITS and THRESHOLD): ``tile_max_ptr`` [N, ceil(V / BLOCK_V)] holds each
        tile's largest score (NaN where it holds a NaN); a row's tile whose max lies below
        the row's threshold is not read, since every logit of it would be left out: it is
        -inf throughout, as ``keep_above`` makes it, so the bits are the full read's."""
        # Grouped order: GROUP_M token blocks share the streamed W tiles in L2.
        pid_m, pid_s = grouped_tile(tl.program_id(0), tl.cdiv(N, BLOCK_M), tl.cdiv(V, SPLIT_V), GROUP_M)

        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = offs_m < N
        rm = (offs_m % N).to(tl.int64)  # rows past N re-read valid rows; never stored
        if TARGET:
            tgt = tl.load(t_ptr + rm).to(tl.int32)  # ids < V < 2^31; 32-bit compares are cheaper
        else:
            tgt = tl.full((BLOCK_M,), -1, tl.int32)
        v_start = pid_s * SPLIT_V
        n_tiles = tl.cdiv(tl.minimum(V - v_start, SPLIT_V), BLOCK_V)

        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        s_i = tl.zeros((BLOCK_M,), tl.float32)
        u_i = tl.zeros((BLOCK_M,), tl.float32)
        zt = tl.zeros((BLOCK_M,), tl.float32)
        if SKIP:
            tl.static_assert(LOGITS and THRESHOLD, "tiles are skipped only in a truncated read of stored logits")
            tau = tl.load(threshold_ptr + rm)
            tile_row = tile_max_ptr + rm * tl.cdiv(V, BLOCK_V) + v_start // BLOCK_V
        # Tiles in ascending column order: the row's statistics are one fixed chain.
        for j in range(0, n_tiles):
            offs_v = v_start + j * BLOCK_V + tl.arange(0, BLOCK_V)
            col_ok = offs_v < V
            if LOGITS:
                read = col_ok[None, :]
                if SKIP:
                    below = tl.load(tile_row + j) < tau  # False for a NaN max or threshold
                    read = read & ~below[:, None]
                z = tl.load(z_ptr + rm[:, None] * stride_zn + offs_v[None, :].to(tl.int64), mask=read, other=0.0)
                z = scores(z, temperature, logit_scale, cap_arg, cap, TEMP, SCALE, CAP, BLOCK_M, BLOCK_V)
            else:
                z, _ = logits_tile(h_ptr, w_ptr, b_ptr, rm, offs_v, pid_m * BLOCK_M, v_start + j * BLOCK_V, V, D,
                                   temperature, logit_scale, cap_arg, cap, stride_hn, stride_hd, stride_wv, stride_wd,
                                   HAS_BIAS, TEMP, SCALE, CAP, IEEE, EVEN_D, TMA, BLOCK_M, BLOCK_V, BLOCK_K)
            z = keep_above(z, threshold_ptr, rm, THRESHOLD)
            if SKIP:
                z = tl.where(below[:, None], float("-inf"), z)
            # At most one column matches: the sum is that logit exactly. Taken first so
            # z's registers can be reused by the statistics below.
            if TARGET:
                zt += tl.sum(tl.where(offs_v[None, :] == tgt[:, None], z, 0.0), axis=1)
            z = tl.where(col_ok[None, :], z, float("-inf"))
            if ENTROPY:
                if THRESHOLD:
                    live = col_ok[None, :] & (z != float("-inf"))
                else:
                    live = col_ok[None, :]
                m_i, s_i, u_i, tile_sum = online_stats(m_i, s_i, u_i, z, live)
            else:
                m_i, m_ref, alpha, e, d, tile_sum, s_i = lse_step(m_i, s_i, z)
            if STORE_TILES:
                n_tiles = tl.cdiv(V, SPLIT_V) * (SPLIT_V // BLOCK_V)
                tile = offs_m.to(tl.int64) * n_tiles + pid_s * (SPLIT_V // BLOCK_V) + j
                tl.store(tile_m_ptr + tile, m_i, mask=row_ok)
                tl.store(tile_s_ptr + tile, tile_sum, mask=row_ok)
        part = pid_s.to(tl.int64) * N + offs_m
        tl.store(m_ptr + part, m_i, mask=row_ok)
        tl.store(s_ptr + part, s_i, mask=row_ok)
        tl.store(u_ptr + part, u_i, mask=row_ok)
        if TARGET:
            in_split = row_ok & (tgt >= v_start) & (tgt < v_start + SPLIT_V)
            tl.store(zt_ptr + offs_m, zt, mask=in_split)

    @triton.jit
    def merge_splits(m_ptr, s_ptr, u_ptr, rows, ok, N, n_split, ENTROPY: tl.constexpr):
        """(max, s, u) of ``rows`` (int64, any shape) over their per-split statistics
        ([n_split, N] each), merged in ascending split order: the LSE chain's merge, one
        definition for every kernel that finishes the forward's statistics. Without
        ENTROPY, u is 0 and ``u_ptr`` unread."""
        mx = tl.full(rows.shape, float("-inf"), tl.float32)
        # Pointers advance by N per split: 64-bit pointer arithmetic, no int32 k * N product.
        m_ptrs = m_ptr + rows
        for k in range(0, n_split):
            mx = tl.maximum(mx, tl.load(m_ptrs, mask=ok, other=0.0))
            m_ptrs += N
        s = tl.zeros(rows.shape, tl.float32)
        u = tl.zeros(rows.shape, tl.float32)
        # A row that keeps no logit at all (its max -inf) merges to s = 0, not exp(-inf + inf).
        ref = tl.where(mx == float("-inf"), 0.0, mx)
        m_ptrs = m_ptr + rows
        s_ptrs = s_ptr + rows
        u_ptrs = u_ptr + rows
        for k in range(0, n_split):
            mk = tl.load(m_ptrs, mask=ok, other=0.0)
            sk = tl.load(s_ptrs, mask=ok, other=1.0)
            a = tl.exp(mk - ref)
            if ENTROPY:
                uk = tl.load(u_ptrs, mask=ok, other=0.0)
                # A split with no logit kept (a truncated distribution's) has s = 0 and m = -inf:
                # its term is 0, not (-inf) * 0. The guard sits on the operand, so the product
                # still contracts with uk into one FMA, as it does in every untruncated merge.
                u += a * (uk + tl.where(sk > 0, mk - mx, 0.0) * sk)
            s = merge_mass(s, a, sk)
            m_ptrs += N
            s_ptrs += N
            u_ptrs += N
        return mx, s, u

    @triton.jit
    def finish_row(mx, s, u, zt, valid, ENTROPY: tl.constexpr):
        """(logp, entropy, lse) from the merged statistics: logp = (zt - max) - log s,
        entropy = log s - u / s (NaN without ENTROPY); 0 where not ``valid``."""
        log_s = tl.log(s)
        logp = tl.where(valid, (zt - mx) - log_s, 0.0)
        if ENTROPY:
            ent = tl.where(valid, log_s - u / s, 0.0)
        else:
            ent = tl.full(mx.shape, float("nan"), tl.float32)
        return logp, ent, mx + log_s

    @triton.jit
    def logprob_combine_kernel(m_ptr, s_ptr, u_ptr, zt_ptr, t_ptr, logp_ptr, ent_ptr, lse_ptr, N, n_split,
                        BLOCK: tl.constexpr, ENTROPY: tl.constexpr):
        """Merge the per-split statistics of each row in ascending split order (the LSE chain's
        merge); without ENTROPY the entropy is NaN (not computed)."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < N
        rows = offs.to(tl.int64)
        mx, s, u = merge_splits(m_ptr, s_ptr, u_ptr, rows, ok, N, n_split, ENTROPY)
        valid = ok & (tl.load(t_ptr + rows, mask=ok, other=-1) >= 0)
        zt = tl.load(zt_ptr + rows, mask=ok, other=0.0)
        logp, ent, lse = finish_row(mx, s, u, zt, valid, ENTROPY)
        tl.store(logp_ptr + rows, logp, mask=ok)
        tl.store(ent_ptr + rows, ent, mask=ok)
        tl.store(lse_ptr + rows, lse, mask=ok)
else:  # pragma: no cover - the torch backend still imports without Triton
    scale_by_temperature = model_logits = scores = scores_kernel = logits_tile = keep_above = online_stats = None
    fwd_partial_kernel = merge_splits = None
    finish_row = None
    logprob_combine_kernel = None
