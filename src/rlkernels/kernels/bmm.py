"""The one-launch tiny-matrix batched GEMM kernel. Host side: ``rlkernels.ops.bmm``."""
from __future__ import annotations

from ._triton import tl, triton

if triton is not None:

    @triton.jit
    def multiple_of(x, DIV: tl.constexpr):
        """x, which the host guarantees to be a multiple of DIV, written so the compiler knows it."""
        return x // DIV * DIV

    @triton.jit
    def tiny_group(
        grp, a_ptr, b_ptr, c_ptr,
        B, M, N, K,
        stride_ab, stride_am, stride_ak,
        stride_bb, stride_bk, stride_bn,
        stride_cb, stride_cm, stride_cn,
        GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        USE_DOT: tl.constexpr, IEEE: tl.constexpr,
    ):
        """Elements [grp*GROUP, grp*GROUP + GROUP) (int64 grp): every element runs the same
        instructions whatever its slot and whichever program runs it, so its bits ignore both."""
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        if GROUP == 1:
            # 2-D tiles: the plain tl.dot lowering for one element per step.
            a_base = a_ptr + grp * stride_ab
            b_base = b_ptr + grp * stride_bb
            c_base = c_ptr + grp * stride_cb
            c_ptrs = c_base + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
            c_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
            if USE_DOT:
                offs_k = tl.arange(0, BLOCK_K)
                a = tl.load(a_base + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak,
                            mask=(offs_m[:, None] < M) & (offs_k[None, :] < K), other=0.0)
                b = tl.load(b_base + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn,
                            mask=(offs_k[:, None] < K) & (offs_n[None, :] < N), other=0.0)
                if IEEE:
                    acc = tl.dot(a, b, input_precision="ieee")
                else:
                    acc = tl.dot(a, b)
            else:
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                # Unrolled over exactly K (= BLOCK_K here) steps with no stores in
                # between, so every load can be issued up front.
                for kk in tl.static_range(BLOCK_K):
                    a_k = tl.load(a_base + offs_m * stride_am + kk * stride_ak,
                                  mask=offs_m < M, other=0.0).to(tl.float32)
                    b_k = tl.load(b_base + kk * stride_bk + offs_n * stride_bn,
                                  mask=offs_n < N, other=0.0).to(tl.float32)
                    acc = tl.fma(a_k[:, None], b_k[None, :], acc)
            tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)
        else:
            g = grp * GROUP + tl.arange(0, GROUP).to(tl.int64)
            g3 = g[:, None, None]
            g_ok = g3 < B
            m3 = offs_m[None, :, None]
            n3 = offs_n[None, None, :]
            c_ptrs = c_ptr + g3 * stride_cb + m3 * stride_cm + n3 * stride_cn
            c_mask = g_ok & (m3 < M) & (n3 < N)
            if USE_DOT:
                offs_k = tl.arange(0, BLOCK_K)
                k_col = offs_k[None, None, :]  # k along the last axis of A
                k_row = offs_k[None, :, None]  # k along the middle axis of B
                a = tl.load(a_ptr + g3 * stride_ab + m3 * stride_am + k_col * stride_ak,
                            mask=g_ok & (m3 < M) & (k_col < K), other=0.0)
                b = tl.load(b_ptr + g3 * stride_bb + k_row * stride_bk + n3 * stride_bn,
                            mask=g_ok & (k_row < K) & (n3 < N), other=0.0)
                if IEEE:
                    acc = tl.dot(a, b, input_precision="ieee")
                else:
                    acc = tl.dot(a, b)
            else:
                acc = tl.zeros((GROUP, BLOCK_M, BLOCK_N), dtype=tl.float32)
                a_col = a_ptr + g3 * stride_ab + m3 * stride_am  # [G, BM, 1]
                b_row = b_ptr + g3 * stride_bb + n3 * stride_bn  # [G, 1, BN]
                a_mask = g_ok & (m3 < M)
                b_mask = g_ok & (n3 < N)
                for kk in tl.static_range(BLOCK_K):  # unrolled, as in the 2-D branch
                    a_k = tl.load(a_col + kk * stride_ak, mask=a_mask, other=0.0).to(tl.float32)
                    b_k = tl.load(b_row + kk * stride_bk, mask=b_mask, other=0.0).to(tl.float32)
                    acc = tl.fma(a_k, b_k, acc)
            tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)

    @triton.jit
    def bmm_tiny_kernel(
        a_ptr, b_ptr, c_ptr,
        B, M, N, K,
        stride_ab, stride_am, stride_ak,
        stride_bb, stride_bk, stride_bn,
        stride_cb, stride_cm, stride_cn,
        M_DIV: tl.constexpr, N_DIV: tl.constexpr, K_DIV: tl.constexpr,
        AM_DIV: tl.constexpr, AK_DIV: tl.constexpr, BK_DIV: tl.constexpr, BN_DIV: tl.constexpr,
        CM_DIV: tl.constexpr, CN_DIV: tl.constexpr,
        GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        USE_DOT: tl.constexpr, IEEE: tl.constexpr, PERSISTENT: tl.constexpr, STAGES: tl.constexpr,
    ):
        # Triton specializes integer arguments only on divisibility by 16, so with 8-
        # or 12-wide rows it could prove no alignment and issued one load per element.
        # The *_DIV constants (the largest power of two <= 16 dividing each dim and
        # inner stride) give it back what it can use: 12 fp32 = 48-byte rows get
        # 16-byte accesses. Classes, not values, so a new m or n compiles nothing new
        # unless its power-of-two class is new; B and batch strides take no hint.
        M = multiple_of(M, M_DIV)
        N = multiple_of(N, N_DIV)
        K = multiple_of(K, K_DIV)
        stride_am = multiple_of(stride_am, AM_DIV)
        stride_ak = multiple_of(stride_ak, AK_DIV)
        stride_bk = multiple_of(stride_bk, BK_DIV)
        stride_bn = multiple_of(stride_bn, BN_DIV)
        stride_cm = multiple_of(stride_cm, CM_DIV)
        stride_cn = multiple_of(stride_cn, CN_DIV)
        if PERSISTENT:
            for grp in tl.range(tl.program_id(0), tl.cdiv(B, GROUP), tl.num_programs(0), num_stages=STAGES):
                tiny_group(tl.cast(grp, tl.int64), a_ptr, b_ptr, c_ptr, B, M, N, K,
                            stride_ab, stride_am, stride_ak, stride_bb, stride_bk, stride_bn,
                            stride_cb, stride_cm, stride_cn, GROUP, BLOCK_M, BLOCK_N, BLOCK_K, USE_DOT, IEEE)
        else:
            tiny_group(tl.program_id(0).to(tl.int64), a_ptr, b_ptr, c_ptr, B, M, N, K,
                        stride_ab, stride_am, stride_ak, stride_bb, stride_bk, stride_bn,
                        stride_cb, stride_cm, stride_cn, GROUP, BLOCK_M, BLOCK_N, BLOCK_K, USE_DOT, IEEE)
else:  # pragma: no cover - the torch backend still imports without Triton
    multiple_of = tiny_group = bmm_tiny_kernel = None
