"""Per-head RMSNorm (Qwen3's q/k norms) whose weight gradient does not depend on the TP size.

One weight [head_dim] normalizes every head of a projection, so its gradient sums over
(tokens, heads), and the ranks split the heads. Here that sum is cut by heads: the heads
form ``segments`` equal contiguous segments, each segment's column sum is the op's own
(:func:`rlkernels.ops.norms.rms_norm`'s backward over that segment's rows, in fp32), and
the segment sums are combined by the pairwise tree of :mod:`.tree`, locally over a rank's
segments and across the ranks in rank order, then rounded once to the weight's dtype.
The forward and the input gradient are the op's, row by row. ``group=None`` gives these
bits on one process.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..ops import _validate as V
from ..ops.norms import rms_norm
from .tree import combine_across_ranks, leaf_width, stack_tree

HEAD_NORM_OP = "head_tree_rms_norm"


class _HeadTreeNormFunction(torch.autograd.Function):
    """y = rms_norm(x, weight) over x [..., heads, head_dim] (this rank's heads)."""

    @staticmethod
    def forward(ctx, x, weight, eps: float, n_seg: int, group, rank: int, world: int):  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        ctx.eps, ctx.tree = eps, (n_seg, group, rank, world)
        return rms_norm(x, weight, eps)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        n_seg, group, rank, world = ctx.tree
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            with torch.enable_grad():
                xd = x.detach().requires_grad_(True)
                (grad_x,) = torch.autograd.grad(rms_norm(xd, weight.detach(), ctx.eps), xd, grad)
        if ctx.needs_input_grad[1]:
            per = x.shape[-2] // n_seg

            def segment_sum(s: int) -> torch.Tensor:
                # The op's weight gradient over segment s's rows, kept in fp32 (an fp32 weight).
                heads = slice(s * per, (s + 1) * per)
                with torch.enable_grad():
                    w32 = weight.detach().float().requires_grad_(True)
                    y = rms_norm(x[..., heads, :].detach(), w32, ctx.eps)
                    (part,) = torch.autograd.grad(y, w32, grad[..., heads, :].to(y.dtype))
                return part[None, :]

            local = stack_tree(segment_sum(s) for s in range(n_seg))
            grad_w = combine_across_ranks(local, group, rank, world, lambda root, c0: root.to(weight.dtype))[0]
        return grad_x, grad_w, None, None, None, None, None


def head_tree_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, segments: int,
                       group: dist.ProcessGroup | None = None, rank: int = 0, world: int = 1) -> torch.Tensor:
    """``rms_norm(x, weight, eps)`` over x [..., heads, head_dim] holding this rank's heads of
    ``segments`` equal head segments (``segments / world`` of them), with the weight
    gradient by the head-segment tree: the same bits at every TP size."""
    op = HEAD_NORM_OP
    V.require_tensor(op, "x", x)
    V.require_ndim(op, "x", x, 2)
    leaf_width(op, "heads", x.shape[-2] * world, "segments", segments, world,
               "the weight gradient's tree is a full binary tree")
    return _HeadTreeNormFunction.apply(x, weight, float(eps), segments // world, group, rank, world)
