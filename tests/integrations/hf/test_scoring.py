"""token_logprobs / model_check on tiny HF causal LMs built from configs (no download)."""
from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

import rlkernels  # noqa: E402
from rlkernels.check import model as model_check  # noqa: E402
from rlkernels.integrations.aten_mode import is_batch_invariant_mode_enabled, set_batch_invariant_mode  # noqa: E402
from rlkernels.integrations.hf import patch_model, token_logprobs  # noqa: E402

from ._models import _tiny  # noqa: E402


def _seqs(n=5, lo=3, hi=20, vocab=300, seed=0):
    return model_check.draw_sequences(n, vocab, lo, hi, seed=seed)


def _four_ways(model, seqs, device="cpu"):
    scorer = model_check.RlkernelsScorer(model)
    ways, _ = model_check.score_four_ways(scorer, seqs, torch.device(device), micro_batch=2, seed=3,
                                          advance=lambda k: None)
    return model_check.compare("rlkernels", ways, 0.0), ways


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
def test_four_ways_bitwise(arch):
    model = patch_model(_tiny(arch))
    res, ways = _four_ways(model, _seqs())
    assert res.tokens > 0 and res.equal_all == res.tokens, res.as_dict()
    assert not is_batch_invariant_mode_enabled()  # token_logprobs restores the mode


def test_left_padding_bitwise_on_cpu():
    # The CPU chain ignores zeros at either end, so left padding is invariant here too.
    model = patch_model(_tiny("qwen3"))
    seqs = _seqs(4)
    L = max(len(s) for s in seqs)
    ids = torch.zeros(4, L, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, L - len(s):], mask[i, L - len(s):] = s, 1
    with torch.no_grad():
        left = token_logprobs(model, ids, mask)
        for i, s in enumerate(seqs):
            one = token_logprobs(model, s[None])[0]
            assert torch.equal(left[i, L - len(s):], one)
            assert torch.equal(left[i, :L - len(s)], torch.zeros(L - len(s)))


def test_token_logprobs_shape_masking_and_values():
    model = _tiny("qwen3")
    seqs = _seqs(3)
    ids, mask = model_check._right_pad(seqs, torch.device("cpu"))
    with torch.no_grad():
        stock = model_check.StockScorer(model).batch(ids, mask)
        patch_model(model)
        lp, ent = token_logprobs(model, ids, mask, return_entropy=True)
        hot = token_logprobs(model, ids, mask, temperature=0.7)
    B, L = ids.shape
    assert lp.shape == ent.shape == hot.shape == (B, L - 1) and lp.dtype == torch.float32
    for i, s in enumerate(seqs):
        n = len(s)
        assert torch.equal(lp[i, n - 1:], torch.zeros(L - n)) and torch.equal(ent[i, n - 1:], torch.zeros(L - n))
        assert (lp[i, :n - 1] < 0).all() and (ent[i, :n - 1] > 0).all()
    assert (lp - stock).abs().max() < 1e-4  # same model, same math up to rounding
    assert not torch.equal(hot, lp)
    assert token_logprobs(model, ids[:, :1]).shape == (B, 0)
    with pytest.raises(ValueError):
        token_logprobs(model, ids[0])


def test_backward_through_patched_model():
    model = patch_model(_tiny("qwen3"))
    ids, mask = model_check._right_pad(_seqs(3), torch.device("cpu"))
    lp = token_logprobs(model, ids, mask)
    lp.sum().backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


def _input_grads(model, ids, mask):
    """d(sum of token log-probs)/d(input embeddings): every backward formula of the model in play."""
    from rlkernels.integrations.hf.scoring import logprobs_from_hidden, next_token_targets, positions_from_mask

    emb = model.model.embed_tokens(ids).detach().requires_grad_()
    h = model.model(inputs_embeds=emb, attention_mask=mask, position_ids=positions_from_mask(mask)).last_hidden_state
    lp = logprobs_from_hidden(model, h[:, :-1], next_token_targets(ids, mask))
    (g,) = torch.autograd.grad(lp.sum(), emb)
    return g


def _backward_invariance(model, seqs, device):
    ids, mask = model_check._right_pad(seqs, torch.device(device))
    with set_batch_invariant_mode():
        batched = _input_grads(model, ids, mask)
        for i, s in enumerate(seqs):
            one = _input_grads(model, s[None].to(device), torch.ones(1, len(s), dtype=torch.long, device=device))
            assert torch.equal(one[0], batched[i, :len(s)]), f"sequence {i}"


def test_backward_bitwise_under_mode():
    # Attention's bmm/softmax backward and silu backward go through the overrides only while
    # the mode is on: run backward inside it too.
    _backward_invariance(patch_model(_tiny("qwen3")), _seqs(4), "cpu")


