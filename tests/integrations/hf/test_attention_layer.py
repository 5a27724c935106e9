"""An attention layer's q/k norms, rotary embedding and KV-cache write as one op: bound only
where the class's forward is the verified formula, taken at the decode steps of a counted
static cache, the same bits as the class's forward, and hooks on the norms still run."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import rlkernels  # noqa: E402
from rlkernels.integrations.hf import attention_layer  # noqa: E402
from rlkernels.testing import _bits_equal  # noqa: E402

from ._models import _same_training_gradients, _tiny, llama_subclass  # noqa: E402
from .test_continuous_batching import _scale_head  # noqa: E402

ARCHS = ["qwen3", "qwen2", "llama", "mistral"]


def _attention_layers(model):
    return [m for m in model.modules() if type(m).__name__.endswith("Attention")]


def _unbind(model):
    for layer in _attention_layers(model):
        del layer.forward


def _trained(model):
    # A trained model's scales: a residual stream larger than the sublayers' outputs, and a
    # head whose logits reach tens.
    model.model.embed_tokens.weight.data.mul_(8)
    model.lm_head.weight.data.mul_(5)
    return model


class _Spy:
    """Records, per call of the op, whether it wrote a cache and how many tokens it took."""

    def __init__(self, monkeypatch):
        self.calls: list[tuple[bool, int]] = []
        op = attention_layer.attention_inputs

        def spy(q, *args, cache=None, **kwargs):
            self.calls.append((cache is not None, q.shape[1]))
            return op(q, *args, cache=cache, **kwargs)

        monkeypatch.setattr(attention_layer, "attention_inputs", spy)


@pytest.mark.parametrize("arch", ARCHS)
def test_patch_model_binds_every_attention_layer_and_generate_keeps_its_bits(arch, monkeypatch):
    model = _trained(rlkernels.patch_model(_tiny(arch, tie_word_embeddings=False)))
    assert _attention_layers(model) and all(attention_layer.is_installed(m) for m in _attention_layers(model))
    spy = _Spy(monkeypatch)
    prompts = torch.randint(0, 300, (3, 11), generator=torch.Generator().manual_seed(5))
    kw = dict(max_new_tokens=6, do_sample=True, seed=4)
    fused = rlkernels.generate(model, prompts, **kw)
    # The prefill fills a fresh cache through the class's forward; every decode step is the op's.
    assert spy.calls == [(True, 1)] * (5 * model.config.num_hidden_layers)
    _unbind(model)
    own = rlkernels.generate(model, prompts, **kw)
    assert torch.equal(fused[0], own[0]) and _bits_equal(fused[1], own[1])


def test_rollout_keeps_its_bits():
    model = _tiny("qwen3", tie_word_embeddings=False)
    _scale_head(model, 2.5)  # a trained head's scale, and an EOS that ends samples early
    model = rlkernels.patch_model(model)
    prompts = [torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 9, 5)]
    kw = dict(n=3, max_new_tokens=12, seed=11, max_batch=3)
    fused = rlkernels.rollout(model, prompts, **kw)
    assert any(r.finished and len(r.tokens) < 12 for r in fused)  # slots free early and refill
    _unbind(model)
    own = rlkernels.rollout(model, prompts, **kw)
    for a, b in zip(fused, own):
        assert torch.equal(a.tokens, b.tokens) and _bits_equal(a.logprobs, b.logprobs)


def test_scoring_without_gradients_takes_the_op_and_training_the_class_forward(monkeypatch):
    model = rlkernels.patch_model(_tiny("qwen3"))
    twin = rlkernels.patch_model(_tiny("qwen3"))
    _unbind(twin)
    spy = _Spy(monkeypatch)
    ids = torch.randint(0, 300, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert _bits_equal(rlkernels.token_logprobs(model, ids), rlkernels.token_logprobs(twin, ids))
    assert spy.calls == [(False, 7)] * model.config.num_hidden_layers
    spy.calls.clear()
    assert _same_training_gradients(model, twin)
    assert spy.calls == []


def test_a_hook_on_a_norm_runs_the_class_forward(monkeypatch):
    model = rlkernels.patch_model(_tiny("qwen3"))
    seen = []
    _attention_layers(model)[0].k_norm.register_forward_hook(lambda mod, args, out: seen.append("k_norm"))
    spy = _Spy(monkeypatch)
    prompts = torch.randint(0, 300, (2, 5), generator=torch.Generator().manual_seed(2))
    rlkernels.generate(model, prompts, max_new_tokens=3, do_sample=False)
    assert seen == ["k_norm"] * 3  # the prefill and both decode steps
    assert spy.calls == [(True, 1)] * 2  # the second layer's decode steps


_FORMULA = """
def forward(self, hidden_states, position_embeddings, attention_mask, past_key_values=None, **kwargs):
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    cos, sin = position_embeddings
    query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
    if past_key_values is not None:
        key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)
    attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
    attn_output, attn_weights = attention_interface(self, query_states, key_states, value_states, attention_mask, dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling, **kwargs)
    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    attn_output = self.o_proj(attn_output)
    return attn_output, attn_weights
