"""rlkernels.tensor_parallel: a patched model sharded over gloo processes (TP = 1, 2, 4, 8)
scores every token with the bits of the one-process layout, at a trained model's logit scale.

Every rank builds the same tiny model from a seed, patches and shards it, and saves its
``token_logprobs`` (left-padded batch), entropies and forward logits; the parent compares
them bitwise with ``tensor_parallel(model, None)`` and against a float64 stock forward.
"""
from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist

import rlkernels
from rlkernels import contract
from rlkernels._env import triton_interpret

from ...parallel._workers import gloo_group, run_world
from ._models import _tiny

SIZES = (1, 2, 4, 8)
# Heads, kv heads, the attention width and the intermediate size divide by 8 (TP up to 8
# and 8 segments); V = 384 makes 8 vocabulary shards of 48 rows.
SHAPE = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_attention_heads=8, num_key_value_heads=8)
# A Qwen3-MoE with a dense second layer: its experts replicated, its attention and dense MLP sharded.
MOE = dict(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1])
CASES = [("qwen3", torch.float32, {}), ("llama", torch.float32, dict(attention_bias=True, tie_word_embeddings=False)),
         ("qwen3", torch.bfloat16, {}), ("qwen3_moe", torch.float32, MOE)]
GREEDY_CASE = 1  # the untied Llama: its heads' logits are uncertain, so greedy is not every draw


def _model(arch: str, dtype: torch.dtype, over: dict):
    model = _tiny(arch, dtype, **dict(SHAPE, **over))
    with torch.no_grad():  # a trained head's logit scale (std ~6)
        model.get_output_embeddings().weight.mul_(40.0)
    return model


def _batch():
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, SHAPE["vocab_size"], (3, 13), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding
    mask[2, :1] = 0
    return ids, mask


def _score(model):
    ids, mask = _batch()
    with torch.no_grad():
        lp, ent = rlkernels.token_logprobs(model, ids, mask, temperature=0.7, return_entropy=True)
        logits = model(input_ids=ids, attention_mask=mask).logits
    return lp, ent, logits


def _generate(model, greedy: bool = False):
    ids, mask = _batch()
    draw = dict(do_sample=False) if greedy else dict(do_sample=True, seed=17, streams=torch.tensor([5, 1 << 40, 9]))
    with torch.no_grad():
        return rlkernels.generate(model, ids, mask, max_new_tokens=5, temperature=0.7, eos_token_id=[],
                                  return_entropy=True, **draw)


ROLLOUT = dict(n=2, max_new_tokens=4, temperature=0.7, seed=17, eos_token_id=[], max_batch=3, cuda_graph=False,
               return_entropy=True)


def _prompts() -> list[list[int]]:
    ids, mask = _batch()
    return [row[m.bool()].tolist() for row, m in zip(ids, mask)]


def _rollout(model, greedy: bool = False):
    kw = dict(ROLLOUT, do_sample=False, n=1) if greedy else ROLLOUT
    with torch.no_grad():  # 3 prompts x 2 samples through 3 rows: the second three wait for slots
        return [(r.tokens, r.logprobs, r.entropy) for r in rlkernels.rollout(model, _prompts(), **kw)]


# A truncated draw: rows keep a few tokens, through generate and rollout. These tiny models'
# largest logit stands ~30 above the next: at T = 8 a nucleus of 0.99 holds several tokens.
TRUNCATION = dict(top_k=40, top_p=0.99, temperature=8.0)


def _generate_truncated(model):
    ids, mask = _batch()
    with torch.no_grad():
        return rlkernels.generate(model, ids, mask, max_new_tokens=5, eos_token_id=[], return_entropy=True,
                                  do_sample=True, seed=17, streams=torch.tensor([5, 1 << 40, 9]),
                                  return_thresholds=True, **TRUNCATION)


def _rollout_truncated(model):
    with torch.no_grad():
        return [(r.tokens, r.logprobs, r.thresholds)
                for r in rlkernels.rollout(model, _prompts(), **dict(ROLLOUT, **TRUNCATION))]


