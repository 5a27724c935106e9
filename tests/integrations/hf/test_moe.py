"""patch_model on Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE and GPT-OSS: the invariant MoE block, on tiny
models built from configs."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import rlkernels  # noqa: E402
from rlkernels import reference  # noqa: E402
from rlkernels.integrations.hf import coverage, moe  # noqa: E402
from rlkernels.nn import RoutedExpertsMlp, SparseMoeBlock  # noqa: E402

from ...conftest import HAS_CUDA  # noqa: E402

VOCAB = 300
KINDS = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")  # SparseMoeBlock
ALL_KINDS = KINDS + ("gpt_oss",)                       # and GPT-OSS's RoutedExpertsMlp
HIDDEN, EXPERTS, TOP_K = 64, 16, 4


def _config(kind: str, **over):
    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_experts_per_tok=TOP_K, tie_word_embeddings=False,
                  max_position_embeddings=256)
    if kind == "qwen3_moe":
        fields = dict(common, intermediate_size=64, moe_intermediate_size=32, head_dim=16, num_experts=EXPERTS,
                      norm_topk_prob=True)
        return transformers.Qwen3MoeConfig(**{**fields, **over})
    if kind == "qwen2_moe":
        fields = dict(common, intermediate_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                      num_experts=EXPERTS, norm_topk_prob=False)
        return transformers.Qwen2MoeConfig(**{**fields, **over})
    if kind == "mixtral":
        fields = dict(common, intermediate_size=32, num_local_experts=EXPERTS, sliding_window=None)
        return transformers.MixtralConfig(**{**fields, **over})
    if kind == "olmoe":
        fields = dict(common, intermediate_size=32, num_experts=EXPERTS, norm_topk_prob=True)
        return transformers.OlmoeConfig(**{**fields, **over})
    if kind == "gpt_oss":  # sinks, biases, the clamped SwiGLU, a window of 8 on every other layer
        fields = dict(common, intermediate_size=32, num_local_experts=EXPERTS, head_dim=16, sliding_window=8,
                      layer_types=["sliding_attention", "full_attention"])
        return transformers.GptOssConfig(**{**fields, **over})
    if kind == "phimoe":
        fields = dict(common, intermediate_size=32, num_local_experts=EXPERTS, num_experts_per_tok=2)
        return transformers.PhimoeConfig(**{**fields, **over})
    raise ValueError(kind)


_MODEL_CLASSES = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                  "mixtral": "MixtralForCausalLM", "olmoe": "OlmoeForCausalLM", "phimoe": "PhimoeForCausalLM",
                  "gpt_oss": "GptOssForCausalLM"}


def build(kind: str, dtype=torch.float32, device="cpu", config=None, **over) -> torch.nn.Module:
    """A random model whose every layer matters: matrices N(0, 1/fan_in) (GPT-OSS's gate/up
    weights three times that, so its clamp at 7 is reached), other 1-D weights 0.1 N(0, 1), a
    router three times sharper (decisive routing), the LM head scaled so the logits' std is 6."""
    config = config or _config(kind, **over)
    torch.manual_seed(0)
    with torch.device(device):  # built and drawn where it runs: the 30B-shaped layers are 2.4e9 numbers
        model = getattr(transformers, _MODEL_CLASSES[kind])(config)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g, device=device) / p.shape[-1] ** 0.5)
            elif "norm" not in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g, device=device))
        for m in model.modules():
            if type(m).__name__.endswith("TopKRouter"):
                m.weight.mul_(3.0)
            if type(m).__name__ == "GptOssExperts":
                m.gate_up_proj.mul_(3.0)
        model.config._experts_implementation = "eager"  # the stock reference in float64 (no grouped_mm)
        model.eval()
        ids = torch.randint(0, VOCAB, (4, 16), generator=g, device=device)
        model.lm_head.weight.mul_(6.0 / model(ids).logits.std())
    return model.to(device=device, dtype=dtype)


def _patched(kind: str, dtype=torch.float32, device="cpu", **over) -> torch.nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return rlkernels.patch_model(build(kind, dtype, device, **over))


def _seqs(n=5, lo=3, hi=20, seed=0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g) for _ in range(n)]


