"""Vocab-parallel sampling: TP = 1, 2, 4, 8 (gloo) draw the one-process sharded sampler's
tokens with its bits, truncated (top-k, top-p) or not; its log-probs are the sharded
scorer's, bitwise; its draws follow the fp64 softmax, or the truncated one (chi-square,
with a control the test rejects)."""
from __future__ import annotations

import pytest
import torch

from rlkernels.ops.lm_head.statistics import TorchHeadStatistics
from rlkernels.ops.lm_head.truncation import threshold
from rlkernels.parallel import sharded_linear_logprob, sharded_linear_sample
from rlkernels.parallel.vocab_parallel_sample import SHARD_COUNTER

from ..ops.test_linear_sample import _accepts
from . import _workers as W


def _every_rank_drew(results: dict, prefix: str, want: tuple) -> None:
    """Every rank at every TP size saved ``want``'s (token, logp, entropy[, tau]), bitwise."""
    for world, ranks in results.items():
        for out in ranks:
            assert torch.equal(out[f"{prefix}_token"], want[0]), world
            assert torch.equal(W.bits(out[f"{prefix}_logp"]), W.bits(want[1])), world
            assert torch.equal(W.bits(out[f"{prefix}_ent"]), W.bits(want[2])), world
            if len(want) > 3:
                assert torch.equal(W.bits(out[f"{prefix}_tau"]), W.bits(want[3])), world


@pytest.mark.parametrize("dtype", W.dtypes(), ids=W.names)
def test_every_tp_size_draws_the_one_process_tokens_with_its_bits(results, dtype):
    h, w, b, streams, positions, seed = W.sample_inputs(dtype)
    want = sharded_linear_sample(h, w, b, shards=W.SHARDS, temperature=W.TEMPERATURE, seed=seed, streams=streams,
                                 positions=positions, return_entropy=True)
    _every_rank_drew(results, f"{W.names(dtype)}sample", want)


def test_a_transformed_head_draws_the_one_process_tokens_at_every_tp_size(results):
    h, w, b, streams, positions, seed = W.sample_inputs(torch.float32)
    kw = dict(shards=W.SHARDS, temperature=W.TEMPERATURE, return_entropy=True, **W.CAPPED)
    want = sharded_linear_sample(h, w, b, seed=seed, streams=streams, positions=positions, **kw)
    ref_lp, ref_ent = sharded_linear_logprob(h, w, want[0], b, **kw)
    assert torch.equal(W.bits(want[1]), W.bits(ref_lp)) and torch.equal(W.bits(want[2]), W.bits(ref_ent))
    plain = sharded_linear_sample(h, w, b, seed=seed, streams=streams, positions=positions, shards=W.SHARDS,
                                  temperature=W.TEMPERATURE)
    assert not torch.equal(plain[1], want[1])  # the transform moves the distribution
    _every_rank_drew(results, "capped/sample", want)
    _every_rank_drew(results, "capped/greedy", sharded_linear_sample(h, w, b, greedy=True, **kw))


@pytest.mark.parametrize("dtype", W.dtypes(), ids=W.names)
def test_a_truncated_draw_at_every_tp_size_is_the_one_process_draw_with_the_scorers_bits(results, dtype):
    h, w, b, streams, positions, seed = W.sample_inputs(dtype)
    kw = dict(shards=W.SHARDS, temperature=W.TEMPERATURE, return_entropy=True)
    want = sharded_linear_sample(h, w, b, seed=seed, streams=streams, positions=positions, return_threshold=True,
                                 **W.TRUNCATION, **kw)
    tok, lp, ent, tau = want
    # The kept sets: tau over the whole vocabulary's scores, as linear_sample's torch
    # definition finds it, holding the drawn token; at most top_k, and truncating every row.
    z = TorchHeadStatistics.head_scores(h, w, b, W.TEMPERATURE)
    assert torch.equal(W.bits(tau), W.bits(threshold(z, **W.TRUNCATION)))
    kept = z >= tau[:, None]
    assert kept.gather(1, tok[:, None]).all()
    assert (kept.sum(dim=1) <= W.TRUNCATION["top_k"]).all() and (kept.sum(dim=1) < w.shape[0]).all()
    # Some row keeps logits in more than one shard: the shard pick runs on kept masses.
    shards_kept = kept.reshape(h.shape[0], W.SHARDS, -1).any(dim=2).sum(dim=1)
    assert (shards_kept > 1).any()
    ref_lp, ref_ent = sharded_linear_logprob(h, w, tok, b, logit_threshold=tau, **kw)
    assert torch.equal(W.bits(lp), W.bits(ref_lp)) and torch.equal(W.bits(ent), W.bits(ref_ent))
    full = sharded_linear_sample(h, w, b, seed=seed, streams=streams, positions=positions, **kw)
    assert not torch.equal(W.bits(full[1]), W.bits(lp))  # truncation moves the log-probs
    for rows in (torch.tensor([3]), torch.tensor([9, 0, 4, 4])):
        got = sharded_linear_sample(h[rows], w, b, seed=seed, streams=streams[rows], positions=positions[rows],
                                    return_threshold=True, **W.TRUNCATION, **kw)
        for x, y in zip(got, want):
            assert torch.equal(W.bits(x), W.bits(y[rows]))
    _every_rank_drew(results, f"{W.names(dtype)}truncated", want)


