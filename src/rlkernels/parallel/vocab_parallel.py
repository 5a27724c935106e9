"""Vocab-parallel ``linear_logprob`` whose bits do not depend on the TP size (opt-in contract).

A stock vocab-parallel lm head merges per-rank softmax statistics with ``all_reduce``
(MAX of the row max, SUM of the rescaled sums), and sums the ranks' dhidden partials the
same way: the association follows the TP size and the collective's algorithm. Here the
vocabulary is cut into ``shards`` equal shards (a power of two, default
:data:`VOCAB_SHARDS`; V not divisible is refused), and a shard is the unit of work at
every TP size:

* **Forward.** Each shard runs the library's fused log-prob backend on its own rows of
  the head, giving per token its log-sum-exp ``lse_i``, entropy ``H_i`` and the
  target's log-prob within the shard (a function of the shard's rows alone). Rank r of
  TP = t holds ``shards / t`` whole shards; the [shards/t, 3, N] statistics are
  all-gathered and every rank merges all shards in shard order (:func:`merge_shards`):
  ``L = max_i lse_i``, ``S = Σ_i e^(lse_i - L)``, ``lse = L + log S``,
  ``H = Σ_i e^(lse_i - lse) (H_i + lse - lse_i)``, ``logp = logp_k + lse_k - lse`` for
  the shard k holding the target; sums run left to right over the shards.
* **Backward.** Each shard's gradient of the logits comes from the merged ``lse`` and
  ``H`` (the fused backend's own formula); its dW and dbias rows are one chain over the
  tokens, like the one-GPU op's; its dhidden partial is one fp32 chain over the shard's
  columns. The shard partials are combined by the pairwise tree of :mod:`.tree`: a
  rank's shards locally, then the top levels over the ranks' partials, split by columns.

:func:`sharded_linear_logprob` is the one-process op with the same shards and the same
combines, so TP = 1, 2, 4, 8 give the same bits (forward and backward). Its bits differ
from :func:`rlkernels.linear_logprob`'s (that op cuts V differently): an opt-in mode.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from ..ops import _validate as V
from ..ops.linear_logprob import backends_for
from ..ops.matmul import main_grad_target
from ..ops.lm_head.backward_schedule import backward_chunk
from ..ops.lm_head.config import NO_TRANSFORM, LogitTransform
from ..ops.lm_head.validate import (HeadNames, validate_head, validate_targets, validate_threshold,
                                    validate_transform)
from .tree import combine_across_ranks, leaf_width, process_group_world, stack_tree

# Default number of vocabulary shards (TP up to 8; V = 151936 gives shards of 18992 rows).
VOCAB_SHARDS = 8

SHARDED_OP = "sharded_linear_logprob"
VOCAB_OP = "vocab_parallel_linear_logprob"
# vocab_parallel_linear_logprob's names for its head: one rank's rows of it.
SHARD_NAMES = HeadNames(weight="weight_shard", bias="bias_shard", rows="V/TP")


@dataclasses.dataclass(frozen=True)
class VocabLayout:
    """Which shards a rank holds: shards ``rank * per_rank ..`` of ``width`` rows each."""

    shards: int
    width: int
    rank: int
    world: int

    @property
    def per_rank(self) -> int:
        return self.shards // self.world

    def first_id(self, local_shard: int) -> int:
        """Global vocabulary id of the first row of this rank's ``local_shard``."""
        return (self.rank * self.per_rank + local_shard) * self.width


def vocab_layout(op: str, vocab: int, shards: int, rank: int, world: int) -> VocabLayout:
    """The layout of V over ``shards`` equal shards; refuses what the contract cannot cut."""
    width = leaf_width(op, "V", vocab, "shards", shards, world,
                       "the dhidden partials of the shards are combined by a binary tree")
    return VocabLayout(shards, width, rank, world)


def local_targets(tgt: torch.Tensor, first_id: int, width: int) -> torch.Tensor:
    """Targets as rows of one shard: ``tgt - first_id`` inside it, ``width`` (no row) elsewhere.

    Never negative: the fused backends read a negative id as an ignored row, whose
    entropy they zero; every row needs the shard's statistics."""
    inside = (tgt >= first_id) & (tgt < first_id + width)
    return torch.where(inside, tgt - first_id, torch.full_like(tgt, width))