# Backward at TP > 1: the untied Llama with biases (fp32), a tied one in bf16, and Qwen3
# (its per-head q/k norms' weight shared by the ranks' heads) in fp32 and bf16.
BACKWARD_CASES = [("llama", torch.float32, dict(attention_bias=True, tie_word_embeddings=False)),
                  ("llama", torch.bfloat16, {}), ("qwen3", torch.float32, {}), ("qwen3", torch.bfloat16, {})]


def _gradients(model) -> dict[str, torch.Tensor]:
    """Each parameter's gradient of a weighted sum of ``token_logprobs`` and entropies."""
    ids, mask = _batch()
    lp, ent = rlkernels.token_logprobs(model, ids, mask, temperature=0.7, return_entropy=True)
    g = torch.Generator().manual_seed(5)
    weights = torch.randn(lp.shape, generator=g), torch.randn(lp.shape, generator=g)
    ((lp.float() * weights[0]).sum() + (ent.float() * weights[1]).sum()).backward()
    return {name: p.grad for name, p in model.named_parameters()}


def _worker(rank: int, world: int, folder: str) -> None:
    with gloo_group(rank, world, folder):
        out: dict = {}
        for i, case in enumerate(BACKWARD_CASES):
            model = rlkernels.tensor_parallel(rlkernels.patch_model(_model(*case).train()), dist.group.WORLD)
            out[f"backward {i}"] = _gradients(model)
        for i, (arch, dtype, over) in enumerate(CASES):
            model = rlkernels.tensor_parallel(rlkernels.patch_model(_model(arch, dtype, over)), dist.group.WORLD)
            out[i] = _score(model)
            out[f"generate {i}"] = _generate(model)
            out[f"rollout {i}"] = _rollout(model)
            if i == GREEDY_CASE and not triton_interpret():  # (the interpreter's draws: the op tests')
                out["greedy"] = (_generate(model, greedy=True), _rollout(model, greedy=True))
            out[f"patched {i}"] = rlkernels.is_patched(model)
            out[f"held {i}"] = {name: p.numel() for name, p in model.named_parameters()}
            if i == 0:
                out["truncated"] = (_generate_truncated(model), _rollout_truncated(model))
        if world < 8:  # Qwen3 with 4 kv heads: its k_norm's gradient tree needs 8 head segments
            model = rlkernels.tensor_parallel(rlkernels.patch_model(_model("qwen3", torch.float32,
                                                                           dict(num_key_value_heads=4))),
                                              dist.group.WORLD)
            ids, mask = _batch()
            try:  # a backward across ranks is not built: refused, not wrong
                rlkernels.token_logprobs(model, ids, mask)
                out["grad"] = "ran"
            except ValueError as e:
                out["grad"] = str(e)
        few_kv = rlkernels.patch_model(_tiny("llama", **dict(SHAPE, num_key_value_heads=2)))
        try:
            rlkernels.tensor_parallel(few_kv, dist.group.WORLD)
            out["kv"] = "sharded"
        except ValueError as e:
            out["kv"] = str(e)
        torch.save(out, os.path.join(folder, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def worlds() -> dict[int, list[dict]]:
    return {world: run_world(world, _worker) for world in SIZES}


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32) if x.dtype == torch.float32 else x.view(torch.int16)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_every_rank_at_every_tp_size_scores_the_one_process_layouts_bits(worlds, case):
    arch, dtype, over = CASES[case]
    model = rlkernels.tensor_parallel(rlkernels.patch_model(_model(arch, dtype, over)), None)
    want, drawn = _score(model), _generate(model)
    # The draws' log-probs are the scorer's, bitwise (the generated positions of the sequence).
    seq, lp, ent = drawn
    ids, mask = _batch()
    L = ids.shape[1]
    full = torch.cat([mask, torch.ones_like(seq[:, L:])], dim=1)
    with torch.no_grad():
        scored, scored_ent = rlkernels.token_logprobs(model, seq, full, temperature=0.7, return_entropy=True)
    assert torch.equal(_bits(scored[:, L - 1:]), _bits(lp)) and torch.equal(_bits(scored_ent[:, L - 1:]), _bits(ent))
    for world, ranks in worlds.items():
        for rank, out in enumerate(ranks):
            assert out[f"patched {case}"]
            for got, ref in zip(out[case], want):
                assert got.shape == ref.shape
                assert torch.equal(_bits(got), _bits(ref)), (world, rank)
            for got, ref in zip(out[f"generate {case}"], drawn):
                assert torch.equal(got, ref) if got.dtype == torch.int64 else torch.equal(_bits(got), _bits(ref))


def _other_moe(kind: str):
    """Tiny Qwen2-MoE (a shared expert, q/k/v biases) and Mixtral at a trained logit scale."""
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=384, hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8,
                  num_experts_per_tok=2, tie_word_embeddings=False, max_position_embeddings=256)
    torch.manual_seed(0)
    if kind == "qwen2_moe":
        model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            **common, intermediate_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=48,
            num_experts=4))
    else:
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **common, intermediate_size=32, num_local_experts=4, sliding_window=None))
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(40.0)
    return rlkernels.patch_model(model.eval())


