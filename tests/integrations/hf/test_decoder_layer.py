"""A decoder layer's residual adds fused into the post-attention norm and the down projection:
bound only where the class's forward is the verified formula, the same bits as that forward,
and hooks on the modules it would skip still run."""
from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import rlkernels  # noqa: E402
from rlkernels.integrations.hf import decoder_layer  # noqa: E402

from ._models import _same_training_gradients, _tiny, llama_subclass  # noqa: E402


def _layers(model):
    return [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]


def _logprobs_both_ways(model, ids):
    """token_logprobs with the fused forwards, then with the classes' own."""
    with torch.no_grad():
        fused = rlkernels.token_logprobs(model, ids)
        for layer in _layers(model):
            del layer.forward
        own = rlkernels.token_logprobs(model, ids)
    return fused, own


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama", "mistral"])
def test_patch_model_binds_every_decoder_layer_and_the_bits_stay(arch):
    model = rlkernels.patch_model(_tiny(arch))
    # A trained residual stream: larger than the sublayers' outputs.
    model.model.embed_tokens.weight.data.mul_(8)
    assert all(decoder_layer.is_installed(m) for m in _layers(model)) and _layers(model)
    ids = torch.randint(0, 300, (3, 9), generator=torch.Generator().manual_seed(0))
    fused, own = _logprobs_both_ways(model, ids)
    assert torch.equal(fused.view(torch.int32), own.view(torch.int32))


def test_training_through_the_fused_forward_gives_the_class_forwards_gradients():
    model = rlkernels.patch_model(_tiny("qwen3"))
    twin = copy.deepcopy(model)
    for layer in _layers(twin):
        del layer.forward
    assert _same_training_gradients(model, twin)


def test_hooks_on_the_skipped_modules_still_run():
    model = rlkernels.patch_model(_tiny("llama"))
    layer = _layers(model)[0]
    seen = []
    layer.post_attention_layernorm.register_forward_hook(lambda mod, args, out: seen.append("norm"))
    layer.mlp.register_forward_hook(lambda mod, args, out: seen.append("mlp"))
    ids = torch.randint(0, 300, (1, 5), generator=torch.Generator().manual_seed(2))
    fused, own = _logprobs_both_ways(model, ids)
    assert seen == ["norm", "mlp", "norm", "mlp"]
    assert torch.equal(fused.view(torch.int32), own.view(torch.int32))


def test_a_backward_hook_on_the_mlp_still_runs():
    model = rlkernels.patch_model(_tiny("qwen3"))
    seen = []
    _layers(model)[1].mlp.register_full_backward_hook(lambda mod, grad_in, grad_out: seen.append("mlp"))
    ids = torch.randint(0, 300, (1, 6), generator=torch.Generator().manual_seed(3))
    rlkernels.token_logprobs(model, ids).sum().backward()
    assert seen == ["mlp"]


_FORMULA = """
def forward(self, hidden_states, attention_mask=None, **kwargs):
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    hidden_states, _ = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask, **kwargs)
    hidden_states = residual + hidden_states
    residual = hidden_states
    hidden_states = self.post_attention_layernorm(hidden_states)
    hidden_states = self.mlp(hidden_states)
    hidden_states = residual + hidden_states
    return hidden_states
"""


def _layer_with(source: str, tmp_path, name: str):
    return llama_subclass("LlamaDecoderLayer", source, tmp_path, name)


def test_another_order_of_the_same_statements_is_not_bound(monkeypatch, tmp_path):
    monkeypatch.setattr(decoder_layer, "family_of", lambda module: "llama")
    config = _tiny("llama").config
    norm_first = _FORMULA.replace(  # OLMo 2's order: the sublayer's output normed before the add
        "    hidden_states = residual + hidden_states\n    residual = hidden_states\n"
        "    hidden_states = self.post_attention_layernorm(hidden_states)\n",
        "    hidden_states = self.post_attention_layernorm(hidden_states)\n"
        "    hidden_states = residual + hidden_states\n    residual = hidden_states\n")
    dropped = _FORMULA.replace("attention_mask=None, **kwargs", "attention_mask=None, position_ids=None, **kwargs")
    assert norm_first != _FORMULA and dropped != _FORMULA
    assert decoder_layer.is_fusable_decoder_layer(_layer_with(_FORMULA, tmp_path, "Same")(config, 0))  # the control
    assert not decoder_layer.is_fusable_decoder_layer(_layer_with(norm_first, tmp_path, "NormFirst")(config, 0))
    assert not decoder_layer.is_fusable_decoder_layer(_layer_with(dropped, tmp_path, "Dropped")(config, 0))


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_fused_decode_gives_the_class_forwards_bits_gpu(arch):
    """bf16 on CUDA, where the fused launches run: generate's tokens and log-probs, eager and
    graphed, equal those of the classes' own forwards."""
    model = rlkernels.patch_model(_tiny(arch, dtype=torch.bfloat16, device="cuda", hidden_size=256,
                                        intermediate_size=512, num_attention_heads=4, num_key_value_heads=2))
    model.lm_head.weight.data.mul_(40)  # a trained head's logit scale
    model.model.embed_tokens.weight.data.mul_(8)
    assert _layers(model) and all(decoder_layer.is_installed(m) for m in _layers(model))
    prompts = torch.randint(0, 300, (3, 13), generator=torch.Generator().manual_seed(5)).cuda()
    kw = dict(max_new_tokens=9, do_sample=True, seed=4)
    fused = rlkernels.generate(model, prompts, **kw)
    graphed = rlkernels.generate(model, prompts, cuda_graph=True, **kw)
    rlkernels.release_decode_graphs()
    for layer in _layers(model):
        del layer.forward
    own = rlkernels.generate(model, prompts, **kw)
    for got in (fused, graphed):
        assert torch.equal(got[0], own[0])
        assert torch.equal(got[1].view(torch.int32), own[1].view(torch.int32))
