"""Fixed-order row and column sums for the norms and softmax. Host side: ``rlkernels.ops.norms``."""
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
    def col_sum_kernel(x_ptr, out_ptr, M, N, stride_m, BLOCK_N: tl.constexpr):
        # Rows one at a time, ascending: a column's sum is one sequential chain.
        pid = tl.program_id(0)
        offs = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = offs < N
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        ptrs = x_ptr + offs.to(tl.int64)  # stepping the pointer keeps row offsets 64-bit
        for _ in range(0, M):
            acc += tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
            ptrs += stride_m
        tl.store(out_ptr + offs, acc, mask=mask)
else:  # pragma: no cover - the torch backend still imports without Triton
    pairwise_sum_1024 = row_dot_kernel = col_sum_kernel = None
