"""An attention layer's q, k and v projections in one launch: bound where the three are the
library's plain Linear, the k and v calls take what the q call's grouped launch kept for that
same input, and the bits are the projections' own."""
from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import rlkernels  # noqa: E402
from rlkernels.integrations.hf import qkv  # noqa: E402

from ._models import _same_training_gradients, _tiny  # noqa: E402


def _attentions(model):
    return [m for m in model.modules() if type(m).__name__.endswith("Attention")]


@pytest.fixture
def grouped_on_cpu(monkeypatch):
    """Counts the grouped calls (on the CPU ``linear_group`` runs one linear per weight)."""
    calls = []

    def group(x, weights):
        calls.append(x.shape)
        return rlkernels.ops.matmul.linear_group(x, weights)

    monkeypatch.setattr(qkv, "linear_group", group)
    return calls


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_patch_model_groups_every_attention_and_the_bits_stay(arch, grouped_on_cpu):
    model = rlkernels.patch_model(_tiny(arch))
    layers = _attentions(model)
    assert layers and all(qkv.is_installed(m) for m in layers)
    ids = torch.randint(0, 300, (3, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        grouped = rlkernels.token_logprobs(model, ids)
        assert len(grouped_on_cpu) == len(layers)  # one grouped call per layer, k and v taken
        assert all(m.q_proj.forward.group.kept is None for m in layers)  # v's call let go of it
        for m in layers:
            for name in ("q_proj", "k_proj", "v_proj"):
                del getattr(m, name).forward  # the class's own forward
        own = rlkernels.token_logprobs(model, ids)
    assert torch.equal(grouped.view(torch.int32), own.view(torch.int32))


def test_k_and_v_of_another_or_modified_input_are_computed(grouped_on_cpu):
    model = rlkernels.patch_model(_tiny("qwen3"))
    attn = _attentions(model)[0]
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(2, 4, attn.q_proj.in_features, generator=g), torch.randn(2, 4, attn.q_proj.in_features,
                                                                                 generator=g)
    with torch.no_grad():
        attn.q_proj(x)
        assert torch.equal(attn.k_proj(y), rlkernels.linear(y, attn.k_proj.weight))  # another tensor
        x.mul_(2)  # modified in place after the grouped launch: its kept k and v are stale
        assert torch.equal(attn.k_proj(x), rlkernels.linear(x, attn.k_proj.weight))
        assert torch.equal(attn.v_proj(x), rlkernels.linear(x, attn.v_proj.weight))


def test_training_through_the_group_gives_the_projections_own_gradients(grouped_on_cpu):
    model = rlkernels.patch_model(_tiny("llama"))
    twin = copy.deepcopy(model)
    for m in _attentions(twin):
        for name in ("q_proj", "k_proj", "v_proj"):
            del getattr(m, name).forward
    assert _same_training_gradients(model, twin)
    assert len(grouped_on_cpu) == len(_attentions(model))  # the twin's calls were not grouped


def test_projections_with_a_bias_keep_the_class_forward():
    model = rlkernels.patch_model(_tiny("qwen2"))  # Qwen2's q, k and v have biases
    layers = _attentions(model)
    assert layers and not any(qkv.is_installed(m) for m in layers)


def test_a_deep_copy_groups_its_own_projections(grouped_on_cpu):
    model = rlkernels.patch_model(_tiny("qwen3"))
    twin = copy.deepcopy(model)
    attn, twin_attn = _attentions(model)[0], _attentions(twin)[0]
    assert qkv.is_installed(twin_attn) and twin_attn.k_proj.forward.group.k is twin_attn.k_proj
    with torch.no_grad():
        twin_attn.k_proj.weight.mul_(2)
        x = torch.randn(2, 5, attn.q_proj.in_features)
        twin_attn.q_proj(x)
        attn.q_proj(x)
        twin_k, k = twin_attn.k_proj(x), attn.k_proj(x)
        assert torch.equal(twin_k, rlkernels.linear(x, twin_attn.k_proj.weight))
        assert torch.equal(k, rlkernels.linear(x, attn.k_proj.weight)) and not torch.equal(k, twin_k)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_grouped_decode_gives_the_projections_own_bits_gpu(arch):
    """bf16 on CUDA, where the grouped launch runs: generate's tokens and log-probs (prefill of
    prime lengths, then one-row decode steps) equal those of the class's own projections."""
    model = rlkernels.patch_model(_tiny(arch, dtype=torch.bfloat16, device="cuda", hidden_size=256,
                                        intermediate_size=512, num_attention_heads=4, num_key_value_heads=2))
    model.lm_head.weight.data.mul_(40)  # a trained head's logit scale
    layers = _attentions(model)
    assert layers and all(qkv.is_installed(m) for m in layers)
    prompts = torch.randint(0, 300, (3, 13), generator=torch.Generator().manual_seed(5)).cuda()
    kw = dict(max_new_tokens=9, do_sample=True, seed=4)
    grouped = rlkernels.generate(model, prompts, **kw)
    graphed = rlkernels.generate(model, prompts, cuda_graph=True, **kw)
    rlkernels.release_decode_graphs()
    for m in layers:
        for name in ("q_proj", "k_proj", "v_proj"):
            del getattr(m, name).forward
    own = rlkernels.generate(model, prompts, **kw)
    for got in (grouped, graphed):
        assert torch.equal(got[0], own[0])
        assert torch.equal(got[1].view(torch.int32), own[1].view(torch.int32))
