"""Row-parallel linear whose bits do not depend on the TP size: the K-tree (opt-in contract).

A stock row-parallel layer (``o_proj``, ``down_proj``) sums each rank's partial product
with ``all_reduce``: the sum's association follows the TP size and the collective's
algorithm, so TP = 1, 2, 4 give different bits. Here K is cut into ``segments`` equal
segments of ``SEG = K / segments`` elements (``segments`` a power of two, default
:data:`TREE_SEGMENTS`; K not divisible is refused). Each segment is one ascending
canonical chain (the library's GEMM backend on that K-slice, fp32 output kept
unrounded); the segment partials are combined by the pairwise tree of :mod:`.tree`,
then the bias is added in fp32 and the sum rounded once. At TP = t (a power of two
dividing ``segments``) rank r holds segments ``r*segments/t ..``, builds the lower
``log2(segments/t)`` levels of the same tree locally, and the top ``log2(t)`` levels run
over the ranks' partials, in rank order, split by output columns
(:func:`.tree.combine_across_ranks`). Same tree, same leaves, so the same bits at every
TP size.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..gemm.chain import accumulator_dtype
from ..gemm.ktree import ktree_fusable, ktree_gemm
from ..ops import _validate as V
from ..ops.matmul import gemm_backend_for, linear_backward
from .tree import combine_across_ranks, leaf_width, process_group_world, stack_tree

# Default number of K-tree segments: SEG = K / 8, so TP = 1, 2, 4, 8 all split K on
# segment boundaries (K = 4096: 512-element chains, multiples of every GEMM backend's K step).
TREE_SEGMENTS = 8

TREE_OP = "tree_linear"
ROW_OP = "row_parallel_tree_linear"
PLAIN_OP = "plain_row_parallel_linear"


def tree_segment(op: str, k_total: int, segments: int, world: int = 1) -> int:
    """SEG, the K-tree's segment length: ``k_total / segments``; refuses what the tree cannot cut."""
    return leaf_width(op, "K", k_total, "segments", segments, world, "the K-tree is a full binary tree")


