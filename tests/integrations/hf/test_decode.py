"""The static-cache decode loop (``generate(..., cuda_graph=True)``): the eager loop's bits,
and a kept decode state (cache, buffers, captured step) reused across calls with a fresh call's bits."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

transformers = pytest.importorskip("transformers")

import rlkernels  # noqa: E402
from rlkernels.integrations.hf import decode  # noqa: E402
from rlkernels.integrations.hf import token_logprobs  # noqa: E402
from rlkernels.integrations.hf.coverage import decoder_of  # noqa: E402

from ._models import _tiny  # noqa: E402
from .test_attention import _model, _pad, _prompts  # noqa: E402


def _static(model, ids, mask, **kw):
    kw.setdefault("cuda_graph", False)
    return decode.static_generate(model, decoder_of(model), ids, mask, **kw)


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_greedy_decode_gives_hugging_faces_tokens_and_the_trainers_logprobs(arch):
    # The StaticCache loop (every slot of the cache visible to attention, the unused ones
    # masked) against Hugging Face generate with a DynamicCache on an fp32 model, whose
    # head logits are the fp32 chain the loop takes its argmax of: the same tokens.
    model = _model(arch)
    ids, mask = _pad(_prompts((5, 11, 3, 8)), left=True)
    seq, lp, ent = _static(model, ids, mask, max_new_tokens=7)
    hf = model.generate(ids, attention_mask=mask, max_new_tokens=7, do_sample=False, pad_token_id=0)
    assert torch.equal(seq, hf)
    assert not lp.requires_grad and lp.shape == ent.shape == (4, 7)
    for i in range(ids.shape[0]):  # the trainer's log-probs of the finished rows
        row = seq[i][mask[i].bool().tolist() + [True] * 7]
        t_lp, t_ent = token_logprobs(model, row[None], return_entropy=True)
        assert torch.equal(t_lp[0, -7:], lp[i]) and torch.equal(t_ent[0, -7:], ent[i])


def test_static_loop_pads_after_eos_and_stops_when_every_row_ended():
    model = _model("qwen3")
    ids, mask = _pad(_prompts((4, 6)), left=True)
    L = ids.shape[1]
    free, _, _ = _static(model, ids, mask, max_new_tokens=6)
    first0, first1 = int(free[0, L]), int(free[1, L])
    assert first0 != first1 and not bool((free[1, L:] == first0).any())
    # Row 0 ends at its first token: generate's padding follows, with log-prob 0; row 1 runs on.
    seq, lp, ent = _static(model, ids, mask, max_new_tokens=6, eos_token_ids=[first0], pad_token_id=0)
    assert int(seq[0, L]) == first0 and bool((seq[0, L + 1:] == 0).all())
    assert lp[0, 0] != 0 and bool((lp[0, 1:] == 0).all()) and bool((ent[0, 1:] == 0).all())
    assert torch.equal(seq[1], free[1]) and lp.shape == (2, 6)
    # Both rows end at once: the loop stops after one token.
    seq2, lp2, _ = _static(model, ids, mask, max_new_tokens=6, eos_token_ids=[first0, first1], pad_token_id=0)
    assert seq2.shape == (2, L + 1) and lp2.shape == (2, 1)


def test_a_rows_draws_are_keyed_by_seed_stream_and_position_alone():
    model = _model("llama")
    prompts = _prompts((3, 7, 5))
    ids, mask = _pad(prompts, left=True)
    kw = dict(max_new_tokens=6, do_sample=True, temperature=0.7)
    streams = torch.tensor([11, 5, 1 << 40])
    seq, lp = rlkernels.generate(model, ids, mask, seed=3, streams=streams, **kw)
    again, lp_again = rlkernels.generate(model, ids, mask, seed=3, streams=streams, **kw)
    assert torch.equal(seq, again) and torch.equal(lp, lp_again)
    width = ids.shape[1]
    for i, p in enumerate(prompts):
        # Alone, unpadded, and at the end of another batch with more left padding.
        alone, lp_alone = rlkernels.generate(model, p[None], seed=3, streams=streams[i:i + 1], **kw)
        assert torch.equal(alone[0, len(p):], seq[i, width:]) and torch.equal(lp_alone[0], lp[i])
        other, omask = _pad([torch.arange(1, 12), p], left=True)
        moved, lp_moved = rlkernels.generate(model, other, omask, seed=3, streams=torch.tensor([99, int(streams[i])]),
                                             **kw)
        assert torch.equal(moved[1, other.shape[1]:], seq[i, width:]) and torch.equal(lp_moved[1], lp[i])
    other_seed, _ = rlkernels.generate(model, ids, mask, seed=4, streams=streams, **kw)
    assert not torch.equal(other_seed, seq)
    torch.manual_seed(8)
    first, _ = rlkernels.generate(model, ids, mask, **kw)  # seed from torch's generator
    torch.manual_seed(8)
    assert torch.equal(first, rlkernels.generate(model, ids, mask, **kw)[0])


@pytest.mark.gpu
@pytest.mark.parametrize("sample", [False, True])
def test_graphed_decode_is_the_eager_decode_bit_for_bit_gpu(sample):
    model = _tiny("qwen3", dtype=torch.bfloat16, device="cuda", hidden_size=1024, intermediate_size=2816,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=64, vocab_size=32000)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    rlkernels.patch_model(model)
    ids, mask = _pad(_prompts((37, 120, 5, 64, 1, 99)), left=True)
    ids, mask = ids.cuda(), mask.cuda()
    kw = dict(max_new_tokens=24, greedy=not sample, temperature=0.9, seed=1)
    eager = decode.static_generate(model, decoder_of(model), ids, mask, cuda_graph=False, **kw)
    graphed = decode.static_generate(model, decoder_of(model), ids, mask, cuda_graph=True, **kw)
    assert all(torch.equal(a, b) for a, b in zip(eager, graphed))
    seq, lp = rlkernels.generate(model, ids, mask, cuda_graph=True, max_new_tokens=24, do_sample=sample,
                                 temperature=0.9, seed=1)
    assert torch.equal(seq, eager[0]) and torch.equal(lp, eager[1])
    width = ids.shape[1]
    for i in range(ids.shape[0]):
        row = seq[i][torch.cat([mask[i].bool(), torch.ones(24, dtype=torch.bool, device="cuda")])]
        assert torch.equal(token_logprobs(model, row[None], temperature=0.9)[0, -24:], lp[i]), i
    assert seq.shape == (ids.shape[0], width + 24)


# ------------------------------------------------------------------ a kept decode state
# On the CPU the kept state's eager step stands where a graph replays on CUDA: the cache
# rewind, the buffer refills and the seed tensor are the same code either way.


def _batches(device="cpu"):
    """Two left-padded batches of 4 prompts, the second shorter (L 14 vs 9), so that the
    second call's cache holds slots the first wrote past its own prompts."""
    ids1, mask1 = _pad(_prompts((14, 3, 9, 6), seed=1), left=True)
    ids2, mask2 = _pad(_prompts((2, 9, 5, 1), seed=2), left=True)
    return (ids1.to(device), mask1.to(device)), (ids2.to(device), mask2.to(device))


