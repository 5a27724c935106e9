"""rlkernels.integrations.trainers.trl: TRL's GRPOTrainer on an rlkernels-patched policy.

Real GRPO steps on the CPU (a tiny random-weight Qwen3 from a config, a character
tokenizer built here, two prompts, a trivial reward; no download). With
``steps_per_generation=2`` TRL takes the "old" per-token log-probs right after
generation (no grad, the whole generation batch in chunks) and the training forward
re-scores the same completions in a shuffled half of that batch; the loss's
importance ratio is exp(new - old). Under rlkernels both are the same bits (ratio
exactly 1.0 on every token); under stock TRL on the same setup they are not. With
top_k / top_p the same holds for the truncated distribution the rollout drew from.
"""
from __future__ import annotations

import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

from rlkernels.integrations.trainers.trl import RLKGRPOTrainer, patch_grpo_trainer  # noqa: E402

CHARS = "abcdefghijklmnopqrstuvwxyz ?"
SPECIAL = ["<pad>", "<eos>", "<unk>"]
GROUP = 4


def _tokenizer():
    vocab = {t: i for i, t in enumerate(SPECIAL + list(CHARS))}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")  # one token per character
    tok.decoder = tokenizers.decoders.Fuse()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                                unk_token="<unk>", padding_side="left")


def _model(tokenizer, seed=0):
    config = transformers.Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
        tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None)
    torch.manual_seed(seed)
    return transformers.Qwen3ForCausalLM(config)


def _reward(completions, **kwargs):
    return [float(sum(c in "aeiou" for c in text)) for text in completions]


def _trainer(cls, tmp_path, *, max_steps=2, bf16=None, rollout=None, **over):
    tokenizer = _tokenizer()
    dataset = datasets.Dataset.from_dict({"prompt": ["what is the sky", "hi"]})
    args = trl.GRPOConfig(
        output_dir=str(tmp_path), use_cpu=True, seed=0, report_to="none", save_strategy="no", logging_steps=1,
        max_steps=max_steps, learning_rate=1e-3, per_device_train_batch_size=2, num_generations=GROUP,
        # One generation batch (2 prompts x GROUP completions) feeds two optimizer steps of two
        # micro-batches each, so TRL keeps the generation-time ("old") log-probs instead of
        # reusing the training forward's: the first step's two micro-batches score the same
        # policy the old log-probs came from, shuffled into other row pairings.
        steps_per_generation=4, gradient_accumulation_steps=2, max_completion_length=8, temperature=0.9,
        dataloader_num_workers=0, **({} if bf16 is None else {"bf16": bf16}),
        **(dict(top_k=0, top_p=1.0, beta=0.0) | over))
    return cls(model=_model(tokenizer), reward_funcs=_reward, args=args, train_dataset=dataset,
               processing_class=tokenizer, **({} if rollout is None else {"rollout": rollout}))


def _run_and_capture(trainer):
    """Train; for each loss computation, (old log-probs from generation, new from the training forward, mask)."""
    pairs = []
    inner_logps = trainer._get_per_token_logps_and_entropies
    inner_loss = trainer._compute_loss
    new = []

    def logps(*args, **kwargs):
        out = inner_logps(*args, **kwargs)
        if torch.is_grad_enabled():  # the training forward (generation-time scoring runs under no_grad)
            new.append(out[0].detach().clone())
        return out

    def compute_loss(model, inputs):
        new.clear()
        loss = inner_loss(model, inputs)
        assert len(new) == 1 and "old_per_token_logps" in inputs
        pairs.append((inputs["old_per_token_logps"].clone(), new[0], inputs["completion_mask"].bool()))
        return loss

    trainer._get_per_token_logps_and_entropies = logps
    trainer._compute_loss = compute_loss
    trainer.train()
    return pairs


def test_grpo_ratio_is_exactly_one_under_rlkernels(tmp_path):
    trainer = _trainer(RLKGRPOTrainer, tmp_path)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    pairs = _run_and_capture(trainer)
    assert len(pairs) == 4
    for old, new, mask in pairs[:2]:  # before the first optimizer step
        assert mask.any()
        assert torch.equal(new, old), f"max |new - old| = {(new - old).abs().max().item()}"
        ratio = torch.exp(new - old)[mask]
        assert torch.equal(ratio, torch.ones_like(ratio))
    # The steps trained: parameters moved, and the second step's ratio moved off 1.
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
    assert all(not torch.equal(new[mask], old[mask]) for old, new, mask in pairs[2:])


