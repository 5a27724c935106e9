"""The layers of a tensor-parallel model as modules: the column-parallel linear (its input
gradient by the N-tree), the K-tree's row-parallel linear, and the vocabulary-parallel
embedding and LM head, each holding this rank's contiguous shard (Megatron's layout) and
giving every rank the whole result by exact copies.

``group=None`` is the one-process layout: whole parameters, the same K-tree and the same
vocabulary shards, so its bits are those of every TP size.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..nn import Linear, RMSNorm
from ..ops.lm_head.truncation import truncates
from ..ops.matmul import linear
from .column_parallel import column_parallel_tree_linear
from .head_norm import head_tree_rms_norm
from .row_parallel import TREE_SEGMENTS, row_parallel_tree_linear, tree_linear
from .tree import all_gather_cat
from .vocab_parallel import VOCAB_SHARDS
from .vocab_parallel_sample import sharded_linear_sample, vocab_parallel_linear_sample


class TreeColumnParallelLinear(Linear):
    """q/k/v or gate/up of a tensor-parallel model: the library's Linear over this rank's
    output rows (weight [N/t, K], bias [N/t]), whose input gradient, where one is taken, is
    the N-tree's (:func:`~rlkernels.parallel.column_parallel.column_parallel_tree_linear`):
    the same bits at every TP size. Without gradients it is the plain Linear."""

    group: dist.ProcessGroup | None
    segments: int

    @classmethod
    def convert(cls, module: Linear, group: dist.ProcessGroup | None, segments: int) -> "TreeColumnParallelLinear":
        """``module`` itself, its class changed (its Parameters, hooks and bound forwards kept)."""
        module.__class__ = cls
        module.group, module.segments = group, segments
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return column_parallel_tree_linear(x, self.weight, self.bias, segments=self.segments, group=self.group)
        return linear(x, self.weight, self.bias)


class HeadTreeRMSNorm(RMSNorm):
    """A per-head norm (Qwen3's q_norm / k_norm, one weight for every head) of a
    tensor-parallel model over this rank's heads: the library's RMSNorm, whose weight
    gradient, where one is taken, is the head-segment tree's
    (:func:`~rlkernels.parallel.head_norm.head_tree_rms_norm`): the same bits at every TP
    size. Without gradients it is the plain RMSNorm."""

    group: dist.ProcessGroup | None
    segments: int
    rank: int
    world: int

    @classmethod
    def convert(cls, module: RMSNorm, group: dist.ProcessGroup | None, segments: int, rank: int,
                world: int) -> "HeadTreeRMSNorm":
        """``module`` itself, its class changed (its Parameter kept)."""
        module.__class__ = cls
        module.group, module.segments, module.rank, module.world = group, segments, rank, world
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return head_tree_rms_norm(x, self.weight, self.variance_epsilon, segments=self.segments,
                                      group=self.group, rank=self.rank, world=self.world)
        return super().forward(x)


class TreeRowParallelLinear(nn.Module):
    """``o_proj`` / ``down_proj`` of a tensor-parallel model: ``F.linear`` by the K-tree
    (:func:`~rlkernels.parallel.row_parallel_tree_linear`), the same bits at every TP size.

    weight: [N, K/t], this rank's columns (all K with ``group=None``); bias: [N]
    (replicated) or None. Takes x [..., K/t] (this rank's columns of the input, as the
    column-parallel layer before it leaves them) and returns y [..., N] on every rank."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, group: dist.ProcessGroup | None,
                 segments: int = TREE_SEGMENTS) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias
        self.group, self.segments = group, segments

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return tree_linear(x, self.weight, self.bias, segments=self.segments)
        return row_parallel_tree_linear(x, self.weight, self.bias, segments=self.segments, group=self.group)


class VocabParallelEmbedding(nn.Module):
    """The input embedding over ``world`` contiguous vocabulary blocks: rank r holds rows
    ``r*V/t .. (r+1)*V/t`` of the table (weight [V/t, D]). Each rank looks up the ids it
    holds; every rank takes each id's row from the rank holding it (an all-gather and a
    select: copies, never a sum). ``num_embeddings`` is the whole V."""

    def __init__(self, weight: nn.Parameter, num_embeddings: int, group: dist.ProcessGroup | None, rank: int,
                 world: int) -> None:
        super().__init__()
        self.weight = weight
        self.num_embeddings, self.group, self.rank, self.world = num_embeddings, group, rank, world

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return F.embedding(ids, self.weight)
        return _VocabParallelLookup.apply(ids, self.weight, self.group, self.rank, self.world)


