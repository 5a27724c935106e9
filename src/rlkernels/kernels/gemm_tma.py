"""The canonical K-chain GEMM with TMA operand loads and a persistent schedule. Host side:
``rlkernels.gemm.tma``."""
from __future__ import annotations

from ._triton import tl, triton
from .tiles import grouped_tile

if triton is not None:

    @triton.jit
    def tma_tile(a_desc, b_desc, c_desc, c_ptr, bias_ptr, tile_id, M, N, K, stride_cm, stride_cn,
                  HAS_BIAS: tl.constexpr, ACC_FROM_C: tl.constexpr, C_DESC: tl.constexpr, IEEE: tl.constexpr,
                  A_KMAJOR: tl.constexpr, B_KMAJOR: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
        pid_m, pid_n = grouped_tile(tile_id, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        if not C_DESC:
            # fp32 outputs (chained dH, main_grad) go through pointers: a TMA staging tile of
            # 128x256 fp32 would not fit in shared memory beside the operand pipeline.
            offs_m = off_m + tl.arange(0, BLOCK_M)
            offs_n = off_n + tl.arange(0, BLOCK_N)
            c_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
            c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :].to(tl.int64) * stride_cn
        if ACC_FROM_C:
            acc = tl.load(c_ptrs, mask=c_mask, other=0.0).to(tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # The canonical chain: one ascending pass over K, one fp32 accumulator.
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            off_k = k * BLOCK_K
            if A_KMAJOR:
                a = a_desc.load([off_m, off_k])
            else:
                a = a_desc.load([off_k, off_m]).T
            if B_KMAJOR:
                b = b_desc.load([off_n, off_k]).T
            else:
                b = b_desc.load([off_k, off_n])
            if IEEE:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        if HAS_BIAS:
            offs_bn = off_n + tl.arange(0, BLOCK_N)
            bias = tl.load(bias_ptr + offs_bn, mask=offs_bn < N, other=0.0)
            acc = acc + bias.to(tl.float32)[None, :]
        if C_DESC:
            c_desc.store([off_m, off_n], acc.to(c_desc.dtype))
        else:
            tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)

    @triton.jit
    def gemm_tma_kernel(a_desc, b_desc, c_desc, c_ptr, bias_ptr, M, N, K, stride_cm, stride_cn,
                         HAS_BIAS: tl.constexpr, ACC_FROM_C: tl.constexpr, C_DESC: tl.constexpr,
                         IEEE: tl.constexpr, A_KMAJOR: tl.constexpr, B_KMAJOR: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr, PERSISTENT: tl.constexpr,
                         WARP_SPECIALIZE: tl.constexpr):
        if PERSISTENT:
            num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
            for tile_id in tl.range(tl.program_id(0), num_tiles, NUM_SMS, flatten=False,
                                    warp_specialize=WARP_SPECIALIZE):
                tma_tile(a_desc, b_desc, c_desc, c_ptr, bias_ptr, tile_id, M, N, K, stride_cm, stride_cn,
                          HAS_BIAS, ACC_FROM_C, C_DESC, IEEE, A_KMAJOR, B_KMAJOR, BLOCK_M, BLOCK_N, BLOCK_K,
                          GROUP_M)
        else:
            tma_tile(a_desc, b_desc, c_desc, c_ptr, bias_ptr, tl.program_id(0), M, N, K, stride_cm, stride_cn,
                      HAS_BIAS, ACC_FROM_C, C_DESC, IEEE, A_KMAJOR, B_KMAJOR, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
else:  # pragma: no cover - the torch backend still imports without Triton
    tma_tile = gemm_tma_kernel = None