def test_completions_come_from_rollout_each_its_prompt_alone(tmp_path, monkeypatch):
    import copy

    import rlkernels
    from rlkernels.integrations.hf import continuous_batching

    trainer = _trainer(RLKGRPOTrainer, tmp_path, max_steps=1)
    initial = copy.deepcopy(trainer.model)  # the policy the first generation samples
    calls = []
    inner = continuous_batching.rollout

    def spy(model, prompts, **kwargs):
        out = inner(model, prompts, **kwargs)
        calls.append((prompts, kwargs, [s.tokens.clone() for s in out]))
        return out

    monkeypatch.setattr(continuous_batching, "rollout", spy)
    monkeypatch.setattr(trl.GRPOTrainer, "_generate_single_turn",
                        lambda *a, **k: pytest.fail("TRL's own generation ran"))
    trainer.train()
    assert len(calls) == 1
    prompts, kwargs, completions = calls[0]
    assert len(prompts) == 2 * GROUP and kwargs["temperature"] == 0.9 and kwargs["max_new_tokens"] == 8
    assert kwargs["streams"] == list(range(2 * GROUP))
    eos = trainer.processing_class.eos_token_id
    for prompt, stream, tokens in zip(prompts, kwargs["streams"], completions):
        seq, _ = rlkernels.generate(initial, torch.tensor([prompt]), seed=kwargs["seed"],
                                    streams=torch.tensor([stream]), temperature=0.9, max_new_tokens=8,
                                    do_sample=True, eos_token_id=eos)
        alone = seq[0, len(prompt):]
        ends = (alone == eos).nonzero()
        assert torch.equal(tokens, alone[:int(ends[0]) + 1] if ends.numel() else alone)
    # The GROUP samples of a prompt differ: one stream each.
    assert len({tuple(t.tolist()) for t in completions[:GROUP]}) > 1


def test_rollout_refuses_sampling_options_it_would_not_score(tmp_path):
    for name, value in (("min_p", 0.1), ("repetition_penalty", 1.1)):
        with pytest.raises(ValueError, match=rf"rlkernels.integrations.trainers.trl: {name}={value} is not "
                                             r"supported when completions come from rlkernels.rollout"):
            _trainer(RLKGRPOTrainer, tmp_path, **{name: value})
        # rollout=False keeps TRL's own generation, which takes them.
        assert _trainer(RLKGRPOTrainer, tmp_path, rollout=False, **{name: value}) is not None
    # A truncated rollout's kept sets are the policy's: a KL term to a reference model has none.
    trainer = _trainer(trl.GRPOTrainer, tmp_path, top_p=0.9)
    trainer.args.beta = 0.04  # (a trainer built with beta > 0 would load a reference model by name)
    with pytest.raises(ValueError, match=r"rlkernels.integrations.trainers.trl: top_k=0, top_p=0.9 with "
                                         r"beta=0.04: the KL term's reference log-probs have no kept set"):
        patch_grpo_trainer(trainer)
    with pytest.raises(ValueError, match=r"rlkernels.integrations.trainers.trl: top_p must lie in \(0, 1\]"):
        _trainer(RLKGRPOTrainer, tmp_path, top_p=1.5)


def test_top_k_and_top_p_train_the_kept_set_the_rollout_drew_from(tmp_path, monkeypatch):
    """With top_k / top_p, each completion's log-probs in TRL's loss -- the old ones scored after
    generation and the training forward's -- are those of the truncated distribution the
    rollout drew it from, bit for bit, so the first update's ratio is exactly 1; the
    untruncated log-probs of the same tokens differ."""
    import copy

    import rlkernels
    from rlkernels.integrations.hf import continuous_batching

    trainer = _trainer(RLKGRPOTrainer, tmp_path, top_k=12, top_p=0.8)
    with torch.no_grad():
        trainer.model.lm_head.weight.mul_(40.0)  # a trained model's logit scale (std ~5)
    initial = copy.deepcopy(trainer.model)
    drawn = {}  # (prompt, completion) -> (sampler log-probs, thresholds)
    inner = continuous_batching.rollout

    def spy(model, prompts, **kwargs):
        assert kwargs["top_k"] == 12 and kwargs["top_p"] == 0.8
        out = inner(model, prompts, **kwargs)
        for s in out:
            drawn[(tuple(prompts[s.prompt]), tuple(s.tokens.tolist()))] = (s.logprobs, s.thresholds)
        return out

    monkeypatch.setattr(continuous_batching, "rollout", spy)
    seen = []
    compute_loss = trainer._compute_loss

    def capture(model, inputs):
        seen.append({k: inputs[k].clone() for k in ("prompt_ids", "prompt_mask", "completion_ids",
                                                     "completion_mask", "old_per_token_logps", "logit_thresholds")})
        return compute_loss(model, inputs)

    trainer._compute_loss = capture
    pairs = _run_and_capture(trainer)
    assert len(seen) == 4 and len(pairs) == 4
    truncated = untruncated_differs = 0
    for batch, (old, new, mask) in zip(seen[:2], pairs[:2]):  # before the first optimizer step
        assert torch.equal(new, old)
        for i in range(old.shape[0]):
            prompt = batch["prompt_ids"][i][batch["prompt_mask"][i].bool()]
            keep = batch["completion_mask"][i].bool()
            tokens = batch["completion_ids"][i][keep]
            logprobs, thresholds = drawn[(tuple(prompt.tolist()), tuple(tokens.tolist()))]
            assert torch.equal(old[i][keep], logprobs)
            assert torch.equal(batch["logit_thresholds"][i][keep], thresholds)
            assert torch.isneginf(batch["logit_thresholds"][i][~keep]).all()
            truncated += int(torch.isfinite(thresholds).sum())
            seq = torch.cat([prompt, tokens])[None]
            raw = rlkernels.token_logprobs(initial, seq, temperature=0.9)[0, len(prompt) - 1:]
            untruncated_differs += int((raw != logprobs).sum())
    assert truncated > 0 and untruncated_differs > 0


