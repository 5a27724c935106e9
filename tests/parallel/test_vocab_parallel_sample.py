"""Vocab-parallel sampling: TP = 1, 2, 4, 8 (gloo) draw the one-process sharded sampler's
tokens with its bits; its log-probs are the sharded scorer's, bitwise; its draws follow
the fp64 softmax (chi-square, with a control the test rejects)."""
from __future__ import annotations

import pytest
import torch

from rlkernels.parallel import sharded_linear_logprob, sharded_linear_sample
from rlkernels.parallel.vocab_parallel_sample import SHARD_COUNTER

from ..ops.test_linear_sample import _accepts
from . import _workers as W


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view({8: torch.int64, 4: torch.int32, 2: torch.int16}[x.element_size()])


def _every_rank_drew(results: dict, prefix: str, want: tuple) -> None:
    """Every rank at every TP size saved ``want``'s (token, logp, entropy), bitwise."""
    for world, ranks in results.items():
        for out in ranks:
            assert torch.equal(out[f"{prefix}_token"], want[0]), world
            assert torch.equal(_bits(out[f"{prefix}_logp"]), _bits(want[1])), world
            assert torch.equal(_bits(out[f"{prefix}_ent"]), _bits(want[2])), world


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
    assert torch.equal(_bits(want[1]), _bits(ref_lp)) and torch.equal(_bits(want[2]), _bits(ref_ent))
    plain = sharded_linear_sample(h, w, b, seed=seed, streams=streams, positions=positions, shards=W.SHARDS,
                                  temperature=W.TEMPERATURE)
    assert not torch.equal(plain[1], want[1])  # the transform moves the distribution
    _every_rank_drew(results, "capped/sample", want)
    _every_rank_drew(results, "capped/greedy", sharded_linear_sample(h, w, b, greedy=True, **kw))


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
    assert torch.equal(_bits(want[1]), _bits(ref_lp)) and torch.equal(_bits(want[2]), _bits(ref_ent))
    _every_rank_drew(results, f"{W.names(dtype)}greedy", want)


@pytest.mark.parametrize("dtype", W.dtypes(), ids=W.names)
def test_the_log_probs_are_the_sharded_scorers_and_rows_are_invariant(dtype):
    h, w, b, streams, positions, seed = W.sample_inputs(dtype)
    kw = dict(shards=W.SHARDS, temperature=W.TEMPERATURE, seed=seed, return_entropy=True)
    tok, lp, ent = sharded_linear_sample(h, w, b, streams=streams, positions=positions, **kw)
    ref_lp, ref_ent = sharded_linear_logprob(h, w, tok, b, shards=W.SHARDS, temperature=W.TEMPERATURE,
                                             return_entropy=True)
    assert torch.equal(_bits(lp), _bits(ref_lp)) and torch.equal(_bits(ent), _bits(ref_ent))
    for rows in (torch.tensor([3]), torch.tensor([9, 0, 4, 4])):
        got = sharded_linear_sample(h[rows], w, b, streams=streams[rows], positions=positions[rows], **kw)
        for x, y in zip(got, (tok, lp, ent)):
            assert torch.equal(_bits(x), _bits(y[rows]))


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
