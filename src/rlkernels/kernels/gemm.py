"""The canonical K-chain GEMM kernels (pointer loads): one ascending fp32 chain over K per output
element. ``gemm_kernel`` serves every GEMM; the decode-size fused launches
(``gemm_silu_mul_kernel``, ``gemm_group_kernel``) run the same chain over the same
k-blocks. Host side: ``rlkernels.gemm.triton``."""
from __future__ import annotations

from ._triton import tl, triton
from .activations import silu_mul_rounded
from .tiles import grouped_tile

if triton is not None:

    @triton.jit
    def load_a_block(a_ptrs, offs_m, offs_k, M, k_left, EVEN_K: tl.constexpr, MASK_M: tl.constexpr):
        """One k-block of A's rows: rows past M zero where MASK_M (else the caller's pointers
        wrap them), columns past K zero in a last partial block (not EVEN_K)."""
        if EVEN_K:
            if MASK_M:
                a = tl.load(a_ptrs, mask=offs_m[:, None] < M, other=0.0)
            else:
                a = tl.load(a_ptrs)
        else:
            mask = offs_k[None, :] < k_left
            if MASK_M:
                mask = mask & (offs_m[:, None] < M)
            a = tl.load(a_ptrs, mask=mask, other=0.0)
        return a

    @triton.jit
    def load_b_block(b_ptrs, offs_k, k_left, EVEN_K: tl.constexpr):
        """One k-block of B: rows past K zero in a last partial block (not EVEN_K)."""
        if EVEN_K:
            b = tl.load(b_ptrs)
        else:
            b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        return b

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
            k_left = K - k * BLOCK_K
            a = load_a_block(a_ptrs, offs_m, offs_k, M, k_left, EVEN_K, MASK_M)
            b = load_b_block(b_ptrs, offs_k, k_left, EVEN_K)
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
            k_left = K - k * BLOCK_K
            a = load_a_block(a_ptrs, offs_m, offs_k, M, k_left, EVEN_K, MASK_M)
            g = load_b_block(g_ptrs, offs_k, k_left, EVEN_K)
            u = load_b_block(u_ptrs, offs_k, k_left, EVEN_K)
            acc_g = tl.dot(a, g, acc_g)
            acc_u = tl.dot(a, u, acc_u)
            a_ptrs += BLOCK_K * stride_ak
            g_ptrs += BLOCK_K * stride_bk
            u_ptrs += BLOCK_K * stride_bk
        dt = c_ptr.dtype.element_ty
        c_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :].to(tl.int64) * stride_cn
        tl.store(c_ptrs, silu_mul_rounded(acc_g.to(dt), acc_u.to(dt), dt), mask=c_mask)

    @triton.jit
    def gemm_group_kernel(
        a_ptr, b0_ptr, b1_ptr, b2_ptr, c0_ptr, c1_ptr, c2_ptr, r_ptr,
        M, N0, N1, N2, K,
        stride_am, stride_ak,
        stride_bk, stride_bn,
        RESIDUAL: tl.constexpr, EVEN_K: tl.constexpr, MASK_M: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        """C_i = A @ B_i for up to three B_i of one A (attention's q, k and v projections) in
        one launch.

        B_i: [K, N_i] views of [N_i, K] weights with the same strides; C_i: contiguous
        [M, N_i]; an absent third member has N2 = 0 (no tiles). The programs cover each
        member's column tiles in turn, and each output element is ``gemm_kernel``'s canonical
        chain over the same k-blocks, rounded once to C's dtype: the bits of the separate
        GEMMs. RESIDUAL (one member): C_0 = R + A @ B_0 with R contiguous [M, N0], the GEMM's
        rounded output added to R in fp32 and rounded again, as torch's add of the residual.
        16-bit operands (no IEEE fp32 chain here)."""
        pid = tl.program_id(0)
        tiles0 = tl.cdiv(N0, BLOCK_N)
        tiles01 = tiles0 + tl.cdiv(N1, BLOCK_N)
        tiles_n = tiles01 + tl.cdiv(N2, BLOCK_N)
        pid_m = pid // tiles_n
        pid_n = pid % tiles_n
        # The member whose output tile this program computes.
        b_ptr = b0_ptr
        c_ptr = c0_ptr
        N = N0
        if pid_n >= tiles01:
            b_ptr = b2_ptr
            c_ptr = c2_ptr
            N = N2
            pid_n -= tiles01
        elif pid_n >= tiles0:
            b_ptr = b1_ptr
            c_ptr = c1_ptr
            N = N1
            pid_n -= tiles0
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        # As gemm_kernel: rows past M masked (MASK_M) or wrapped, columns past N wrapped;
        # neither is stored, and a stored row's products are its own row's.
        rm = offs_m.to(tl.int64) if MASK_M else (offs_m % M).to(tl.int64)
        rn = (offs_n % N).to(tl.int64)
        a_ptrs = a_ptr + rm[:, None] * stride_am + offs_k[None, :].to(tl.int64) * stride_ak
        b_ptrs = b_ptr + offs_k[:, None].to(tl.int64) * stride_bk + rn[None, :] * stride_bn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            k_left = K - k * BLOCK_K
            a = load_a_block(a_ptrs, offs_m, offs_k, M, k_left, EVEN_K, MASK_M)
            b = load_b_block(b_ptrs, offs_k, k_left, EVEN_K)
            acc = tl.dot(a, b, acc)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
        c_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        c_offs = offs_m[:, None].to(tl.int64) * N + offs_n[None, :].to(tl.int64)
        out = acc.to(c_ptr.dtype.element_ty)
        if RESIDUAL:
            r = tl.load(r_ptr + c_offs, mask=c_mask, other=0.0)
            out = (out.to(tl.float32) + r.to(tl.float32)).to(c_ptr.dtype.element_ty)
        tl.store(c_ptr + c_offs, out, mask=c_mask)

else:  # pragma: no cover - the torch backend still imports without Triton
    gemm_kernel = gemm_silu_mul_kernel = gemm_group_kernel = None
