"""Column-parallel linear whose input gradient does not depend on the TP size.

The forward of a column-parallel layer (q/k/v, gate/up) is exact at any TP size: each
output column is one chain over K. Its input gradient is not: dX = dY @ W sums over the
output columns N, which the ranks split, so a stock layer adds the ranks' partial dX by
``all_reduce``. Here dX is the K-tree of :mod:`.row_parallel` turned around: N is cut into
``segments`` equal segments, each segment's ``dY_s @ W_s`` is one canonical chain, and
the segment partials are combined by the same pairwise tree, locally over a rank's
contiguous segments and across the ranks in rank order
(:func:`.tree.combine_across_ranks`), then rounded once. dW and dbias are the rank's rows
of the one-process layer's, by the same chains (``main_grad`` honoured). ``group=None``
gives these bits on one process.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..ops import _validate as V
from ..ops.matmul import gemm_backend_for, linear, linear_backward
from .row_parallel import local_tree
from .tree import combine_across_ranks, leaf_width, process_group_world

COLUMN_OP = "column_parallel_tree_linear"


class _ColumnTreeFunction(torch.autograd.Function):
    """y = x @ W^T + b with W this rank's output rows; dX by the N-tree across the ranks."""

    @staticmethod
    def forward(ctx, x, weight, bias, seg: int, n_seg: int, group, rank: int, world: int,  # type: ignore[override]
                gemm_backend, backend: str | None):
        ctx.save_for_backward(x, weight, bias)
        ctx.tree = (seg, n_seg, group, rank, world)
        ctx.gemm_backend = gemm_backend
        return linear(x, weight, bias, backend=backend)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        x, weight, bias = ctx.saved_tensors
        seg, n_seg, group, rank, world = ctx.tree
        K = x.shape[-1]
        x2 = x.reshape(-1, K)
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        _, grad_w, grad_b = linear_backward(ctx.gemm_backend, grad_out, x2, weight, bias, x.shape,
                                            (False, need_w, need_b))
        grad_x = None
        if need_x:
            dy = grad_out.reshape(-1, weight.shape[0]).to(x.dtype)
            # The tree's leaves over this rank's output rows: dY_s @ W_s, each [tokens, K] in fp32.
            local = local_tree(ctx.gemm_backend, dy, weight.t(), seg, n_seg)
            grad_x = combine_across_ranks(local, group, rank, world,
                                          lambda root, c0: root.to(x.dtype)).reshape(x.shape)
        return grad_x, grad_w, grad_b, None, None, None, None, None, None, None


def column_parallel_tree_linear(x: torch.Tensor, weight_shard: torch.Tensor, bias_shard: torch.Tensor | None = None,
                                *, segments: int, group: dist.ProcessGroup | None = None,
                                backend: str | None = None) -> torch.Tensor:
    """Column-parallel linear (Megatron's ColumnParallelLinear layout) with a TP-invariant backward.

    Rank r of ``group`` (TP = t ranks, t a power of two dividing ``segments``; None: one
    process, t = 1) holds weight_shard [N/t, K] and bias_shard [N/t], output rows
    ``r*N/t .. (r+1)*N/t``; x [..., K] is whole on every rank. Returns this rank's columns
    y [..., N/t], the one-process layer's bits. The input gradient is whole on every rank
    and bitwise the same at every TP size (the N-tree above); the weight and bias
    gradients are this rank's rows of the one-process layer's.
    """
    op = COLUMN_OP
    V.require_tensor(op, "x", x)
    V.require_tensor(op, "weight", weight_shard)
    rank, world = process_group_world(op, group, group is not None)
    seg = leaf_width(op, "N", weight_shard.shape[0] * world, "segments", segments, world,
                     "the input gradient's tree is a full binary tree")
    gemm_backend = gemm_backend_for(x.device, backend)
    return _ColumnTreeFunction.apply(x, weight_shard, bias_shard, seg, segments // world, group, rank, world,
                                     gemm_backend, backend)