def shard_stats(logprob_backend, h2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                tgt_local: torch.Tensor, temperature: float, threshold: torch.Tensor | None = None,
                transform: LogitTransform = NO_TRANSFORM) -> torch.Tensor:
    """[3, N] fp32 (fp64 for fp64): the shard's (lse, entropy, logp of the target within it),
    over its logits >= ``threshold`` [N] where given (lse -inf where it keeps none), each
    logit made by the model's ``transform`` (elementwise: a shard applies it to its own)."""
    logp, ent, lse = logprob_backend.forward(h2, weight, bias, tgt_local, temperature, True, threshold, transform)
    return torch.stack([lse, ent, logp])


def merge_shards(stats: list[torch.Tensor], tgt: torch.Tensor,
                 width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logp, entropy, lse) [N] from the shards' [3, N] statistics, in shard order."""
    big = stats[0][0]
    for st in stats[1:]:
        big = torch.maximum(big, st[0])  # exact: any order gives the same max
    total = torch.zeros_like(big)
    for st in stats:
        total = total + torch.exp(st[0] - big)
    lse = big + torch.log(total)
    ent = torch.zeros_like(big)
    logp = torch.zeros_like(big)
    for i, st in enumerate(stats):
        # A shard that keeps no logit of a truncated row (lse -inf) adds nothing to its entropy.
        kept = st[0] > -math.inf
        ent = ent + torch.where(kept, torch.exp(st[0] - lse) * (st[1] + (lse - st[0])), torch.zeros_like(big))
        inside = (tgt >= i * width) & (tgt < (i + 1) * width)
        # A target in a shard that keeps nothing is outside the kept set: -inf.
        logp = torch.where(inside, torch.where(kept, st[2] + (st[0] - lse), -math.inf), logp)
    valid = tgt >= 0
    zero = torch.zeros_like(big)
    return torch.where(valid, logp, zero), torch.where(valid, ent, zero), lse


def _shard_order(gathered: list[torch.Tensor], per_rank: int) -> list[torch.Tensor]:
    """The gathered [per_rank, 3, N] blocks as one list of shard stats, rank 0's shards first."""
    return [block[i] for block in gathered for i in range(per_rank)]


