"""The grouped canonical K-chain GEMMs over experts, one launch each. Host side:
``rlkernels.gemm.grouped``.

* ``grouped_gemm_kernel``: C[s] = A[row(s)] @ B[e(s)]^T for the slots s of every expert
  (the forward, and the backward's dh and dX);
* ``grouped_wgrad_kernel``: C[e] (+)= A[slots of e]^T @ B[slots of e] for every expert
  (the backward's weight gradients: a reduction over each expert's tokens).

The slots are sorted by expert; ``slot_end[e]`` (on the device) is the end of expert e's
slots. Neither launch needs a count on the host. A ``grouped_gemm_kernel`` program finds
its (expert, row tile) from ``slot_end`` itself -- a prefix sum of the experts' tile
counts over a [BLOCK_E] vector -- under a grid that bounds the tiles (a function of the
slot count, E and BLOCK_M); programs past the last real tile return at once. B is read
through its strides alone, so one kernel serves both orientations: the forward's
nn.Linear weights ([N, K] per expert) and the backward's transposed views ([K, N] per
expert, N contiguous). A ``grouped_wgrad_kernel`` program owns one tile of one expert's
[M, N] gradient (grid: E times the tiles) and reads that expert's two ends of
``slot_end``: its reduction length is the expert's token count, found on the device.

Every output element is the canonical chain of ``gemm_kernel``: one fp32 accumulator, one
ascending pass over K in BLOCK_K steps, rounded once. A row's products are its own row's
whatever the other rows of its tile are (rows past the expert's end are masked, never
stored), so a slot's bits are those of ``rlkernels.linear`` on its token row alone with its
expert's weight (the chain's bits do not follow the tile or M: docs/design/canonical_k_chain.md).
In the weight gradient K is the expert's slots, s0 first: the K blocks and the chain of
the per-expert dW call ``gemm(dY[s0:s1]^T, X[s0:s1])``, so the same bits.
"""
from __future__ import annotations

from ._triton import tl, triton
from .cuda_math import expf