def _other_moe_worker(rank: int, world: int, folder: str) -> None:
    with gloo_group(rank, world, folder):
        out = {}
        for kind in ("qwen2_moe", "mixtral"):
            model = rlkernels.tensor_parallel(_other_moe(kind), dist.group.WORLD)
            out[kind] = (_score(model), _generate(model))
            out[f"backward {kind}"] = _gradients(model)
        torch.save(out, os.path.join(folder, f"rank{rank}.pt"))


def test_qwen2_moe_and_mixtral_at_tp_2_and_4_are_the_one_process_layouts_bits():
    """Scores, draws and (each rank's shard of) the gradients, experts replicated."""
    want, grads = {}, {}
    for kind in ("qwen2_moe", "mixtral"):
        model = rlkernels.tensor_parallel(_other_moe(kind), None)
        assert rlkernels.is_patched(model)
        want[kind] = (_score(model), _generate(model))
        grads[kind] = _gradients(model)
    for world in (2, 4):
        for rank, out in enumerate(run_world(world, _other_moe_worker)):
            for kind, (scored, drawn) in want.items():
                for got, ref in zip(_flat(out[kind]), _flat((scored, drawn))):
                    assert torch.equal(_bits(got) if got.is_floating_point() else got,
                                       _bits(ref) if ref.is_floating_point() else ref), (kind, world, rank)
                for name, g in out[f"backward {kind}"].items():
                    ref = _shard(grads[kind][name], g, rank)
                    assert torch.equal(_bits(g), _bits(ref.contiguous())), (kind, world, rank, name)


def test_an_moe_models_experts_are_whole_on_every_rank_and_its_attention_and_dense_mlp_sharded(worlds):
    case = next(i for i, (arch, _, _) in enumerate(CASES) if arch == "qwen3_moe")
    whole = {name: p.numel() for name, p in _model(*CASES[case]).named_parameters()}
    experts = [name for name in whole if ".mlp.experts." in name or ".mlp.gate." in name]
    sharded = [name for name in whole if any(f".{p}." in name for p in ("q_proj", "k_proj", "v_proj", "o_proj",
                                                                         "gate_proj", "up_proj", "down_proj"))]
    assert experts and any(".layers.1.mlp.down_proj" in name for name in sharded)  # the dense second layer
    for world, ranks in worlds.items():
        for out in ranks:
            held = out[f"held {case}"]
            assert all(held[name] == whole[name] for name in experts), world
            assert all(held[name] * world == whole[name] for name in sharded), world


def _shard(whole: torch.Tensor, part: torch.Tensor, rank: int) -> torch.Tensor:
    """The block of ``whole`` a rank holding ``part`` holds: contiguous rows or columns."""
    for dim in range(whole.dim()):
        if whole.shape[dim] != part.shape[dim]:
            size = part.shape[dim]
            return whole.narrow(dim, rank * size, size)
    return whole