@pytest.mark.parametrize("sample", [False, True])
def test_a_kept_state_is_reused_with_another_prompt_length_seed_and_streams_bitwise(sample):
    model = _model("qwen3")
    decode.release_decode_graphs(model)
    (ids1, mask1), (ids2, mask2) = _batches()
    total = 20
    kw = dict(greedy=not sample, temperature=0.8)
    call1 = dict(max_new_tokens=total - ids1.shape[1], seed=3, streams=torch.tensor([4, 8, 1 << 40, 2]), **kw)
    call2 = dict(max_new_tokens=total - ids2.shape[1], seed=11, streams=torch.tensor([7, 0, 5, 1 << 33]), **kw)
    first = _static(model, ids1, mask1, keep=True, **call1)
    state = decode.decode_graph(model)
    assert state is not None and state.calls == 1 and state.warm and state.graph is None
    keys = state.cache.layers[0].keys
    second = _static(model, ids2, mask2, keep=True, **call2)
    assert decode.decode_graph(model) is state and state.calls == 2 and state.cache.layers[0].keys is keys
    # Each equals a call with a state of its own, bit for bit.
    assert _same(first, _static(model, ids1, mask1, **call1))
    assert _same(second, _static(model, ids2, mask2, **call2))
    assert first[0].shape == (4, total) and second[0].shape == (4, total)
    if sample:  # the seed and streams were read from the refilled buffers, not the first call's
        assert not _same(second, _static(model, ids2, mask2, **dict(call2, seed=3)))
    # Back to the first call's prompts on the state the second one left: the first call's bits.
    assert _same(first, _static(model, ids1, mask1, keep=True, **call1)) and decode.decode_graph(model) is state
    decode.release_decode_graphs(model)
    assert decode.decode_graph(model) is None


