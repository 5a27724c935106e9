"""Vocab-parallel ``linear_sample`` whose token and log-prob do not depend on the TP size
(opt-in contract): the sampler of :mod:`.vocab_parallel`'s distribution.

The vocabulary is cut into the same ``shards`` as the scorer's, and a draw is two steps:

* **The shard.** Each shard's log-sum-exp ``lse_s`` and entropy come from the fused
  log-prob backend (:func:`~.vocab_parallel.shard_stats`, the scorer's numbers), gathered
  in shard order. Shard k is picked by the inverse CDF of the fp64 masses
  ``exp(lse_s - max)``, summed in shard order, at a uniform from the counter-based
  generator keyed by (seed, stream, position) at a counter of its own
  (:data:`SHARD_COUNTER`), independent of every word ``linear_sample`` reads.
* **The token.** In every shard a rank holds, :func:`rlkernels.linear_sample` draws each
  row's token from that shard's softmax with the same keys; the ranks' tokens are
  all-gathered and each row takes shard k's.

So ``P(v) = exp(lse_k - lse) exp(z_v - lse_k) = softmax(z)_v`` up to the fp32/fp64 rounding
of the masses, as for ``linear_sample`` itself.

Greedy (``greedy=True``): every shard's candidate is its argmax (``linear_sample``'s greedy
draw, ties: the lowest id), and a row takes the candidate with the highest log-prob in the
merged distribution (ties: the first shard). That is the argmax of the logits unless two
shards' maxima lie within the fp32 rounding of their merged log-probs, where it may take
the other one; either way the choice is a function of the shards' statistics alone, the
same at every TP size. The log-prob and entropy are the scorer's
merge (:func:`~.vocab_parallel.merge_shards`) of the shards' statistics with shard k's
in-shard log-prob, which ``linear_sample`` returns bitwise as ``linear_logprob``: they
are bitwise :func:`~.vocab_parallel.vocab_parallel_linear_logprob` of the drawn token.
Every collective is an ``all_gather`` (copies), so TP = 1, 2, 4 and 8 draw the same
tokens with the same bits. It costs two passes over the head (the statistics, then the
shards' draws) against one for ``linear_sample``.

**Truncated** (``top_k``, ``top_p``): the kept set is ``{v : z_v >= tau}`` over the whole
vocabulary, tau a function of the row's scores alone. The shards' scores are written out
([N, V/t] per rank, by the backend's own pass), gathered side by side in shard order
(the same values at every TP size) and tau is the torch definition of the threshold over
them (:func:`rlkernels.ops.lm_head.truncation.threshold`). Then the draw above runs on
the kept set: each shard's statistics over its logits >= tau (lse -inf where it keeps
none), and each shard's token by ``linear_sample(..., logit_threshold=tau)`` (-inf for a
shard that keeps none: its token is never taken). The log-prob and entropy are those of
the truncated distribution: bitwise :func:`~.vocab_parallel.vocab_parallel_linear_logprob`
with ``logit_threshold=tau``.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..ops import _validate as V
from ..ops.linear_logprob import backends_for
from ..ops.linear_sample import linear_sample, tile_uniform, validate
from ..ops.lm_head import truncation
from ..ops.lm_head.config import LogitTransform
from ..ops.lm_head.validate import validate_transform
from .tree import all_gather_cat, process_group_world
from .vocab_parallel import VOCAB_SHARDS, VocabLayout, merge_shards, shard_stats, vocab_layout

SHARDED_OP = "sharded_linear_sample"
VOCAB_OP = "vocab_parallel_linear_sample"
# The Philox counter of the shard's uniform: below linear_sample's tile counter (2^32 - 1)
# and above its noise words' (< V / 4).
SHARD_COUNTER = (1 << 32) - 2


def _gather(local: torch.Tensor, layout: VocabLayout, group) -> torch.Tensor:
    """This rank's [per_rank, ...] rows of a per-shard tensor -> all shards' [shards, ...]."""
    return local if layout.world == 1 else all_gather_cat(local, group, layout.world, 0)


def _pick_shard(lse: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Each row's shard [N] int64: the first whose cumulative fp64 mass exp(lse_s - max)
    (summed in shard order) exceeds u times the total; ``lse`` [shards, N]."""
    big = lse.amax(dim=0)
    masses = torch.exp((lse - big).double())
    cum = [masses[0]]
    for m in masses[1:]:
        cum.append(cum[-1] + m)
    cum = torch.stack(cum)
    below = cum <= (u * cum[-1])[None, :]
    return below.sum(dim=0).clamp(max=lse.shape[0] - 1)


