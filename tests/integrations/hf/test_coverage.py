"""is_patched claims only what the library covers; heads that scale or cap logits are refused."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import rlkernels  # noqa: E402
from rlkernels.integrations.hf import coverage  # noqa: E402
from rlkernels.ops.lm_head.config import NO_TRANSFORM, LogitTransform  # noqa: E402

VOCAB = 300
DENSE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)


def _build(kind: str, **over) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0))
    elif kind == "qwen3_moe":
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=16, num_experts_per_tok=4))
    elif kind == "phimoe":  # a mixture-of-experts family the library does not read (its sparse-mixer router)
        model = transformers.PhimoeForCausalLM(transformers.PhimoeConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, num_local_experts=16, num_experts_per_tok=2))
    elif kind in ("cohere", "cohere2"):
        if kind == "cohere":
            model = transformers.CohereForCausalLM(transformers.CohereConfig(**DENSE, **over))
        else:  # windows of 8 on three layers of four, no rotary on the full one
            fields = dict(DENSE, num_hidden_layers=4, sliding_window=8,
                          layer_types=["sliding_attention"] * 3 + ["full_attention"])
            model = transformers.Cohere2ForCausalLM(transformers.Cohere2Config(**{**fields, **over}))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.normal_(1.0, 0.3)  # initialised to ones: give each its own weights
    elif kind == "gemma2":
        model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**DENSE, head_dim=8, **over))
    elif kind == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**DENSE, **{"sliding_window": None, **over}))
    elif kind == "gemma3":  # text: sliding and full layers, Gemma's norms, tanh-GELU MLP
        fields = dict(DENSE, head_dim=8, sliding_window=8, layer_types=["sliding_attention", "full_attention"])
        model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**{**fields, **over}))
    elif kind == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**DENSE, **over))
    elif kind == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**DENSE, head_dim=8))
    elif kind == "olmo2":  # post-norms, q/k norms over all heads, its own RMSNorm order
        model = transformers.Olmo2ForCausalLM(transformers.Olmo2Config(
            **DENSE, pad_token_id=0, bos_token_id=1, eos_token_id=2, **over))
    elif kind == "gpt_oss":  # sinks, biased projections, YaRN's table, windows of 8, its MoE MLP
        config = transformers.GptOssConfig(**{**DENSE, "hidden_size": 64}, head_dim=16, num_local_experts=8,
                                           num_experts_per_tok=2, sliding_window=8,
                                           layer_types=["sliding_attention", "full_attention"], **over)
        model = transformers.GptOssForCausalLM(config)
        model.config._experts_implementation = "eager"  # the float64 reference (grouped_mm takes no float64)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("sinks", "bias")):
                    p.normal_(0.0, 0.5)  # initialised to zeros or near them: give each its own values
    elif kind == "phi3":  # Phi-3 / Phi-4: fused qkv and gate_up projections
        model = transformers.Phi3ForCausalLM(transformers.Phi3Config(
            **DENSE, pad_token_id=0, bos_token_id=1, eos_token_id=2, **over))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**DENSE, **over))
    return model.eval()


def _ragged(n: int = 5, seed: int = 0) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, VOCAB, (int(torch.randint(3, 20, (1,), generator=g)),), generator=g) for _ in range(n)]
    width = max(len(s) for s in seqs)
    ids = torch.zeros(n, width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, :len(s)], mask[i, :len(s)] = s, 1
    return seqs, ids, mask


def _scores_as_its_float64_forward(model: torch.nn.Module, reference: torch.nn.Module) -> list[torch.Tensor]:
    """token_logprobs of a ragged batch within 1e-4 of ``reference`` (the stock model in
    float64) at a trained model's logit spread; returns the sequences. Each goes through the
    reference alone: eager attention (Gemma 2's, for its soft-cap) multiplies a padding row's
    NaN values by the zero weights of real rows."""
    seqs, ids, mask = _ragged()
    logp = rlkernels.token_logprobs(model, ids, mask).detach()
    for i, s in enumerate(seqs):
        with torch.no_grad():
            logits = reference(s[None]).logits[0, :-1]
        want = logits.log_softmax(-1).gather(-1, s[1:, None])[:, 0]
        assert logits.std() >= 5 and float((logp[i, :len(s) - 1].double() - want).abs().max()) <= 1e-4
    return seqs


def _rows_equal_alone_and_batched(model: torch.nn.Module, batch_invariant: bool | None) -> int:
    seqs, ids, mask = _ragged()
    batched = rlkernels.token_logprobs(model, ids, mask, batch_invariant=batch_invariant)
    return sum(torch.equal(rlkernels.token_logprobs(model, s[None], batch_invariant=batch_invariant)[0],
                           batched[i, :len(s) - 1]) for i, s in enumerate(seqs))


@pytest.mark.parametrize("kind", ["llama", "qwen3", "mistral", "phi3", "olmo2", "gemma3", "qwen3_moe", "gpt_oss",
                                  "cohere"])
def test_verified_families_are_patched_without_a_warning(kind):
    model = _build(kind)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rlkernels.patch_model(model)
    assert rlkernels.is_patched(model)
    assert list(coverage.uncovered_modules(model)) == []


@pytest.mark.parametrize("kind, named", [("gpt2", "Conv1D"), ("phimoe", "PhimoeExperts")])
def test_uncovered_modules_are_named_and_not_claimed(kind, named):
    model = _build(kind)
    with pytest.warns(UserWarning, match=f"(?s)only partly covered.*{named}") as record:
        rlkernels.patch_model(model)
    assert not rlkernels.is_patched(model)
    # One line per kind of gap, not one line of hundreds of characters.
    lines = str(record[0].message).splitlines()
    assert len(lines) >= 3 and max(map(len, lines)) <= 200, lines
    # Not patched, so token_logprobs runs it under the mode: a row's bits alone == in a batch.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert _rows_equal_alone_and_batched(model, None) == 5


def test_stock_moe_rows_move_with_the_batch_outside_the_mode():
    """The control: the same MoE forward without the mode is not invariant on this CPU."""
    model = _build("phimoe")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rlkernels.patch_model(model)
        assert _rows_equal_alone_and_batched(model, False) < 5


def test_a_stock_moe_block_is_a_gap_even_in_a_verified_family():
    model = _build("qwen3_moe")  # not patched: the stock block, its router and its experts
    gaps = {type(m).__name__ for _, m in coverage.uncovered_modules(model)}
    assert {"Qwen3MoeSparseMoeBlock", "Qwen3MoeTopKRouter", "Qwen3MoeExperts"} <= gaps


def test_a_parameter_holding_module_in_a_verified_family_is_a_gap():
    model = rlkernels.patch_model(_build("llama"))
    model.model.layers[0].mlp.register_parameter("scale", torch.nn.Parameter(torch.ones(32)))
    assert not rlkernels.is_patched(model)
    assert any("LlamaMLP (e.g. model.layers.0.mlp)" in line for line in coverage.describe_gaps(model))


def test_cohere_logit_scale_is_applied_by_the_fused_head():
    # Cohere multiplies its logits by logit_scale after the head; the head applies the
    # scale, in the model's order.
    stock = _build("cohere", logit_scale=0.0625)
    with torch.no_grad():
        stock.lm_head.weight.mul_(60.0 * 16)  # a trained model's logit spread after the scale
    reference = copy.deepcopy(stock).double()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = rlkernels.patch_model(stock)
    assert rlkernels.is_patched(model) and coverage.logit_transform(model)[0].scale == 0.0625
    seqs = _scores_as_its_float64_forward(model, reference)
    prompts = torch.stack([s[:3] for s in seqs])
    seq, lp = rlkernels.generate(model, prompts, max_new_tokens=6, do_sample=True, seed=4, eos_token_id=[])
    assert torch.equal(rlkernels.token_logprobs(model, seq)[:, 2:], lp)


@pytest.mark.parametrize("kind, over, field", [
    ("granite", dict(logits_scaling=8.0), "logits_scaling=8.0"),  # a division, not applied by the head
    ("gemma2", dict(final_logit_softcapping=30.0, logit_scale=2.0), "logit_scale=2.0"),  # two at once
])
def test_heads_that_transform_logits_otherwise_are_refused(kind, over, field):
    if kind == "granite":
        model = transformers.GraniteForCausalLM(transformers.GraniteConfig(**DENSE, **over)).eval()
    else:
        model = _build(kind, **over)
    ids = torch.tensor([[1, 2, 3, 4]])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rlkernels.patch_model(model)
    with pytest.raises(ValueError, match=rf"token_logprobs: .* changes its logits after the LM head \(.*{field}"):
        rlkernels.token_logprobs(model, ids)
    with pytest.raises(ValueError, match=f"generate: .*{field}"):
        rlkernels.generate(model, ids, max_new_tokens=1)


def test_a_transform_is_taken_only_where_the_forward_makes_it():
    model = _build("gemma2", final_logit_softcapping=30.0)
    assert coverage.logit_transform(model) == (LogitTransform(softcap=30.0), [])

    class Capped(type(model)):  # the same field, another formula in the forward
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = torch.clamp(out.logits, -30.0, 30.0)
            return out

    model.__class__ = Capped
    assert coverage.logit_transform(model) == (NO_TRANSFORM, ["final_logit_softcapping=30.0"])


def test_neutral_transform_values_are_not_refused():
    model = _build("cohere", logit_scale=1.0)
    assert coverage.logit_transforms(model) == []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert rlkernels.token_logprobs(model, torch.tensor([[1, 2, 3]])).shape == (1, 2)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["gpt2", "phimoe"])
def test_uncovered_models_run_under_the_mode_on_the_gpu(kind):
    model = _build(kind).to(device="cuda", dtype=torch.bfloat16)
    with pytest.warns(UserWarning, match="only partly covered"):
        rlkernels.patch_model(model)
    assert not rlkernels.is_patched(model)
    seqs, ids, mask = _ragged()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        batched = rlkernels.token_logprobs(model, ids.cuda(), mask.cuda())
        alone = [rlkernels.token_logprobs(model, s[None].cuda())[0] for s in seqs]
    assert all(torch.equal(a, batched[i, :len(s) - 1]) for i, (a, s) in enumerate(zip(alone, seqs)))


def test_a_rotary_table_that_follows_the_batch_is_not_claimed():
    # transformers recomputes a "dynamic" rope table from the largest position of the call.
    rope = dict(rope_type="dynamic", factor=2.0, rope_theta=10000.0)
    stock = _build("llama", rope_parameters=rope, max_position_embeddings=16)
    g = torch.Generator().manual_seed(1)
    short, long = torch.randint(1, VOCAB, (10,), generator=g), torch.randint(1, VOCAB, (30,), generator=g)
    ids = torch.zeros(2, 30, dtype=torch.long)
    mask = torch.zeros_like(ids)
    ids[0, :10], mask[0, :10], ids[1], mask[1] = short, 1, long, 1
    with torch.no_grad():
        alone = stock(short[None]).logits[0]
        beside = stock(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits[0, :10]
    assert not torch.equal(alone, beside)  # stock: a row's logits move with the longest row beside it
    model = _build("llama", rope_parameters=rope, max_position_embeddings=16)
    with pytest.warns(UserWarning, match="(?s)only partly covered.*LlamaRotaryEmbedding \\(rope_type 'dynamic'"):
        rlkernels.patch_model(model)
    assert not rlkernels.is_patched(model)
    # A rope table fixed by the config (llama3, linear, yarn) stays covered.
    fixed = _build("llama", rope_parameters=dict(rope_type="linear", factor=2.0, rope_theta=10000.0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rlkernels.patch_model(fixed)
    assert rlkernels.is_patched(fixed)


@pytest.mark.parametrize("kind, over", [
    ("phi3", {}), ("phi3", dict(partial_rotary_factor=0.5)), ("phi3", dict(sliding_window=8)), ("olmo2", {}),
    ("mistral", dict(sliding_window=8)),
    ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)), ("gemma3", {}),
    ("gemma2", dict(sliding_window=8, attn_logit_softcapping=1.0, final_logit_softcapping=30.0)), ("gpt_oss", {}),
    ("cohere", dict(use_qk_norm=True, logit_scale=1.0)), ("cohere2", dict(logit_scale=1.0))])
def test_a_family_scores_as_its_own_forward_and_samples_what_it_scores(kind, over):
    # Phi-3 and Phi-4 (Phi3ForCausalLM): Phi-4-mini rotates part of each head, Phi-3-mini-4k
    # has a sliding window. OLMo 2. Mistral's window; Qwen2's on its later layers only; Gemma 3's
    # and Gemma 2's on every other layer. The windows (8) are shorter than the sequences, so they
    # hide keys. Gemma 2's attention scores are soft-capped, and its logits at 30 as released
    # (the head's spread reaches past the cap, so the cap moves the log-probs). GPT-OSS: attention
    # sinks, a window on every other layer, biased experts with the clamped SwiGLU. Cohere: its
    # LayerNorms (per-head q/k norms too) and parallel block, interleaved rotary pairs.
    stock = _build(kind, **over)
    with torch.no_grad():
        stock.lm_head.weight.mul_(60.0)  # a trained model's logit spread
    reference = copy.deepcopy(stock).double()
    model = rlkernels.patch_model(stock)
    assert rlkernels.is_patched(model)
    seqs = _scores_as_its_float64_forward(model, reference)
    assert _rows_equal_alone_and_batched(model, None) == len(seqs)
    prompts = torch.stack([s[:3] for s in seqs])
    seq, lp = rlkernels.generate(model, prompts, max_new_tokens=10, do_sample=True, seed=4, temperature=0.8,
                                 eos_token_id=[])  # (no row ends: every new token is scored)
    assert torch.equal(rlkernels.token_logprobs(model, seq, temperature=0.8)[:, 2:], lp)


def test_an_attention_that_does_not_hand_its_sinks_on_is_not_covered():
    # GPT-OSS's attention holds its sinks and hands them to the attention as s_aux; a
    # subclass whose forward does not is a module holding a weight the library does not apply.
    model = _build("gpt_oss")

    class QuietSinks(type(model.model.layers[0].self_attn)):
        def forward(self, hidden_states, position_embeddings, attention_mask, **kwargs):
            return super().forward(hidden_states, position_embeddings, attention_mask, **kwargs)

    QuietSinks.__module__ = type(model.model.layers[0].self_attn).__module__  # a GPT-OSS module by family
    model.model.layers[1].self_attn.__class__ = QuietSinks
    assert coverage.family_of(model.model.layers[1].self_attn) == "gpt_oss"
    with pytest.warns(UserWarning, match="(?s)only partly covered.*QuietSinks"):
        rlkernels.patch_model(model)
    assert not rlkernels.is_patched(model)
    assert coverage._covered(model.model.layers[0].self_attn)


def test_rms_norms_are_swapped_only_for_a_formula_the_library_computes():
    olmo2, llama = _build("olmo2"), _build("llama")
    rlkernels.patch_model(olmo2)
    rlkernels.patch_model(llama)
    norms = [m for m in olmo2.modules() if isinstance(m, rlkernels.RMSNorm)]
    assert norms and all(m.weight_in_fp32 for m in norms)  # OLMo 2: (weight * xhat).to(dtype)
    assert not any(m.weight_in_fp32 for m in llama.modules() if isinstance(m, rlkernels.RMSNorm))

    class OffsetRMSNorm(torch.nn.Module):  # another formula under the same kind of name: left alone
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(32))
            self.variance_epsilon = 1e-6

        def forward(self, hidden_states):
            variance = hidden_states.pow(2).mean(-1, keepdim=True)
            return (1 + self.weight) * hidden_states * torch.rsqrt(variance + self.variance_epsilon)

    model = _build("llama")
    model.model.norm = OffsetRMSNorm()
    with pytest.warns(UserWarning, match="(?s)only partly covered.*OffsetRMSNorm"):
        rlkernels.patch_model(model)
    assert type(model.model.norm) is OffsetRMSNorm and not rlkernels.is_patched(model)


@pytest.mark.parametrize("family", sorted(coverage.VERIFIED_FAMILIES))
def test_every_verified_familys_rms_norm_is_a_formula_the_library_computes(family):
    import importlib

    from rlkernels.integrations.hf.patch import _rms_norm_formula

    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    if family.startswith("cohere"):  # LayerNorms, Cohere's formula (rlkernels.nn.LayerNorm)
        from rlkernels.integrations.hf.patch import _is_cohere_layer_norm
        norms = [getattr(module, name) for name in dir(module) if name.endswith("LayerNorm")]
        assert norms and all(_is_cohere_layer_norm(cls) for cls in norms)
        return
    norms = [getattr(module, name) for name in dir(module) if name.endswith("RMSNorm")]
    want = {"olmo2": (True, 0.0), "gpt_oss": (True, 0.0), "gemma2": (True, 1.0),
            "gemma3": (True, 1.0)}.get(family, (False, 0.0))
    assert norms and all(_rms_norm_formula(cls) == want for cls in norms)


def _commented(x):  # a comment after the signature
    y = x * 2  # "a comment" with # inside
    return "#" + y  # the string's '#' stays


def test_source_lines_drop_comments_and_keep_strings():
    assert coverage.source_lines(_commented) == [
        "def _commented(x):", 'y = x * 2', 'return "#" + y']
    assert coverage.source_lines(len) is None  # a builtin has no source to read


def test_source_lines_read_through_a_hub_kernel_wrapper():
    # transformers decorates modeling functions with kernels' use_kernel_forward_from_hub,
    # which makes them nn.Module instances; the formula checks read the function inside.
    hub = pytest.importorskip("kernels")
    wrapped = hub.use_kernel_forward_from_hub("rlkernels_test_layer")(_commented)
    assert isinstance(wrapped, torch.nn.Module)
    assert coverage.hub_function(wrapped) is _commented
    assert coverage.source_lines(wrapped) == coverage.source_lines(_commented)
    assert coverage.hub_function(torch.nn.Identity()) is not _commented  # another module is itself
