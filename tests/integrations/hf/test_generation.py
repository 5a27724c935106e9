"""rlkernels.generate's host side: the options, prompts and arguments it refuses, each error
naming rlkernels.generate."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import rlkernels  # noqa: E402
from rlkernels.integrations.hf import patch_model  # noqa: E402

from ._models import _tiny  # noqa: E402
from .test_attention import _model, _pad, _prompts  # noqa: E402


def test_generate_refuses_prompts_it_cannot_continue_as_the_trainer_scores():
    model = patch_model(_tiny("qwen3"))
    ids = torch.tensor([[0, 0, 5, 6], [0, 0, 0, 0], [7, 8, 9, 10]])
    empty_row = torch.tensor([[0, 0, 1, 1], [0, 0, 0, 0], [1, 1, 1, 1]])
    # Before, row 1's first log-prob was -ln V from a forward over nothing, where the
    # trainer's token_logprobs scores that position 0.
    with pytest.raises(ValueError, match=r"prompt row 1 is all padding \(attention_mask\[1\] has no 1\)"):
        rlkernels.generate(model, ids, empty_row, max_new_tokens=2)
    right = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]])
    with pytest.raises(ValueError, match=r"prompt row 0 is not left-padded .*padding_side = 'left'"):
        rlkernels.generate(model, ids, right, max_new_tokens=2)
    with pytest.raises(ValueError, match=r"attention_mask has shape \(3, 3\)"):
        rlkernels.generate(model, ids, right[:, :3], max_new_tokens=2)


def test_bad_token_ids_and_an_empty_prompt_are_refused_naming_generate():
    model = patch_model(_tiny("qwen3"))
    ids = torch.tensor([[3, 4, 5], [6, 7, 8]])
    for kwargs, err, match in [
            (dict(pad_token_id="x"), TypeError, r"pad_token_id must be an int \(or None\), got 'x'"),
            (dict(pad_token_id=2.0), TypeError, r"pad_token_id must be an int \(or None\), got 2.0"),
            (dict(eos_token_id="x"), TypeError, r"eos_token_id must be an int or a list of ints, got 'x'"),
            (dict(eos_token_id=[2, None]), TypeError, r"eos_token_id must be an int or a list of ints, got None"),
            (dict(eos_token_id=torch.tensor([1.0])), TypeError, r"eos_token_id .*got a torch.float32 tensor")]:
        with pytest.raises(err, match=rf"rlkernels.generate: {match}"):
            rlkernels.generate(model, ids, max_new_tokens=2, **kwargs)
    with pytest.raises(ValueError, match=r"rlkernels.generate: input_ids has no tokens \(\[B, 0\]\)"):
        rlkernels.generate(model, ids[:, :0], max_new_tokens=2)
    limit = model.config.max_position_embeddings
    with pytest.warns(UserWarning, match=rf"the prompt \(3 tokens\) plus max_new_tokens \({limit - 2}\) exceeds "
                                         rf"the model's max_position_embeddings \({limit}\)"):
        rlkernels.generate(model, ids[:1], max_new_tokens=limit - 2, eos_token_id=[], cuda_graph=False)
    # An EOS given as a tensor or a tuple is the same EOS as the int.
    seq, _ = rlkernels.generate(model, ids, max_new_tokens=3)
    eos = int(seq[0, 3])
    for given in (eos, (eos,), torch.tensor([eos])):
        out, _ = rlkernels.generate(model, ids, max_new_tokens=3, eos_token_id=given, pad_token_id=0)
        assert int(out[0, 3]) == eos and out[0, 4:].tolist() == [0, 0]


@pytest.mark.parametrize("call", ["generate", "token_logprobs"])
def test_temperature_must_be_a_python_number(call):
    model = patch_model(_tiny("qwen3"))
    fn = getattr(rlkernels, call)
    ids = torch.tensor([[3, 4, 5]])
    with pytest.raises(TypeError, match=rf"rlkernels.{call}: temperature must be a Python number .*got Tensor "
                                        r".*\(pass float\(temperature\)\)"):
        fn(model, ids, temperature=torch.tensor(0.7))
    for bad in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=rf"rlkernels.{call}: temperature must be a finite number > 0"):
            fn(model, ids, temperature=bad)
    # One rule everywhere: token_logprobs once returned NaN at T = 1e-40 where linear_sample refused.
    for tiny in (1e-40, 1e-5):
        with pytest.raises(ValueError, match=rf"rlkernels.{call}: temperature must be >= 0.0001, got {tiny!r}"):
            fn(model, ids, temperature=tiny)


@pytest.mark.parametrize("option, value, why", [
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


@pytest.mark.parametrize("call, kwargs", [("generate", dict(max_new_tokens=2)), ("token_logprobs", {})])
def test_an_id_outside_the_vocab_is_named_with_the_function_called(call, kwargs):
    model = patch_model(_tiny("llama"))
    ids = torch.randint(0, 300, (2, 6), generator=torch.Generator().manual_seed(0))
    ids[1, 4] = 300
    with pytest.raises(ValueError, match=rf"^rlkernels\.{call}: input_ids\[1, 4\] = 300 is outside the model's "
                                         r"vocabulary \[0, 300\)"):
        getattr(rlkernels, call)(model, ids, **kwargs)


@pytest.mark.parametrize("call", ["generate", "token_logprobs"])
@pytest.mark.parametrize("scale, shown", [(2, "2"), (0.5, "0.5")])
def test_a_mask_of_other_values_than_0_and_1_is_refused(call, scale, shown):
    # Positions are counted from the mask: mask * 2 once scored tokens at other positions
    # (off from the stock forward by up to 0.65 nats) and drew other tokens, silently.
    model = patch_model(_tiny("qwen3"))
    ids = torch.tensor([[0, 3, 4, 5], [6, 7, 8, 9]])
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]]) * scale
    kwargs = dict(max_new_tokens=2) if call == "generate" else {}
    with pytest.raises(ValueError, match=rf"rlkernels.{call}: attention_mask must hold only 0 and 1, got {shown}"):
        getattr(rlkernels, call)(model, ids, mask, **kwargs)
    # A packed batch's segment ids are refused the same way; a bool or float 0/1 mask is taken.
    with pytest.raises(ValueError, match="segment ids are not a mask"):
        getattr(rlkernels, call)(model, ids, torch.tensor([[1, 1, 2, 2], [1, 1, 1, 1]]), **kwargs)
    ok = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    want = getattr(rlkernels, call)(model, ids, ok, **kwargs)
    for same in (ok.bool(), ok.float()):
        got = getattr(rlkernels, call)(model, ids, same, **kwargs)
        assert all(torch.equal(a, b) for a, b in zip(want, got)) if call == "generate" else torch.equal(want, got)


@pytest.mark.parametrize("call", ["generate", "token_logprobs"])
def test_a_mask_that_is_not_a_tensor_is_refused(call):
    model = patch_model(_tiny("qwen3"))
    ids = torch.tensor([[3, 4, 5]])
    kwargs = dict(max_new_tokens=2) if call == "generate" else {}
    with pytest.raises(TypeError, match=rf"rlkernels.{call}: attention_mask must be a tensor of 0s and 1s .*got list"):
        getattr(rlkernels, call)(model, ids, [[1, 1, 1]], **kwargs)


def test_generation_config_sampling_is_read_with_its_temperature():
    # With do_sample=True and temperature=0.3 in the config, generate once sampled at T = 1
    # silently, and the trainer scoring at 0.3 no longer matched.
    model = _model("qwen3")
    with torch.no_grad():  # a trained model's logit spread (std ~6), where rounding would show
        model.get_output_embeddings().weight.mul_(50.0)
    ids = torch.tensor([[3, 4, 5, 6]])
    model.generation_config.do_sample, model.generation_config.temperature = True, 0.3
    seq, lp = rlkernels.generate(model, ids, max_new_tokens=4, seed=1)
    seq_t, lp_t = rlkernels.generate(model, ids, max_new_tokens=4, seed=1, do_sample=True, temperature=0.3)
    assert torch.equal(seq, seq_t) and torch.equal(lp, lp_t)
    trainer = rlkernels.token_logprobs(model, seq, temperature=0.3)[:, ids.shape[1] - 1:]
    assert torch.equal(trainer, lp)
    # The config's top_p is taken as Hugging Face takes it; the truncated log-probs need the
    # kept sets, so a call that would drop them is refused. Passing do_sample samples without it.
    model.generation_config.top_k, model.generation_config.top_p = 0, 0.95
    with pytest.raises(ValueError, match=r"generation_config samples with top_k=0, top_p=0.95: .*"
                                         r"pass return_thresholds=True"):
        rlkernels.generate(model, ids, max_new_tokens=4, seed=1)
    seq_c, lp_c, tau_c = rlkernels.generate(model, ids, max_new_tokens=4, seed=1, return_thresholds=True)
    seq_e, lp_e, tau_e = rlkernels.generate(model, ids, max_new_tokens=4, seed=1, do_sample=True, temperature=0.3,
                                            top_p=0.95, return_thresholds=True)
    assert torch.equal(seq_c, seq_e) and torch.equal(lp_c, lp_e) and torch.equal(tau_c, tau_e)
    assert torch.isfinite(tau_c).all()
    seq_f, _ = rlkernels.generate(model, ids, max_new_tokens=4, seed=1, do_sample=True, temperature=0.3)
    assert torch.equal(seq_f, seq_t)


def test_neutral_repetition_penalty_is_taken_and_another_is_refused():
    model = _model("qwen3")
    ids = torch.tensor([[3, 4, 5]])
    base = rlkernels.generate(model, ids, max_new_tokens=2)
    assert torch.equal(rlkernels.generate(model, ids, max_new_tokens=2, repetition_penalty=1.0)[0], base[0])
    with pytest.raises(ValueError, match=r"repetition_penalty=1.2 is not supported"):
        rlkernels.generate(model, ids, max_new_tokens=2, repetition_penalty=1.2)


def _trained_head(model):
    with torch.no_grad():  # a trained model's logit spread (std ~6)
        model.get_output_embeddings().weight.mul_(50.0)
    return model


def _positions_thresholds(seq, prompt_len, tau):
    """token_logprobs' [B, L-1] logit_threshold: each new token's draw threshold at its
    position, -inf at the prompt's."""
    out = torch.full((seq.shape[0], seq.shape[1] - 1), float("-inf"))
    out[:, prompt_len - 1:] = tau
    return out


