"""patch_model on tiny HF causal LMs built from configs (no download): the swapped modules,
compilation, and Hugging Face's own generate drawing from the fp32 logits."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import rlkernels  # noqa: E402
from rlkernels.integrations.aten_mode import set_batch_invariant_mode  # noqa: E402
from rlkernels.integrations.hf import patch_model, token_logprobs  # noqa: E402
from rlkernels.nn import RMSNorm  # noqa: E402

from ._models import _tiny  # noqa: E402


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
def test_patch_model_swaps_modules_and_shares_params(arch):
    model = _tiny(arch)
    params = {n: p for n, p in model.named_parameters()}
    assert patch_model(model) is model
    mods = list(model.modules())
    assert not any(type(m) is torch.nn.Linear for m in mods)
    assert any(isinstance(m, rlkernels.Linear) for m in mods)
    assert not any(type(m).__name__.endswith("RMSNorm") and not isinstance(m, RMSNorm) for m in mods)
    for n, p in model.named_parameters():
        assert p is params[n]
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied embeddings stay tied
    assert model.config._attn_implementation == "rlkernels"


def test_a_compiled_patched_model_gives_the_eager_bits():
    import copy

    model = patch_model(_tiny("qwen3", intermediate_size=67))
    ids = torch.randint(0, 300, (3, 29), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        eager = model(ids).logits
        compiled = torch.compile(model)(ids).logits
    assert torch.equal(eager, compiled)
    assert model.generation_config.disable_compile
    # A copy (a reference policy, say) runs its own weights, not the original's.
    ref = copy.deepcopy(model)
    with torch.no_grad():
        ref.model.embed_tokens.weight.mul_(2)
        assert not torch.equal(ref(ids).logits, eager) and torch.equal(model(ids).logits, eager)


@pytest.mark.gpu
def test_compile_and_static_cache_generate_keep_the_bits_gpu():
    model = _tiny("qwen3", dtype=torch.bfloat16, device="cuda", hidden_size=1024, intermediate_size=2816,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=64, vocab_size=32000)
    model.generation_config.pad_token_id = 0
    ids = torch.randint(1, 32000, (4, 40), generator=torch.Generator().manual_seed(1)).cuda()
    decoder = model.model
    with torch.no_grad():
        # The control: inductor's fused elementwise code rounds otherwise than the eager ops.
        stock_eager = decoder(ids).last_hidden_state
        stock_compiled = torch.compile(lambda x: decoder(x).last_hidden_state)(ids)
        assert not torch.equal(stock_eager, stock_compiled)
        patch_model(model)
        eager = model(ids).logits
        assert torch.equal(eager, torch.compile(model)(ids).logits)
        kw = dict(max_new_tokens=12, do_sample=False, output_scores=True, return_dict_in_generate=True)
        dynamic = model.generate(ids, **kw)
        static = model.generate(ids, cache_implementation="static", **kw)
    assert torch.equal(dynamic.sequences, static.sequences)
    assert all(torch.equal(a, b) for a, b in zip(dynamic.scores, static.scores))


def _scaled_patched_qwen3(dtype, device="cpu", **over):
    """A patched tiny Qwen3 whose head gives a trained model's logit scale (std ~6)."""
    model = _tiny("qwen3", dtype=dtype, device=device, tie_word_embeddings=False, **over)
    ids = torch.randint(1, model.config.vocab_size, (4, 9), generator=torch.Generator().manual_seed(3)).to(device)
    with torch.no_grad():
        h = model.model(ids).last_hidden_state
        model.lm_head.weight.mul_(6.0 / (h @ model.lm_head.weight.T).float().std())
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    patch_model(model)
    return model, ids


def test_hugging_faces_own_generate_draws_from_the_fp32_logits():
    # A trained model's logit scale (std ~6), where rounding logits to bf16 moves the argmax
    # of near-ties and probabilities by percents.
    model, ids = _scaled_patched_qwen3(torch.bfloat16)
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.dtype == torch.float32 and not torch.equal(logits, logits.bfloat16().float())
    hf = model.generate(ids, max_new_tokens=12, do_sample=False)
    ours, _ = rlkernels.generate(model, ids, max_new_tokens=12)
    assert torch.equal(hf, ours)


def _hf_scores_match_token_logprobs(model, ids, **sampling):
    """Hugging Face's own generate: log_softmax of its scores (logits / T) under the mode,
    at the drawn tokens, against token_logprobs of the sequences (bits)."""
    temperature = sampling.get("temperature", 1.0)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, output_scores=True, return_dict_in_generate=True, **sampling)
        new = out.sequences[:, ids.shape[1]:]
        with set_batch_invariant_mode(True):
            hf = torch.stack([torch.log_softmax(s, -1).gather(1, new[:, i:i + 1])[:, 0]
                              for i, s in enumerate(out.scores)], dim=1)
        stock = torch.stack([torch.log_softmax(s, -1).gather(1, new[:, i:i + 1])[:, 0]
                             for i, s in enumerate(out.scores)], dim=1)
    ours = token_logprobs(model, out.sequences, temperature=temperature)[:, ids.shape[1] - 1:]
    return torch.equal(hf.view(torch.int32), ours.view(torch.int32)), \
        torch.equal(stock.view(torch.int32), ours.view(torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_log_softmax_of_hugging_faces_scores_is_token_logprobs(dtype):
    model, ids = _scaled_patched_qwen3(dtype)
    equal, stock_equal = _hf_scores_match_token_logprobs(model, ids, do_sample=False)
    assert equal and not stock_equal  # the control: ATen's log_softmax sums in another order
    torch.manual_seed(5)
    equal, _ = _hf_scores_match_token_logprobs(model, ids, do_sample=True, temperature=0.7, top_k=0)
    assert equal


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_log_softmax_of_hugging_faces_scores_is_token_logprobs_gpu(dtype):
    model, ids = _scaled_patched_qwen3(dtype, "cuda", hidden_size=1024, intermediate_size=2816,
                                       num_attention_heads=16, num_key_value_heads=8, head_dim=64,
                                       vocab_size=151936)
    equal, stock_equal = _hf_scores_match_token_logprobs(model, ids, do_sample=False)
    assert equal and not stock_equal
    torch.manual_seed(5)
    equal, _ = _hf_scores_match_token_logprobs(model, ids, do_sample=True, temperature=0.7, top_k=0)
    assert equal