class _VocabParallelFunction(torch.autograd.Function):
    """(logp, entropy) [N] of rows h2 [N, D] against this rank's head rows [V/t, D]."""

    @staticmethod
    def forward(ctx, h2, weight, bias, tgt, layout: VocabLayout, temperature: float, group,  # type: ignore[override]
                logprob_backend, gemm_backend, threshold=None, transform: LogitTransform = NO_TRANSFORM,
                op: str = SHARDED_OP):
        w = layout.width
        local = [shard_stats(logprob_backend, h2, weight[i * w:(i + 1) * w],
                             bias[i * w:(i + 1) * w] if bias is not None else None,
                             local_targets(tgt, layout.first_id(i), w), temperature, threshold, transform)
                 for i in range(layout.per_rank)]
        if layout.world > 1:
            mine = torch.stack(local)
            gathered = [torch.empty_like(mine) for _ in range(layout.world)]
            dist.all_gather(gathered, mine, group=group)
            local = _shard_order(gathered, layout.per_rank)
        logp, ent, lse = merge_shards(local, tgt, w)
        ctx.save_for_backward(h2, weight, bias, tgt, lse, ent, threshold)
        ctx.layout, ctx.temperature, ctx.group, ctx.transform = layout, temperature, group, transform
        ctx.logprob_backend, ctx.gemm_backend, ctx.op = logprob_backend, gemm_backend, op
        ctx.set_materialize_grads(False)
        return logp, ent

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logp, grad_ent):  # type: ignore[override]
        h2, weight, bias, tgt, lse, ent, threshold = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[2]
        nothing = (None,) * 12
        if grad_logp is None and grad_ent is None or not (need_h or need_w or need_b):
            return nothing
        layout, T = ctx.layout, ctx.temperature
        logprob_backend, gemm_backend = ctx.logprob_backend, ctx.gemm_backend
        N, D = h2.shape
        dev, acc_dt = h2.device, lse.dtype
        valid = tgt >= 0
        zero = torch.zeros(N, dtype=acc_dt, device=dev)
        # Ignored rows get exactly zero upstream gradient (so their logit gradients are 0).
        g_logp = torch.where(valid, grad_logp.to(acc_dt), zero) if grad_logp is not None else zero
        g_ent = torch.where(valid, grad_ent.to(acc_dt), zero) if grad_ent is not None else None
        w = layout.width
        # A parameter's fp32 main_grad takes dW / dbias, their chains continuing from it (as
        # linear_logprob's do); the returned gradient is then None.
        w_main = main_grad_target(ctx.op, weight, tuple(weight.shape), "weight", contiguous=True) if need_w else None
        b_main = main_grad_target(ctx.op, bias, tuple(bias.shape), "bias", contiguous=True) if need_b else None
        dw = w_main if w_main is not None else (torch.empty_like(weight) if need_w else None)
        db = (b_main if b_main is not None else torch.zeros(weight.shape[0], dtype=acc_dt, device=dev)) if need_b \
            else None
        cv = min(w, backward_chunk(N, w, h2.element_size()))
        g_buf = torch.empty(N, cv, dtype=h2.dtype, device=dev)

        def shard_dhidden(i: int) -> torch.Tensor:
            """Shard i's dW/dbias rows (written), and its fp32 dhidden partial (returned)."""
            rows = slice(i * w, (i + 1) * w)
            w_i, b_i = weight[rows], bias[rows] if bias is not None else None
            t_i = local_targets(tgt, layout.first_id(i), w)
            dh = torch.zeros(N, D, dtype=acc_dt, device=dev) if need_h else None
            for v0 in range(0, w, cv):
                v1 = min(w, v0 + cv)
                g = g_buf[:, :v1 - v0]
                logprob_backend.grad_logits(h2, w_i, b_i, t_i, lse, ent, g_logp, g_ent, T, v0, v1, g, threshold,
                                            ctx.transform)
                if need_h and D > 0:
                    # One fp32 chain over the shard's columns, split at multiples of 256 (same bits).
                    gemm_backend.gemm(g, w_i[v0:v1], out=dh, accumulate=True)
                rowsum = db[i * w + v0:i * w + v1] if need_b else None
                if need_w and D > 0:
                    # dW rows: one chain over all tokens, ascending, rounded once (the one-GPU op's).
                    gemm_backend.gemm(g.t(), h2, out=dw[i * w + v0:i * w + v1], rowsum=rowsum,
                                      accumulate=w_main is not None)
                elif need_b:
                    gemm_backend.gemm(g.t(), h2[:, :1] if D > 0 else g.new_zeros(N, 1), out_dtype=acc_dt,
                                      rowsum=rowsum)
            return dh

        grad_h = None
        if need_h:
            local = stack_tree(shard_dhidden(i) for i in range(layout.per_rank))
            grad_h = combine_across_ranks(local, ctx.group, layout.rank, layout.world,
                                          lambda root, c0: root.to(h2.dtype))
        else:
            for i in range(layout.per_rank):
                shard_dhidden(i)
        if need_w and D == 0 and w_main is None:
            dw.zero_()
        grad_w = dw if w_main is None else None
        grad_b = db.to(bias.dtype) if need_b and b_main is None else None
        return grad_h, grad_w, grad_b, None, None, None, None, None, None, None, None, None


def _run(op: str, hidden, weight, target, bias, layout: VocabLayout, temperature, ignore_index, return_entropy,
         group, backend, logit_threshold=None, logit_scale=1.0, logit_softcap=0.0):
    transform = validate_transform(op, logit_scale, logit_softcap)
    if logit_threshold is not None:
        validate_threshold(op, logit_threshold, tuple(hidden.shape[:-1]), hidden.dtype, hidden.device)
    logprob_backend, gemm_backend = backends_for(op, hidden, backend)
    h2 = hidden.reshape(target.numel(), hidden.shape[-1])
    t1 = target.reshape(-1).to(torch.int64)
    tgt = torch.where(t1 == ignore_index, torch.full_like(t1, -1), t1)
    threshold = logit_threshold.detach().reshape(-1).contiguous() if logit_threshold is not None else None
    logp, ent = _VocabParallelFunction.apply(h2, weight, bias, tgt, layout, float(temperature), group,
                                             logprob_backend, gemm_backend, threshold, transform, op)
    logp, ent = logp.reshape(target.shape), ent.reshape(target.shape)
    return (logp, ent) if return_entropy else logp