def _threshold(logprob_backend, hidden, weight, bias, layout: VocabLayout, temperature: float,
               transform: LogitTransform, top_k: int, top_p: float, group) -> torch.Tensor:
    """Each row's kept-set threshold [N] over the whole vocabulary, from the shards' scores
    side by side in shard order (the same values at every TP size)."""
    w = layout.width
    local = torch.cat([logprob_backend.head_scores(hidden, weight[i * w:(i + 1) * w],
                                                   bias[i * w:(i + 1) * w] if bias is not None else None,
                                                   temperature, transform)
                       for i in range(layout.per_rank)], dim=1)
    scores = local if layout.world == 1 else all_gather_cat(local, group, layout.world, 1)
    return truncation.threshold(scores, top_k, top_p)


def _sample(op: str, hidden, weight, bias, layout: VocabLayout, temperature: float, seed, streams, positions,
            return_entropy: bool, group, backend, greedy: bool, transform: LogitTransform, top_k: int = 0,
            top_p: float = 1.0, return_threshold: bool = False):
    logprob_backend, _ = backends_for(op, hidden, backend)
    N = hidden.shape[0]
    w = layout.width
    # Any target in the shard: its statistics' lse and entropy do not depend on it (and an
    # ignored target, -1, gives 0s), and its log-prob is replaced by the drawn token's.
    first = torch.zeros(N, dtype=torch.int64, device=hidden.device)
    stats, tokens = [], []
    with torch.no_grad():
        tau = None
        if truncation.truncates(top_k, top_p, layout.shards * w):
            tau = _threshold(logprob_backend, hidden, weight, bias, layout, temperature, transform, top_k, top_p,
                             group)
        for i in range(layout.per_rank):
            w_i = weight[i * w:(i + 1) * w]
            b_i = bias[i * w:(i + 1) * w] if bias is not None else None
            lse_ent = shard_stats(logprob_backend, hidden, w_i, b_i, first, temperature, tau, transform)[:2]
            # A shard that keeps none of a row's logits draws from all of them: its token is
            # never taken (its mass is 0), and a draw needs a distribution.
            tau_i = None if tau is None else torch.where(lse_ent[0] > -math.inf, tau, -math.inf)
            tok, lp = linear_sample(hidden, w_i, b_i, temperature=temperature, seed=seed, streams=streams,
                                    positions=positions, greedy=greedy, backend=backend, logit_threshold=tau_i,
                                    logit_scale=transform.scale, logit_softcap=transform.softcap)
            stats.append(torch.cat([lse_ent, lp.to(lse_ent.dtype)[None]]))
            tokens.append(tok + layout.first_id(i))
        stats = _gather(torch.stack(stats), layout, group)      # [shards, 3, N]
        tokens = _gather(torch.stack(tokens), layout, group)    # [shards, N]
        if greedy:
            _, _, lse = merge_shards(list(stats), torch.full_like(first, -1), w)
            k = (stats[:, 2] + (stats[:, 0] - lse[None, :])).argmax(dim=0)  # (merge_shards' logp of each candidate)
        else:
            pos = positions if positions is not None else torch.zeros_like(streams)
            k = _pick_shard(stats[:, 0], tile_uniform(seed, streams, pos, SHARD_COUNTER))
        token = tokens.gather(0, k[None, :])[0]
        logp, ent, _ = merge_shards(list(stats), token, w)
        if return_threshold and tau is None:
            tau = torch.full_like(logp, -math.inf)
    out = (token, logp, ent) if return_entropy else (token, logp)
    return out + (tau,) if return_threshold else out


def _validate(op: str, hidden, weight, bias, temperature, seed, streams, positions, greedy, logit_scale,
              logit_softcap, top_k, top_p) -> LogitTransform:
    V.require_tensor(op, "hidden", hidden)
    if hidden.dim() != 2:
        raise ValueError(f"rlkernels.{op}: hidden must be [N, D], got {tuple(hidden.shape)}")
    validate(hidden, weight, bias, temperature, seed, streams, positions, bool(greedy))
    truncation.validate_truncation(op, top_k, top_p)
    return validate_transform(op, logit_scale, logit_softcap)


