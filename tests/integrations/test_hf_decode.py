"""The static-cache decode loop (``generate(..., cuda_graph=True)``): the eager loop's bits."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import rlkernels  # noqa: E402
from rlkernels.integrations import hf_decode  # noqa: E402
from rlkernels.integrations.hf import cache_kwargs, decoder_of, token_logprobs  # noqa: E402

from .test_hf import _tiny  # noqa: E402
from .test_hf_attention import _model, _pad, _prompts  # noqa: E402


def _static(model, ids, mask, **kw):
    return hf_decode.static_generate(model, decoder_of(model), ids, mask, cuda_graph=False,
                                     cache_kwargs=cache_kwargs, **kw)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_greedy_decode_gives_hugging_faces_tokens_and_the_trainers_logprobs(arch):
    # The StaticCache loop (every slot of the cache visible to attention, the unused ones
    # masked) against Hugging Face generate with a DynamicCache on an fp32 model, whose
    # head logits are the fp32 chain the loop takes its argmax of: the same tokens.
    model = _model(arch)
    ids, mask = _pad(_prompts((5, 11, 3, 8)), left=True)
    seq, lp, ent = _static(model, ids, mask, max_new_tokens=7)
    hf = model.generate(ids, attention_mask=mask, max_new_tokens=7, do_sample=False, pad_token_id=0)
    assert torch.equal(seq, hf)
    assert not lp.requires_grad and lp.shape == ent.shape == (4, 7)
    for i in range(ids.shape[0]):  # the trainer's log-probs of the finished rows
        row = seq[i][mask[i].bool().tolist() + [True] * 7]
        t_lp, t_ent = token_logprobs(model, row[None], return_entropy=True)
        assert torch.equal(t_lp[0, -7:], lp[i]) and torch.equal(t_ent[0, -7:], ent[i])


def test_static_loop_pads_after_eos_and_stops_when_every_row_ended():
    model = _model("qwen3")
    ids, mask = _pad(_prompts((4, 6)), left=True)
    L = ids.shape[1]
    free, _, _ = _static(model, ids, mask, max_new_tokens=6)
    first0, first1 = int(free[0, L]), int(free[1, L])
    assert first0 != first1 and not bool((free[1, L:] == first0).any())
    # Row 0 ends at its first token: generate's padding follows, with log-prob 0; row 1 runs on.
    seq, lp, ent = _static(model, ids, mask, max_new_tokens=6, eos_token_ids=[first0], pad_token_id=0)
    assert int(seq[0, L]) == first0 and bool((seq[0, L + 1:] == 0).all())
    assert lp[0, 0] != 0 and bool((lp[0, 1:] == 0).all()) and bool((ent[0, 1:] == 0).all())
    assert torch.equal(seq[1], free[1]) and lp.shape == (2, 6)
    # Both rows end at once: the loop stops after one token.
    seq2, lp2, _ = _static(model, ids, mask, max_new_tokens=6, eos_token_ids=[first0, first1], pad_token_id=0)
    assert seq2.shape == (2, L + 1) and lp2.shape == (2, 1)


def test_a_rows_draws_are_keyed_by_seed_stream_and_position_alone():
    model = _model("llama")
    prompts = _prompts((3, 7, 5))
    ids, mask = _pad(prompts, left=True)
    kw = dict(max_new_tokens=6, do_sample=True, temperature=0.7)
    streams = torch.tensor([11, 5, 1 << 40])
    seq, lp = rlkernels.generate(model, ids, mask, seed=3, streams=streams, **kw)
    again, lp_again = rlkernels.generate(model, ids, mask, seed=3, streams=streams, **kw)
    assert torch.equal(seq, again) and torch.equal(lp, lp_again)
    width = ids.shape[1]
    for i, p in enumerate(prompts):
        # Alone, unpadded, and at the end of another batch with more left padding.
        alone, lp_alone = rlkernels.generate(model, p[None], seed=3, streams=streams[i:i + 1], **kw)
        assert torch.equal(alone[0, len(p):], seq[i, width:]) and torch.equal(lp_alone[0], lp[i])
        other, omask = _pad([torch.arange(1, 12), p], left=True)
        moved, lp_moved = rlkernels.generate(model, other, omask, seed=3, streams=torch.tensor([99, int(streams[i])]),
                                             **kw)
        assert torch.equal(moved[1, other.shape[1]:], seq[i, width:]) and torch.equal(lp_moved[1], lp[i])
    other_seed, _ = rlkernels.generate(model, ids, mask, seed=4, streams=streams, **kw)
    assert not torch.equal(other_seed, seq)
    torch.manual_seed(8)
    first, _ = rlkernels.generate(model, ids, mask, **kw)  # seed from torch's generator
    torch.manual_seed(8)
    assert torch.equal(first, rlkernels.generate(model, ids, mask, **kw)[0])


@pytest.mark.parametrize("option, value, why", [
    ("top_k", 20, "truncated distribution"), ("top_p", 0.9, "truncated distribution"),
    ("min_new_tokens", 3, "without it"), ("generator", torch.Generator(), "seed=, streams="),
    ("repetition_penalty", 1.2, "not supported"),
])
def test_options_that_change_the_distribution_are_refused(option, value, why):
    model = _model("qwen3")
    ids, mask = _pad(_prompts((3, 5)), left=True)
    with pytest.raises(ValueError, match=f"rlkernels.generate: .*{option}.*{why}"):
        rlkernels.generate(model, ids, mask, max_new_tokens=2, do_sample=True, **{option: value})
    # Their neutral values change nothing and pass.
    rlkernels.generate(model, ids, mask, max_new_tokens=2, do_sample=True, top_k=0, top_p=1.0, min_new_tokens=0)


def test_cuda_graph_refusals():
    model = _model("qwen3")
    ids, mask = _pad(_prompts((3, 5)), left=True)
    with pytest.raises(ValueError, match="CUDA device"):
        rlkernels.generate(model, ids, mask, max_new_tokens=2, cuda_graph=True)
    unpatched = _model("qwen3", patched=False)
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="patch_model"):
            rlkernels.generate(unpatched.cuda(), ids.cuda(), mask.cuda(), max_new_tokens=2, cuda_graph=True)


@pytest.mark.gpu
@pytest.mark.parametrize("sample", [False, True])
def test_graphed_decode_is_the_eager_decode_bit_for_bit_gpu(sample):
    model = _tiny("qwen3", dtype=torch.bfloat16, device="cuda", hidden_size=1024, intermediate_size=2816,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=64, vocab_size=32000)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    rlkernels.patch_model(model)
    ids, mask = _pad(_prompts((37, 120, 5, 64, 1, 99)), left=True)
    ids, mask = ids.cuda(), mask.cuda()
    kw = dict(max_new_tokens=24, greedy=not sample, temperature=0.9, seed=1)
    eager = hf_decode.static_generate(model, decoder_of(model), ids, mask, cuda_graph=False,
                                      cache_kwargs=cache_kwargs, **kw)
    graphed = hf_decode.static_generate(model, decoder_of(model), ids, mask, cuda_graph=True,
                                        cache_kwargs=cache_kwargs, **kw)
    assert all(torch.equal(a, b) for a, b in zip(eager, graphed))
    seq, lp = rlkernels.generate(model, ids, mask, cuda_graph=True, max_new_tokens=24, do_sample=sample,
                                 temperature=0.9, seed=1)
    assert torch.equal(seq, eager[0]) and torch.equal(lp, eager[1])
    width = ids.shape[1]
    for i in range(ids.shape[0]):
        row = seq[i][torch.cat([mask[i].bool(), torch.ones(24, dtype=torch.bool, device="cuda")])]
        assert torch.equal(token_logprobs(model, row[None], temperature=0.9)[0, -24:], lp[i]), i
    assert seq.shape == (ids.shape[0], width + 24)