def sharded_linear_logprob(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                           bias: torch.Tensor | None = None, *, shards: int = VOCAB_SHARDS,
                           temperature: float = 1.0, ignore_index: int = -100, return_entropy: bool = False,
                           logit_threshold: torch.Tensor | None = None, logit_scale: float = 1.0,
                           logit_softcap: float = 0.0, backend: str | None = None):
    """One-process :func:`vocab_parallel_linear_logprob`: the same shards, the same combines, the same bits.

    Arguments as :func:`rlkernels.linear_logprob` (hidden [..., D], weight [V, D], target
    [...], bias [V] or None) plus ``shards`` (a power of two dividing V). Returns logp
    [...] (and entropy) in fp32 (fp64 for fp64), differentiable w.r.t. hidden, weight and
    bias (first order). Its bits may differ from ``linear_logprob``'s (another vocab
    cut): an opt-in mode.
    """
    op = SHARDED_OP
    validate_head(op, hidden, weight, bias, temperature)
    validate_targets(op, hidden, weight, target, bias, ignore_index)
    layout = vocab_layout(op, weight.shape[0], shards, 0, 1)
    return _run(op, hidden, weight, target, bias, layout, temperature, ignore_index, return_entropy, None, backend,
                logit_threshold, logit_scale, logit_softcap)


def vocab_parallel_linear_logprob(hidden: torch.Tensor, weight_shard: torch.Tensor, target: torch.Tensor,
                                  bias_shard: torch.Tensor | None = None, *, shards: int = VOCAB_SHARDS,
                                  temperature: float = 1.0, ignore_index: int = -100, return_entropy: bool = False,
                                  logit_threshold: torch.Tensor | None = None, logit_scale: float = 1.0,
                                  logit_softcap: float = 0.0, group: dist.ProcessGroup | None = None,
                                  backend: str | None = None):
    """``linear_logprob`` with the lm head sharded on the vocabulary over ``group`` (TP = t ranks).

    hidden [..., D] and target [...] (global ids) are replicated; rank r holds rows
    ``r*V/t .. (r+1)*V/t`` of the lm head, weight_shard [V/t, D] (bias_shard [V/t] or
    None), with t dividing ``shards`` (a power of two dividing V). Returns logp (and
    entropy) [...] fp32 on every rank, bitwise equal to :func:`sharded_linear_logprob`
    with the same ``shards``; differentiable: dhidden (replicated, the full gradient on
    every rank), dW and dbias of this rank's rows, each bitwise the TP = 1 values.
    The collectives are ``all_gather`` (statistics [shards/t, 3, N] forward) and, backward,
    ``all_to_all`` of the fp32 [N, D] dhidden partials by column chunks and ``all_gather``
    of the finished chunks: exact copies, never a sum. ``logit_threshold`` (target's shape,
    replicated): the truncated distribution's, as :func:`rlkernels.linear_logprob` takes it;
    every shard leaves out its logits below it. ``logit_scale``/``logit_softcap``: the
    model's logit transform, as :func:`rlkernels.linear_logprob` takes it (each shard applies
    it to its own logits).
    """
    op = VOCAB_OP
    V.require_tensor(op, "hidden", hidden)
    V.require_tensor(op, "weight_shard", weight_shard)
    V.require_tensor(op, "target", target)
    rank, world = process_group_world(op, group, True)
    validate_head(op, hidden, weight_shard, bias_shard, temperature, SHARD_NAMES)
    vocab = validate_targets(op, hidden, weight_shard, target, bias_shard, ignore_index, SHARD_NAMES, world)
    layout = vocab_layout(op, vocab, shards, rank, world)
    return _run(op, hidden, weight_shard, target, bias_shard, layout, temperature, ignore_index, return_entropy,
                group, backend, logit_threshold, logit_scale, logit_softcap)
