"""Triton and Gluon kernels of the batch-invariant attention (host code: ``rlkernels.ops.attention``).

Modules by role: ``prologue`` (which tile a program computes, its sequence's bounds and
key range, row addresses, loads and stores), ``softmax`` (the online-softmax state: a block's
step, the merge, a split's walk, the finish), ``forward`` (the full kernel), ``split``
(split-KV decode and its combine), ``backward`` (delta, dK/dV, dQ) and ``forward_ws``
(the warp-specialized Hopper forward, Gluon).

The chain every forward kernel computes for a query row (see docs/operators/attention.md):
keys in blocks of BLOCK_N aligned to key 0, ascending; blocks grouped in splits of
S_SPLIT keys aligned to key 0; each split's online-softmax state (m, l, acc) starts
from scratch and the splits' states are merged in ascending order by ``merge_states``
starting from the empty state. ``block_step`` and ``merge_states`` are the only places
where the state is updated; both the full (prefill) kernel and the split (decode)
kernel walk a split with ``split_walk`` and merge with ``merge_states``, so their
rows agree bit for bit. ``forward_ws`` computes the same chain with the same
instructions in a warp-specialized Hopper kernel.

Exactness of the no-op steps (why a tile's extra rows/blocks cost no bits): a block
whose keys are all masked for a row leaves (m, l, acc) unchanged exactly (alpha =
exp2(0) = 1, p = exp2(-inf) = 0, fma(l, 1, 0) = l, acc + 0 = acc), and merging the
empty state (-inf, 0, 0) is exact too. Scores are in log2 units (qk_scale includes
log2(e)); the saved LSE is m + log2(l) in the same units.

Loads: blocks whose rows all lie inside the sequence may come through TMA descriptors
(``TMA``; ``tma_row`` says where a head's rows are) and the rest through masked pointer
loads; a block's values, and so every dot, are the same either way.
"""
