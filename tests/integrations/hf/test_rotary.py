"""The fused rotary inside a patched decoder: the modeling module's function is swapped only
where it is transformers' formula, runs fused only inside a patched decoder, changes no bit,
and leaves compiled models of the same family tracing as before."""
from __future__ import annotations

import importlib
import types

import pytest
import torch

transformers = pytest.importorskip("transformers")

import rlkernels  # noqa: E402
from rlkernels._env import triton_interpret  # noqa: E402
from rlkernels.integrations.hf import attention_layer, rotary as hf_rotary  # noqa: E402
from rlkernels.ops import rotary  # noqa: E402  (the kernel the dispatcher calls)
from rlkernels.integrations.hf.coverage import VERIFIED_FAMILIES  # noqa: E402

from ._models import _tiny  # noqa: E402


# Verified families whose rotary is another formula (Phi-3's may leave part of each head
# unrotated, OLMo 2's rounds back to q's dtype): it runs as transformers' elementwise ops,
# which the fused launch must not take.
# GPT-OSS: a half-width table applied to two halves; Cohere: interleaved pairs, in fp32.
OTHER_FORMULA = {"phi3", "olmo2", "gpt_oss", "cohere", "cohere2"}


@pytest.mark.parametrize("family", sorted(VERIFIED_FAMILIES))
def test_every_verified_family_has_transformers_formula(family):
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    function = getattr(module, hf_rotary.FUNCTION)
    original = getattr(function, "rlkernels_original", function)
    taken = hf_rotary.is_transformers_formula(types.SimpleNamespace(apply_rotary_pos_emb=original,
                                                                     rotate_half=getattr(module, "rotate_half", None)))
    assert taken == (family not in OTHER_FORMULA)


def test_another_formula_is_not_taken_for_transformers():
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        cos = cos.unsqueeze(unsqueeze_dim)
        sin = sin.unsqueeze(unsqueeze_dim)
        q_embed = (q * cos) - (rotate_half(q) * sin)
        k_embed = (k * cos) + (rotate_half(k) * sin)
        return q_embed, k_embed

    def rotate_half(x):
        x1 = x[..., : x.shape[-1] // 2]
        x2 = x[..., x.shape[-1] // 2 :]
        return torch.cat((-x2, x1), dim=-1)

    assert not hf_rotary.is_transformers_formula(types.SimpleNamespace(apply_rotary_pos_emb=apply_rotary_pos_emb,
                                                                        rotate_half=rotate_half))


@pytest.fixture
def fused_calls(monkeypatch):
    calls = []
    real = rotary.rotary_embedding_fused

    def counted(*args):
        calls.append(args[0].shape)
        return real(*args)

    monkeypatch.setattr(hf_rotary, "rotary_embedding_fused", counted)
    return calls


@pytest.mark.skipif(not triton_interpret(), reason="the fused kernel on the CPU needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_a_patched_decoder_rotates_in_one_launch_with_the_same_bits(arch, fused_calls):
    ids = torch.randint(0, 300, (3, 11), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    stock = _tiny(arch)
    patched = rlkernels.patch_model(_tiny(arch))
    # The classes' own attention forwards, which call the module's rotary function (the bound
    # forward of attention_layer runs the rotary inside its one op instead).
    for layer in patched.modules():
        if attention_layer.is_installed(layer):
            del layer.forward
    module = importlib.import_module(type(patched).__module__)
    assert hf_rotary.is_installed(module)
    with torch.no_grad():
        stock(input_ids=ids, attention_mask=mask)
        assert not fused_calls  # an unpatched model of the family runs transformers' function
        fused = rlkernels.token_logprobs(patched, ids, mask)
        assert len(fused_calls) == patched.config.num_hidden_layers
        original = getattr(module, hf_rotary.FUNCTION).rlkernels_original
        swapped = getattr(module, hf_rotary.FUNCTION)
        try:
            setattr(module, hf_rotary.FUNCTION, original)
            unfused = rlkernels.token_logprobs(patched, ids, mask)
        finally:
            setattr(module, hf_rotary.FUNCTION, swapped)
    assert torch.equal(fused.view(torch.int32), unfused.view(torch.int32))


def test_a_gradient_keeps_the_torch_formula(fused_calls):
    patched = rlkernels.patch_model(_tiny("qwen3"))
    ids = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(1))
    logp = rlkernels.token_logprobs(patched, ids)
    logp.sum().backward()
    assert not fused_calls
    assert all(p.grad is not None for p in patched.model.layers[0].self_attn.q_proj.parameters())


def test_a_compiled_model_of_the_family_traces_transformers_function():
    rlkernels.patch_model(_tiny("qwen3"))
    stock = _tiny("qwen3")
    ids = torch.randint(0, 300, (2, 7), generator=torch.Generator().manual_seed(2))
    compiled = torch.compile(stock, backend="eager", fullgraph=True)
    with torch.no_grad():
        assert torch.equal(compiled(input_ids=ids).logits, stock(input_ids=ids).logits)