@pytest.mark.parametrize("truncation", [dict(top_k=5), dict(top_p=0.8), dict(top_k=20, top_p=0.9)],
                         ids=["top_k", "top_p", "both"])
def test_truncated_generate_is_the_thresholded_trainer_and_each_row_is_its_prompt_alone(truncation):
    model = _trained_head(_model("qwen3"))
    prompts = _prompts((3, 7, 5))
    ids, mask = _pad(prompts, left=True)
    kw = dict(max_new_tokens=6, do_sample=True, temperature=0.8, seed=11, return_thresholds=True, **truncation)
    seq, lp, tau = rlkernels.generate(model, ids, mask, **kw)
    assert tau.shape == lp.shape and tau.dtype == torch.float32 and torch.isfinite(tau).all()
    L = ids.shape[1]
    full_mask = torch.cat([mask, torch.ones_like(seq[:, L:])], dim=1)
    trainer = rlkernels.token_logprobs(model, seq, full_mask, temperature=0.8,
                                       logit_threshold=_positions_thresholds(seq, L, tau))[:, L - 1:]
    assert torch.equal(trainer, lp)
    untruncated = rlkernels.token_logprobs(model, seq, full_mask, temperature=0.8)[:, L - 1:]
    assert (lp >= untruncated).all() and (lp > untruncated).any()
    for row, prompt in enumerate(prompts):
        one, lp1, tau1 = rlkernels.generate(model, torch.as_tensor(prompt)[None], streams=torch.tensor([row]), **kw)
        assert torch.equal(one[0, len(prompt):], seq[row, L:])
        assert torch.equal(lp1[0], lp[row]) and torch.equal(tau1[0], tau[row])