@pytest.mark.parametrize("case", range(len(BACKWARD_CASES)))
def test_the_backward_at_every_tp_size_gives_each_rank_its_shard_of_the_one_process_gradients(worlds, case):
    want = _gradients(rlkernels.tensor_parallel(rlkernels.patch_model(_model(*BACKWARD_CASES[case]).train()),
                                                None))
    assert all(g is not None and bool(g.any()) for g in want.values())
    for world, ranks in worlds.items():
        for rank, out in enumerate(ranks):
            got = out[f"backward {case}"]
            assert got.keys() == want.keys()
            for name, g in got.items():
                ref = _shard(want[name], g, rank)
                assert g.shape == ref.shape and torch.equal(_bits(g), _bits(ref.contiguous())), (world, rank, name)
            if world > 1:  # the sharded parameters hold 1/world of the gradient
                assert got["model.layers.0.self_attn.q_proj.weight"].shape[0] * world == \
                    want["model.layers.0.self_attn.q_proj.weight"].shape[0]


@pytest.mark.skipif(triton_interpret(), reason="the greedy draw's kernels under the interpreter: "
                    "tests/parallel/test_vocab_parallel_sample.py")
def test_greedy_at_every_tp_size_is_the_one_process_layouts_and_its_scores(worlds):
    arch, dtype, over = CASES[GREEDY_CASE]
    model = rlkernels.tensor_parallel(rlkernels.patch_model(_model(arch, dtype, over)), None)
    (seq, lp, ent), rolled = _generate(model, greedy=True), _rollout(model, greedy=True)
    ids, mask = _batch()
    L = ids.shape[1]
    with torch.no_grad():  # the greedy log-probs are the scorer's; each rollout sample is its prompt's greedy row
        scored, scored_ent = rlkernels.token_logprobs(model, seq, torch.cat([mask, torch.ones_like(seq[:, L:])], 1),
                                                      temperature=0.7, return_entropy=True)
        alone = [rlkernels.generate(model, torch.tensor([p]), max_new_tokens=ROLLOUT["max_new_tokens"],
                                    do_sample=False, temperature=0.7, eos_token_id=[]) for p in _prompts()]
    assert torch.equal(_bits(scored[:, L - 1:]), _bits(lp)) and torch.equal(_bits(scored_ent[:, L - 1:]), _bits(ent))
    for (tokens, _, _), row, prompt in zip(rolled, alone, _prompts()):
        assert torch.equal(tokens, row[0][0, len(prompt):])
    for world, ranks in worlds.items():
        for rank, out in enumerate(ranks):
            got_gen, got_roll = out["greedy"]
            for got, ref in zip(got_gen, (seq, lp, ent)):
                assert torch.equal(_bits(got) if got.is_floating_point() else got,
                                   _bits(ref) if ref.is_floating_point() else ref), (world, rank)
            for got, ref in zip(got_roll, rolled):
                assert torch.equal(got[0], ref[0]) and torch.equal(_bits(got[1]), _bits(ref[1])), (world, rank)