def _padded(seqs, left: bool, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        cols = slice(width - len(s), width) if left else slice(0, len(s))
        ids[i, cols], mask[i, cols] = s, 1
    return ids.to(device), mask.to(device)


def _alone_vs_padded(model, seqs, device="cpu") -> None:
    with torch.no_grad():
        alone = [rlkernels.token_logprobs(model, s[None].to(device))[0] for s in seqs]
        right = rlkernels.token_logprobs(model, *_padded(seqs, left=False, device=device))
        left = rlkernels.token_logprobs(model, *_padded(seqs, left=True, device=device))
    width = right.shape[1] + 1
    for i, s in enumerate(seqs):
        n = len(s)
        assert torch.equal(right[i, :n - 1], alone[i]), f"right-padded row {i}"
        assert torch.equal(left[i, width - n:], alone[i]), f"left-padded row {i}"


def _blocks(model) -> list[torch.nn.Module]:
    return [layer.mlp for layer in model.model.layers]


def _router(block: torch.nn.Module) -> torch.nn.Module:
    return block.router if hasattr(block, "router") else block.gate


def _output(result) -> torch.Tensor:
    """A block's output: GPT-OSS's MLP returns (output, routing weights)."""
    return result[0] if isinstance(result, tuple) else result


# ---------------------------------------------------------------- patching


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_patch_model_replaces_the_blocks_sharing_every_parameter(kind):
    model = build(kind)
    params = dict(model.named_parameters())
    keys = set(model.state_dict())
    with torch.no_grad():
        logits = model(torch.arange(12)[None]).logits
    assert float(logits.std()) >= 5.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert rlkernels.patch_model(model) is model
    assert rlkernels.is_patched(model) and list(coverage.uncovered_modules(model)) == []
    assert all(isinstance(b, RoutedExpertsMlp if kind == "gpt_oss" else SparseMoeBlock) for b in _blocks(model))
    assert set(model.state_dict()) == keys
    for name, p in model.named_parameters():
        assert p is params[name], name
    block = _blocks(model)[0]
    assert _router(block).top_k == TOP_K and _router(block).num_experts == EXPERTS
    if kind == "gpt_oss":
        assert block.router.bias is not None and block.experts.transposed
        assert block.experts.activation == rlkernels.ops.moe.GatedActivation(interleaved=True, limit=7.0, alpha=1.702)
        return
    assert block.gate.normalize is (kind != "qwen2_moe") and block.gate.round_weights is (kind != "mixtral")
    assert (block.shared_expert is not None) is (kind == "qwen2_moe")


def test_an_unread_moe_family_stays_uncovered():
    model = build("phimoe")  # PhiMoE routes with its sparse mixer: not a block the library reads
    with pytest.warns(UserWarning, match="(?s)only partly covered.*PhimoeExperts"):
        rlkernels.patch_model(model)
    assert not rlkernels.is_patched(model)
    assert not any(isinstance(m, SparseMoeBlock) for m in model.modules())


# ---------------------------------------------------------------- the contract, model level


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ALL_KINDS)
def test_alone_right_and_left_padded_are_bitwise_equal(kind, dtype):
    _alone_vs_padded(_patched(kind, dtype), _seqs())


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_generate_logprobs_are_the_trainers(kind):
    model = _patched(kind, torch.bfloat16 if kind == "qwen3_moe" else torch.float32)
    prompts = _seqs(4, 2, 9, seed=1)
    ids, mask = _padded(prompts, left=True)
    for sample in (False, True):
        seq, logp = rlkernels.generate(model, ids, mask, max_new_tokens=6, do_sample=sample, seed=3,
                                       eos_token_id=[], pad_token_id=0)
        full = torch.cat([mask, torch.ones(len(prompts), 6, dtype=mask.dtype)], dim=1)
        with torch.no_grad():
            trainer = rlkernels.token_logprobs(model, seq, full)[:, ids.shape[1] - 1:]
        assert torch.equal(logp, trainer), sample
        # Each row alone draws the same tokens (its stream is its row index in both).
        one, one_logp = rlkernels.generate(model, prompts[2][None], max_new_tokens=6, do_sample=sample, seed=3,
                                           eos_token_id=[], pad_token_id=0, streams=torch.tensor([2]))
        assert torch.equal(one[0, len(prompts[2]):], seq[2, ids.shape[1]:]) and torch.equal(one_logp[0], logp[2])


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_training_backward_is_bitwise_reproducible(kind):
    model = _patched(kind)
    ids, mask = _padded(_seqs(), left=False)
    runs = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        rlkernels.token_logprobs(model, ids, mask).sum().backward()
        runs.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert runs[0].keys() == runs[1].keys()
    assert all(torch.equal(runs[0][n], runs[1][n]) for n in runs[0])
    moe = [n for n, _ in model.named_parameters() if ".mlp." in n]
    assert moe and all(n in runs[0] and torch.isfinite(runs[0][n]).all() for n in moe)
    # The router gets a gradient (through the routing weights), so do the experts that were used.
    router = "router" if kind == "gpt_oss" else "gate"
    assert float(runs[0][f"model.layers.0.mlp.{router}.weight"].abs().max()) > 0