if triton is not None:

    @triton.jit
    def grouped_gemm_kernel(
        a_ptr, a_rows_ptr, b_ptr, c_ptr, c_rows_ptr, gu_ptr, slot_end_ptr,
        E, N, K,
        stride_am, stride_ak,
        stride_be, stride_bn, stride_bk,
        stride_cm, stride_cn,
        stride_gm, stride_gn,
        GATHER_A: tl.constexpr, SCATTER_C: tl.constexpr, SILU_UP: tl.constexpr, STORE_GU: tl.constexpr,
        IEEE: tl.constexpr, EVEN_K: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    ):
        """GATHER_A: A's row of slot s is ``a_rows[s]`` (the slot's token), else s.
        SCATTER_C: C's row of slot s is ``c_rows[s]`` (the slot's (token, rank) place), else s.
        SILU_UP: B holds 2N rows per expert, the gate [0, N) and the up projection [N, 2N);
        the program chains both for its columns and writes h = silu(g) * u (N columns), with
        g and u rounded to C's dtype first, as the unfused path stores them; STORE_GU also
        writes g and u (sorted slot order, 2N columns) for the backward."""
        pid = tl.program_id(0)
        n_tiles = tl.cdiv(N, BLOCK_N)
        tile = pid // n_tiles
        pid_n = pid % n_tiles

        # Expert e's tiles: a prefix sum of cdiv(count, BLOCK_M) in expert order.
        ids = tl.arange(0, BLOCK_E)
        ends = tl.load(slot_end_ptr + ids, mask=ids < E, other=0).to(tl.int64)
        starts = tl.load(slot_end_ptr + ids - 1, mask=(ids >= 1) & (ids < E), other=0).to(tl.int64)
        tiles = tl.where(ids < E, (ends - starts + BLOCK_M - 1) // BLOCK_M, 0)
        tile_end = tl.cumsum(tiles, axis=0)
        e = tl.sum((tile_end <= tile).to(tl.int32), axis=0)
        if e >= E:
            return  # past the last real tile
        pick = ids == e
        first_tile = tl.sum(tl.where(pick, tile_end - tiles, 0), axis=0)
        row0 = tl.sum(tl.where(pick, starts, 0), axis=0) + (tile - first_tile) * BLOCK_M
        row_end = tl.sum(tl.where(pick, ends, 0), axis=0)

        offs_m = row0 + tl.arange(0, BLOCK_M).to(tl.int64)
        m_mask = offs_m < row_end
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        if GATHER_A:
            a_rows = tl.load(a_rows_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
        else:
            a_rows = offs_m
        # Columns past N re-read valid columns (wrapped); their results are never stored.
        rn = (offs_n % N).to(tl.int64)
        a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :].to(tl.int64) * stride_ak
        b_ptrs = (b_ptr + e.to(tl.int64) * stride_be + offs_k[:, None].to(tl.int64) * stride_bk
                  + rn[None, :] * stride_bn)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if SILU_UP:
            acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            u_off = N * stride_bn

        # The canonical chain: one ascending pass over K, one fp32 accumulator per output.
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            if EVEN_K:
                a = tl.load(a_ptrs, mask=m_mask[:, None], other=0.0)
                b = tl.load(b_ptrs)
                if SILU_UP:
                    b_u = tl.load(b_ptrs + u_off)
            else:
                k_left = K - k * BLOCK_K
                a = tl.load(a_ptrs, mask=m_mask[:, None] & (offs_k[None, :] < k_left), other=0.0)
                b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
                if SILU_UP:
                    b_u = tl.load(b_ptrs + u_off, mask=offs_k[:, None] < k_left, other=0.0)
            if IEEE:
                acc = tl.dot(a, b, acc, input_precision="ieee")
                if SILU_UP:
                    acc_u = tl.dot(a, b_u, acc_u, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
                if SILU_UP:
                    acc_u = tl.dot(a, b_u, acc_u)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk

        c_mask = m_mask[:, None] & (offs_n[None, :] < N)
        if SCATTER_C:
            c_rows = tl.load(c_rows_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
        else:
            c_rows = offs_m
        c_ptrs = c_ptr + c_rows[:, None] * stride_cm + offs_n[None, :].to(tl.int64) * stride_cn
        if SILU_UP:
            out_ty = c_ptr.dtype.element_ty
            g = acc.to(out_ty)
            u = acc_u.to(out_ty)
            if STORE_GU:
                g_ptrs = gu_ptr + offs_m[:, None] * stride_gm + offs_n[None, :].to(tl.int64) * stride_gn
                tl.store(g_ptrs, g, mask=c_mask)
                tl.store(g_ptrs + N * stride_gn, u, mask=c_mask)
            # silu as ATen's CUDA kernel computes it: g / (1 + exp(-g)) in fp32 (expf: libdevice's,
            # not the approximate tl.exp; an IEEE division, not the approximate fp32 '/'),
            # rounded to the dtype; then the product in fp32 rounded once (exact before the
            # rounding for 16-bit operands), as ATen's mul.
            gf = g.to(tl.float32)
            s = tl.math.div_rn(gf, 1.0 + expf(-gf)).to(out_ty)
            tl.store(c_ptrs, (s.to(tl.float32) * u.to(tl.float32)).to(out_ty), mask=c_mask)
        else:
            tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)

    @triton.jit
    def grouped_wgrad_kernel(
        a_ptr, b_ptr, b_rows_ptr, c_ptr, slot_end_ptr,
        M, N,
        stride_as, stride_am,
        stride_bs, stride_bn,
        stride_ce, stride_cm, stride_cn,
        GATHER_B: tl.constexpr, ACC_FROM_C: tl.constexpr, IEEE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        """C[e] (+)= A[s0:s1]^T @ B[s0:s1], [s0, s1) expert e's sorted slots (from ``slot_end``):
        A [slots, M], B [slots, N] (GATHER_B: B's row of slot s is ``b_rows[s]``), C [E, M, N].

        One program per (expert, [BLOCK_M x BLOCK_N] tile of C[e]); the grid is E times the
        tiles of one [M, N] gradient, known on the host without any count. The reduction
        runs over the expert's slots -- its tokens, ascending -- in BLOCK_K steps from s0,
        the K blocks of ``gemm_kernel`` on A = dY[s0:s1]^T, B = X[s0:s1] (what the per-expert
        dW call runs), the tail masked to zeros; one fp32 accumulator, from C's value with
        ACC_FROM_C (``main_grad`` continues its chain), stored once in C's dtype. An expert
        with no slot gets zeros, or with ACC_FROM_C its C left as it is."""
        pid = tl.program_id(0)
        tiles_n = tl.cdiv(N, BLOCK_N)
        tiles = tl.cdiv(M, BLOCK_M) * tiles_n
        e = pid // tiles
        tile = pid % tiles
        pid_m = tile // tiles_n
        pid_n = tile % tiles_n
        s0 = tl.load(slot_end_ptr + e - 1, mask=e > 0, other=0).to(tl.int64)
        s1 = tl.load(slot_end_ptr + e).to(tl.int64)

        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_mask = offs_m < M
        n_mask = offs_n < N
        c_mask = m_mask[:, None] & n_mask[None, :]
        c_ptrs = (c_ptr + e.to(tl.int64) * stride_ce + offs_m[:, None].to(tl.int64) * stride_cm
                  + offs_n[None, :].to(tl.int64) * stride_cn)
        if ACC_FROM_C:
            if s1 == s0:
                return  # no token: the chain has nothing to add to main_grad
            acc = tl.load(c_ptrs, mask=c_mask, other=0.0).to(tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)

        # Rows and columns past M and N are masked, not wrapped as in gemm_kernel (a stored
        # element's products are its own either way): unwrapped offsets keep A's and B's
        # unit-stride dims contiguous to the compiler, so their loads stay vectorised.
        offs_s = s0 + tl.arange(0, BLOCK_K).to(tl.int64)
        a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_s[None, :] * stride_as
        # The canonical chain: one ascending pass over the expert's slots, one fp32 accumulator.
        for _ in range(0, tl.cdiv((s1 - s0).to(tl.int32), BLOCK_K)):
            s_mask = offs_s < s1
            a = tl.load(a_ptrs, mask=m_mask[:, None] & s_mask[None, :], other=0.0)
            if GATHER_B:
                b_rows = tl.load(b_rows_ptr + offs_s, mask=s_mask, other=0).to(tl.int64)
            else:
                b_rows = offs_s
            b = tl.load(b_ptr + b_rows[:, None] * stride_bs + offs_n[None, :].to(tl.int64) * stride_bn,
                        mask=s_mask[:, None] & n_mask[None, :], other=0.0)
            if IEEE:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
            offs_s += BLOCK_K
            a_ptrs += BLOCK_K * stride_as
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)

else:  # pragma: no cover - the torch backend still imports without Triton
    grouped_gemm_kernel = None
    grouped_wgrad_kernel = None