def test_truncated_draws_at_every_tp_size_are_the_one_process_layouts_and_its_thresholded_scores(worlds):
    model = rlkernels.tensor_parallel(rlkernels.patch_model(_model(*CASES[0])), None)
    seq, lp, ent, tau = _generate_truncated(model)
    rolled = _rollout_truncated(model)
    ids, mask = _batch()
    L = ids.shape[1]
    # The draws truncate: every kept set is smaller than the vocabulary (a finite tau).
    assert torch.isfinite(tau).all() and all(torch.isfinite(r[2]).all() for r in rolled)
    # The draws' log-probs are the scorer's under each draw's kept set, bitwise.
    threshold = torch.full((seq.shape[0], seq.shape[1] - 1), -float("inf"))
    threshold[:, L - 1:] = tau
    T = TRUNCATION["temperature"]
    with torch.no_grad():
        scored, scored_ent = rlkernels.token_logprobs(model, seq, torch.cat([mask, torch.ones_like(seq[:, L:])], 1),
                                                      temperature=T, return_entropy=True, logit_threshold=threshold)
        full = rlkernels.token_logprobs(model, seq, torch.cat([mask, torch.ones_like(seq[:, L:])], 1),
                                        temperature=T)
        logits = model(input_ids=seq, attention_mask=torch.cat([mask, torch.ones_like(seq[:, L:])], 1)).logits
    assert torch.equal(_bits(scored[:, L - 1:]), _bits(lp)) and torch.equal(_bits(scored_ent[:, L - 1:]), _bits(ent))
    assert (full[:, L - 1:] < lp).all()  # the kept set's mass is renormalised: each token's log-prob rises
    kept = (logits[:, L - 1:-1] / T >= tau[..., None]).sum(dim=-1)
    assert (kept > 1).any() and (kept <= TRUNCATION["top_k"]).all()
    # Each rollout sample is its prompt's truncated generate alone, thresholds included.
    n = ROLLOUT["n"]
    for i, prompt in enumerate(_prompts()):
        with torch.no_grad():
            alone = rlkernels.generate(model, torch.tensor([prompt]), max_new_tokens=ROLLOUT["max_new_tokens"],
                                       eos_token_id=[], do_sample=True, seed=ROLLOUT["seed"],
                                       streams=torch.tensor([i * n]), return_thresholds=True, **TRUNCATION)
        tokens, logps, taus = rolled[i * n]
        assert torch.equal(tokens, alone[0][0, len(prompt):]) and torch.equal(_bits(logps), _bits(alone[1][0]))
        assert torch.equal(_bits(taus), _bits(alone[2][0]))
    for world, ranks in worlds.items():
        for rank, out in enumerate(ranks):
            got_gen, got_roll = out["truncated"]
            for got, ref in zip(got_gen, (seq, lp, ent, tau)):
                assert torch.equal(_bits(got) if got.is_floating_point() else got,
                                   _bits(ref) if ref.is_floating_point() else ref), (world, rank)
            for got, ref in zip(got_roll, rolled):
                assert all(torch.equal(_bits(a) if a.is_floating_point() else a,
                                       _bits(b) if b.is_floating_point() else b) for a, b in zip(got, ref)), (world,
                                                                                                           rank)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_rollout_at_every_tp_size_is_the_one_process_layouts_and_each_sample_its_prompt_alone(worlds, case):
    arch, dtype, over = CASES[case]
    model = rlkernels.tensor_parallel(rlkernels.patch_model(_model(arch, dtype, over)), None)
    want = _rollout(model)
    n, new = ROLLOUT["n"], ROLLOUT["max_new_tokens"]
    assert len(want) == len(_prompts()) * n
    for i, prompt in enumerate(_prompts()):
        with torch.no_grad():  # the prompt alone, [1, L], no padding, the sample's stream
            alone = [rlkernels.generate(model, torch.tensor([prompt]), max_new_tokens=new, do_sample=True,
                                        temperature=ROLLOUT["temperature"], seed=ROLLOUT["seed"],
                                        streams=torch.tensor([i * n + j]), eos_token_id=[], return_entropy=True)
                     for j in range(n)]
        for j, (seq, lp, ent) in enumerate(alone):
            tokens, r_lp, r_ent = want[i * n + j]
            assert torch.equal(tokens, seq[0, len(prompt):]), (i, j)
            assert torch.equal(_bits(r_lp), _bits(lp[0])) and torch.equal(_bits(r_ent), _bits(ent[0])), (i, j)
    # The untied llama head's draws are uncertain, and a prompt's samples differ (the tied qwen3
    # heads, scaled with their embeddings, put ~all the mass on one token).
    assert arch != "llama" or any(not torch.equal(want[i * n][0], want[i * n + 1][0]) for i in range(len(want) // n))
    for world, ranks in worlds.items():
        for rank, out in enumerate(ranks):
            for got, ref in zip(out[f"rollout {case}"], want):
                assert torch.equal(got[0], ref[0]), (world, rank)
                assert torch.equal(_bits(got[1]), _bits(ref[1])) and torch.equal(_bits(got[2]), _bits(ref[2]))


@pytest.mark.parametrize("case", range(len(CASES)))
def test_the_layouts_log_probs_are_the_models_own(case):
    arch, dtype, over = CASES[case]
    ids, mask = _batch()
    scored = mask[:, :-1].bool() & mask[:, 1:].bool()
    lp, _, _ = _score(rlkernels.tensor_parallel(rlkernels.patch_model(_model(arch, dtype, over)), None))
    tol = contract.tolerance("linear_logprob", dtype).tolerance
    if dtype == torch.float32:  # against a float64 stock forward of the same weights
        stock = _model(arch, dtype, over).double()
        stock.config._experts_implementation = "eager"  # (grouped_mm takes no float64)
        with torch.no_grad():
            logits = stock(input_ids=ids, attention_mask=mask).logits[:, :-1] / 0.7
        assert logits.std() > 4  # a trained model's scale
        ref = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
        assert (lp.double() - ref)[scored].abs().max() <= tol
    else:  # every layer rounds to bf16: against the unsharded patched model, the same roundings
        plain, _, _ = _score(rlkernels.patch_model(_model(arch, dtype, over)))
        assert (lp - plain)[scored].abs().max() <= 100 * tol


def test_the_one_process_layout_trains_deterministically_and_as_the_patched_model():
    ids, mask = _batch()
    base = rlkernels.patch_model(_model("qwen3", torch.float32, {}))
    grads = []
    for model in (rlkernels.tensor_parallel(copy.deepcopy(base), None),
                  rlkernels.tensor_parallel(copy.deepcopy(base), None), base):
        rlkernels.token_logprobs(model, ids, mask, temperature=0.7).sum().backward()
        grads.append([p.grad for p in model.parameters()])
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(grads[0], grads[1]))
    for a, b in zip(grads[0], grads[2]):  # the same math, another order of the sums
        assert torch.allclose(a, b, rtol=1e-3, atol=1e-3 * float(b.abs().max()))


def test_the_one_process_layout_fills_main_grad_where_the_patched_model_does():
    """Megatron-style fp32 main_grad buffers: every projection's, the K-tree layers' and the
    head's gradients land in them (the bits .grad gets without them, in fp32), the other
    parameters' in .grad, as on the patched model."""
    ids, mask = _batch()
    base = rlkernels.patch_model(_model("qwen3", torch.float32, {}))

    def train(model, main: bool):
        if main:
            for p in model.parameters():
                p.main_grad = torch.zeros_like(p)
        rlkernels.token_logprobs(model, ids, mask, temperature=0.7).sum().backward()
        return {n: p for n, p in model.named_parameters()}

    plain = train(rlkernels.tensor_parallel(copy.deepcopy(base), None), False)
    kept = train(rlkernels.tensor_parallel(copy.deepcopy(base), None), True)
    patched = train(copy.deepcopy(base), True)
    into_main = {n for n, p in kept.items() if bool(p.main_grad.any())}
    assert into_main == {n for n, p in patched.items() if bool(p.main_grad.any())}
    assert any("o_proj" in n for n in into_main) and any("down_proj" in n for n in into_main)
    for name, p in kept.items():
        got = p.main_grad if p.grad is None else p.grad + p.main_grad  # a tied table gets both
        want = plain[name].grad
        assert torch.equal(got, want) if p.grad is None else torch.allclose(got, want), name


def _fsdp_layout_worker(rank: int, world: int, folder: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    with gloo_group(rank, world, folder):
        model = rlkernels.tensor_parallel(rlkernels.patch_model(_model("qwen3", torch.float32, {})), None)
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        ids, mask = _batch()
        lp = rlkernels.token_logprobs(model, ids[rank::world], mask[rank::world], temperature=0.7)
        lp.sum().backward()
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        torch.save({"lp": lp.detach(), "grads": grads}, os.path.join(folder, f"rank{rank}.pt"))


def test_the_one_process_layout_under_fsdp2_scores_with_its_bits_and_trains_reproducibly():
    """A trainer sharding the layout with FSDP2 scores its rows with the one-process layout's
    bits, which are a TP rollout's; its backward gives the same gradients run to run."""
    runs = [run_world(2, _fsdp_layout_worker) for _ in range(2)]
    model = rlkernels.tensor_parallel(rlkernels.patch_model(_model("qwen3", torch.float32, {})), None)
    ids, mask = _batch()
    with torch.no_grad():
        want = rlkernels.token_logprobs(model, ids, mask, temperature=0.7)
    for rank, out in enumerate(runs[0]):
        assert torch.equal(_bits(out["lp"]), _bits(want[rank::2])), rank
    for a, b in zip(*runs):
        assert all(torch.equal(_bits(a["grads"][n]), _bits(b["grads"][n])) for n in a["grads"])
        assert all(torch.isfinite(g).all() for g in a["grads"].values())


def test_refusals_name_the_value_before_anything_moves(worlds):
    for world, ranks in worlds.items():
        for out in ranks:
            if world == 1:
                assert out["grad"] == "ran" and out["kv"] == "sharded"
            elif world < 8:
                assert f"tensor-parallel over {world} ranks, where its backward is not built " \
                       "(Qwen3Attention.k_norm holds one weight for every head, whose gradient is a tree over 8 head " \
                       "segments, and num_key_value_heads (4) does not divide into them)" in out["grad"]
            if world in (4, 8):
                assert f"num_key_value_heads (2) must divide by {world}" in out["kv"]
    model = rlkernels.patch_model(_model("qwen3", torch.float32, {}))
    weight = model.lm_head.weight
    with pytest.raises(ValueError, match=r"rlkernels.tensor_parallel: segments \(3\) must be a power of two"):
        rlkernels.tensor_parallel(model, None, segments=3)
    with pytest.raises(ValueError, match=r"vocabulary \(384 rows of the LM head\) must divide by vocab_shards \(256\)"):
        rlkernels.tensor_parallel(model, None, vocab_shards=256)
    assert model.lm_head.weight is weight  # nothing moved
    with pytest.raises(ValueError, match=r"rlkernels.tensor_parallel: LlamaForCausalLM is not patched"):
        rlkernels.tensor_parallel(_model("llama", torch.float32, {}), None)
    transformers = pytest.importorskip("transformers")
    olmoe = rlkernels.patch_model(transformers.OlmoeForCausalLM(transformers.OlmoeConfig(
        vocab_size=384, hidden_size=32, intermediate_size=16, num_experts=4, num_experts_per_tok=2,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)))
    assert rlkernels.is_patched(olmoe)
    with pytest.raises(ValueError, match=r"\(olmoe\) is not covered: .* with their experts replicated, "
                                         r"mixtral, qwen2_moe, qwen3_moe"):
        rlkernels.tensor_parallel(olmoe, None)
    sharded = rlkernels.tensor_parallel(model, None)
    with pytest.raises(ValueError, match=r"rlkernels.tensor_parallel: the model is tensor-parallel already"):
        rlkernels.tensor_parallel(sharded, None)
    with pytest.raises(ValueError, match=r"cannot capture the decode step here: a tensor-parallel model's sampler"):
        rlkernels.rollout(sharded, [[1, 2, 3]], max_new_tokens=2, seed=1, cuda_graph=True)


def _tp_plan_worker(rank: int, world: int, folder: str) -> None:
    transformers = pytest.importorskip("transformers")
    with gloo_group(rank, world, folder):
        path = os.path.join(folder, "model")
        if rank == 0:
            _model("qwen3", torch.float32, {}).save_pretrained(path)
        dist.barrier()
        # transformers takes the TP size from the launcher's environment (torchrun's)
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
        model = transformers.AutoModelForCausalLM.from_pretrained(path, tp_plan="auto")
        q = model.model.layers[0].self_attn.q_proj
        try:
            rlkernels.patch_model(model)
            out = {"patch": "patched"}
        except ValueError as e:
            out = {"patch": str(e)}
        out["untouched"] = type(q) is torch.nn.Linear and model.model.layers[0].self_attn.q_proj is q
        out["q rows"] = q.weight.to_local().shape[0] if hasattr(q.weight, "to_local") else q.weight.shape[0]
        torch.save(out, os.path.join(folder, f"rank{rank}.pt"))


def test_a_model_sharded_by_transformers_tp_plan_is_refused_pointing_to_tensor_parallel():
    for out in run_world(2, _tp_plan_worker):
        assert "rlkernels.patch_model: Qwen3ForCausalLM was sharded by transformers' tensor parallelism " \
               "(tp_plan, tp_size=2)" in out["patch"]
        assert "rlkernels.tensor_parallel(model, group)" in out["patch"]
        assert out["untouched"]  # refused before anything was swapped
        assert out["q rows"] * 2 == SHAPE["num_attention_heads"] * 64  # each rank held half of q_proj


# ---------------------------------------------------------------- several GPUs (NCCL)
# A Qwen3-1.7B-shaped model in bf16, sharded over NCCL ranks (one GPU each), against the
# one-process layout on one GPU: scoring, a sampled and a greedy eager generate, and a rollout.

GPU_SHAPE = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096,
                 tie_word_embeddings=True)
GPU_ROLLOUT = dict(n=2, max_new_tokens=12, temperature=0.7, seed=5, eos_token_id=[], max_batch=5, cuda_graph=False,
                   return_entropy=True)


def _gpu_model(device: torch.device):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)  # every rank draws the same weights on its own GPU
    with torch.device(device):
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**GPU_SHAPE))
    model = model.to(torch.bfloat16).eval()
    with torch.no_grad():  # a trained head's logit scale (std ~6)
        model.get_output_embeddings().weight.mul_(7.0)
    return rlkernels.patch_model(model)