@pytest.mark.parametrize("sample", [False, True])
def test_a_pinned_cache_length_changes_no_bit_and_keeps_one_state_across_prompt_lengths(sample):
    # The slots past a row's keys are masked out of the attention's chain: a longer cache
    # gives the same tokens and log-probs, and with the length pinned, calls whose
    # L + max_new_tokens differ share the model's one kept state.
    model = _model("llama")
    decode.release_decode_graphs(model)
    (ids1, mask1), (ids2, mask2) = _batches()
    kw = dict(greedy=not sample, temperature=0.8, seed=9)
    unpinned = [_static(model, ids1, mask1, max_new_tokens=6, **kw),
                _static(model, ids2, mask2, max_new_tokens=11, **kw)]
    cache_len = ids1.shape[1] + 13
    first = _static(model, ids1, mask1, max_new_tokens=6, keep=True, cache_len=cache_len, **kw)
    state = decode.decode_graph(model)
    second = _static(model, ids2, mask2, max_new_tokens=11, keep=True, cache_len=cache_len, **kw)
    assert decode.decode_graph(model) is state and state.calls == 2 and state.key[1] == cache_len
    assert _same(first, unpinned[0]) and _same(second, unpinned[1])
    decode.release_decode_graphs(model)


def test_a_cache_length_shorter_than_the_decode_is_refused():
    model = _model("qwen3")
    ids, mask = _pad(_prompts((4, 6)), left=True)
    with pytest.raises(ValueError, match=r"rlkernels.generate: cache_len must be at least .*\(6 \+ 5\), got 10"):
        _static(model, ids, mask, max_new_tokens=5, cache_len=10)
    for bad in (10, 11.0, True):
        with pytest.raises(ValueError, match=r"rlkernels.generate: cache_len must be an int >= .*\(6 \+ 5\)"):
            rlkernels.generate(model, ids, mask, max_new_tokens=5, cache_len=bad)


class _RecordedStep:
    """A CUDA graph's stand-in on the CPU: "capture" keeps the step closure of the call that
    recorded it (running nothing, as a capture runs nothing), and a replay runs that
    closure -- with its tensors and the Python values it closed over -- writing into fixed
    outputs. A step that read anything of a later call's other than the kept buffers and
    cache (its streams, its seed, its prompt length) would replay the recording call's."""

    def __init__(self, step, batch):
        self.step = step
        self.out = (torch.zeros(batch, dtype=torch.long), torch.zeros(batch), torch.zeros(batch))
        self.replays = 0

    def replay(self):
        for kept, new in zip(self.out, self.step()):
            kept.copy_(new)
        self.replays += 1


@pytest.fixture
def recorded_steps(monkeypatch):
    def capture(state, step):
        state.graph = _RecordedStep(step, state.buffers.ids.shape[0])
        state.graph_out = state.graph.out
        state.captures += 1

    monkeypatch.setattr(decode.DecodeGraph, "capture", capture)


@pytest.mark.parametrize("sample", [False, True])
def test_a_step_recorded_by_an_earlier_call_replays_with_a_fresh_calls_bits(sample, recorded_steps):
    model = _model("qwen3")
    (ids1, mask1), (ids2, mask2) = _batches()
    total = 20
    kw = dict(greedy=not sample, temperature=0.8, cuda_graph=True)
    call1 = dict(max_new_tokens=total - ids1.shape[1], seed=3, streams=torch.tensor([4, 8, 1 << 40, 2]), **kw)
    call2 = dict(max_new_tokens=total - ids2.shape[1], seed=11, streams=torch.tensor([7, 0, 5, 1 << 33]), **kw)
    first = _static(model, ids1, mask1, **call1)
    state = decode.decode_graph(model)
    recorded = state.graph
    # The first call: prefill, an eager step, then the recorded step for tokens 2.. .
    assert state.captures == 1 and recorded.replays == call1["max_new_tokens"] - 2
    second = _static(model, ids2, mask2, **call2)
    # The second call replays the first call's recording from its first decode step.
    assert decode.decode_graph(model) is state and state.graph is recorded and state.captures == 1
    assert recorded.replays == call1["max_new_tokens"] - 2 + call2["max_new_tokens"] - 1
    eager = dict(cuda_graph=False, keep=False)
    assert _same(first, _static(model, ids1, mask1, **dict(call1, **eager)))
    assert _same(second, _static(model, ids2, mask2, **dict(call2, **eager)))
    decode.release_decode_graphs(model)


