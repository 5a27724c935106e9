"""rlkernels.rollout: continuous batching whose every sample is bitwise its prompt's generate alone,
whatever the batch size, the other prompts, their order and the step a sample is admitted at."""
from __future__ import annotations

import functools
import random

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

import rlkernels  # noqa: E402
from rlkernels.integrations.hf import decode  # noqa: E402
from rlkernels.integrations.hf.continuous_batching import _rollout, _Rollout  # noqa: E402

from ._models import _tiny  # noqa: E402
from .test_moe import _patched as _patched_moe  # noqa: E402

EOS = 7
# Prompt lengths: more samples than rows, so that rows free up and take waiting samples.
LENGTHS = (5, 9, 3, 12, 7)
KW = dict(n=3, max_new_tokens=12, temperature=0.8, seed=7)


@pytest.fixture(autouse=True)
def _torch_backend_on_the_cpu(request, monkeypatch):
    """The CPU tests run the torch backend, also under TRITON_INTERPRET=1: they check the
    scheduling, and the interpreted kernels' invariance is their own tests' (the GPU tests
    run the Triton kernels)."""
    if request.node.get_closest_marker("gpu") is None:
        monkeypatch.setenv("RLKERNELS_BACKEND", "torch")


def _scale_head(model, eos_gain: float) -> None:
    """A trained model's logit scale (std 6), and an EOS row scaled so that samples often end early."""
    ids = torch.randint(1, model.config.vocab_size, (4, 9), generator=torch.Generator().manual_seed(3))
    ids = ids.to(model.lm_head.weight.device)
    with torch.no_grad():
        h = model.model(ids).last_hidden_state
        model.lm_head.weight.mul_(6.0 / (h @ model.lm_head.weight.T).float().std())
        model.lm_head.weight[EOS].mul_(eos_gain)
    model.generation_config.eos_token_id = EOS
    model.generation_config.pad_token_id = 0


@functools.lru_cache(maxsize=None)
def _model(arch: str, patched: bool = True):
    model = _tiny(arch, tie_word_embeddings=False)
    _scale_head(model, 2.5)
    return rlkernels.patch_model(model) if patched else model


@functools.lru_cache(maxsize=None)
def _reference(arch: str):
    """The rollout the other schedules are compared with: 4 rows for 15 samples, EOS from generation_config."""
    return rlkernels.rollout(_model(arch), _prompts(), max_batch=4, return_entropy=True, **KW)


def _prompts(lengths=LENGTHS, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 300, (n,), generator=g) for n in lengths]


def _alone(model, prompt, stream, *, max_new_tokens, temperature, seed=None, do_sample=True, **kw):
    """generate's tokens, log-probs and entropies for ``prompt`` alone, cut after its EOS."""
    streams = torch.tensor([stream], device=prompt.device)
    seq, lp, ent = rlkernels.generate(model, prompt[None], seed=seed, streams=streams, max_new_tokens=max_new_tokens,
                                      temperature=temperature, do_sample=do_sample, return_entropy=True, **kw)
    tokens = seq[0, len(prompt):]
    ends = (tokens == EOS).nonzero()
    T = int(ends[0]) + 1 if ends.numel() else tokens.numel()
    return tokens[:T], lp[0, :T], ent[0, :T]


def _by_key(results, prompts):
    """(prompt ids, stream) -> (tokens, logprobs, finished) of each sample."""
    return {(tuple(prompts[r.prompt].tolist()), r.stream): (r.tokens, r.logprobs, r.finished) for r in results}


def _count_calls(monkeypatch, cls, name) -> list:
    """A list that grows by the arguments of every call of ``cls.name`` (still run)."""
    calls = []
    original = getattr(cls, name)

    def counted(self, *args):
        calls.append(args)
        return original(self, *args)

    monkeypatch.setattr(cls, name, counted)
    return calls