def local_tree(gemm_backend, x2: torch.Tensor, w_nk: torch.Tensor, seg: int, n_seg: int,
               bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The subtree over this rank's ``n_seg`` segments of ``seg`` columns, plus ``bias`` in fp32,
    rounded once to ``out_dtype`` (default: unrounded fp32, fp64 for fp64) [M, N].

    The Triton backend runs it as one kernel (:func:`ktree_gemm`) where the operands allow;
    otherwise, and on the torch backend, it is one GEMM per segment and the tree's
    additions: the same arithmetic, the same bits."""
    adt = accumulator_dtype(x2.dtype)
    if gemm_backend.name == "triton" and ktree_fusable(x2, w_nk, seg):
        return ktree_gemm(x2, w_nk, seg, n_seg, bias, out_dtype or adt)
    y = stack_tree(gemm_backend.gemm(x2[:, s * seg:(s + 1) * seg], w_nk[:, s * seg:(s + 1) * seg].t(),
                                     out_dtype=adt) for s in range(n_seg))
    if bias is not None:
        y = y.add_(bias.to(adt))
    return y if out_dtype is None else y.to(out_dtype)


def _validate_linear(op: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    V.require_tensor(op, "x", x)
    V.require_tensor(op, "weight", weight)
    V.require_float(op, "x", x)
    V.require_float(op, "weight", weight)
    if bias is not None:
        V.require_float(op, "bias", bias)
        V.require_ndim(op, "bias", bias, 1, 1)
    V.require_ndim(op, "x", x, 1)
    V.require_ndim(op, "weight", weight, 2, 2)
    V.require_same_device(op, x=x, weight=weight, bias=bias)
    V.require_same_dtype(op, x=x, weight=weight, bias=bias)
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"rlkernels.{op}: x {tuple(x.shape)} has K={x.shape[-1]} but weight "
                         f"{tuple(weight.shape)} ([N, K] layout) has K={weight.shape[1]}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"rlkernels.{op}: bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")


class _TreeLinearFunction(torch.autograd.Function):
    """y = x @ W^T + b by the K-tree; x and W hold this rank's K columns."""

    @staticmethod
    def forward(ctx, x, weight, bias, seg: int, n_seg: int, group, rank: int, world: int,  # type: ignore[override]
                gemm_backend):
        K = x.shape[-1]
        x2 = x.reshape(x.shape[:-1].numel(), K)
        if world == 1:
            y = local_tree(gemm_backend, x2, weight, seg, n_seg, bias, x.dtype)
        else:
            def finish(root: torch.Tensor, c0: int) -> torch.Tensor:
                # The bias in fp32, then the one rounding: the one-process layer's last steps.
                if bias is not None:
                    b = bias[c0:c0 + root.shape[1]].to(root.dtype)
                    root = root.add_(torch.nn.functional.pad(b, (0, root.shape[1] - b.shape[0])))
                return root.to(x.dtype)

            y = combine_across_ranks(local_tree(gemm_backend, x2, weight, seg, n_seg), group, rank, world, finish)
        ctx.save_for_backward(x2, weight, bias)
        ctx.gemm_backend, ctx.in_shape = gemm_backend, x.shape
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        # Everything is local: dY is replicated (the forward's output is), dX_rank = dY @ W_rank
        # is this rank's columns of dY @ W, dW_rank = dY^T @ X_rank its columns of dW; both
        # are the GEMM backend's chains over N and over tokens, the same bits as the one-process
        # layer. A parameter's main_grad takes dW / dbias, as rlkernels.linear's does.
        x2, weight, bias = ctx.saved_tensors
        grads = linear_backward(ctx.gemm_backend, grad_out, x2, weight, bias, ctx.in_shape, ctx.needs_input_grad[:3])
        return (*grads, None, None, None, None, None, None)


def _tree_linear(op: str, x, weight, bias, segments, group, distributed: bool, backend: str | None):
    _validate_linear(op, x, weight, bias)
    rank, world = process_group_world(op, group, distributed)
    seg = tree_segment(op, weight.shape[1] * world, segments, world)
    gemm_backend = gemm_backend_for(x.device, backend)
    V.refuse_interpreted_bf16(op, gemm_backend.name, x)
    if x.dtype == torch.float64 and gemm_backend.name == "triton":
        raise ValueError(f"rlkernels.{op}: float64 runs on the torch backend only (RLKERNELS_BACKEND=torch)")
    return _TreeLinearFunction.apply(x, weight, bias, seg, segments // world, group, rank, world, gemm_backend)


def tree_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                segments: int = TREE_SEGMENTS, backend: str | None = None) -> torch.Tensor:
    """``F.linear`` by the K-tree on one process: the bits of :func:`row_parallel_tree_linear` at any TP.

    x: [..., K]; weight: [N, K]; bias: [N] or None; one float dtype and device.
    ``segments``: a power of two dividing K (SEG = K / segments). Returns [..., N] in x's
    dtype, rounded once. Differentiable; the backward is that of :func:`rlkernels.linear`.
    These bits differ from :func:`rlkernels.linear`'s (one chain over K): an opt-in mode.
    """
    return _tree_linear(TREE_OP, x, weight, bias, segments, None, False, backend)


def row_parallel_tree_linear(x_shard: torch.Tensor, weight_shard: torch.Tensor, bias: torch.Tensor | None = None, *,
                             segments: int = TREE_SEGMENTS, group: dist.ProcessGroup | None = None,
                             backend: str | None = None) -> torch.Tensor:
    """Row-parallel linear (Megatron's RowParallelLinear layout) by the K-tree.

    Rank r of ``group`` (TP = t ranks, t a power of two dividing ``segments``) holds
    x_shard [..., K/t] and weight_shard [N, K/t], columns ``r*K/t .. (r+1)*K/t`` of x and
    W; bias [N] (replicated) or None. Returns the full y [..., N] on every rank, bitwise
    equal to :func:`tree_linear` on the whole x, W at the same ``segments``. The cross-rank
    step moves fp32 partials by ``all_to_all`` (rank r gets column chunk r of each) and
    combines them in rank order, then gathers the finished chunks: never a collective sum.
    Backward is local (dX_rank, dW_rank; dbias replicated).
    """
    return _tree_linear(ROW_OP, x_shard, weight_shard, bias, segments, group, True, backend)


def plain_row_parallel_linear(x_shard: torch.Tensor, weight_shard: torch.Tensor, bias: torch.Tensor | None = None, *,
                              group: dist.ProcessGroup | None = None, backend: str | None = None) -> torch.Tensor:
    """The stock row-parallel layer, for comparison: one chain over the rank's K/t, then ``all_reduce``.

    Not TP-invariant (the chain length and the collective's sum order follow t); forward only.
    """
    _validate_linear(PLAIN_OP, x_shard, weight_shard, bias)
    gemm_backend = gemm_backend_for(x_shard.device, backend)
    x2 = x_shard.reshape(x_shard.shape[:-1].numel(), x_shard.shape[-1])
    part = gemm_backend.gemm(x2, weight_shard.t(), out_dtype=accumulator_dtype(x2.dtype))
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(part, group=group)
    if bias is not None:
        part = part + bias.to(part.dtype)
    return part.to(x_shard.dtype).reshape(*x_shard.shape[:-1], weight_shard.shape[0])
