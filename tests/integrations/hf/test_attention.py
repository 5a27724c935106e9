"""The "rlkernels" HF attention and the sampler-side ``generate``: rollout and trainer log-probs agree bit for bit."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import rlkernels  # noqa: E402
from rlkernels.integrations.hf import attention  # noqa: E402
from rlkernels.integrations.hf import patch_model, token_logprobs  # noqa: E402
from rlkernels.integrations.hf.scoring import hidden_states  # noqa: E402
from rlkernels.integrations.hf.coverage import cache_kwargs  # noqa: E402

from ._models import _tiny  # noqa: E402

TEMPERATURE = 0.9
# Large enough that stock CPU attention gives padded rows other bits than alone (the controls).
STOCK_DIFFERS = dict(hidden_size=256, intermediate_size=512)


def _prompts(lengths=(5, 11, 3, 8), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 300, (n,), generator=g) for n in lengths]


def _pad(seqs, left: bool):
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        sl = slice(width - len(s), width) if left else slice(0, len(s))
        ids[i, sl], mask[i, sl] = s, 1
    return ids, mask


def _model(arch, patched=True, **over):
    model = _tiny(arch, **over)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return patch_model(model) if patched else model


def _rows(lp, seqs, left, width):
    """Each sequence's own scored positions out of a padded batch's [B, width - 1] log-probs."""
    return [lp[i, width - len(s):width - 1] if left else lp[i, :len(s) - 1] for i, s in enumerate(seqs)]


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_patched_model_alone_padded_and_packed_are_bitwise_equal(arch):
    model = _model(arch)
    seqs = _prompts((5, 11, 3, 8, 1, 13))
    alone = [token_logprobs(model, s[None])[0] for s in seqs]
    for left in (True, False):
        ids, mask = _pad(seqs, left)
        got = _rows(token_logprobs(model, ids, mask), seqs, left, ids.shape[1])
        for a, b in zip(alone, got):
            assert torch.equal(a, b), ("left" if left else "right")
    # Packed: one row, position_ids restarting at 0 (as trainers pack); hidden states compared.
    packed = torch.cat(seqs)[None]
    positions = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    assert not rlkernels.is_batch_invariant_mode_enabled()
    h_packed = hidden_states(model, packed, position_ids=positions)[0]
    start = 0
    for s in seqs:
        h_alone = hidden_states(model, s[None])[0]
        assert torch.equal(h_packed[start:start + len(s)], h_alone)
        start += len(s)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_a_patched_model_runs_without_the_mode_and_an_unpatched_one_under_it(arch):
    # A patched model's forward is invariant as it is (the test above runs it so): no
    # Python override per ATen call. Anything left unpatched puts the decoder under the mode.
    seen: list[bool] = []
    ids, mask = _pad(_prompts((5, 9)), left=True)
    for patched in (True, False):
        model = _model(arch, patched=patched)
        assert rlkernels.is_patched(model) is patched
        hook = model.model.layers[0].register_forward_hook(
            lambda *_: seen.append(rlkernels.is_batch_invariant_mode_enabled()))
        token_logprobs(model, ids, mask)
        rlkernels.generate(model, ids, mask, max_new_tokens=2)
        token_logprobs(model, ids, mask, batch_invariant=True)
        hook.remove()
    # token_logprobs, generate (a prefill and one decode step), token_logprobs forced under the mode
    assert seen == [False, False, False, True] + [True] * 4
    model = _model(arch)
    model.model.layers[0].mlp.up_proj = torch.nn.Linear(8, 8)  # one module left stock
    assert not rlkernels.is_patched(model)


@pytest.mark.filterwarnings("ignore:.*not batch-invariant")
def test_eager_attention_is_not_left_padding_invariant():
    # Why the model needs its own attention: with eager attention (even under the mode)
    # or SDPA, a left-padded row's scores are not the row's scores alone.
    # At hidden size 32 the CPU kernels happen to give the padded rows the alone bits; at 256
    # (head dim 64) they do not, as at real sizes.
    seqs = _prompts((5, 11, 3, 8, 1, 13, 40, 77))
    ids, mask = _pad(seqs, left=True)
    differ = 0
    for impl in ("eager", "sdpa"):
        model = patch_model(_tiny("llama", attn_implementation=impl, **STOCK_DIFFERS),
                            attn_implementation=impl)
        got = _rows(token_logprobs(model, ids, mask), seqs, True, ids.shape[1])
        differ += sum(not torch.equal(token_logprobs(model, s[None])[0], g) for s, g in zip(seqs, got))
    assert differ > 0


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("sample", [False, True])
def test_generate_logprobs_are_the_trainers_bit_for_bit(arch, sample):
    model = _model(arch)
    prompts = _prompts()
    ids, mask = _pad(prompts, left=True)
    torch.manual_seed(1)
    seq, lp, ent = rlkernels.generate(model, ids, mask, max_new_tokens=6, do_sample=sample,
                                      temperature=TEMPERATURE, return_entropy=True)
    width, steps = ids.shape[1], seq.shape[1] - ids.shape[1]
    assert steps == 6 and lp.shape == ent.shape == (len(prompts), steps) and lp.dtype == torch.float32
    finished = [torch.cat([p, seq[i, width:]]) for i, p in enumerate(prompts)]
    # The trainer, one sequence at a time ...
    for i, f in enumerate(finished):
        t_lp, t_ent = token_logprobs(model, f[None], temperature=TEMPERATURE, return_entropy=True)
        assert torch.equal(t_lp[0, len(prompts[i]) - 1:], lp[i])
        assert torch.equal(t_ent[0, len(prompts[i]) - 1:], ent[i])
    # ... and batched, left- and right-padded.
    for left in (True, False):
        b_ids, b_mask = _pad(finished, left)
        rows = _rows(token_logprobs(model, b_ids, b_mask, temperature=TEMPERATURE), finished, left, b_ids.shape[1])
        for i, r in enumerate(rows):
            assert torch.equal(r[len(prompts[i]) - 1:], lp[i])


def test_stock_sampler_and_trainer_disagree():
    # The same comparison on the unpatched model (SDPA): the rollout's log-probs are not
    # the trainer's for every token (so the test above can fail).
    model = _model("qwen3", patched=False, **STOCK_DIFFERS)
    prompts = _prompts()
    ids, mask = _pad(prompts, left=True)
    # Both sides warn that an unpatched model's SDPA is not invariant (generate once did not).
    with pytest.warns(UserWarning, match=r"rlkernels.generate: attention implementation 'sdpa' is not batch-inv"):
        seq, lp = rlkernels.generate(model, ids, mask, max_new_tokens=6, temperature=TEMPERATURE)
    full = torch.cat([mask, torch.ones(len(prompts), seq.shape[1] - ids.shape[1], dtype=mask.dtype)], 1)
    with pytest.warns(UserWarning, match="rlkernels.token_logprobs: attention implementation 'sdpa' is not"):
        trainer = token_logprobs(model, seq, full, temperature=TEMPERATURE)
    assert not torch.equal(trainer[:, ids.shape[1] - 1:], lp)


def test_generate_masks_tokens_after_eos_and_refuses_beam_search():
    model = _model("qwen3")
    prompts = _prompts((4, 6))
    ids, mask = _pad(prompts, left=True)
    seq, lp = rlkernels.generate(model, ids, mask, max_new_tokens=5)
    eos = int(seq[0, ids.shape[1] + 1])  # the second new token of row 0 plays EOS
    model.generation_config.eos_token_id = eos
    seq2, lp2 = rlkernels.generate(model, ids, mask, max_new_tokens=5)
    new = seq2[0, ids.shape[1]:]
    first = int((new == eos).nonzero()[0, 0])
    assert (lp2[0, first + 1:] == 0).all() and (lp2[0, :first + 1] != 0).all()
    with pytest.raises(ValueError, match="num_beams=2 is not supported"):
        rlkernels.generate(model, ids, mask, max_new_tokens=2, num_beams=2)
    with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
        rlkernels.generate(model, ids, mask, temperature=0)


def test_attention_refuses_what_it_does_not_compute():
    model = _model("qwen3")
    attn = model.model.layers[0].self_attn
    q, k = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8)
    with pytest.raises(ValueError, match="sliding_window must be a positive int, got 0"):
        attention.rlkernels_attention_forward(attn, q, k, k, None, sliding_window=0)
    # Gemma 2's softcap is passed to the kernels: the op's bits, not the uncapped ones.
    capped, _ = attention.rlkernels_attention_forward(attn, 4 * q, k, k, None, softcap=2.0)
    want = rlkernels.ops.attention.flash_attn_func(4 * q.transpose(1, 2), k.transpose(1, 2), k.transpose(1, 2),
                                                   softcap=2.0)
    assert torch.equal(capped, want) and not torch.allclose(capped, attention.rlkernels_attention_forward(
        attn, 4 * q, k, k, None)[0], atol=1e-3)
    attn.train()
    with pytest.raises(ValueError, match="attention dropout"):
        attention.rlkernels_attention_forward(attn, q, k, k, None, dropout=0.1)
    attn.eval()
    holes = torch.tensor([[1, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    with pytest.raises(ValueError, match="row 0 of the attention mask has padding between real tokens"):
        attention.rlkernels_attention_forward(attn, q, k, k, holes)


def test_mistral_with_its_default_sliding_window_is_exact_where_the_window_holds_every_key():
    model = _tiny("mistral", tie_word_embeddings=False)
    assert model.config.sliding_window == 4096  # what MistralConfig and Mistral-7B ship
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)  # a trained model's logit spread
    rlkernels.patch_model(model)
    assert rlkernels.is_patched(model)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(1, model.config.vocab_size, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    logp = token_logprobs(model, ids, mask)
    seq, lp = rlkernels.generate(model, ids, mask, max_new_tokens=4, do_sample=True, seed=3)
    samples = rlkernels.rollout(model, [ids[0], ids[1, 5:]], max_new_tokens=4, seed=3, eos_token_id=[])
    model.config.sliding_window = None  # the window holds every key: without it, the same bits
    try:
        assert torch.equal(token_logprobs(model, ids, mask), logp)
        seq0, lp0 = rlkernels.generate(model, ids, mask, max_new_tokens=4, do_sample=True, seed=3)
        assert torch.equal(seq0, seq) and torch.equal(lp0, lp)
        assert torch.equal(samples[0].tokens, seq[0, 12:]) and torch.equal(samples[0].logprobs, lp[0])
    finally:
        model.config.sliding_window = 4096


def test_a_window_shorter_than_the_sequence_keeps_sampler_and_trainer_equal():
    # Mistral with a window of 8 over 12-token prompts and 6 new tokens: the window hides keys
    # in the prompt, in generate's static cache and in rollout's slot cache.
    model = _tiny("mistral", tie_word_embeddings=False, sliding_window=8)
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)
    rlkernels.patch_model(model)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, model.config.vocab_size, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding: positions count from the first real token
    seq, lp = rlkernels.generate(model, ids, mask, max_new_tokens=6, do_sample=True, seed=3, eos_token_id=[])
    full_mask = torch.cat([mask, torch.ones(3, 6, dtype=mask.dtype)], 1)
    assert torch.equal(token_logprobs(model, seq, full_mask)[:, 11:], lp)
    alone = rlkernels.generate(model, ids[1:2, 5:], max_new_tokens=6, do_sample=True, seed=3, eos_token_id=[],
                               streams=torch.tensor([1]))
    assert torch.equal(alone[0][0, 7:], seq[1, 12:]) and torch.equal(alone[1][0], lp[1])
    samples = rlkernels.rollout(model, [ids[0], ids[1, 5:]], max_new_tokens=6, seed=3, eos_token_id=[])
    assert torch.equal(samples[1].tokens, seq[1, 12:]) and torch.equal(samples[1].logprobs, lp[1])
    # Hugging Face's own generate keeps every key (own_generate) and gives the greedy decode's
    # tokens, left-padded rows included; transformers' rolling cache, passed in, keeps the last
    # 7 keys only: refused once it drops one.
    greedy, _ = rlkernels.generate(model, ids, mask, max_new_tokens=6, do_sample=False, eos_token_id=[])
    theirs = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, eos_token_id=None,
                            pad_token_id=0)
    assert torch.equal(theirs[:, 12:], greedy[:, 12:])
    rolling = transformers.DynamicCache(config=model.config)
    with pytest.raises(ValueError, match="the cache has dropped its first"):
        model.generate(ids[:1], max_new_tokens=3, do_sample=False, **cache_kwargs(model, rolling))


def test_registered_for_from_config_and_set_attn_implementation():
    attention.register()
    model = _tiny("qwen3")
    model.set_attn_implementation("rlkernels")
    assert model.config._attn_implementation == "rlkernels"
    ids = torch.randint(1, 300, (2, 7))
    out = model(ids).logits
    assert out.shape == (2, 7, 300) and torch.isfinite(out).all()


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_generate_logprobs_are_the_trainers_bit_for_bit_gpu(arch):
    # bf16 on CUDA, hidden 1024: wide enough for stock kernels to drift.
    model = _tiny(arch, dtype=torch.bfloat16, device="cuda", hidden_size=1024, intermediate_size=2816,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=64, vocab_size=32000)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    patch_model(model)
    prompts = [p.cuda() for p in _prompts((37, 120, 5, 64, 1, 99))]
    ids, mask = _pad([p.cpu() for p in prompts], left=True)
    ids, mask = ids.cuda(), mask.cuda()
    torch.manual_seed(2)
    seq, lp = rlkernels.generate(model, ids, mask, max_new_tokens=16, do_sample=True, temperature=TEMPERATURE)
    width = ids.shape[1]
    finished = [torch.cat([p, seq[i, width:]]) for i, p in enumerate(prompts)]
    for i, f in enumerate(finished):
        assert torch.equal(token_logprobs(model, f[None], temperature=TEMPERATURE)[0, len(prompts[i]) - 1:], lp[i])
    for left in (True, False):
        b_ids, b_mask = _pad([f.cpu() for f in finished], left)
        rows = _rows(token_logprobs(model, b_ids.cuda(), b_mask.cuda(), temperature=TEMPERATURE), finished, left,
                     b_ids.shape[1])
        for i, r in enumerate(rows):
            assert torch.equal(r[len(prompts[i]) - 1:], lp[i])


def _gemma3_gpu() -> torch.nn.Module:
    """Gemma-3-1B's layer shape (hidden 1152, 4 query heads over 1 KV head of 256, MLP 6912,
    five sliding layers to one full), six layers, vocabulary 32000, a window of 64."""
    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(
        vocab_size=32000, hidden_size=1152, intermediate_size=6912, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, sliding_window=64, query_pre_attn_scalar=256,
        layer_types=["sliding_attention"] * 5 + ["full_attention"], tie_word_embeddings=False)
    return transformers.Gemma3ForCausalLM(config).to(device="cuda", dtype=torch.bfloat16).eval()


def _gemma2_gpu() -> torch.nn.Module:
    """Gemma-2-2B's attention and head (8 query heads over 4 KV heads of 256, scores capped at
    50, final logits at 30, every other layer windowed), hidden 1152, four layers, vocabulary
    32000, a window of 64."""
    torch.manual_seed(0)
    config = transformers.Gemma2Config(
        vocab_size=32000, hidden_size=1152, intermediate_size=4608, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, head_dim=256, sliding_window=64, query_pre_attn_scalar=256,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, tie_word_embeddings=False)
    return transformers.Gemma2ForCausalLM(config).to(device="cuda", dtype=torch.bfloat16).eval()


def _gpt_oss_gpu() -> torch.nn.Module:
    """GPT-OSS-20B's layer shape (hidden 2880, 64 query heads over 8 KV heads of 64, sinks, 32
    biased experts of 2880, top 4), two layers, the first windowed, vocabulary 32000, a window of 64."""
    torch.manual_seed(0)
    config = transformers.GptOssConfig(
        vocab_size=32000, hidden_size=2880, intermediate_size=2880, num_hidden_layers=2, num_attention_heads=64,
        num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4, sliding_window=64,
        layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False)
    model = transformers.GptOssForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("sinks", "bias")):
                p.normal_(0.0, 0.5)  # initialised to zeros or near them
    return model.to(device="cuda", dtype=torch.bfloat16).eval()


def _cohere_gpu() -> torch.nn.Module:
    """A Command-R-like shape (hidden 2048, 16 query heads over 4 KV heads of 128, per-head q/k
    LayerNorms, the parallel block, logits scaled by 1/16), four layers, vocabulary 32000."""
    torch.manual_seed(0)
    config = transformers.CohereConfig(
        vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=4, num_attention_heads=16,
        num_key_value_heads=4, use_qk_norm=True, logit_scale=0.0625, tie_word_embeddings=False)
    model = transformers.CohereForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
        model.lm_head.weight.mul_(16.0)  # the scale's 1/16 undone: a trained model's spread below
    return model.to(device="cuda", dtype=torch.bfloat16).eval()


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["mistral", "gemma3", "gemma2", "gpt_oss", "cohere"])
def test_a_sliding_window_keeps_graphed_generate_rollout_and_trainer_equal_gpu(family):
    # bf16, a window of 64 under prompts of up to 120 tokens and 40 new ones: Mistral's shape
    # (every layer windowed), Gemma 3's (head dim 256, one KV head, 5 windowed layers to 1),
    # Gemma 2's (its scores and its final logits soft-capped), GPT-OSS's (sinks, its MoE
    # experts) and Cohere's (no window: its LayerNorms, parallel block and logit scale).
    if family == "gemma3":
        model = _gemma3_gpu()
    elif family == "gemma2":
        model = _gemma2_gpu()
    elif family == "gpt_oss":
        model = _gpt_oss_gpu()
    elif family == "cohere":
        model = _cohere_gpu()
    else:
        model = _tiny("mistral", dtype=torch.bfloat16, device="cuda", hidden_size=1024, intermediate_size=2816,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=64, vocab_size=32000,
                      sliding_window=64, tie_word_embeddings=False)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # a trained model's logit spread
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    patch_model(model)
    assert rlkernels.is_patched(model)
    prompts = [p.cuda() for p in _prompts((37, 120, 5, 64, 1, 99))]
    ids, mask = _pad([p.cpu() for p in prompts], left=True)
    ids, mask = ids.cuda(), mask.cuda()
    kw = dict(max_new_tokens=40, do_sample=True, temperature=TEMPERATURE, seed=5)
    seq, lp = rlkernels.generate(model, ids, mask, cuda_graph=False, **kw)
    seq_g, lp_g = rlkernels.generate(model, ids, mask, cuda_graph=True, **kw)
    assert torch.equal(seq, seq_g) and torch.equal(lp, lp_g)
    width = ids.shape[1]
    for i, p in enumerate(prompts):
        row = torch.cat([p, seq[i, width:]])
        assert torch.equal(token_logprobs(model, row[None], temperature=TEMPERATURE)[0, len(p) - 1:], lp[i]), i
    samples = rlkernels.rollout(model, prompts, n=2, max_batch=4, cuda_graph=True, **kw)
    for r in samples[::3]:
        alone = rlkernels.generate(model, prompts[r.prompt][None], streams=torch.tensor([r.stream]).cuda(), **kw)
        assert torch.equal(r.tokens, alone[0][0, len(prompts[r.prompt]):]) and torch.equal(r.logprobs, alone[1][0])


def test_mask_hook_hands_the_first_query_slot_through():
    # transformers 5.x passes q_offset (an int, or a static cache's device counter, copied
    # before the first layer's update advances it); 4.x passes cache_position instead.
    # Where the queries are the last keys the mask goes through as it came.
    hook = attention._pass_padding_mask
    mask = torch.ones(2, 9, dtype=torch.long)
    assert hook(attention_mask=mask) is mask
    assert hook(attention_mask=mask, q_offset=6, kv_length=9, q_length=3) is mask
    assert hook(attention_mask=None, q_offset=0, kv_length=4, q_length=4) is None
    counter = torch.tensor([5])
    got = hook(attention_mask=mask, q_offset=counter, kv_length=9, q_length=1)
    counter += 1
    assert got.shape == (2, 1, 1, 9) and got.dtype == torch.bool and bool(got.all())
    assert int(getattr(got, attention.Q_OFFSET)) == 5
    got = hook(attention_mask=mask, cache_position=torch.arange(6, 9))
    assert int(getattr(got, attention.Q_OFFSET)) == 6
    got = hook(attention_mask=None, q_offset=torch.tensor(2), batch_size=2, kv_length=9, q_length=3)
    assert got[:, 0, 0].tolist() == [[True] * 5 + [False] * 4] * 2


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_hugging_face_static_cache_generate_gives_the_dynamic_cache_bits(arch):
    # generate(cache_implementation="static"): attention sees every slot of the cache; the
    # queries' slot comes through the mask hook (it was taken as the last keys before).
    model = _model(arch)
    ids, mask = _pad(_prompts((5, 11, 3, 8)), left=True)
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0, output_scores=True,
              return_dict_in_generate=True)
    dynamic = model.generate(ids, **kw)
    static = model.generate(ids, cache_implementation="static", **kw)  # patch_model keeps it uncompiled
    assert torch.equal(dynamic.sequences, static.sequences)
    assert all(torch.equal(a, b) for a, b in zip(dynamic.scores, static.scores))
    # Without a mask the hook's mask is built from an expanded row; generate makes the mask
    # contiguous, which must not drop the queries' first slot.
    ids = ids[:, -3:]
    del kw["attention_mask"]
    dynamic, static = model.generate(ids, **kw), model.generate(ids, cache_implementation="static", **kw)
    assert torch.equal(dynamic.sequences, static.sequences)
    assert all(torch.equal(a, b) for a, b in zip(dynamic.scores, static.scores))


def test_a_hook_mask_copied_without_its_query_slot_is_refused():
    model = _model("llama")
    q, k = torch.zeros(2, 4, 3, 8), torch.zeros(2, 2, 9, 8)
    carrier = attention._pass_padding_mask(attention_mask=None, q_offset=torch.tensor(2), batch_size=2,
                                          kv_length=9, q_length=3)
    layer = model.model.layers[0].self_attn
    assert attention.rlkernels_attention_forward(layer, q, k, k, carrier)[0].shape == (2, 3, 4, 8)
    with pytest.raises(ValueError, match="without the queries' first slot"):
        attention.rlkernels_attention_forward(layer, q, k, k, carrier.clone())