def _kept_first_call(family: str, max_new_tokens: int, **kw):
    """(model, its kept DecodeGraph, the second batch) after one kept call on the first batch."""
    model = _model(family)
    (ids1, mask1), second = _batches()
    _static(model, ids1, mask1, keep=True, max_new_tokens=max_new_tokens, **kw)
    return model, decode.decode_graph(model), second


def test_stale_and_nan_cache_slots_change_no_bit():
    # Slots a previous call wrote are not cleared on reuse: the attention masks them out of
    # the chain (K and V loads masked to 0), so even NaN there changes nothing.
    kw = dict(greedy=False, temperature=0.7, seed=5)
    model, state, (ids2, mask2) = _kept_first_call("llama", 6, **kw)
    for layer in state.cache.layers:
        layer.keys.fill_(float("nan"))
        layer.values.fill_(float("nan"))
    got = _static(model, ids2, mask2, keep=True, max_new_tokens=11, **kw)
    assert decode.decode_graph(model) is state
    assert _same(got, _static(model, ids2, mask2, max_new_tokens=11, **kw))
    assert not torch.isnan(got[1]).any()
    decode.release_decode_graphs(model)


def test_the_key_replaces_the_models_one_entry():
    kw = dict(greedy=False, temperature=0.8, seed=1)
    model, state, (ids2, mask2) = _kept_first_call("qwen3", 4, **kw)
    # Same B and cache length, another prompt length: the same entry.
    _static(model, ids2, mask2, keep=True, max_new_tokens=9, **kw)
    assert decode.decode_graph(model) is state
    changes = [dict(max_new_tokens=5),                                      # the cache length
               dict(max_new_tokens=9, temperature=0.9),                     # T, a kernel argument
               dict(max_new_tokens=9, greedy=True)]                         # greedy vs sampled
    for change in changes:
        got = _static(model, ids2, mask2, keep=True, **dict(kw, **change))
        now = decode.decode_graph(model)
        assert now is not state and now.calls == 1, change  # one entry per model: the newest key
        assert _same(got, _static(model, ids2, mask2, **dict(kw, **change)))
        state = now
    # Another batch size.
    _static(model, ids2[:3], mask2[:3], keep=True, max_new_tokens=9, streams=torch.arange(3), **kw)
    assert decode.decode_graph(model) is not state and decode.decode_graph(model).key[0] == 3


def test_weights_written_in_place_keep_the_entry_and_new_tensors_replace_it():
    model = _model("qwen3")
    (ids1, mask1), _ = _batches()
    kw = dict(greedy=True, max_new_tokens=6)
    _static(model, ids1, mask1, keep=True, **kw)
    state = decode.decode_graph(model)
    with torch.no_grad():  # an optimizer step: the same tensors, new values
        for p in model.parameters():
            p.mul_(1.25)
    got = _static(model, ids1, mask1, keep=True, **kw)
    assert decode.decode_graph(model) is state
    assert _same(got, _static(model, ids1, mask1, **kw))
    # A new Parameter object (new memory): the entry is replaced, not replayed.
    head = model.get_output_embeddings()
    head.weight = torch.nn.Parameter(head.weight.detach().clone() * 2)
    got = _static(model, ids1, mask1, keep=True, **kw)
    assert decode.decode_graph(model) is not state
    assert _same(got, _static(model, ids1, mask1, **kw))
    # A swapped module (the same parameters, a new object): replaced too.
    state = decode.decode_graph(model)
    norm = decoder_of(model).norm
    decoder_of(model).norm = type(norm).from_module(norm)
    _static(model, ids1, mask1, keep=True, **kw)
    assert decode.decode_graph(model) is not state