@pytest.mark.parametrize("dtype", W.dtypes(), ids=W.names)
def test_greedy_takes_the_argmax_with_the_scorers_log_prob_at_every_tp_size(results, dtype):
    h, w, b, _, _, _ = W.sample_inputs(dtype)
    want = sharded_linear_sample(h, w, b, shards=W.SHARDS, temperature=W.TEMPERATURE, greedy=True,
                                 return_entropy=True)
    z = (h.double() @ w.double().T + b.double()) / W.TEMPERATURE
    top = z.topk(2, dim=1).values
    assert (top[:, 0] - top[:, 1]).min() > 1e-3  # no near-tie: the argmax is the greedy token
    assert torch.equal(want[0], z.argmax(dim=1))
    ref_lp, ref_ent = sharded_linear_logprob(h, w, want[0], b, shards=W.SHARDS, temperature=W.TEMPERATURE,
                                             return_entropy=True)
    assert torch.equal(W.bits(want[1]), W.bits(ref_lp)) and torch.equal(W.bits(want[2]), W.bits(ref_ent))
    _every_rank_drew(results, f"{W.names(dtype)}greedy", want)


@pytest.mark.parametrize("dtype", W.dtypes(), ids=W.names)
def test_the_log_probs_are_the_sharded_scorers_and_rows_are_invariant(dtype):
    h, w, b, streams, positions, seed = W.sample_inputs(dtype)
    kw = dict(shards=W.SHARDS, temperature=W.TEMPERATURE, seed=seed, return_entropy=True)
    tok, lp, ent = sharded_linear_sample(h, w, b, streams=streams, positions=positions, **kw)
    ref_lp, ref_ent = sharded_linear_logprob(h, w, tok, b, shards=W.SHARDS, temperature=W.TEMPERATURE,
                                             return_entropy=True)
    assert torch.equal(W.bits(lp), W.bits(ref_lp)) and torch.equal(W.bits(ent), W.bits(ref_ent))
    for rows in (torch.tensor([3]), torch.tensor([9, 0, 4, 4])):
        got = sharded_linear_sample(h[rows], w, b, streams=streams[rows], positions=positions[rows], **kw)
        for x, y in zip(got, (tok, lp, ent)):
            assert torch.equal(W.bits(x), W.bits(y[rows]))


def test_the_draws_follow_the_fp64_softmax_and_not_a_flattened_one():
    g = torch.Generator().manual_seed(5)
    v, d, n = 64, 16, 60000
    w = torch.randn(v, d, generator=g, dtype=torch.float64) * 1.2
    h = torch.randn(1, d, generator=g, dtype=torch.float64)
    z = (h @ w.T)[0] / 0.8
    p = torch.softmax(z, 0)
    assert z.std() > 4  # a trained model's logit scale
    tok, _ = sharded_linear_sample(h.expand(n, d).contiguous(), w, shards=8, temperature=0.8, seed=7,
                                   streams=torch.arange(n), positions=torch.full((n,), 11))
    counts = torch.bincount(tok, minlength=v).double()
    assert _accepts(counts, p)
    # Control: the same draws against the distribution at another temperature are rejected.
    assert not _accepts(counts, torch.softmax(z * 0.8 / 0.9, 0))
    assert SHARD_COUNTER > v // 4  # the shard's uniform reads a counter no noise word reads


@pytest.mark.parametrize("truncation", [dict(top_p=0.8), dict(top_k=6), dict(top_k=9, top_p=0.9)],
                         ids=["top_p", "top_k", "both"])
def test_truncated_draws_follow_the_truncated_fp64_softmax_and_not_the_full_one(truncation):
    g = torch.Generator().manual_seed(6)
    v, d, n = 64, 16, 40000
    w = torch.randn(v, d, generator=g, dtype=torch.float64) * 0.5
    h = torch.randn(1, d, generator=g, dtype=torch.float64)
    z = TorchHeadStatistics.head_scores(h, w, None, 0.8)[0]  # the scores the kept set is cut from
    tok, _, tau = sharded_linear_sample(h.expand(n, d).contiguous(), w, shards=8, temperature=0.8, seed=7,
                                        streams=torch.arange(n), positions=torch.full((n,), 11),
                                        return_threshold=True, **truncation)
    # The truncated distribution in float64, by sorting: top-k, then top-p over its mass.
    p = torch.softmax(z, 0)
    order = torch.sort(z, descending=True).indices
    keep = torch.zeros(v, dtype=torch.bool)
    k = truncation.get("top_k", v)
    mass = torch.cumsum(p[order[:k]] / p[order[:k]].sum(), 0)
    last = int((mass >= truncation.get("top_p", 1.0) - 1e-12).nonzero()[0, 0])
    keep[order[:last + 1]] = True
    assert 2 < int(keep.sum()) < v // 2  # a truncation that keeps several tokens and drops most
    assert torch.equal(z >= tau[0], keep)
    truncated = torch.where(keep, p, torch.zeros_like(p))
    truncated = truncated / truncated.sum()
    counts = torch.bincount(tok, minlength=v).double()
    assert counts[~keep].sum() == 0
    assert _accepts(counts[keep], truncated[keep])
    # Control: the same draws against the full distribution over the kept tokens' mass:
    # the untruncated one's tokens spread over the dropped ones, which these never take.
    assert not _accepts(counts, p)