def _gpu_batch(device: torch.device):
    gen = torch.Generator().manual_seed(8)
    ids = torch.randint(0, GPU_SHAPE["vocab_size"], (4, 97), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :30] = 0  # left padding
    mask[3, :61] = 0
    return ids.to(device), mask.to(device)


def _gpu_run(model, device: torch.device) -> dict:
    ids, mask = _gpu_batch(device)
    out = {"weights": model.get_input_embeddings().weight.float().sum().item()}
    with torch.no_grad():
        out["score"] = rlkernels.token_logprobs(model, ids, mask, temperature=0.7, return_entropy=True)
        out["generate"] = rlkernels.generate(model, ids, mask, max_new_tokens=16, do_sample=True, temperature=0.7,
                                             seed=3, streams=torch.tensor([4, 1 << 40, 9, 2], device=device),
                                             eos_token_id=[], return_entropy=True)
        out["greedy"] = rlkernels.generate(model, ids, mask, max_new_tokens=16, do_sample=False, temperature=0.7,
                                           eos_token_id=[], return_entropy=True)
        prompts = [row[m.bool()].tolist() for row, m in zip(ids.cpu(), mask.cpu())]
        out["rollout"] = [(r.tokens, r.logprobs, r.entropy)
                          for r in rlkernels.rollout(model, prompts, **GPU_ROLLOUT)]
    return {k: _to_cpu(v) for k, v in out.items()}