def test_the_entry_goes_with_the_model_and_generate_keeps_nothing_eagerly():
    model = _model("qwen3")
    (ids1, mask1), _ = _batches()
    rlkernels.generate(model, ids1, mask1, max_new_tokens=3)  # cuda_graph=False: nothing kept
    assert decode.decode_graph(model) is None
    _static(model, ids1, mask1, keep=True, max_new_tokens=3)
    state = weakref.ref(decode.decode_graph(model))
    del model
    gc.collect()
    assert state() is None


def test_a_state_in_use_is_not_shared_and_a_failed_call_drops_its_state():
    model = _model("qwen3")
    (ids1, mask1), _ = _batches()
    kw = dict(greedy=False, seed=2, max_new_tokens=5)
    want = _static(model, ids1, mask1, **kw)
    _static(model, ids1, mask1, keep=True, **kw)
    state = decode.decode_graph(model)
    state.in_use = True  # as while another thread decodes with it
    calls = state.calls
    assert _same(_static(model, ids1, mask1, keep=True, **kw), want)
    assert decode.decode_graph(model) is state and state.calls == calls and state.in_use
    state.in_use = False
    # A call that raises part-way (here: NaN logits, refused by the draw) keeps nothing.
    with torch.no_grad():
        model.get_output_embeddings().weight[3, 0] = float("nan")
    with pytest.raises(ValueError, match="not a distribution"):
        _static(model, ids1, mask1, keep=True, **kw)
    assert decode.decode_graph(model) is None


def test_the_seed_and_streams_are_checked_before_they_fill_the_buffers():
    model = _model("qwen3")
    (ids1, mask1), _ = _batches()
    kw = dict(greedy=False, max_new_tokens=2, keep=True)
    for streams, what in ((torch.arange(4, dtype=torch.int32), "torch.int32"), (torch.arange(1), r"\(1,\)"),
                          (torch.arange(8).reshape(4, 2), r"\(4, 2\)")):
        with pytest.raises(ValueError, match=rf"rlkernels.generate: streams must be an int64 tensor of shape "
                                             rf"\(4,\) on cpu, got .*{what}"):
            _static(model, ids1, mask1, seed=1, streams=streams, **kw)
    with pytest.raises(ValueError, match=r"rlkernels.linear_sample: seed must be in \[0, 2\^63\), got -1"):
        _static(model, ids1, mask1, seed=-1, **kw)
    with pytest.raises(ValueError, match=r"rlkernels.linear_sample: seed must be in \[0, 2\^63\)"):
        rlkernels.generate(model, ids1, mask1, max_new_tokens=2, do_sample=True, seed=1 << 63)
    assert decode.decode_graph(model) is None


# ------------------------------------------------------------------ GPU: the graph kept across calls


def _gpu_model(dtype):
    model = _tiny("qwen3", dtype=dtype, device="cuda", hidden_size=512, intermediate_size=1408,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=64, vocab_size=4099)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return rlkernels.patch_model(model)


def _graphed(model, ids, mask, **kw):
    return decode.static_generate(model, decoder_of(model), ids, mask, cuda_graph=True, **kw)