def sharded_linear_sample(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                          shards: int = VOCAB_SHARDS, temperature: float = 1.0, seed: int | torch.Tensor = 0,
                          streams: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                          return_entropy: bool = False, greedy: bool = False, top_k: int = 0, top_p: float = 1.0,
                          return_threshold: bool = False, logit_scale: float = 1.0, logit_softcap: float = 0.0,
                          backend: str | None = None):
    """One-process :func:`vocab_parallel_linear_sample`: the same shards, the same draw, the same bits.

    hidden [N, D]; weight [V, D]; bias [V] or None; ``seed``, ``streams`` [N] and
    ``positions`` [N] as :func:`rlkernels.linear_sample` takes them (none with ``greedy``:
    the module docstring says which token greedy takes); ``shards`` a power of two
    dividing V. Returns ``(token [N] int64, logp [N])`` (and entropy) with no autograd
    graph: logp and entropy bitwise :func:`~rlkernels.parallel.sharded_linear_logprob` of
    the token with the same ``shards``. Tokens and log-probs differ from ``linear_sample``'s
    (another cut of the vocabulary): an opt-in mode. ``logit_scale``/``logit_softcap``: the
    model's logit transform, as :func:`rlkernels.linear_sample` takes it. ``top_k``/``top_p``
    truncate the distribution in :func:`rlkernels.linear_sample`'s order (module docstring:
    how); ``return_threshold`` returns each row's tau [N] last (-inf without truncation),
    the ``logit_threshold`` under which :func:`~rlkernels.parallel.sharded_linear_logprob`
    gives these log-probs.
    """
    transform = _validate(SHARDED_OP, hidden, weight, bias, temperature, seed, streams, positions, greedy,
                          logit_scale, logit_softcap, top_k, top_p)
    layout = vocab_layout(SHARDED_OP, weight.shape[0], shards, 0, 1)
    return _sample(SHARDED_OP, hidden, weight, bias, layout, float(temperature), seed, streams, positions,
                   return_entropy, None, backend, bool(greedy), transform, int(top_k), float(top_p),
                   bool(return_threshold))


def vocab_parallel_linear_sample(hidden: torch.Tensor, weight_shard: torch.Tensor,
                                 bias_shard: torch.Tensor | None = None, *, shards: int = VOCAB_SHARDS,
                                 temperature: float = 1.0, seed: int | torch.Tensor = 0,
                                 streams: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                                 return_entropy: bool = False, greedy: bool = False, top_k: int = 0,
                                 top_p: float = 1.0, return_threshold: bool = False, logit_scale: float = 1.0,
                                 logit_softcap: float = 0.0, group: dist.ProcessGroup | None = None,
                                 backend: str | None = None):
    """``linear_sample`` with the LM head sharded on the vocabulary over ``group`` (TP = t ranks).

    hidden [N, D], ``streams`` and ``positions`` replicated; rank r holds rows ``r*V/t ..
    (r+1)*V/t`` of the head (weight_shard [V/t, D], bias_shard [V/t] or None), t dividing
    ``shards``. Returns the same ``(token, logp[, entropy])`` on every rank, bitwise
    :func:`sharded_linear_sample`'s with the same ``shards`` at every TP size (``top_k``,
    ``top_p`` and ``return_threshold`` included).
    """
    V.require_tensor(VOCAB_OP, "weight_shard", weight_shard)
    rank, world = process_group_world(VOCAB_OP, group, True)
    transform = _validate(VOCAB_OP, hidden, weight_shard, bias_shard, temperature, seed, streams, positions, greedy,
                          logit_scale, logit_softcap, top_k, top_p)
    layout = vocab_layout(VOCAB_OP, weight_shard.shape[0] * world, shards, rank, world)
    return _sample(VOCAB_OP, hidden, weight_shard, bias_shard, layout, float(temperature), seed, streams, positions,
                   return_entropy, group, backend, bool(greedy), transform, int(top_k), float(top_p),
                   bool(return_threshold))
