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
def test_static_loop_gives_generates_tokens_and_hidden_states(arch):
    # The StaticCache loop (every slot of the cache visible to attention, the unused ones
    # masked) against Hugging Face generate with a DynamicCache: same tokens, same hidden
    # bits, so the same log-probs.
    model = _model(arch)
    ids, mask = _pad(_prompts((5, 11, 3, 8)), left=True)
    seq, lp = rlkernels.generate(model, ids, mask, max_new_tokens=7)
    seq2, hidden = _static(model, ids, mask, max_new_tokens=7)
    assert torch.equal(seq, seq2)
    target = seq2[:, ids.shape[1]:]
    lp2 = rlkernels.linear_logprob(hidden.reshape(-1, hidden.shape[-1]), model.lm_head.weight,
                                   target.reshape(-1)).reshape(target.shape)
    assert torch.equal(lp, lp2)
    for i in range(ids.shape[0]):  # and the trainer's log-probs of the finished rows
        row = seq2[i][mask[i].bool().tolist() + [True] * 7]
        assert torch.equal(token_logprobs(model, row[None])[0, -7:], lp2[i])


def test_static_loop_pads_after_eos_and_stops_when_every_row_ended():
    model = _model("qwen3")
    ids, mask = _pad(_prompts((4, 6)), left=True)
    L = ids.shape[1]
    free, _ = _static(model, ids, mask, max_new_tokens=6)
    first0, first1 = int(free[0, L]), int(free[1, L])
    assert first0 != first1 and not bool((free[1, L:] == first0).any())
    # Row 0 ends at its first token: generate's padding follows; row 1 runs on.
    seq, hidden = _static(model, ids, mask, max_new_tokens=6, eos_token_ids=[first0], pad_token_id=0)
    assert int(seq[0, L]) == first0 and bool((seq[0, L + 1:] == 0).all())
    assert torch.equal(seq[1], free[1]) and hidden.shape[:2] == (2, 6)
    # Both rows end at once: the loop stops after one token.
    seq2, hidden2 = _static(model, ids, mask, max_new_tokens=6, eos_token_ids=[first0, first1], pad_token_id=0)
    assert seq2.shape == (2, L + 1) and hidden2.shape[:2] == (2, 1)
    # min_new_tokens forbids an EOS before it
    seq3, _ = _static(model, ids, mask, max_new_tokens=6, min_new_tokens=6, eos_token_ids=[first0, first1],
                      pad_token_id=0)
    assert seq3.shape == (2, L + 6) and not bool(torch.isin(seq3[:, L:], torch.tensor([first0, first1])).any())


def test_sampling_follows_the_generator():
    model = _model("llama")
    ids, mask = _pad(_prompts((3, 7)), left=True)
    runs = [_static(model, ids, mask, max_new_tokens=5, do_sample=True, temperature=0.7, top_k=20, top_p=0.9,
                    generator=torch.Generator().manual_seed(4))[0] for _ in range(2)]
    assert torch.equal(runs[0], runs[1])


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
    kw = dict(max_new_tokens=24, do_sample=sample, temperature=0.9)
    eager, hidden = hf_decode.static_generate(model, decoder_of(model), ids, mask, cuda_graph=False,
                                              cache_kwargs=cache_kwargs,
                                              generator=torch.Generator("cuda").manual_seed(1), **kw)
    graphed, hidden_g = hf_decode.static_generate(model, decoder_of(model), ids, mask, cuda_graph=True,
                                                  cache_kwargs=cache_kwargs,
                                                  generator=torch.Generator("cuda").manual_seed(1), **kw)
    assert torch.equal(eager, graphed) and torch.equal(hidden, hidden_g)
    seq, lp = rlkernels.generate(model, ids, mask, cuda_graph=True, **kw)
    if not sample:
        hf_seq, hf_lp = rlkernels.generate(model, ids, mask, **kw)
        assert torch.equal(seq, hf_seq) and torch.equal(lp, hf_lp)
    width = ids.shape[1]
    for i in range(ids.shape[0]):
        row = seq[i][torch.cat([mask[i].bool(), torch.ones(24, dtype=torch.bool, device="cuda")])]
        assert torch.equal(token_logprobs(model, row[None], temperature=0.9)[0, -24:], lp[i]), i
    assert seq.shape == (ids.shape[0], width + 24)