"""


def _attention_with(source: str, tmp_path, name: str) -> type:
    return llama_subclass("LlamaAttention", source, tmp_path, name)


@pytest.mark.parametrize("change", ["scaled queries", "another window", "a positional update argument",
                                    "cache under another name"])
def test_only_the_verified_formula_is_read_as_it(change, tmp_path):
    changed = {
        "scaled queries": ("query_states = self.q_proj(hidden_states)", "query_states = 2 * self.q_proj(hidden_states)"),
        "another window": ("scaling=self.scaling,", "scaling=self.scaling, sliding_window=8,"),
        "a positional update argument": ("(key_states, value_states, self.layer_idx)",
                                         "(value_states, key_states, self.layer_idx)"),
        "cache under another name": ("past_key_values", "kv_cache"),
    }[change]
    source = _FORMULA.replace(*changed)
    assert source != _FORMULA
    assert attention_layer._formula(_attention_with(_FORMULA, tmp_path, "Same")) == (False, None)  # the control
    assert attention_layer._formula(_attention_with(source, tmp_path, "Changed")) is None


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_fused_decode_gives_the_class_forwards_bits_gpu(arch):
    """bf16 on CUDA, where the one launch runs: generate's tokens and log-probs, eager and
    graphed, and rollout's, equal those of the classes' own forwards."""
    model = _trained(rlkernels.patch_model(_tiny(arch, dtype=torch.bfloat16, device="cuda", hidden_size=256,
                                                 intermediate_size=512, num_attention_heads=4,
                                                 num_key_value_heads=2, tie_word_embeddings=False)))
    prompts = torch.randint(0, 300, (3, 13), generator=torch.Generator().manual_seed(5)).cuda()
    kw = dict(max_new_tokens=9, do_sample=True, seed=4)
    lists = [p[: 5 + 3 * i].tolist() for i, p in enumerate(prompts)]
    fused = [rlkernels.generate(model, prompts, **kw), rlkernels.generate(model, prompts, cuda_graph=True, **kw)]
    fused_rollout = rlkernels.rollout(model, lists, n=2, max_new_tokens=9, seed=3, max_batch=4)
    rlkernels.release_decode_graphs()
    _unbind(model)
    own = rlkernels.generate(model, prompts, **kw)
    for got in fused:
        assert torch.equal(got[0], own[0]) and _bits_equal(got[1], own[1])
    own_rollout = rlkernels.rollout(model, lists, n=2, max_new_tokens=9, seed=3, max_batch=4)
    for a, b in zip(fused_rollout, own_rollout):
        assert torch.equal(a.tokens, b.tokens) and _bits_equal(a.logprobs, b.logprobs)