def test_stock_grpo_on_the_same_setup(tmp_path):
    """Stock TRL, same setup. Inside TRL's own loop the old and new log-probs come out equal on
    this CPU case: TRL scores the old ones in chunks of the training micro-batch size, from
    the same padded tensors, and the CPU kernels' rows do not depend on the other rows at a
    fixed shape (measured: 0 of 26 completion tokens differ). The mismatch shows as soon
    as a sequence is scored in another layout, as a sampler sees it: alone, without the
    batch's left padding (stock: positions count the padding, and TRL's default bf16
    autocast rounds differently per shape), which rlkernels gives the same bits."""
    pairs = _run_and_capture(_trainer(trl.GRPOTrainer, tmp_path))
    deltas = torch.cat([(new - old)[mask] for old, new, mask in pairs[:2]])  # before the first update
    print(f"stock TRL {trl.__version__} in-loop: max |new - old| = {deltas.abs().max().item():.3g}, "
          f"{float((deltas != 0).double().mean()):.0%} of {deltas.numel()} completion tokens differ")

    stock, ours = _trainer(trl.GRPOTrainer, tmp_path), _trainer(RLKGRPOTrainer, tmp_path)
    ids, mask = _batch(stock.processing_class)
    keep = 2
    with torch.no_grad():
        batched = {t: t._get_per_token_logps_and_entropies(t.model, ids, mask, keep)[0] for t in (stock, ours)}
        alone = {t: torch.cat([t._get_per_token_logps_and_entropies(t.model, ids[i:i + 1, s:], mask[i:i + 1, s:],
                                                                     keep)[0]
                               for i, s in enumerate(mask.argmax(-1).tolist())]) for t in (stock, ours)}
    assert torch.equal(batched[ours], alone[ours])
    delta = batched[stock] - alone[stock]
    print(f"stock TRL {trl.__version__} alone vs batch: max |delta| = {delta.abs().max().item():.3g}, "
          f"{float((delta != 0).double().mean()):.0%} of {delta.numel()} tokens differ")
    assert not torch.equal(batched[stock], alone[stock])


def _batch(tokenizer):
    enc = tokenizer(["what is the sky", "hi a", "abcd", "z zz"], return_tensors="pt", padding=True)
    return enc["input_ids"], enc["attention_mask"]


def test_fused_forward_matches_stock_values_and_ignores_chunking(tmp_path):
    """The rlkernels log-probs are TRL's (fp32 stock, within rounding) and do not depend on TRL's batch_size chunks."""
    trainer = _trainer(RLKGRPOTrainer, tmp_path)
    stock = _trainer(trl.GRPOTrainer, tmp_path, bf16=False)
    ids, mask = _batch(trainer.processing_class)
    keep = 3
    with torch.no_grad():
        one, ent_one, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, keep,
                                                                     compute_entropy=True)
        chunked, ent_chunked, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, keep,
                                                                             batch_size=1, compute_entropy=True)
        ref, ent_ref, _ = stock._get_per_token_logps_and_entropies(stock.model, ids, mask, keep,
                                                                   compute_entropy=True)
    assert one.shape == (4, keep) and one.dtype == torch.float32
    assert torch.equal(one, chunked) and torch.equal(ent_one, ent_chunked)
    torch.testing.assert_close(one, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent_one, ent_ref, rtol=1e-5, atol=1e-5)


def test_refusals(tmp_path):
    with pytest.raises(TypeError, match="rlkernels.integrations.trainers.trl.patch_grpo_trainer: "
                                        "expected a trl.GRPOTrainer"):
        patch_grpo_trainer(object())
    trainer = _trainer(RLKGRPOTrainer, tmp_path)
    ids = torch.ones(1, 4, dtype=torch.long)
    with pytest.raises(NotImplementedError, match="rlkernels.integrations.trainers.trl: .*pixel_values"):
        trainer.model(ids, labels=ids, fused_lm_head=True, pixel_values=torch.zeros(1))
    trainer.args.cast_lm_head_to_fp32 = True
    with pytest.raises(ValueError, match="rlkernels.integrations.trainers.trl: cast_lm_head_to_fp32"):
        patch_grpo_trainer(trainer)