def test_thresholds_after_eos_keep_every_logit_and_greedy_truncates_nothing():
    model = _trained_head(_model("qwen3"))
    ids = torch.tensor([[3, 4, 5], [6, 7, 8]])
    seq, lp, tau = rlkernels.generate(model, ids, max_new_tokens=8, do_sample=True, seed=3, top_p=0.9,
                                      return_thresholds=True)
    eos = int(seq[0, 4])  # the second new token of row 0 as EOS: the row ends there
    seq_e, lp_e, tau_e = rlkernels.generate(model, ids, max_new_tokens=8, do_sample=True, seed=3, top_p=0.9,
                                            return_thresholds=True, eos_token_id=eos, pad_token_id=0)
    ended = (seq_e[:, 3:] == eos).int().cumsum(dim=1).roll(1, dims=1)
    ended[:, 0] = 0
    after = ended.bool()
    assert after.any() and torch.isneginf(tau_e[after]).all() and (lp_e[after] == 0).all()
    assert torch.equal(tau_e[~after], tau[:, :tau_e.shape[1]][~after])
    greedy, glp, gtau = rlkernels.generate(model, ids, max_new_tokens=3, top_k=2, top_p=0.5, return_thresholds=True)
    assert torch.isneginf(gtau).all()
    assert torch.equal(greedy, rlkernels.generate(model, ids, max_new_tokens=3)[0])


@pytest.mark.parametrize("kwargs, err, match", [
    (dict(top_k=-2), ValueError, r"rlkernels.generate: top_k must be >= 0"),
    (dict(top_p=1.5), ValueError, r"rlkernels.generate: top_p must lie in \(0, 1\]"),
    (dict(top_p=0.9), ValueError, r"rlkernels.generate: the call samples with top_k=0, top_p=0.9: .*return_thresholds"),
])
def test_bad_truncation_and_dropped_kept_sets_are_refused(kwargs, err, match):
    model = _model("qwen3")
    with pytest.raises(err, match=match):
        rlkernels.generate(model, torch.tensor([[3, 4]]), max_new_tokens=2, do_sample=True, seed=1, **kwargs)
