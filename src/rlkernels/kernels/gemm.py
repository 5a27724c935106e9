"""The canonical K-chain GEMM kernel (pointer loads): one ascending fp32 chain over K per output
element. Host side: ``rlkernels.gemm.triton``."""
from __future__ import annotations

from ._triton import tl, triton
from .activations import silu_mul_rounded
from .tiles import grouped_tile

if triton is not None:

    @triton.jit
    def gemm_kernel(
        a_ptr, b_ptr, c_ptr, bias_ptr, rowsum_ptr,
        M, N, K,
        stride_ab, stride_am, stride_ak,
        stride_bb, stride_bk, stride_bn,
        stride_cb, stride_cm, stride_cn,
        HAS_BIAS: tl.constexpr, ACC_FROM_C: tl.constexpr, ROWSUM: tl.constexpr,
        IEEE: tl.constexpr, EVEN_K: tl.constexpr, MASK_M: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
        SWAPPED: tl.constexpr,
    ):
        pid = tl.program_id(0)
        batch = tl.program_id(1).to(tl.int64)
        pid_m, pid_n = grouped_tile(pid, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)

        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        # Rows/cols past the edge re-read valid memory (wrapped) instead of masking;
        # their results are never stored. int64: lm-head outputs exceed 2^31 elements.
        # MASK_M (fewer rows than the tile, i.e. decode): rows past M are not read at
        # all. Wrapped, every program fetched row 0 BLOCK_M times per k-block, all from
        # the same few L2 lines: at M = 1 a 16-row tile ran 5-60% slower than the same
        # tile at M = 4, the narrower tiles worst (H100; masked, M = 1 runs like M = 4;
        # docs/design/gemm_dispatch.md#decode-tiles).
        # Either way a stored row's products are its own row's, so its bits are the same.
        rm = offs_m.to(tl.int64) if MASK_M else (offs_m % M).to(tl.int64)
        if SWAPPED:
            # B = X^T, its columns padded to whole tiles by the launcher: read unwrapped,
            # so the compiler sees contiguous, aligned rows (16-byte copies at any M).
            rn = offs_n.to(tl.int64)
        else:
            rn = (offs_n % N).to(tl.int64)
        a_ptrs = a_ptr + batch * stride_ab + rm[:, None] * stride_am + offs_k[None, :].to(tl.int64) * stride_ak
        b_ptrs = b_ptr + batch * stride_bb + offs_k[:, None].to(tl.int64) * stride_bk + rn[None, :] * stride_bn

        c_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        c_ptrs = c_ptr + batch * stride_cb + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :].to(tl.int64) * stride_cn
        if ACC_FROM_C:
            acc = tl.load(c_ptrs, mask=c_mask, other=0.0).to(tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if ROWSUM:
            # The row-sum chain starts from the current value (bias.main_grad), like acc.
            do_rowsum = pid_n == 0
            rs_ptrs = rowsum_ptr + batch * M + offs_m
            rs_col = tl.arange(0, 16)
            rs_start = tl.load(rs_ptrs, mask=offs_m < M, other=0.0)
            rs_acc = tl.where(rs_col[None, :] == 0, rs_start[:, None], 0.0)
            ones = tl.full((BLOCK_K, 16), 1.0, dtype=a_ptr.dtype.element_ty)

        # The canonical chain: one ascending pass over K, one fp32 accumulator.
        # (No evict-first hint on the once-read decode weight: Triton 3.6's pipeliner
        # drops it from the cp.async these loads become; docs/design/l2_window.md.)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            if EVEN_K:
                if MASK_M:
                    a = tl.load(a_ptrs, mask=offs_m[:, None] < M, other=0.0)
                else:
                    a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
            else:
                k_left = K - k * BLOCK_K
                a_mask = offs_k[None, :] < k_left
                if MASK_M:
                    a_mask = a_mask & (offs_m[:, None] < M)
                a = tl.load(a_ptrs, mask=a_mask, other=0.0)
                b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
            if IEEE:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
            if ROWSUM:
                if do_rowsum:
                    if IEEE:
                        rs_acc = tl.dot(a, ones, rs_acc, input_precision="ieee")
                    else:
                        rs_acc = tl.dot(a, ones, rs_acc)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk

        if HAS_BIAS:
            if SWAPPED:  # C^T's rows are the output features
                bias = tl.load(bias_ptr + offs_m, mask=offs_m < M, other=0.0)
                acc = acc + bias.to(tl.float32)[:, None]
            else:
                bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)
                acc = acc + bias.to(tl.float32)[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)
        if ROWSUM:
            if do_rowsum:
                # Column 0 holds the chain; the others are exact zeros plus the same sums.
                rs = tl.sum(tl.where(rs_col[None, :] == 0, rs_acc, 0.0), axis=1)
                tl.store(rs_ptrs, rs, mask=offs_m < M)

    @triton.jit
    def gemm_silu_mul_kernel(
        a_ptr, gate_ptr, up_ptr, c_ptr,
        M, N, K,
        stride_am, stride_ak,
        stride_bk, stride_bn,
        stride_cm, stride_cn,
        EVEN_K: tl.constexpr, MASK_M: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ):
        """C = silu(A @ G) * (A @ U): a gated MLP's gate and up projections in one launch.

        G and U ([K, N] views of the two weights, the same strides) each get the canonical
        chain, one ascending fp32 accumulator per output over the same k-blocks as
        ``gemm_kernel``, rounded to C's dtype as the two GEMMs store them; the epilogue is
        ``silu_mul_kernel``'s formula on those rounded values, so an element's bits are
        those of the three separate ops. 16-bit operands (no IEEE fp32 chain here)."""
        pid = tl.program_id(0)
        pid_m, pid_n = grouped_tile(pid, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        # As gemm_kernel: rows past M masked (MASK_M) or wrapped, columns past N wrapped;
        # neither is stored, and a stored row's products are its own row's.
        rm = offs_m.to(tl.int64) if MASK_M else (offs_m % M).to(tl.int64)
        rn = (offs_n % N).to(tl.int64)
        a_ptrs = a_ptr + rm[:, None] * stride_am + offs_k[None, :].to(tl.int64) * stride_ak
        b_offs = offs_k[:, None].to(tl.int64) * stride_bk + rn[None, :] * stride_bn
        g_ptrs = gate_ptr + b_offs
        u_ptrs = up_ptr + b_offs
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            if EVEN_K:
                if MASK_M:
                    a = tl.load(a_ptrs, mask=offs_m[:, None] < M, other=0.0)
                else:
                    a = tl.load(a_ptrs)
                g = tl.load(g_ptrs)
                u = tl.load(u_ptrs)
            else:
                k_left = K - k * BLOCK_K
                a_mask = offs_k[None, :] < k_left
                if MASK_M:
                    a_mask = a_mask & (offs_m[:, None] < M)
                a = tl.load(a_ptrs, mask=a_mask, other=0.0)
                g = tl.load(g_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
                u = tl.load(u_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
            acc_g = tl.dot(a, g, acc_g)
            acc_u = tl.dot(a, u, acc_u)
            a_ptrs += BLOCK_K * stride_ak
            g_ptrs += BLOCK_K * stride_bk
            u_ptrs += BLOCK_K * stride_bk
        dt = c_ptr.dtype.element_ty
        c_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :].to(tl.int64) * stride_cn
        tl.store(c_ptrs, silu_mul_rounded(acc_g.to(dt), acc_u.to(dt), dt), mask=c_mask)

else:  # pragma: no cover - the torch backend still imports without Triton
    gemm_kernel = gemm_silu_mul_kernel = None