@pytest.fixture
def count_captures(monkeypatch):
    """How many times ``torch.cuda.graph`` records (every capture goes through it)."""
    count = [0]
    real = torch.cuda.graph

    def counting(*args, **kwargs):
        count[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.cuda, "graph", counting)
    return count


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampled"])
def test_gpu_a_reused_graph_gives_a_fresh_calls_and_the_eager_loops_bits(dtype, sample, count_captures):
    model = _gpu_model(dtype)
    decode.release_decode_graphs(model)
    (ids1, mask1), (ids2, mask2) = _batches("cuda")
    total = 40
    kw = dict(greedy=not sample, temperature=0.9)
    call1 = dict(max_new_tokens=total - ids1.shape[1], seed=3, streams=torch.tensor([4, 8, 1 << 40, 2], device="cuda"),
                 **kw)
    call2 = dict(max_new_tokens=total - ids2.shape[1], seed=(1 << 62) + 11,
                 streams=torch.tensor([7, 0, 5, 1 << 33], device="cuda"), **kw)
    first = _graphed(model, ids1, mask1, **call1)
    state = decode.decode_graph(model)
    graph = state.graph
    assert graph is not None and state.captures == 1 and count_captures[0] == 1
    second = _graphed(model, ids2, mask2, **call2)
    # The second call replayed the first call's graph from its first decode step.
    assert decode.decode_graph(model) is state and state.graph is graph and state.captures == 1
    assert count_captures[0] == 1 and state.calls == 2
    for (ids, mask, call), got in (((ids1, mask1, call1), first), ((ids2, mask2, call2), second)):
        eager = _static(model, ids, mask, **call)
        assert _same(got, eager)
        decode.release_decode_graphs(model)  # a fresh state: eager first step, then a capture
        assert _same(got, _graphed(model, ids, mask, **call))
    # rlkernels.generate keeps and reuses the same way.
    decode.release_decode_graphs(model)
    seq1, lp1 = rlkernels.generate(model, ids1, mask1, cuda_graph=True, max_new_tokens=call1["max_new_tokens"],
                                   do_sample=sample, temperature=0.9, seed=3, streams=call1["streams"])
    seq2, lp2 = rlkernels.generate(model, ids2, mask2, cuda_graph=True, max_new_tokens=call2["max_new_tokens"],
                                   do_sample=sample, temperature=0.9, seed=call2["seed"], streams=call2["streams"])
    assert torch.equal(seq1, first[0]) and torch.equal(lp1, first[1])
    assert torch.equal(seq2, second[0]) and torch.equal(lp2, second[1])
    assert decode.decode_graph(model).captures == 1
    for i in range(ids2.shape[0]):  # the trainer's log-probs of the second call's rows
        row = seq2[i][torch.cat([mask2[i].bool(), torch.ones(call2["max_new_tokens"], dtype=torch.bool,
                                                             device="cuda")])]
        assert torch.equal(token_logprobs(model, row[None], temperature=0.9)[0, -call2["max_new_tokens"]:], lp2[i])


@pytest.mark.gpu
def test_gpu_another_cache_length_or_batch_captures_again(count_captures):
    model = _gpu_model(torch.bfloat16)
    decode.release_decode_graphs(model)
    (ids1, mask1), (ids2, mask2) = _batches("cuda")
    kw = dict(greedy=False, temperature=0.9, seed=5)
    _graphed(model, ids1, mask1, max_new_tokens=12, **kw)
    state = decode.decode_graph(model)
    for ids, mask, new, streams in ((ids1, mask1, 13, None), (ids2[:3], mask2[:3], 17, None),
                                    (ids2, mask2, 16, torch.arange(4, device="cuda"))):
        before = count_captures[0]
        got = _graphed(model, ids, mask, max_new_tokens=new, streams=streams, **kw)
        now = decode.decode_graph(model)
        assert now is not state and now.captures == 1 and count_captures[0] == before + 1
        assert _same(got, _static(model, ids, mask, max_new_tokens=new, streams=streams, **kw))
        state = now
    # ids2 with 16 new tokens is ids1's cache length (9 + 16 = 14 + 11): back to replaying.
    before = count_captures[0]
    got = _graphed(model, ids1, mask1, max_new_tokens=11, **kw)
    assert decode.decode_graph(model) is state and count_captures[0] == before
    assert _same(got, _static(model, ids1, mask1, max_new_tokens=11, **kw))


@pytest.mark.gpu
def test_gpu_a_pinned_cache_length_replays_one_graph_across_prompt_lengths(count_captures):
    model = _gpu_model(torch.bfloat16)
    decode.release_decode_graphs(model)
    (ids1, mask1), (ids2, mask2) = _batches("cuda")
    kw = dict(greedy=False, temperature=0.9, seed=5, cache_len=40)
    calls = [(ids1, mask1, 12), (ids2, mask2, 20), (ids2[:, 3:], mask2[:, 3:], 7)]
    got = [_graphed(model, ids, mask, max_new_tokens=new, **kw) for ids, mask, new in calls]
    assert count_captures[0] == 1 and decode.decode_graph(model).calls == 3
    for out, (ids, mask, new) in zip(got, calls):  # an unpinned eager call's bits
        assert _same(out, _static(model, ids, mask, max_new_tokens=new, greedy=False, temperature=0.9, seed=5))
    decode.release_decode_graphs(model)