class _VocabParallelLookup(torch.autograd.Function):
    """Each id's row from the rank holding it (copies), and the backward of ``F.embedding``
    over this rank's rows: each row's gradient sums its own ids' output gradients in token
    order, as the one-process lookup's does (the other ranks' ids go to a discarded row)."""

    @staticmethod
    def forward(ctx, ids, weight, group, rank: int, world: int):  # type: ignore[override]
        rows = weight.shape[0]
        owner = torch.div(ids, rows, rounding_mode="floor")
        mine = owner == rank
        local = torch.where(mine, ids - rank * rows, torch.full_like(ids, rows))
        found = F.embedding(torch.where(mine, local, torch.zeros_like(local)), weight)
        parts = [torch.empty_like(found) for _ in range(world)]
        dist.all_gather(parts, found.contiguous(), group=group)
        out = parts[0]
        for r in range(1, world):
            out = torch.where((owner == r)[..., None], parts[r], out)
        ctx.save_for_backward(local)
        ctx.rows = rows
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        (local,) = ctx.saved_tensors
        if not ctx.needs_input_grad[1]:
            return None, None, None, None, None
        # The output gradient is whole on every rank; row ``rows`` collects the ids this rank
        # does not hold, and is dropped. F.embedding's own backward, over a table of one more row.
        with torch.enable_grad():
            table = grad_out.new_zeros(ctx.rows + 1, grad_out.shape[-1]).requires_grad_(True)
            (grad,) = torch.autograd.grad(F.embedding(local, table), table, grad_out)
        return None, grad[:ctx.rows], None, None, None


class VocabParallelHead(nn.Module):
    """The LM head over ``world`` contiguous vocabulary blocks (weight [V/t, D], bias [V/t]
    or None): its forward gives every rank the whole fp32 logits [..., V] (each rank's
    block by the canonical chain, then all-gathered: copies). ``token_logprobs`` scores
    it by :func:`~rlkernels.parallel.vocab_parallel_linear_logprob` with ``shards``
    (:func:`~rlkernels.parallel.sharded_linear_logprob` with ``group=None``)."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, vocab: int, group: dist.ProcessGroup | None,
                 world: int, shards: int = VOCAB_SHARDS) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias
        self.vocab, self.group, self.world, self.shards = vocab, group, world, shards

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = linear(x, self.weight, self.bias, out_dtype=torch.float32)
        return local if self.world == 1 else all_gather_cat(local, self.group, self.world, -1)

    def sample(self, hidden: torch.Tensor, *, temperature: float, seed: int | torch.Tensor, streams: torch.Tensor,
               positions: torch.Tensor, greedy: bool = False, top_k: int = 0, top_p: float = 1.0,
               logit_scale: float = 1.0, logit_softcap: float = 0.0) -> tuple[torch.Tensor, ...]:
        """(token, logp, entropy) [N] of rows ``hidden`` [N, D], and each row's kept-set
        threshold where (``top_k``, ``top_p``) truncate: the vocabulary-parallel draw
        (:func:`~rlkernels.parallel.vocab_parallel_linear_sample`, or its greedy pick), whose
        log-probs are the ones ``token_logprobs`` scores this head with (under that
        threshold); ``logit_scale`` and ``logit_softcap``: the model's logit transform."""
        kw = dict(shards=self.shards, temperature=temperature, seed=seed, streams=streams, positions=positions,
                  return_entropy=True, greedy=greedy, top_k=top_k, top_p=top_p,
                  return_threshold=truncates(top_k, top_p, self.vocab), logit_scale=logit_scale,
                  logit_softcap=logit_softcap)
        if self.group is None:
            return sharded_linear_sample(hidden, self.weight, self.bias, **kw)
        return vocab_parallel_linear_sample(hidden, self.weight, self.bias, group=self.group, **kw)