# ---------------------------------------------------------------- the block


def _crowd(block, dtype, n=300, seed=0) -> tuple[torch.Tensor, int]:
    """Hidden rows: ``n`` copies of one row (crowding its k experts) around one other row,
    the target, returned with the target's position."""
    g = torch.Generator().manual_seed(seed)
    v, t = torch.randn(2, HIDDEN, generator=g).to(dtype)
    x = torch.cat([v.expand(n // 2, HIDDEN), t[None], v.expand(n - n // 2, HIDDEN)])
    return x[None], n // 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ALL_KINDS)
def test_a_token_alone_and_in_a_crowded_batch_is_the_same(kind, dtype):
    block = _blocks(_patched(kind, dtype))[0]
    x, at = _crowd(block, dtype)
    with torch.no_grad():
        _, _, index = _router(block)(x[0])
        counts = torch.bincount(index.reshape(-1), minlength=EXPERTS)
        assert counts.max() >= 300 and (counts == 0).sum() >= EXPERTS - 2 * TOP_K  # crowded and empty experts
        batched = _output(block(x))
        assert torch.equal(_output(block(x[:, at:at + 1]))[0, 0], batched[0, at])
        assert torch.equal(_output(block(x[:, :1]))[0, 0], batched[0, 0])
        # Batch layout does not matter either: [B, L, H] with the target in another row.
        assert torch.equal(_output(block(x[:, :300].reshape(3, 100, HIDDEN)))[1, at - 100], batched[0, at])


@pytest.mark.parametrize("kind", KINDS)
def test_tied_router_scores_go_to_the_lowest_expert_id(kind):
    model = _patched(kind, torch.bfloat16)
    block = _blocks(model)[0]
    with torch.no_grad():
        block.gate.weight[11] = block.gate.weight[4]  # experts 4 and 11 always score the same
        x = torch.randn(400, HIDDEN, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
        logits, weights, index = block.gate(x)
    assert torch.equal(logits[:, 4], logits[:, 11])
    has4, has11 = (index == 4).any(-1), (index == 11).any(-1)
    assert has4.sum() >= 20 and bool((has4 | ~has11).all())  # 11 never chosen without 4
    both = has4 & has11
    rank4 = (index == 4).long().argmax(-1)
    rank11 = (index == 11).long().argmax(-1)
    assert both.any() and bool((rank4[both] < rank11[both]).all())
    assert torch.equal(weights[both].gather(-1, rank4[both, None]), weights[both].gather(-1, rank11[both, None]))


@pytest.mark.parametrize("impl", ["eager", "grouped_mm"])
def test_control_the_stock_block_moves_with_the_batch_on_the_cpu(impl):
    """The same property, on the stock block: a token's output changes with its batch-mates."""
    model = build("qwen3_moe")
    model.config._experts_implementation = impl
    block = _blocks(model)[0]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 300, HIDDEN, generator=g)
    with torch.no_grad():
        batched = block(x)
        same = sum(torch.equal(block(x[:, i:i + 1])[0, 0], batched[0, i]) for i in range(300))
    assert same < 300


def _family_reference(block, x: torch.Tensor) -> torch.Tensor:
    """The stock block's formula in float64 (routing from the logits rounded to the model
    dtype, as the stock router computes them)."""
    xd = x.reshape(-1, x.shape[-1])
    if hasattr(block, "router"):  # GPT-OSS: softmax over the k largest logits
        router, experts = block.router, block.experts
        logits = (xd.double() @ router.weight.double().T + router.bias.double()).to(x.dtype).double()
        top, index = torch.topk(logits, router.top_k, dim=-1)
        out = reference.moe_experts_ref(
            xd, index, torch.softmax(top, -1), experts.gate_up_proj, experts.down_proj,
            gate_up_bias=experts.gate_up_proj_bias, down_bias=experts.down_proj_bias, interleaved=True,
            limit=experts.limit, alpha=experts.alpha, transposed=True)
        return out.reshape(x.shape)
    gate = block.gate
    logits = (xd.double() @ gate.weight.double().T).to(x.dtype).double()
    probs = torch.softmax(logits, -1)
    top, index = torch.topk(probs, gate.top_k, dim=-1)
    if getattr(gate, "norm_topk_prob", True):
        top = top / top.sum(-1, keepdim=True)
    out = reference.moe_experts_ref(xd, index, top, block.experts.gate_up_proj, block.experts.down_proj)
    if hasattr(block, "shared_expert"):
        mlp = block.shared_expert
        h = torch.nn.functional.silu(xd.double() @ mlp.gate_proj.weight.double().T) * \
            (xd.double() @ mlp.up_proj.weight.double().T)
        shared = h @ mlp.down_proj.weight.double().T
        out = out + torch.sigmoid(xd.double() @ block.shared_expert_gate.weight.double().T) * shared
    return out.reshape(x.shape)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 8e-3)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ALL_KINDS)
def test_the_block_computes_the_families_math(kind, dtype, tol):
    model = build(kind, dtype)
    stock = copy.deepcopy(_blocks(model)[0])
    ours = _blocks(rlkernels.patch_model(model))[0]
    x = torch.randn(1, 200, HIDDEN, generator=torch.Generator().manual_seed(2)).to(dtype)
    with torch.no_grad():
        ref = _family_reference(stock, x)
        got, theirs = _output(ours(x)), _output(stock(x))
    assert got.dtype == dtype
    err, stock_err = _rel(got, ref), _rel(theirs, ref)
    assert err <= tol, (err, stock_err)
    assert err <= 2 * stock_err + 1e-7, (err, stock_err)  # no less accurate than stock (it rounds more often)


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_the_blocks_gradients_are_the_stock_blocks_in_float64(kind):
    model = build(kind, torch.float64)
    model.config._experts_implementation = "eager"  # torch's grouped_mm takes no float64
    stock = copy.deepcopy(_blocks(model)[0])
    ours = _blocks(rlkernels.patch_model(model))[0]
    x = torch.randn(1, 40, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    grad = torch.randn(1, 40, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    results = []
    for block in (ours, stock):
        xi = x.clone().requires_grad_()
        block.zero_grad(set_to_none=True)
        _output(block(xi)).backward(grad)
        results.append([xi.grad] + [p.grad for _, p in sorted(block.named_parameters())])
    # The stock routers take the softmax in fp32 even for a float64 model (ours: fp64), hence 1e-5.
    for a, b in zip(*results):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))


# ---------------------------------------------------------------- refusals


def _refused(model, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        rlkernels.patch_model(model)


def test_a_router_with_a_bias_is_refused():
    model = build("qwen3_moe")
    model.model.layers[1].mlp.gate.register_parameter("bias", torch.nn.Parameter(torch.zeros(EXPERTS)))
    _refused(model, r"model\.layers\.1\.mlp \(Qwen3MoeSparseMoeBlock\).*\['bias', 'weight'\].*router without a bias")
    # Nothing was swapped: the refusal comes before any replacement.
    assert not any(isinstance(m, SparseMoeBlock) for m in model.modules())


def test_a_top_k_beyond_the_experts_is_refused():
    model = build("qwen3_moe")
    model.model.layers[0].mlp.gate.top_k = EXPERTS + 1
    _refused(model, r"model\.layers\.0\.mlp .*top_k = 17 is not an int in \[1, 16\]")


def test_expert_counts_that_do_not_match_are_refused():
    model = build("mixtral")
    experts = model.model.layers[0].mlp.experts
    experts.gate_up_proj = torch.nn.Parameter(experts.gate_up_proj[:15].detach().clone())
    _refused(model, r"model\.layers\.0\.mlp \(MixtralSparseMoeBlock\).*router scores 16 experts but the "
                    r"experts hold 15")


def test_router_jitter_is_refused():
    _refused(build("mixtral", router_jitter_noise=0.1), "router_jitter_noise=0.1")


def test_recording_router_logits_is_refused():
    _refused(build("qwen2_moe", output_router_logits=True), "output_router_logits=True")


def test_another_activation_is_refused():
    _refused(build("qwen3_moe", hidden_act="gelu"), "activation is GELUActivation, not SiLU")


def test_an_unknown_block_is_refused_by_name():
    block = build("phimoe").model.layers[0].mlp
    with pytest.raises(ValueError, match=r"layer0 \(PhimoeSparseMoeBlock\) cannot be replaced: not a block"):
        moe.replace_block("layer0", block)


# ---------------------------------------------------------------- GPU


def _gpu_patched(kind: str, config=None) -> torch.nn.Module:
    return rlkernels.patch_model(build(kind, torch.bfloat16, "cuda", config=config))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("kind", ALL_KINDS)
def test_alone_right_and_left_padded_are_bitwise_equal_gpu_bf16(kind):
    model = _gpu_patched(kind)
    assert rlkernels.is_patched(model)
    _alone_vs_padded(model, _seqs(), "cuda")
    block = _blocks(model)[0]
    x, at = _crowd(block, torch.bfloat16, n=4000)
    x = x.cuda()
    with torch.no_grad():
        assert torch.equal(_output(block(x[:, at:at + 1]))[0, 0], _output(block(x))[0, at])


def _generate_equals_the_trainer_and_backward_repeats(model, ids, mask, new: int, seed: int) -> dict:
    """Sampled ``generate``, eager and graphed, gives the trainer's log-probs bitwise, and two
    backward passes over its sequences give the same gradients; returns them by name."""
    kw = dict(max_new_tokens=new, do_sample=True, seed=seed, eos_token_id=[], pad_token_id=0)
    seq, logp = rlkernels.generate(model, ids, mask, **kw)
    full = torch.cat([mask, torch.ones(len(ids), new, dtype=mask.dtype, device=mask.device)], dim=1)
    with torch.no_grad():
        assert torch.equal(logp, rlkernels.token_logprobs(model, seq, full)[:, ids.shape[1] - 1:])
    graphed = rlkernels.generate(model, ids, mask, cuda_graph=True, **kw)
    assert torch.equal(graphed[0], seq) and torch.equal(graphed[1], logp)
    runs = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        rlkernels.token_logprobs(model, seq, full).sum().backward()
        runs.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert runs[0].keys() == runs[1].keys() and all(torch.equal(runs[0][n], runs[1][n]) for n in runs[0])
    return runs[0]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("kind", ALL_KINDS)
def test_generate_and_backward_gpu_bf16(kind):
    model = _gpu_patched(kind)
    ids, mask = _padded(_seqs(4, 2, 9, seed=1), left=True, device="cuda")
    _generate_equals_the_trainer_and_backward_repeats(model, ids, mask, new=6, seed=3)


QWEN3_30B_A3B_4L = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                        num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=4096,
                        rope_theta=1e6, tie_word_embeddings=False)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_qwen3_30b_a3b_shaped_four_layers_gpu_bf16():
    config = transformers.Qwen3MoeConfig(**QWEN3_30B_A3B_4L)
    model = _gpu_patched("qwen3_moe", config=config)
    assert rlkernels.is_patched(model)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, config.vocab_size, (n,), generator=g) for n in (17, 64, 5, 40)]
    _alone_vs_padded(model, seqs, "cuda")
    ids, mask = _padded(seqs[:2], left=True, device="cuda")
    seq, logp = rlkernels.generate(model, ids, mask, max_new_tokens=4, eos_token_id=[], pad_token_id=0)
    full = torch.cat([mask, torch.ones(2, 4, dtype=mask.dtype, device="cuda")], dim=1)
    with torch.no_grad():
        assert torch.equal(logp, rlkernels.token_logprobs(model, seq, full)[:, ids.shape[1] - 1:])
    graphed = rlkernels.generate(model, ids, mask, max_new_tokens=4, eos_token_id=[], pad_token_id=0,
                                 cuda_graph=True)
    assert torch.equal(graphed[0], seq) and torch.equal(graphed[1], logp)