@pytest.mark.gpu
def test_gpu_a_new_parameter_object_captures_again_instead_of_replaying_stale_pointers(count_captures):
    model = _gpu_model(torch.bfloat16)
    decode.release_decode_graphs(model)
    (ids1, mask1), _ = _batches("cuda")
    kw = dict(greedy=False, temperature=0.9, seed=7, max_new_tokens=10)
    _graphed(model, ids1, mask1, **kw)
    state = decode.decode_graph(model)
    head = model.get_output_embeddings()
    old = head.weight  # kept alive: a replay through its pointer would read the old values
    head.weight = torch.nn.Parameter(old.detach().clone().mul_(3))
    before = count_captures[0]
    got = _graphed(model, ids1, mask1, **kw)
    assert decode.decode_graph(model) is not state and count_captures[0] == before + 1
    assert _same(got, _static(model, ids1, mask1, **kw))
    # Written in place (an optimizer step): the graph stays and reads the new values.
    state = decode.decode_graph(model)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    before = count_captures[0]
    got = _graphed(model, ids1, mask1, **kw)
    assert decode.decode_graph(model) is state and count_captures[0] == before
    assert _same(got, _static(model, ids1, mask1, **kw))
    del old


@pytest.mark.gpu
@pytest.mark.parametrize("truncation", [dict(top_k=40), dict(top_p=0.9), dict(top_k=100, top_p=0.95)],
                         ids=["top_k", "top_p", "both"])
def test_gpu_a_truncated_graphed_decode_is_the_eager_one_and_the_thresholded_trainer(truncation):
    model = _gpu_model(torch.bfloat16)
    with torch.no_grad():  # a trained model's logit spread
        model.get_output_embeddings().weight.mul_(40.0)
    decode.release_decode_graphs(model)
    (ids, mask), _ = _batches("cuda")
    kw = dict(max_new_tokens=24, greedy=False, temperature=0.9, seed=5,
              streams=torch.tensor([3, 1, 4, 1 << 35], device="cuda"), return_thresholds=True, **truncation)
    graphed = _graphed(model, ids, mask, **kw)
    again = _graphed(model, ids, mask, **kw)  # replayed from the kept graph
    eager = _static(model, ids, mask, **kw)
    assert _same(graphed, eager) and _same(again, eager)
    seq, lp, _, tau = graphed
    assert torch.isfinite(tau).all()
    L = ids.shape[1]
    full_mask = torch.cat([mask, torch.ones_like(seq[:, L:])], dim=1)
    threshold = torch.full((seq.shape[0], seq.shape[1] - 1), float("-inf"), device="cuda")
    threshold[:, L - 1:] = tau
    trainer = token_logprobs(model, seq, full_mask, temperature=0.9, logit_threshold=threshold)[:, L - 1:]
    assert torch.equal(trainer, lp)
    decode.release_decode_graphs(model)


def test_decode_steps_vouch_their_queries_real_and_zero_no_padding_row(monkeypatch):
    """The prefill of a left-padded batch zeroes its padding rows' attention; the decode steps
    feed real tokens only and skip that ``where`` (one launch per layer), with the same bits."""
    from rlkernels.integrations.hf import attention as hf_attention

    model = rlkernels.patch_model(_tiny("qwen3"))
    ids = torch.randint(1, 300, (3, 7), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    zeroed = []
    real_zero = hf_attention._zero
    monkeypatch.setattr(hf_attention, "_zero", lambda *a: zeroed.append(1) or real_zero(*a))
    vouched = _static(model, ids, mask, max_new_tokens=5, greedy=False, temperature=1.0, seed=3,
                      streams=torch.arange(3))
    layers = model.config.num_hidden_layers
    assert len(zeroed) == layers  # the prefill's, once per layer
    zeroed.clear()
    monkeypatch.setattr(decode, "QUERIES_REAL", "not_vouched")  # the same loop without the keyword
    plain = _static(model, ids, mask, max_new_tokens=5, greedy=False, temperature=1.0, seed=3,
                    streams=torch.arange(3))
    assert len(zeroed) == 5 * layers  # the prefill and four decode steps
    assert _same(vouched[:2], plain[:2])
