"""The grouped canonical K-chain GEMM: C[s] = A[row(s)] @ B[e(s)]^T for the slots s of every
expert, in one launch. Host side: ``rlkernels.gemm.grouped``.

The slots are sorted by expert; ``slot_end[e]`` (on the device) is the end of expert e's
slots. Each program finds its (expert, row tile) from ``slot_end`` itself -- a prefix sum
of the experts' tile counts over a [BLOCK_E] vector -- so the launch needs no count on the
host: the grid is an upper bound on the tiles (a function of the slot count, E and
BLOCK_M) and programs past the last real tile return at once. B is read through its
strides alone, so one kernel serves both orientations: the forward's nn.Linear weights
([N, K] per expert) and the backward's transposed views ([K, N] per expert, N contiguous).

Every output element is the canonical chain of ``gemm_kernel``: one fp32 accumulator, one
ascending pass over K in BLOCK_K steps, rounded once. A row's products are its own row's
whatever the other rows of its tile are (rows past the expert's end are masked, never
stored), so a slot's bits are those of ``rlkernels.linear`` on its token row alone with its
expert's weight (the chain's bits do not follow the tile or M: docs/design/canonical_k_chain.md).
"""
from __future__ import annotations

from .._env import triton_interpret
from ._triton import tl, triton

if triton is not None:
    from triton.language.extra import libdevice

    if triton_interpret():
        @triton.jit
        def _expf(x):
            return tl.exp(x)  # the interpreter runs no libdevice: numpy's exp
    else:
        @triton.jit
        def _expf(x):
            # CUDA's expf, as ATen's silu calls it; tl.exp is an approximate exp2 on NVIDIA GPUs.
            return libdevice.exp(x)

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
            s = tl.math.div_rn(gf, 1.0 + _expf(-gf)).to(out_ty)
            tl.store(c_ptrs, (s.to(tl.float32) * u.to(tl.float32)).to(out_ty), mask=c_mask)
        else:
            tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)

else:  # pragma: no cover - the torch backend still imports without Triton
    grouped_gemm_kernel = None