GPT_OSS_20B_2L = dict(vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=2,
                      num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32,
                      num_experts_per_tok=4, sliding_window=128, layer_types=["sliding_attention", "full_attention"],
                      max_position_embeddings=4096, tie_word_embeddings=False)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_gpt_oss_20b_shaped_two_layers_gpu_bf16():
    """GPT-OSS-20B's layer shapes (sinks, a window of 128 that the prompts cross, 32 biased
    experts of the clamped SwiGLU): alone == padded, generate (eager and graphed) == the
    trainer's log-probs, and a deterministic backward."""
    config = transformers.GptOssConfig(**GPT_OSS_20B_2L)
    model = _gpu_patched("gpt_oss", config=config)
    assert rlkernels.is_patched(model)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, config.vocab_size, (n,), generator=g) for n in (17, 200, 5, 141)]
    _alone_vs_padded(model, seqs, "cuda")
    ids, mask = _padded(seqs[1::2], left=True, device="cuda")
    grads = _generate_equals_the_trainer_and_backward_repeats(model, ids, mask, new=4, seed=1)
    moe = [n for n, _ in model.named_parameters() if ".mlp." in n or n.endswith("sinks")]
    assert moe and all(n in grads and torch.isfinite(grads[n]).all() for n in moe)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_graphed_decode_refuses_the_torch_backends_per_expert_loop_gpu(monkeypatch):
    model = _gpu_patched("qwen3_moe")
    ids, mask = _padded(_seqs(2, 2, 9, seed=1), left=True, device="cuda")
    monkeypatch.setenv("RLKERNELS_BACKEND", "torch")
    with pytest.raises(ValueError, match="needs the Triton backend"):
        rlkernels.generate(model, ids, mask, max_new_tokens=2, cuda_graph=True, pad_token_id=0)
