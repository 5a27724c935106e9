"""The K-tree GEMM kernel: each output tile is the pairwise tree over ``N_SEG`` segments of K,
each segment one canonical fp32 chain from zero. Host side: ``rlkernels.gemm.ktree``.

Operands come by TMA (no per-element pointers to hold). The tree's pending nodes (at
most log2(N_SEG), one per level) wait in the program's own fp32 scratch slots rather
than in registers, so the kernel holds one accumulator like the plain GEMM.
"""
from __future__ import annotations

from ._triton import tl, triton
from .tiles import grouped_tile

if triton is not None:

    @triton.jit
    def _slot(slots, j: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """Pointers to level j's pending node of this program: [BLOCK_M, BLOCK_N] fp32, made
        where used (a tile of 64-bit pointers held across the loop costs registers)."""
        return (slots + j * BLOCK_M * BLOCK_N + tl.arange(0, BLOCK_M)[:, None] * BLOCK_N
                + tl.arange(0, BLOCK_N)[None, :])

    @triton.jit
    def _tree_step(acc, slots, s, N_SEG: tl.constexpr, LEVELS: tl.constexpr, FIRST: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """After leaf s: merge with the pending node of each level j >= FIRST the leaf completes
        ((s + 1) divisible by 2^(j+1), consecutive j), the left operand first; then, unless this
        is the root, wait at level ctz(s + 1). Levels below FIRST were merged by the caller
        and have no slot: level j waits in slot j - FIRST."""
        for j in tl.static_range(FIRST, LEVELS):
            if (s + 1) % (2 << j) == 0:
                acc = tl.load(_slot(slots, j - FIRST, BLOCK_M, BLOCK_N)) + acc
        tl.debug_barrier()  # every thread has read the slots before any is rewritten
        if s + 1 < N_SEG:
            for j in tl.static_range(FIRST, LEVELS):
                if (s + 1) % (1 << j) == 0 and (s + 1) % (2 << j) != 0:
                    tl.store(_slot(slots, j - FIRST, BLOCK_M, BLOCK_N), acc)
            tl.debug_barrier()  # the slot is written before any thread reads it
        return acc

    @triton.jit
    def _segment_chain(a_desc, b_desc, off_m, off_n, s, steps, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """Segment s: one ascending chain from zero (the canonical GEMM's, on this K-slice)."""
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, steps):
            off_k = (s * steps + k) * BLOCK_K
            a = a_desc.load([off_m, off_k])
            b = b_desc.load([off_n, off_k]).T
            if IEEE:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        return acc

    @triton.jit
    def ktree_gemm_kernel(
        a_desc, b_desc, c_ptr, bias_ptr, scratch_ptr,
        M, N, SEG, stride_cm, stride_cn,
        N_SEG: tl.constexpr, LEVELS: tl.constexpr, PAIRS: tl.constexpr, HAS_BIAS: tl.constexpr,
        IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
    ):
        """C = tree over segments of (A[:, seg] @ B[:, seg]^T) (+ bias); A [M, K], B [N, K] by TMA;
        BLOCK_K divides SEG. Rows and columns past the edge load as zeros and are not stored.
        PAIRS (N_SEG >= 2): each pair of leaves is added in registers (the tree's level 0, a
        second accumulator), so only levels >= 1 go through the scratch slots."""
        pid = tl.program_id(0)
        pid_m, pid_n = grouped_tile(pid, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        slots = scratch_ptr + pid.to(tl.int64) * ((LEVELS - PAIRS) * BLOCK_M * BLOCK_N)
        steps = SEG // BLOCK_K
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if PAIRS:
            for p in range(0, N_SEG // 2):
                left = _segment_chain(a_desc, b_desc, off_m, off_n, 2 * p, steps, IEEE, BLOCK_M, BLOCK_N, BLOCK_K)
                acc = _segment_chain(a_desc, b_desc, off_m, off_n, 2 * p + 1, steps, IEEE, BLOCK_M, BLOCK_N,
                                     BLOCK_K)
                acc = _tree_step(left + acc, slots, 2 * p + 1, N_SEG, LEVELS, 1, BLOCK_M, BLOCK_N)
        else:
            for s in range(0, N_SEG):
                acc = _segment_chain(a_desc, b_desc, off_m, off_n, s, steps, IEEE, BLOCK_M, BLOCK_N, BLOCK_K)
                acc = _tree_step(acc, slots, s, N_SEG, LEVELS, 0, BLOCK_M, BLOCK_N)
        offs_m = off_m + tl.arange(0, BLOCK_M)
        offs_n = off_n + tl.arange(0, BLOCK_N)
        if HAS_BIAS:
            bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)
            acc = acc + bias.to(tl.float32)[None, :]
        c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :].to(tl.int64) * stride_cn
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))

else:  # pragma: no cover - the torch backend still imports without Triton
    ktree_gemm_kernel = None