def _to_cpu(value):
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


def _nccl_model_worker(rank: int, world: int, folder: str) -> None:
    from ...parallel._workers import nccl_group

    with nccl_group(rank, world, folder) as dev:
        full_weights = _gpu_model(dev).get_input_embeddings().weight.float().sum().item()
        model = rlkernels.tensor_parallel(_gpu_model(dev), dist.group.WORLD)
        out = _gpu_run(model, dev)
        out["weights"] = full_weights
        out["held"] = sum(p.numel() for p in model.parameters())
        torch.save(out, os.path.join(folder, f"rank{rank}.pt"))


def _raw(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.uint8) if x.is_floating_point() else x


def _flat(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    return [t for v in value for t in _flat(v)]


@pytest.mark.gpu
@pytest.mark.parametrize("world", (2, 4, 8))
def test_nccl_qwen3_1p7b_shape_is_the_one_gpu_layouts_bits(world):
    from ...parallel._workers import run_nccl_world

    ranks = run_nccl_world(world, _nccl_model_worker)
    dev = torch.device("cuda", 0)
    model = rlkernels.tensor_parallel(_gpu_model(dev), None)
    whole = sum(p.numel() for p in model.parameters())
    want = _gpu_run(model, dev)
    del model
    assert want["score"][0].std() > 0.1  # uncertain draws: the log-probs are not all ~0
    for rank, out in enumerate(ranks):
        assert out["weights"] == want["weights"], rank  # the same model was built on every rank
        # Each rank holds its shard: ~1/t of the projections and the (tied) embedding.
        assert out["held"] < whole / world * 1.1, (rank, out["held"], whole)
        for key in ("score", "generate", "greedy", "rollout"):
            got, ref = _flat(out[key]), _flat(want[key])
            assert len(got) == len(ref)
            for g, r in zip(got, ref):
                assert g.shape == r.shape and torch.equal(_raw(g), _raw(r)), (world, rank, key)
