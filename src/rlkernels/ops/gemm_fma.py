"""The fp32 canonical K-chain without ``tl.dot``: explicit FMA chains for small M.

Why: an IEEE fp32 ``tl.dot`` is an FMA chain over ascending k, but Triton's FMA-dot
lowering needs M >= 16 (a decode row is padded to 16 and does 16x the work) and
stages both operands through shared memory in a layout that starves the FMA units
(H100, 4096 x 4096, M = 1: 178 us where cuBLAS SGEMM takes 40 us). At small M the
GEMM is a weight stream; here each thread walks its own output columns' chains
in registers, reading the weight straight from global memory. With no split over
K there is one thread per output column, so the table uses it for wide outputs only
(N >= 8192: 4096 x 12288 M = 1 in 148 us vs 247 us for the best dot tile; the lm head
in 1.3 ms vs 2.8 ms). At N = 4096, 4096 threads cannot keep enough loads in flight
and the padded dot tile wins (benchmarks/results/explore_fp32_h100.json).

The arithmetic is the chain the dot lowering runs: ``acc = fma(a[m, k], b[k, n], acc)``
for k = 0, 1, ..., K-1, from acc = 0 (or C's value when accumulating), one fp32
accumulator, no split, rounded once; the same bits as the dot kernel
(``tests/test_matmul_gpu.py`` proves it for every table entry). There is no padding
past K: each k-block is split into its columns in registers and chained in order.

Two load modes (``K_VEC``): when B's k-stride is 1 (an ``nn.Linear`` weight read as
B = W^T) every thread loads K_VEC consecutive k of its column at once and splits them
into columns in registers; otherwise (B row-major) it reads one coalesced row of B
per k (``K_VEC = 1``).
"""
from __future__ import annotations

import torch

from ._triton import tl, triton