def _same(a, b) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k][0], b[k][0]) and torch.equal(a[k][1], b[k][1]) and a[k][2] == b[k][2] for k in a)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_each_sample_is_its_prompt_alone_and_the_trainers_logprobs(arch):
    model = _model(arch)
    prompts = _prompts()
    results = _reference(arch)
    assert len(results) == len(prompts) * KW["n"]
    finished = 0
    for k, r in enumerate(results):
        assert (r.prompt, r.sample, r.stream) == (k // 3, k % 3, k)
        tokens, lp, ent = _alone(model, prompts[r.prompt], r.stream, max_new_tokens=12, temperature=0.8, seed=7)
        assert torch.equal(r.tokens, tokens) and torch.equal(r.logprobs, lp) and torch.equal(r.entropy, ent), k
        assert r.tokens.dtype == torch.int64 and r.logprobs.dtype == torch.float32 and not r.logprobs.requires_grad
        assert r.finished == (int(r.tokens[-1]) == EOS) and (r.finished or r.tokens.numel() == 12)
        finished += r.finished
        # The trainer scores the finished sequence with the same bits.
        seq = torch.cat([prompts[r.prompt], r.tokens])[None]
        t_lp, t_ent = rlkernels.token_logprobs(model, seq, temperature=0.8, return_entropy=True)
        n_new = r.tokens.numel()
        assert torch.equal(t_lp[0, -n_new:], r.logprobs) and torch.equal(t_ent[0, -n_new:], r.entropy), k
    # Samples ended early (their rows took waiting samples) and others ran to max_new_tokens.
    assert 0 < finished < len(results)
    # The n samples of a prompt are n draws (a tiny model's peaked distribution may give
    # one prompt's samples the same EOS first).
    differ = [len({tuple(r.tokens.tolist()) for r in results[3 * i:3 * i + 3]}) > 1 for i in range(len(prompts))]
    assert sum(differ) >= len(prompts) - 1


def test_batch_size_order_and_other_prompts_change_no_bit():
    model = _model("qwen3")
    prompts = _prompts()
    reference = _by_key(_reference("qwen3"), prompts)
    for max_batch in (1, None):  # None: one row per sample on the CPU
        got = _by_key(rlkernels.rollout(model, prompts, max_batch=max_batch, **KW), prompts)
        assert _same(got, reference), max_batch
    # The prompts shuffled, with strangers among them, each sample keeping its stream (and
    # lists of ids are the same prompts as tensors).
    order = [3, 0, 4, 2, 1]
    strangers = _prompts((10, 2), seed=5)
    mixed = [prompts[order[0]], strangers[0], *[prompts[i] for i in order[1:3]], strangers[1],
             *[prompts[i] for i in order[3:]]]
    owner = [order[0], None, *order[1:3], None, *order[3:]]
    streams = []
    for k, i in enumerate(owner):
        streams += [1000 + 3 * k + j for j in range(3)] if i is None else [3 * i + j for j in range(3)]
    got = _by_key(rlkernels.rollout(model, [p.tolist() for p in mixed], streams=streams, max_batch=3, **KW), mixed)
    assert _same({key: got[key] for key in reference}, reference)


def test_greedy_samples_are_the_greedy_decode_alone():
    model = _model("llama")
    prompts = _prompts((6, 2, 11))
    results = rlkernels.rollout(model, prompts, n=2, max_new_tokens=10, do_sample=False, temperature=0.7,
                                max_batch=2)
    for r in results:
        tokens, lp, _ = _alone(model, prompts[r.prompt], r.stream, max_new_tokens=10, temperature=0.7,
                               do_sample=False)
        assert torch.equal(r.tokens, tokens) and torch.equal(r.logprobs, lp)
    for i in range(len(prompts)):
        assert torch.equal(results[2 * i].tokens, results[2 * i + 1].tokens)


@pytest.mark.parametrize("truncation", [dict(top_k=6), dict(top_p=0.85), dict(top_k=30, top_p=0.9)],
                         ids=["top_k", "top_p", "both"])
def test_truncated_samples_are_their_prompts_truncated_generate_and_carry_the_trainers_thresholds(truncation):
    model = _model("qwen3")
    prompts = _prompts()
    results = rlkernels.rollout(model, prompts, max_batch=4, **KW, **truncation)
    full = _reference("qwen3")
    assert any(not torch.equal(r.tokens, f.tokens) for r, f in zip(results, full))  # truncation draws other tokens
    for k, r in enumerate(results):
        streams = torch.tensor([r.stream])
        seq, lp, tau = rlkernels.generate(model, prompts[r.prompt][None], seed=7, streams=streams, max_new_tokens=12,
                                          temperature=0.8, do_sample=True, return_thresholds=True, **truncation)
        T = r.tokens.numel()
        assert torch.equal(r.tokens, seq[0, len(prompts[r.prompt]):][:T]) and torch.equal(r.logprobs, lp[0, :T])
        assert torch.equal(r.thresholds, tau[0, :T]) and torch.isfinite(r.thresholds).all(), k
        sequence = torch.cat([prompts[r.prompt], r.tokens])[None]
        threshold = torch.full((1, sequence.shape[1] - 1), float("-inf"))
        threshold[0, -T:] = r.thresholds
        trainer = rlkernels.token_logprobs(model, sequence, temperature=0.8, logit_threshold=threshold)
        assert torch.equal(trainer[0, -T:], r.logprobs), k
    # Another batch size and order give the same bits; greedy and untruncated samples carry none.
    again = rlkernels.rollout(model, prompts, max_batch=2, **KW, **truncation)
    assert all(torch.equal(a.tokens, r.tokens) and torch.equal(a.thresholds, r.thresholds)
               for a, r in zip(again, results))
    assert all(r.thresholds is None for r in full)
    greedy = rlkernels.rollout(model, prompts[:2], n=1, max_new_tokens=4, do_sample=False, **truncation)
    assert all(r.thresholds is None for r in greedy)


def test_compacting_the_cache_changes_no_bit(monkeypatch):
    model = _model("qwen3")
    prompts = _prompts()
    reference = _by_key(_reference("qwen3"), prompts)
    compactions = _count_calls(monkeypatch, _Rollout, "compact")
    # The fewest slots that fit (the longest prompt plus max_new_tokens): compacted every few steps.
    tight = _by_key(_rollout(model, prompts, max_batch=4, slots=max(LENGTHS) + 12, **KW), prompts)
    assert len(compactions) >= 2 and _same(tight, reference)


def test_shrinking_the_step_batch_and_moving_rows_change_no_bit(monkeypatch):
    model = _model("qwen3")
    prompts = _prompts()
    reference = _by_key(_reference("qwen3"), prompts)
    batches = _count_calls(monkeypatch, _Rollout, "_forward")
    moves = []  # (rows moved, the step batch before, after) of every pack that moved rows
    original = _Rollout.pack

    def top_batch(rollout):
        return rollout.step_batch(int(np.flatnonzero(rollout.row_sample >= 0)[-1]) + 1)

    def pack(self):
        before, batch = self.row_sample.copy(), top_batch(self) if (self.row_sample >= 0).any() else 0
        original(self)
        moved = [r for r, s in enumerate(before) if s >= 0 and self.row_sample[r] != s]
        if moved:
            moves.append((moved, batch, top_batch(self)))

    monkeypatch.setattr(_Rollout, "pack", pack)
    # 15 samples on 8 rows: once none waits, the samples left move to the first rows and the
    # steps run at 4 rows, then 2, then 1.
    got = _by_key(_rollout(model, prompts, max_batch=8, smallest_step_batch=1, **KW), prompts)
    steps = [b for (b,) in batches]
    assert steps[0] == 8 and {2, 4} <= set(steps) and steps == sorted(steps, reverse=True)
    assert moves and _same(got, reference)
    # Rows move only where the step shrinks, so at most once per step batch left behind.
    assert all(after < before for _, before, after in moves), moves
    assert len(moves) <= len(set(steps)) - 1


def test_a_prompts_samples_name_one_row_whose_keys_they_hold(monkeypatch):
    """Every decode step names, per row, the lowest row holding a sample of its prompt and the
    prompt's length (``shared_keys``), and the promise holds: the row's first keys and values
    are that row's, bit for bit, in every layer, also once rows end, move and take others."""
    from rlkernels.integrations.hf import attention as hf_attention
    from rlkernels.integrations.hf.attention import SHARED_KEYS

    model = _model("qwen3")
    prompts = _prompts()
    calls = []
    original = hf_attention.attention_by_bounds

    def recording(op, q, k, v, q_start, q_len, k_start, k_len, max_q, max_k, **kw):
        shared = kw.get("shared_keys")
        if shared is not None:
            src, length = (t.tolist() for t in shared)
            for b, (s, n) in enumerate(zip(src, length)):
                a, c = int(k_start[b]), int(k_start[s])
                assert n <= min(int(k_len[b]), int(k_len[s]))
                for t in (k, v):
                    assert torch.equal(t[b, a:a + n].view(torch.int32), t[s, c:c + n].view(torch.int32)), (b, s, n)
            calls.append((src, length))
        return original(op, q, k, v, q_start, q_len, k_start, k_len, max_q, max_k, **kw)

    monkeypatch.setattr(hf_attention, "attention_by_bounds", recording)
    steps = []
    forward = _Rollout._forward

    def step(self, b):
        owner = self.row_sample[:b].copy()
        steps.append((owner, self.prompt_of[np.maximum(owner, 0)], self.length[np.maximum(owner, 0)]))
        return forward(self, b)

    monkeypatch.setattr(_Rollout, "_forward", step)
    got = _by_key(_rollout(model, prompts, max_batch=8, smallest_step_batch=1, **KW), prompts)
    assert _same(got, _by_key(_reference("qwen3"), prompts))
    layers = model.config.num_hidden_layers
    assert len(calls) == layers * len(steps)
    shared = 0
    for (owner, prompt, length), (src, n) in zip(steps, calls[::layers]):
        for r, sample in enumerate(owner):
            if sample < 0:
                assert (src[r], n[r]) == (r, 0)
                continue
            siblings = [i for i in range(len(owner)) if owner[i] >= 0 and prompt[i] == prompt[r]]
            assert (src[r], n[r]) == (siblings[0], length[r])
            shared += src[r] != r
    assert shared > 0  # some steps read a sibling's copy


def test_prefilling_prompts_together_changes_no_bit(monkeypatch):
    model = _model("qwen3")
    prompts = _prompts()
    reference = _by_key(_reference("qwen3"), prompts)
    groups = _count_calls(monkeypatch, _Rollout, "_prefill")
    # LENGTHS: 5, 9, 3, 12, 7 tokens, which wait shortest first: 3, 5, 7 | 9, 12 within 24
    # padded tokens (in the given order, 5, 9 | 3, 12 | 7).
    for budget, lengths in ((8192, [[3, 5, 7, 9, 12]]), (24, [[3, 5, 7], [9, 12]])):
        groups.clear()
        got = _by_key(_rollout(model, prompts, max_batch=15, prefill_tokens=budget, **KW), prompts)
        assert [[LENGTHS[p] for p in g] for (g,) in groups] == lengths and _same(got, reference), budget


def test_admitting_once_rows_are_free_changes_no_bit(monkeypatch):
    model = _model("qwen3")
    prompts = _prompts()
    reference = _by_key(_reference("qwen3"), prompts)
    admissions = []  # (free rows, waiting samples) at each admission
    original = _Rollout._admit

    def admit(self, waiting):
        admissions.append((int((self.row_sample < 0).sum()), len(waiting)))
        return original(self, waiting)

    monkeypatch.setattr(_Rollout, "_admit", admit)
    counts = {}
    for rows in (1, 2, 4):
        admissions.clear()
        got = _by_key(_rollout(model, prompts, max_batch=4, admit_rows=rows, **KW), prompts)
        assert _same(got, reference), rows
        # An admission waits for `rows` free rows (or every waiting sample's), unless none decodes.
        assert all(free == 4 or free >= min(rows, waiting) for free, waiting in admissions), (rows, admissions)
        counts[rows] = len(admissions)
    assert counts[1] > counts[4], counts


def test_the_engine_a_call_keeps_is_reused_and_changes_no_bit():
    model = _model("qwen3")
    prompts = _prompts()
    reference = _by_key(_reference("qwen3"), prompts)
    decode.release_decode_graphs(model)
    try:
        first = _by_key(_rollout(model, prompts, max_batch=4, keep=True, **KW), prompts)
        engine = decode.kept_state("rollout", model)
        assert _same(first, reference) and engine.max_batch == 4 and not engine.in_use
        # Shorter prompts, max_batch None: the kept engine's rows and slots, its stale slots masked.
        short = _prompts((4, 2, 6), seed=9)
        again = _by_key(_rollout(model, short, keep=True, **KW), short)
        assert decode.kept_state("rollout", model) is engine
        assert _same(again, _by_key(_rollout(model, short, max_batch=2, **KW), short))
        # Another temperature is another step: the kept engine is replaced.
        _rollout(model, short, keep=True, **KW | dict(temperature=0.5))
        assert decode.kept_state("rollout", model) not in (None, engine)
    finally:
        decode.release_decode_graphs(model)
    assert decode.kept_state("rollout", model) is None


def test_a_stock_model_run_on_the_same_schedule_is_not_its_prompts_alone():
    # The control: the same slots, windows and batch on the unpatched model (SDPA, stock
    # matmuls): some sample's log-probs differ from its prompt's decode alone.
    model = _model("qwen3", patched=False)
    assert not rlkernels.is_patched(model)
    prompts = _prompts()
    results = _rollout(model, prompts, max_batch=4, batch_invariant=False, **KW)
    differ = 0
    for r in results:
        tokens, lp, _ = _alone(model, prompts[r.prompt], r.stream, max_new_tokens=12, temperature=0.8, seed=7,
                               batch_invariant=False)
        n_new = min(r.tokens.numel(), tokens.numel())
        differ += not (torch.equal(r.tokens, tokens) and torch.equal(r.logprobs, lp[:n_new]))
    assert differ > 0


def test_a_mixture_of_experts_model_samples_its_prompts_alone():
    model = _patched_moe("qwen3_moe")
    _scale_head(model, 2.5)
    prompts = _prompts((4, 8, 2))
    results = rlkernels.rollout(model, prompts, n=2, max_new_tokens=8, temperature=0.9, seed=3, max_batch=2)
    for r in results:
        tokens, lp, _ = _alone(model, prompts[r.prompt], r.stream, max_new_tokens=8, temperature=0.9, seed=3)
        assert torch.equal(r.tokens, tokens) and torch.equal(r.logprobs, lp)


def test_no_new_tokens_no_prompts_and_the_default_eos():
    model = _model("qwen3")
    empty = rlkernels.rollout(model, _prompts((3, 4)), n=2, max_new_tokens=0, seed=1)
    assert [(r.prompt, r.sample, r.tokens.numel(), r.logprobs.numel(), r.finished) for r in empty] == [
        (0, 0, 0, 0, False), (0, 1, 0, 0, False), (1, 0, 0, 0, False), (1, 1, 0, 0, False)]
    assert rlkernels.rollout(model, [], max_new_tokens=4) == []
    # eos_token_id=[] runs every sample to max_new_tokens (the default, generation_config's,
    # ends some in the other tests).
    free = rlkernels.rollout(model, _prompts((3, 4)), n=2, max_new_tokens=6, seed=1, eos_token_id=[])
    assert all(r.tokens.numel() == 6 and not r.finished for r in free)


_PROMPTS = _prompts((3, 4))
REFUSALS = [
    (dict(prompts=torch.ones(2, 3, dtype=torch.long)), ValueError, r"prompts is a 2-D tensor.*pass a list of prompts"),
    (dict(prompts=_PROMPTS[0]), ValueError, r"prompts must be a list of prompts .*got a 1-D tensor"),
    (dict(prompts=[_PROMPTS[0], []]), ValueError, r"prompts\[1\] is empty"),
    (dict(prompts=[_PROMPTS[0], torch.tensor([1, 2, 300])]), ValueError,
     r"prompts\[1\]\[2\] = 300 is outside the model's vocabulary \[0, 300\)"),
    (dict(prompts=[[1, -1]]), ValueError, r"prompts\[0\]\[1\] = -1 is outside"),
    (dict(prompts=[[1.0, 2.0]]), TypeError, r"prompts\[0\] must hold integer token ids"),
    (dict(prompts=[torch.ones(257, dtype=torch.long)]), ValueError,
     r"prompts\[0\] has 257 tokens, more than the model.s max_position_embeddings \(256\)"),
    (dict(n=0), ValueError, r"n must be an int >= 1"),
    (dict(max_new_tokens=-1), ValueError, r"max_new_tokens must be an int >= 0"),
    (dict(temperature=0.0), ValueError, r"temperature must be a finite number > 0"),
    (dict(temperature=float("nan")), ValueError, r"temperature must be a finite number > 0"),
    (dict(temperature=-1.0), ValueError, r"temperature must be a finite number > 0"),
    (dict(streams=[0, 1, 2]), ValueError, r"streams has 3 entries; .* len\(prompts\) \* n = 4"),
    (dict(streams=[0, 5, 1, 5]), ValueError, r"streams must be distinct \(stream 5 is repeated\)"),
    (dict(max_batch=0), ValueError, r"max_batch must be an int >= 1"),
    (dict(seed=-1), ValueError, r"seed must be a Python int in \[0, 2\^63\)"),
    (dict(cuda_graph=True), ValueError, r"cuda_graph=True cannot capture the decode step here: the model is on cpu"),
    (dict(top_k=-1), ValueError, r"top_k must be >= 0"),
    (dict(top_p=0.0), ValueError, r"top_p must lie in \(0, 1\]"),
]


def test_bad_arguments_are_refused_before_any_compute():
    model = _model("qwen3")
    unpatched = _model("qwen3", patched=False)

    def ran(*args, **kwargs):
        raise AssertionError("the model ran")

    handles = [m.model.register_forward_pre_hook(ran) for m in (model, unpatched)]
    try:
        for over, error, message in REFUSALS:
            kw = dict(n=2, max_new_tokens=4, seed=1) | over
            prompts = kw.pop("prompts", _PROMPTS)
            with pytest.raises(error, match=r"^rlkernels\.rollout: " + message):
                rlkernels.rollout(model, prompts, **kw)
        with pytest.raises(ValueError, match=r"^rlkernels\.rollout: the model is not patched.*patch_model"):
            rlkernels.rollout(unpatched, _PROMPTS, max_new_tokens=4)
    finally:
        for handle in handles:
            handle.remove()


def _gpu_model():
    """A patched bf16 Qwen3 of 32000 ids on CUDA, its head at a trained scale and EOS common."""
    model = _tiny("qwen3", dtype=torch.bfloat16, device="cuda", hidden_size=1024, intermediate_size=2816,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=64, vocab_size=32000,
                  tie_word_embeddings=False)
    _scale_head(model, 4.0)
    return rlkernels.patch_model(model)


@pytest.mark.gpu
@pytest.mark.parametrize("sample", [False, True])
def test_graphed_rollout_is_the_eager_rollout_bit_for_bit_gpu(sample, monkeypatch):
    model = _gpu_model()
    rng = random.Random(0)
    prompts = [torch.randint(1, 32000, (rng.randint(1, 120),)).cuda() for _ in range(12)]
    kw = dict(n=4, max_new_tokens=40, temperature=0.9, seed=11, do_sample=sample, max_batch=16)
    eager = rlkernels.rollout(model, prompts, cuda_graph=False, **kw)
    assert any(r.finished for r in eager)  # ended early: their rows took waiting samples (48 samples, 16 rows)
    captures = _count_calls(monkeypatch, decode.DecodeGraph, "capture")
    compactions = _count_calls(monkeypatch, _Rollout, "compact")
    graphed = rlkernels.rollout(model, prompts, cuda_graph=True, **kw)
    assert 1 <= len(captures) <= 2  # the step at 16 rows and, once few samples are left, at 8
    graphed_captures = len(captures)
    # The next call replays the engine the first one kept: no eager step, no capture.
    again = rlkernels.rollout(model, prompts, cuda_graph=True, **kw)
    assert len(captures) == graphed_captures
    rlkernels.release_decode_graphs(model)
    auto = rlkernels.rollout(model, prompts, **kw | dict(max_batch=None))  # graphed: one row per sample
    assert len(captures) > graphed_captures and not compactions
    # Compacted while graphed: every sample runs to max_new_tokens in the fewest slots that fit.
    longest = max(len(p) for p in prompts)
    free = rlkernels.rollout(model, prompts, cuda_graph=False, eos_token_id=[], **kw)
    tight = _rollout(model, prompts, cuda_graph=True, eos_token_id=[], slots=longest + 40, **kw)
    assert len(compactions) >= 2
    for e, g, k, a in zip(eager, graphed, again, auto):
        for x in (g, k, a):
            assert torch.equal(e.tokens, x.tokens) and torch.equal(e.logprobs, x.logprobs) and e.finished == x.finished
    for e, t in zip(free, tight):
        assert torch.equal(e.tokens, t.tokens) and torch.equal(e.logprobs, t.logprobs)
    for r in eager[::5]:
        tokens, lp, _ = _alone(model, prompts[r.prompt], r.stream, max_new_tokens=40, temperature=0.9, seed=11,
                               do_sample=sample)
        assert torch.equal(r.tokens, tokens) and torch.equal(r.logprobs, lp)


@pytest.mark.gpu
def test_gpu_a_truncated_graphed_rollout_is_the_eager_rollout_and_generate_alone():
    model = _gpu_model()
    rng = random.Random(1)
    prompts = [torch.randint(1, 32000, (rng.randint(1, 90),)).cuda() for _ in range(10)]
    kw = dict(n=4, max_new_tokens=32, temperature=0.9, seed=13, max_batch=16, top_k=50, top_p=0.9)
    eager = rlkernels.rollout(model, prompts, cuda_graph=False, **kw)
    graphed = rlkernels.rollout(model, prompts, cuda_graph=True, **kw)
    assert any(r.finished for r in eager)
    for e, g in zip(eager, graphed):
        assert torch.equal(e.tokens, g.tokens) and torch.equal(e.logprobs, g.logprobs)
        assert torch.equal(e.thresholds, g.thresholds)
    for r in eager[::7]:
        seq, lp, tau = rlkernels.generate(model, prompts[r.prompt][None], seed=13,
                                          streams=torch.tensor([r.stream]).cuda(), max_new_tokens=32,
                                          temperature=0.9, do_sample=True, top_k=50, top_p=0.9,
                                          return_thresholds=True)
        T = r.tokens.numel()
        assert torch.equal(r.tokens, seq[0, len(prompts[r.prompt]):][:T]) and torch.equal(r.logprobs, lp[0, :T])
        assert torch.equal(r.thresholds, tau[0, :T])
    rlkernels.release_decode_graphs(model)