def test_model_check_run_cpu(tmp_path, capsys):
    out = tmp_path / "check.json"
    threads = torch.get_num_threads()
    report = model_check.run("cpu", None, 4, None, str(out))
    assert report["ok"] is True and torch.get_num_threads() == threads
    data = json.loads(out.read_text())
    assert data["ok"] and data["dtype"] == "float32"
    ours = [r for r in data["results"] if r["implementation"] == "rlkernels"][0]
    assert ours["bitwise_equal_fraction"] == 1.0 and ours["max_abs_logprob_diff"] == 0.0
    # At a trained model's logit scale a bf16-logit sampler draws from another distribution.
    gap = data["sampler_gap"]
    assert gap["logit_std"] > 5 and gap["stock_kl_max"] > 0 and gap["stock_max_abs_dlogp_at_drawn"] > 1e-3
    assert gap["rlkernels_logp_bitwise_linear_logprob"] is True
    assert "sampling distribution vs the trainer's" in capsys.readouterr().out


def test_tiny_config_is_packaged():
    cfg = json.load(open(model_check.tiny_config_path()))
    assert cfg["model_type"] == "qwen3"


GPU_SIZES = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=4, vocab_size=8192)


def _gpu_model(arch: str):
    return _tiny(arch, dtype=torch.bfloat16, device="cuda", **GPU_SIZES)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
def test_four_ways_bitwise_gpu_bf16(arch):
    model = patch_model(_gpu_model(arch))
    res, _ = _four_ways(model, _seqs(12, 8, 200, vocab=8192), device="cuda")
    assert res.equal_all == res.tokens, res.as_dict()


@pytest.mark.gpu
def test_model_check_run_gpu(tmp_path):
    report = model_check.run("cuda", "bfloat16", 16, None, str(tmp_path / "gpu.json"), max_len=256,
                         config_overrides=dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                                               num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                                               vocab_size=8192))
    assert report["ok"] is True


@pytest.mark.gpu
def test_backward_bitwise_under_mode_gpu_bf16():
    _backward_invariance(patch_model(_gpu_model("qwen3")), _seqs(4, 8, 120, vocab=8192), "cuda")


@pytest.mark.gpu
def test_backward_gpu_bf16_runs():
    model = patch_model(_gpu_model("qwen3"))
    seqs = _seqs(4, 8, 64, vocab=8192)
    ids, mask = model_check._right_pad(seqs, torch.device("cuda"))
    with set_batch_invariant_mode():
        lp = token_logprobs(model, ids, mask)
        lp.sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad.float()).all() for p in model.parameters())


def test_token_logprobs_warns_on_non_eager_attention():
    model = _tiny("qwen3", attn_implementation="sdpa")
    ids = torch.randint(3, 300, (2, 6))
    with pytest.warns(UserWarning, match="not batch-invariant"), torch.no_grad():
        token_logprobs(model, ids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_token_logprobs_empty_batch(dtype):
    model = patch_model(_tiny("qwen3", dtype=dtype))
    ids = torch.zeros(0, 7, dtype=torch.long)
    lp, ent = token_logprobs(model, ids, torch.ones_like(ids), return_entropy=True)
    want = token_logprobs(model, torch.randint(0, 300, (1, 7)))
    assert lp.shape == ent.shape == (0, 6) and lp.dtype == ent.dtype == want.dtype
    lp.sum().backward()  # an empty micro-batch contributes zero gradient, not an error
    assert torch.equal(model.lm_head.weight.grad, torch.zeros_like(model.lm_head.weight))


@pytest.mark.parametrize("bad,where", [(300, (1, 4)), (-1, (0, 2)), (10 ** 6, (1, 0))])
def test_token_logprobs_rejects_ids_outside_the_vocab(bad, where):
    model = patch_model(_tiny("llama"))
    ids = torch.randint(0, 300, (2, 6), generator=torch.Generator().manual_seed(0))
    ids[where] = bad
    ids[1, 5] = 301  # a later bad id: the first one (row-major) is named
    b, i = where
    with pytest.raises(ValueError, match=rf"rlkernels\.token_logprobs: input_ids\[{b}, {i}\] = {bad} is outside "
                                         rf"the model's vocabulary \[0, 300\) \(first bad id, at batch {b}, "
                                         rf"index {i}\)"):
        token_logprobs(model, ids)


def test_a_patched_model_gives_the_same_bits_with_the_mode_on_or_off():
    # An intermediate size that is no multiple of the CPU's vector width: ATen's silu
    # rounds the tail differently, the mode's chain does not.
    model = patch_model(_tiny("qwen3", intermediate_size=67))
    assert rlkernels.is_patched(model)
    ids = torch.randint(0, 300, (3, 29), generator=torch.Generator().manual_seed(5))
    off = token_logprobs(model, ids, return_entropy=True, batch_invariant=False)
    on = token_logprobs(model, ids, return_entropy=True, batch_invariant=True)
    assert all(torch.equal(a, b) for a, b in zip(off, on))