if triton is not None:

    @triton.jit
    def _halves(x):
        """[BM, BN, 2j] -> the even and odd k of the last axis, [BM, BN, j] each."""
        return tl.split(tl.reshape(x, (x.shape[0], x.shape[1], x.shape[2] // 2, 2)))

    @triton.jit
    def _chain(acc, a, b, K_VEC: tl.constexpr):
        """acc = fma(a[..., k], b[..., k], acc) for k = 0 .. K_VEC-1 in order; a, b [BM, BN, K_VEC]."""
        if K_VEC == 1:
            acc = tl.fma(tl.reshape(a, acc.shape), tl.reshape(b, acc.shape), acc)
        elif K_VEC == 2:
            a0, a1 = tl.split(a)
            b0, b1 = tl.split(b)
            acc = tl.fma(a1, b1, tl.fma(a0, b0, acc))
        elif K_VEC == 4:
            # x[k], k = 2i + j: the split gives j (even/odd k), then i.
            ae, ao = _halves(a)
            be, bo = _halves(b)
            ae0, ae1 = tl.split(ae)
            ao0, ao1 = tl.split(ao)
            be0, be1 = tl.split(be)
            bo0, bo1 = tl.split(bo)
            acc = tl.fma(ae0, be0, acc)  # k = 0
            acc = tl.fma(ao0, bo0, acc)  # k = 1
            acc = tl.fma(ae1, be1, acc)  # k = 2
            acc = tl.fma(ao1, bo1, acc)  # k = 3
        else:
            tl.static_assert(K_VEC == 8, "K_VEC must be 1, 2, 4 or 8")
            ae, ao = _halves(a)
            be, bo = _halves(b)
            aee, aeo = _halves(ae)  # k = 4p, 4p + 2
            aoe, aoo = _halves(ao)  # k = 4p + 1, 4p + 3
            bee, beo = _halves(be)
            boe, boo = _halves(bo)
            aee0, aee1 = tl.split(aee)
            aeo0, aeo1 = tl.split(aeo)
            aoe0, aoe1 = tl.split(aoe)
            aoo0, aoo1 = tl.split(aoo)
            bee0, bee1 = tl.split(bee)
            beo0, beo1 = tl.split(beo)
            boe0, boe1 = tl.split(boe)
            boo0, boo1 = tl.split(boo)
            acc = tl.fma(aee0, bee0, acc)  # k = 0
            acc = tl.fma(aoe0, boe0, acc)  # k = 1
            acc = tl.fma(aeo0, beo0, acc)  # k = 2
            acc = tl.fma(aoo0, boo0, acc)  # k = 3
            acc = tl.fma(aee1, bee1, acc)  # k = 4
            acc = tl.fma(aoe1, boe1, acc)  # k = 5
            acc = tl.fma(aeo1, beo1, acc)  # k = 6
            acc = tl.fma(aoo1, boo1, acc)  # k = 7
        return acc

    @triton.jit
    def _gemm_fma_kernel(
        a_ptr, b_ptr, c_ptr, bias_ptr,
        M, N, K,
        stride_ab, stride_am, stride_ak,
        stride_bb, stride_bk, stride_bn,
        stride_cb, stride_cm, stride_cn,
        HAS_BIAS: tl.constexpr, ACC_FROM_C: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, K_VEC: tl.constexpr, UNROLL: tl.constexpr,
    ):
        pid = tl.program_id(0)
        batch = tl.program_id(1).to(tl.int64)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        pid_m = pid // num_pid_n
        pid_n = pid % num_pid_n
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_v = tl.arange(0, K_VEC)
        # Rows/cols past the edge re-read valid memory (wrapped) and are never stored.
        rm = (offs_m % M).to(tl.int64)
        rn = (offs_n % N).to(tl.int64)
        # [BM, 1, K_VEC] and [1, BN, K_VEC]: k runs along the last axis.
        a_ptrs = (a_ptr + batch * stride_ab + rm[:, None, None] * stride_am
                  + offs_v[None, None, :].to(tl.int64) * stride_ak)
        b_ptrs = (b_ptr + batch * stride_bb + rn[None, :, None] * stride_bn
                  + offs_v[None, None, :].to(tl.int64) * stride_bk)

        c_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        c_ptrs = (c_ptr + batch * stride_cb + offs_m[:, None].to(tl.int64) * stride_cm
                  + offs_n[None, :].to(tl.int64) * stride_cn)
        if ACC_FROM_C:
            acc = tl.load(c_ptrs, mask=c_mask, other=0.0).to(tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)

        # The canonical chain, k = 0, 1, ..., K-1: whole blocks of UNROLL * K_VEC, then
        # the remaining k one at a time (no zero padding past K).
        step = UNROLL * K_VEC
        for _ in range(0, K // step):
            for u in tl.static_range(UNROLL):
                # A is loaded through [BM, BN, K_VEC] pointers (same address along n) so
                # it takes B's register layout: no shuffles in the loop.
                a = tl.load(tl.broadcast_to(a_ptrs + u * K_VEC * stride_ak, (BLOCK_M, BLOCK_N, K_VEC)))
                b = tl.load(b_ptrs + u * K_VEC * stride_bk)
                acc = _chain(acc, a.to(tl.float32), tl.broadcast_to(b, (BLOCK_M, BLOCK_N, K_VEC)).to(tl.float32),
                             K_VEC)
            a_ptrs += step * stride_ak
            b_ptrs += step * stride_bk
        a_col = a_ptr + batch * stride_ab + rm[:, None] * stride_am
        b_row = b_ptr + batch * stride_bb + rn[None, :] * stride_bn
        for k in range(K // step * step, K):
            a_k = tl.load(a_col + k * stride_ak).to(tl.float32)
            b_k = tl.load(b_row + k * stride_bk).to(tl.float32)
            acc = tl.fma(a_k, b_k, acc)

        if HAS_BIAS:
            bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)
            acc = acc + bias.to(tl.float32)[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)
else:  # pragma: no cover - the torch backend still imports without Triton
    _gemm_fma_kernel = None


def fma_k_vec(b: torch.Tensor, requested: int) -> int:
    """The K_VEC a B operand supports: vector loads along k only when its k-stride is 1."""
    return requested if b.stride(-2) == 1 else 1
