"""``rlkernels.rollout``: continuous-batching RL rollouts, each sample bitwise its prompt's decode alone.

A rollout engine keeps a fixed number of cache rows busy: a sample that ends frees its
row, and the next waiting sample takes it between two decode steps. Here every sample's
tokens and log-probs are, bit for bit, what :func:`rlkernels.generate` gives for its
prompt alone with its stream, whatever the other samples in the batch, the order of the
prompts, the batch size and the step at which the sample was admitted. Three properties
of a patched model make that hold:

* the patched attention reads each row's keys as one interval of the cache's slots and
  runs its fixed chain over them counted from the interval's first slot, so neither
  where the interval sits nor the cache's length changes a bit, and masked slots --
  stale, or even NaN -- contribute nothing (``docs/operators/attention.md``);
* every other op of the forward and the draw by :func:`rlkernels.linear_sample` are
  row-invariant: a row's result does not depend on the other rows;
* the draw of a sample's token at position p is keyed by (seed, the sample's stream, p),
  the keys :func:`rlkernels.generate` uses for a row.

The cache is one ``StaticCache`` (:func:`~rlkernels.integrations.hf.decode.new_cache`) of
``max_batch`` rows by S slots, whose write position is one device counter c shared by
every row and layer (:mod:`.static_cache`). A sample whose prompt has L tokens is placed
left-padded so that it ends at the counter: its prompt's keys and values fill slots
[c - L, c) of its row, its mask row is 1 there, and its position ids are its own (0 to
L - 1, then L + t for its t-th new token), as in a left-padded row of ``generate``.
Samples wait shortest prompt first, and the waiting prompts whose samples the free rows
take are prefilled together (so a group's prompts are of about one length), one left-padded
batch in a cache of its own (each row is its prompt's prefill alone, bit for bit: padding
and batch-mates change no bit); a prompt's n samples' first tokens are drawn from its one
forward and its keys and values are copied into each sample's row. A decode step feeds
every row its last token, writes slot c of every row and advances c by one; a row
without a sample is fed token 0 with only slot c unmasked (finite, discarded). When c reaches S, every row's keys
are moved left so that the longest window starts at slot 0 and the counter moves back
with them (copies only). The memory the keys and values take is therefore bounded by
``max_batch`` x S slots per layer, S = longest prompt + 1.5 x ``max_new_tokens``
(:func:`default_slots`).

A step runs the cache's first b rows only, b the smallest of the step batches
(:func:`step_batches`) that holds every row in use: a sample takes the lowest free row,
and once no sample waits and the samples left fit a smaller step batch than their
highest row needs, those past it move down into its free rows (their keys, values and
mask copied to the same slots). So the tail of a rollout, where few samples are left,
runs at a small batch. A row's bits depend on neither b nor the row it sits in.

With ``cuda_graph`` the decode step at each b -- decoder, final norm, head and draw -- is
captured (:class:`~rlkernels.integrations.hf.decode.DecodeGraph`) after one eager step at
that b and replayed, every graph in one memory pool: its inputs (token ids, positions,
streams, the mask over every slot, the seed, the cache's rows and its counter) are views
of fixed buffers that admissions, the per-step input copies, the moves and the
compaction write in place.
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
from torch import nn

from ...ops._validate import require_temperature
from ...ops.linear_sample import SEED_LIMIT
from ...ops.lm_head.config import NO_TRANSFORM, LogitTransform
from ...ops.lm_head.truncation import truncates, validate_truncation
from ..trainers import fsdp
from . import decode, moe, static_cache
from .coverage import decoder_of, is_patched, mode_for
from .scoring import check_head, eos_token_ids, head_vocab, is_int, vocab_parallel, vocab_size

OP = "rollout"
logger = logging.getLogger(__name__)

# Rows of the cache when max_batch is None off CUDA; on CUDA, what free memory holds.
CPU_MAX_BATCH = 64
# The share of free device memory the automatic max_batch gives the cache and mask; the
# rest is left for the step's activations and the prefill.
CACHE_MEMORY_SHARE = 0.5
# While samples decode, waiting ones are admitted once max(n, max_batch // ADMIT_SHARE)
# rows are free: an admission's prefill forward and its copies cost about as much for a
# few prompts as for one, and a few rows idle for a few steps cost less.
ADMIT_SHARE = 16


@dataclass(frozen=True, eq=False)  # tensors have no single truth value: identity equality
class RolloutSample:
    """One sample of :func:`rollout`.

    ``prompt``: the prompt's index, ``sample``: j in [0, n), ``stream``: the stream its
    draws are keyed by. ``tokens``: int64 [T], the new tokens (the EOS included where one
    was drawn); ``logprobs``: fp32 [T], each token's log-prob at the rollout's
    temperature, no autograd graph; ``entropy``: fp32 [T] with ``return_entropy``, else
    None; ``finished``: True where the sample ended with an EOS token (False where it
    ran to ``max_new_tokens``); ``thresholds``: fp32 [T] where the rollout truncates
    (``top_k``/``top_p``), each draw's kept-set threshold (the ``logit_threshold`` under
    which :func:`rlkernels.token_logprobs` gives ``logprobs``), else None.
    """

    prompt: int
    sample: int
    stream: int
    tokens: torch.Tensor
    logprobs: torch.Tensor
    entropy: torch.Tensor | None
    finished: bool
    thresholds: torch.Tensor | None = None


@dataclass
class _Plan:
    """The checked arguments of one rollout."""

    prompts: list[list[int]]
    n: int
    max_new_tokens: int
    temperature: float
    greedy: bool
    seed: int
    streams: list[int]
    eos: frozenset[int]
    max_batch: int
    prefill_tokens: int
    admit_rows: int  # the free rows that admit waiting samples while others decode
    step_batches: tuple[int, ...]  # the batch sizes a decode step runs at, ascending
    slots: int
    cuda_graph: bool
    keep: bool
    device: torch.device
    return_entropy: bool
    top_k: int = 0
    top_p: float = 1.0
    transform: LogitTransform = NO_TRANSFORM  # the model's logits from its head's (check_head)
    shared_prompt_reads: bool = True  # a prompt's samples read one copy of its keys (_prompt_copies)

    @property
    def truncating(self) -> bool:
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0)

    @property
    def longest(self) -> int:
        return max(len(p) for p in self.prompts)


def _prompt_ids(prompts: object, vocab: int | None, max_positions: int | None) -> list[list[int]]:
    """Each prompt as a list of ids, checked: no padding is possible, so no 2-D tensor."""
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() == 2:
            raise ValueError("rlkernels.rollout: prompts is a 2-D tensor, whose padding would be ambiguous; "
                             "pass a list of prompts (token-id lists or 1-D tensors), each without padding")
        raise ValueError(f"rlkernels.rollout: prompts must be a list of prompts (token-id lists or 1-D tensors), "
                         f"got a {prompts.dim()}-D tensor")
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"rlkernels.rollout: prompts must be a list of prompts (token-id lists or 1-D tensors), "
                        f"got {type(prompts).__name__}")
    out = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, torch.Tensor):
            if prompt.dim() != 1:
                raise ValueError(f"rlkernels.rollout: prompts[{i}] is a {prompt.dim()}-D tensor; each prompt is a "
                                 "1-D tensor or a list of token ids")
            if prompt.dtype.is_floating_point or prompt.dtype.is_complex or prompt.dtype == torch.bool:
                raise TypeError(f"rlkernels.rollout: prompts[{i}] must hold integer token ids, got {prompt.dtype}")
            ids = prompt.tolist()
        elif isinstance(prompt, (list, tuple)):
            bad = next((v for v in prompt if not is_int(v)), None)
            if bad is not None:
                raise TypeError(f"rlkernels.rollout: prompts[{i}] must hold integer token ids, got "
                                f"{type(bad).__name__} {bad!r}")
            ids = [int(v) for v in prompt]
        else:
            raise TypeError(f"rlkernels.rollout: prompts[{i}] must be a list of token ids or a 1-D tensor, got "
                            f"{type(prompt).__name__}")
        if not ids:
            raise ValueError(f"rlkernels.rollout: prompts[{i}] is empty; every prompt needs at least one token")
        if vocab is not None:
            k = next((k for k, v in enumerate(ids) if not 0 <= v < vocab), None)
            if k is not None:
                raise ValueError(f"rlkernels.rollout: prompts[{i}][{k}] = {ids[k]} is outside the model's "
                                 f"vocabulary [0, {vocab})")
        if max_positions is not None and len(ids) > max_positions:
            raise ValueError(f"rlkernels.rollout: prompts[{i}] has {len(ids)} tokens, more than the model's "
                             f"max_position_embeddings ({max_positions})")
        out.append(ids)
    return out


def _stream_ids(streams: object, count: int) -> list[int]:
    if streams is None:
        return list(range(count))
    if isinstance(streams, torch.Tensor):
        if streams.dim() != 1 or streams.dtype.is_floating_point or streams.dtype == torch.bool:
            raise ValueError(f"rlkernels.rollout: streams must be a 1-D integer tensor or a list of ints, got "
                             f"{streams.dtype} {tuple(streams.shape)}")
        values = streams.tolist()
    elif isinstance(streams, (list, tuple)):
        bad = next((v for v in streams if not is_int(v)), None)
        if bad is not None:
            raise TypeError(f"rlkernels.rollout: streams must be ints, got {type(bad).__name__} {bad!r}")
        values = [int(v) for v in streams]
    else:
        raise TypeError(f"rlkernels.rollout: streams must be a list of ints or a 1-D tensor, got "
                        f"{type(streams).__name__}")
    if len(values) != count:
        raise ValueError(f"rlkernels.rollout: streams has {len(values)} entries; it needs one per sample, "
                         f"len(prompts) * n = {count}")
    if len(set(values)) != len(values):
        seen: set[int] = set()
        twice = next(v for v in values if v in seen or seen.add(v))
        raise ValueError(f"rlkernels.rollout: streams must be distinct (stream {twice} is repeated): two samples "
                         "of one prompt with one stream would draw the same tokens")
    out_of_range = next((v for v in values if not -SEED_LIMIT <= v < SEED_LIMIT), None)
    if out_of_range is not None:
        raise ValueError(f"rlkernels.rollout: stream {out_of_range} does not fit in int64")
    return values


def _text_config(model: nn.Module) -> Any:
    config = getattr(model, "config", None)
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config


def _slot_bytes(model: nn.Module, dtype: torch.dtype) -> int:
    """Bytes one cache slot of one row takes: keys and values of every layer, and the mask's entry."""
    config = _text_config(model)
    heads = getattr(config, "num_attention_heads", 1)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or getattr(config, "hidden_size", heads) // heads
    layers = getattr(config, "num_hidden_layers", 1)
    return layers * 2 * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size() + 8


def _auto_max_batch(model: nn.Module, device: torch.device, slots: int, samples: int, dtype: torch.dtype) -> int:
    """The rows of cache to keep: on CUDA, as many as ``CACHE_MEMORY_SHARE`` of the free memory
    holds (``slots`` slots each), at most one per sample; elsewhere min(samples, ``CPU_MAX_BATCH``)."""
    if device.type != "cuda":
        return max(1, min(samples, CPU_MAX_BATCH))
    free, _ = torch.cuda.mem_get_info(device)
    per_row = slots * _slot_bytes(model, dtype)
    rows = max(1, min(samples, int(free * CACHE_MEMORY_SHARE // per_row)))
    logger.debug("rlkernels.rollout: max_batch=None -> %d rows (%d samples; %.1f MiB free on %s, %d slots of "
                 "%.1f KiB per row)", rows, samples, free / 2**20, device, slots, per_row / slots / 2**10)
    return rows


def _model_device(model: nn.Module) -> tuple[torch.device, torch.dtype]:
    embedding = model.get_input_embeddings() if callable(getattr(model, "get_input_embeddings", None)) else None
    weight = getattr(embedding, "weight", None)
    if not isinstance(weight, torch.Tensor):
        weight = next(model.parameters())
    return weight.device, weight.dtype


def _check_model(model: nn.Module) -> None:
    if not is_patched(model):
        raise ValueError("rlkernels.rollout: the model is not patched; call rlkernels.patch_model(model) first (a "
                         "sample is its prompt's decode alone only where the attention is invariant to where a "
                         "row's keys sit in the cache, which the patched attention is)")


def default_slots(longest: int, max_new_tokens: int) -> int:
    """The slot cache's length where the call gives none: the longest prompt plus
    ``max_new_tokens`` (the widest window a row can hold), plus half of ``max_new_tokens``
    again (at least 64) before the counter runs out. A compaction then comes at most once
    per that many steps and copies every row's window once, about what a decode step reads
    of the keys; the memory a row takes, and so the rows a device holds, is what sets the
    batch."""
    return longest + max_new_tokens + max(max_new_tokens // 2, 64)


def step_batches(max_batch: int, smallest: int = 8, spacing: int = 32) -> tuple[int, ...]:
    """The batch sizes a decode step runs at: the powers of two from ``smallest`` up to
    ``spacing``, then the multiples of ``spacing``, below ``max_batch``, and ``max_batch``
    itself. A step of b rows costs about a fixed part plus b times a row's, so past
    ``spacing`` rows the sizes grow by ``spacing`` rather than doubling: a step computes
    fewer than ``spacing`` rows it does not use. Each size is one captured graph."""
    sizes = []
    b = max(1, smallest)
    while b < max_batch and b < spacing:
        sizes.append(b)
        b *= 2
    b = max(b, spacing)
    while b < max_batch:
        sizes.append(b)
        b += max(1, spacing)
    return (*sizes, max_batch)


def _plan(model: nn.Module, prompts: object, *, n: int, max_new_tokens: int, temperature: float, do_sample: bool,
          seed: int | None, streams: object, eos_token_id: object, max_batch: int | None, cuda_graph: bool | None,
          return_entropy: bool, slots: int | None, smallest_step_batch: int = 8, step_spacing: int = 32,
          prefill_tokens: int = 8192, admit_rows: int | None = None, keep: bool | None = None, top_k: int = 0,
          top_p: float = 1.0, shared_prompt_reads: bool = True) -> _Plan:
    """Every argument checked (errors name ``rlkernels.rollout``), before any compute."""
    head, transform = check_head(OP, model)
    validate_truncation(OP, top_k, top_p)
    if not is_int(n) or n < 1:
        raise ValueError(f"rlkernels.rollout: n must be an int >= 1, got {n!r}")
    if not is_int(max_new_tokens) or max_new_tokens < 0:
        raise ValueError(f"rlkernels.rollout: max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    temperature = require_temperature(OP, temperature)
    if max_batch is not None and (not is_int(max_batch) or max_batch < 1):
        raise ValueError(f"rlkernels.rollout: max_batch must be an int >= 1 (or None), got {max_batch!r}")
    config = _text_config(model)
    max_positions = getattr(config, "max_position_embeddings", None)
    ids = _prompt_ids(prompts, vocab_size(model), max_positions if is_int(max_positions) else None)
    stream_ids = _stream_ids(streams, len(ids) * n)
    greedy = not bool(do_sample)
    # Greedy draws truncate nothing (the argmax is always kept); neutral values are no truncation.
    if greedy or not truncates(int(top_k), float(top_p), head_vocab(head)):
        top_k, top_p = 0, 1.0
    if seed is not None and (not is_int(seed) or not 0 <= seed < SEED_LIMIT):
        kind = TypeError if not is_int(seed) else ValueError
        raise kind(f"rlkernels.rollout: seed must be a Python int in [0, 2^63) (or None), got {seed!r}")
    eos = frozenset(eos_token_ids(OP, model, eos_token_id))
    device, dtype = _model_device(model)
    decoder = decoder_of(model)
    if decode.takes_cache_position(decoder):
        raise ValueError("rlkernels.rollout: needs transformers 5.x, whose StaticCache counts its writes on the "
                         "device (this decoder takes cache_position, as transformers 4.x's do)")
    tensor_parallel = vocab_parallel(head)
    # Why the decode step cannot be captured on this model, if it cannot.
    no_graph = ("a tensor-parallel model's sampler runs eagerly" if tensor_parallel
                else f"the model is on {device}" if device.type != "cuda"
                else "an FSDP2 model gathers its parameters in every step's forward" if fsdp.is_fsdp(model)
                else "the decode step is captured for a patched model only" if not is_patched(model)
                else "a mixture-of-experts model's torch backend sizes one GEMM per expert on the host every step"
                if moe.has_moe_blocks(model) and not moe.experts_capture(device) else None)
    if cuda_graph and no_graph is not None:
        raise ValueError(f"rlkernels.rollout: cuda_graph=True cannot capture the decode step here: {no_graph}; "
                         "pass cuda_graph=False (or None)")
    longest = max((len(p) for p in ids), default=0)
    window = longest + max_new_tokens
    samples = len(ids) * n
    graphed = no_graph is None if cuda_graph is None else bool(cuda_graph)
    keep = graphed if keep is None else bool(keep)
    kept = decode.kept_state("rollout", model) if keep else None
    if (slots is None and kept is not None and not kept.in_use and kept.slots >= window
            and max_batch in (None, kept.max_batch)):
        # The engine a graphed call kept fits: its rows and slots, so its graphs replay.
        slots, max_batch = kept.slots, kept.max_batch
    else:
        if slots is None:
            slots = default_slots(longest, max_new_tokens)
        elif slots < window:
            i = next(i for i, p in enumerate(ids) if len(p) == longest)
            raise ValueError(f"rlkernels.rollout: prompts[{i}] ({longest} tokens) plus max_new_tokens "
                             f"({max_new_tokens}) does not fit in {slots} cache slots")
        if max_batch is None:
            max_batch = _auto_max_batch(model, device, slots, samples, dtype) if samples else 1
        max_batch = max(1, min(max_batch, samples))
    if seed is None:
        seed = int(torch.randint(0, 1 << 62, (1,))) if not greedy else 0  # generate's draw of a seed
    if admit_rows is None:
        admit_rows = max(n, max_batch // ADMIT_SHARE)
    return _Plan(prompts=ids, n=n, max_new_tokens=max_new_tokens, temperature=temperature, greedy=greedy,
                 seed=seed, streams=stream_ids, eos=eos, max_batch=max_batch, prefill_tokens=prefill_tokens,
                 admit_rows=max(1, admit_rows),
                 step_batches=step_batches(max_batch, smallest_step_batch, step_spacing), slots=slots,
                 cuda_graph=graphed, keep=keep, device=device,
                 return_entropy=bool(return_entropy), top_k=int(top_k), top_p=float(top_p), transform=transform,
                 shared_prompt_reads=bool(shared_prompt_reads))


# The step's input rows, int64 [len, max_batch]: each row's fed token, its position, its
# stream, whether a sample holds it, and its shared prompt (:meth:`_Rollout._prompt_copies`).
_INPUT_ROWS = ("token", "position", "stream", "in_use", "prompt_src", "prompt_len")


class _Engine:
    """What a rollout decodes on, kept across graphed calls (``decode.acquire("rollout",
    ...)``, keyed by :func:`~rlkernels.integrations.hf.decode.decode_key` of its rows and
    slots): the slot cache, the step's input buffers (the rows of ``_INPUT_ROWS``, filled
    from a pinned staging tensor; the mask over every slot; the seed), and per step batch b
    the cache's first b rows and, once captured, the step's graph, every graph in one
    memory pool."""

    def __init__(self, key: tuple | None, model: nn.Module, plan: _Plan) -> None:
        dev, B, S = plan.device, plan.max_batch, plan.slots
        self.key = key
        self.in_use = False
        self.max_batch, self.slots = B, S
        self.cache = decode.new_cache(model, S)
        self.counters: list[torch.Tensor] = []  # the cache's shared write counter, once it has storage
        self.inputs = torch.zeros(len(_INPUT_ROWS), B, dtype=torch.long, device=dev)
        self.staging = torch.zeros(len(_INPUT_ROWS), B, dtype=torch.long, pin_memory=dev.type == "cuda")
        self.mask = torch.zeros(B, S, dtype=torch.long, device=dev)
        self.seed = torch.zeros((), dtype=torch.long, device=dev)
        self.caches: dict[int, Any] = {}
        self.graphs: dict[int, decode.DecodeGraph] = {}
        self.graph_pool = torch.cuda.graph_pool_handle() if plan.cuda_graph else None


class _Rollout:
    """The host bookkeeping of one rollout, on an :class:`_Engine`.

    The bookkeeping is arrays, so that a step's host work is a few vectorized operations
    whatever the batch: per sample (in the results' order) its prompt length, stream,
    tokens drawn so far, last token (drawn, not yet in the cache), and whether it ended
    (by EOS, or by either EOS or ``max_new_tokens``); per cache row the sample it holds
    (-1: none). Every draw's (token, log-prob, entropy) goes into a pool, with the sample
    each of its rows belongs to; the results gather each sample's rows in draw order.
    """

    def __init__(self, model: nn.Module, plan: _Plan, engine: _Engine) -> None:
        self.plan = plan
        self.model = model
        self.decoder = decoder_of(model)
        self.head = model.get_output_embeddings()
        self.engine = e = engine
        self.cache, self.inputs, self.staging, self.mask, self.seed = e.cache, e.inputs, e.staging, e.mask, e.seed
        self.staging_view = self.staging.numpy()  # the same memory
        B = plan.max_batch
        self.ids = self.inputs[0].view(B, 1)
        self.positions = self.inputs[1].view(B, 1)
        self.streams = self.inputs[2]
        self.in_use = self.inputs[3]
        self.shared = self.inputs[4:6]  # (the row whose prompt copy to read, its length)
        # The last prefill: its cache, and each of its prompts' (row there, length).
        self.prefill_cache: Any = None
        self.prefilled: dict[int, tuple[int, int]] = {}
        self.counter = 0  # the host's copy of the cache's write position c
        self.mask.zero_()
        self.seed.fill_(plan.seed)
        if e.counters:  # a kept engine's cache: every admitted prompt ends at the longest's length
            self._set_counter(plan.longest)
        count = len(plan.streams)
        self.prompt_of = np.arange(count) // plan.n
        self.length = np.array([len(p) for p in plan.prompts], dtype=np.int64)[self.prompt_of]
        self.stream = np.array(plan.streams, dtype=np.int64)
        self.drawn = np.zeros(count, dtype=np.int64)
        self.last = np.zeros(count, dtype=np.int64)
        self.finished = np.zeros(count, dtype=bool)
        self.done = np.zeros(count, dtype=bool)
        self.eos = np.array(sorted(plan.eos), dtype=np.int64)
        self.row_sample = np.full(B, -1, dtype=np.int64)
        self.pool: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.pool_owner: list[np.ndarray] = []

    # ----------------------------------------------------------------- drawing
    def _take(self, drawn: tuple[torch.Tensor, torch.Tensor, torch.Tensor], owner: np.ndarray) -> None:
        """Keep a draw in the pool and give row k's token to sample ``owner[k]`` (-1: no
        sample); a sample ends at an EOS or at max_new_tokens."""
        self.pool.append(drawn)
        self.pool_owner.append(owner)
        tokens = drawn[0].cpu().numpy()
        taken = owner >= 0
        samples, tokens = owner[taken], tokens[taken]
        self.drawn[samples] += 1
        self.last[samples] = tokens
        self.finished[samples] = np.isin(tokens, self.eos)
        self.done[samples] = self.finished[samples] | (self.drawn[samples] == self.plan.max_new_tokens)

    def _prefill(self, prompts: list[int]) -> None:
        """``generate``'s prefill of ``prompts`` as one left-padded batch (each row's bits are
        its prompt's alone), in a cache of their own, then the first draw of each of their n
        samples."""
        plan = self.plan
        dev = plan.device
        lengths = [len(plan.prompts[p]) for p in prompts]
        width = max(lengths)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for i, (p, L) in enumerate(zip(prompts, lengths)):
            ids[i, width - L:] = torch.tensor(plan.prompts[p])
            mask[i, width - L:] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        self.prefill_cache = decode.new_cache(self.model, width)
        self.prefilled = {p: (i, L) for i, (p, L) in enumerate(zip(prompts, lengths))}
        hidden = decode.last_hidden(self.decoder, self.prefill_cache, ids, mask,
                                    (mask.cumsum(-1) - 1).clamp(min=0))
        n = plan.n
        owner = (np.asarray(prompts)[:, None] * n + np.arange(n)).reshape(-1)
        # One hidden row per sample: rows are independent in the draw, keyed by each one's stream.
        drawn = decode.draw(self.head, hidden.repeat_interleave(n, dim=0), temperature=plan.temperature,
                            greedy=plan.greedy, seed=self.seed, streams=torch.from_numpy(self.stream[owner]).to(dev),
                            positions=torch.tensor(lengths, device=dev).repeat_interleave(n), top_k=plan.top_k,
                            top_p=plan.top_p, transform=plan.transform)
        self._take(drawn, owner)

    # ----------------------------------------------------------------- the slot cache
    def _allocate(self) -> None:
        """Give the slot cache its storage, shaped as the prefill cache's layers with max_batch
        rows, through its own update (which also sets up the shared counter), then put the
        counter at the longest prompt's length: every admitted prompt ends at it."""
        B = self.plan.max_batch
        for layer, like in zip(self.cache.layers, self.prefill_cache.layers):
            k, v = like.keys, like.values
            layer.update(k.new_zeros(B, k.shape[1], 1, k.shape[3]), v.new_zeros(B, v.shape[1], 1, v.shape[3]))
        counters = {id(layer.cumulative_length): layer.cumulative_length for layer in self.cache.layers}
        self.engine.counters = list(counters.values())
        self._set_counter(self.plan.longest)

    def _set_counter(self, value: int) -> None:
        for counter in self.engine.counters:
            counter.fill_(value)
        self.counter = value

    def _place(self, placing: dict[int, list[int]]) -> None:
        """Copy each prefilled prompt's keys and values into its rows (``placing``: prompt ->
        rows) so that they end at the counter c, and unmask its L slots [c - L, c).

        One copy per layer for all of them: the prefill's whole width W (its longest prompt;
        c >= W) goes to slots [c - W, c), a shorter prompt's left padding included, which
        its mask leaves out of the chain."""
        if not placing:
            return
        if not self.engine.counters:
            self._allocate()
        c = self.counter
        width = self.prefill_cache.layers[0].keys.shape[2]
        rows = [r for p in placing for r in placing[p]]
        sources = [self.prefilled[p][0] for p in placing for _ in placing[p]]
        lengths = [self.prefilled[p][1] for p in placing for _ in placing[p]]
        dev = self.plan.device
        rows_t, sources_t, lengths_t = (torch.tensor(v, dtype=torch.long, device=dev) for v in (rows, sources, lengths))
        for layer, source in zip(self.cache.layers, self.prefill_cache.layers):
            layer.keys[rows_t, :, c - width:c] = source.keys[sources_t]
            layer.values[rows_t, :, c - width:c] = source.values[sources_t]
        slots = torch.arange(self.mask.shape[1], device=dev)
        self.mask[rows_t] = ((slots >= c - lengths_t[:, None]) & (slots < c)).to(self.mask.dtype)

    def _window(self, rows: np.ndarray) -> int:
        """The longest key window among ``rows``' samples: prompt and every drawn token but the last."""
        samples = self.row_sample[rows]
        return int((self.length[samples] + self.drawn[samples] - 1).max())

    def compact(self) -> None:
        """Move every row's keys, values and mask left by c - w, w the longest window in use (at
        least the longest prompt), and the counter with them: the windows keep their ends
        aligned at the counter, and the next steps have S - w free slots. Copies only."""
        used = np.flatnonzero(self.row_sample >= 0)
        width = max(self.plan.longest, self._window(used)) if used.size else self.plan.longest
        c = self.counter
        shift = c - width
        for layer in self.cache.layers:
            layer.keys[:, :, :width] = layer.keys[:, :, shift:c].clone()
            layer.values[:, :, :width] = layer.values[:, :, shift:c].clone()
        self.mask[:, :width] = self.mask[:, shift:c].clone()
        self.mask[:, width:] = 0
        self._set_counter(width)

    def step_batch(self, rows: int) -> int:
        """The smallest step batch that holds the cache's first ``rows`` rows."""
        return next(b for b in self.plan.step_batches if b >= rows)

    def pack(self) -> None:
        """Where the samples in use fit a smaller step batch than their highest row needs, move
        those in rows at or past that batch into its free rows, so that the next steps run at
        it. Copies only: a row's keys, values and mask move to the same slots of another row.

        A move costs two copies per layer, so rows move only when the step shrinks: moving
        the top sample down whenever any lower one ends would copy at most steps."""
        used = np.flatnonzero(self.row_sample >= 0)
        if not used.size:
            return
        b = self.step_batch(used.size)
        if self.step_batch(int(used[-1]) + 1) == b:
            return
        sources = used[used >= b]
        targets = np.flatnonzero(self.row_sample[:b] < 0)[:sources.size]
        c = self.counter
        start = c - self._window(sources)  # the widest window's first slot
        dev = self.plan.device
        src, dst = (torch.from_numpy(rows).to(dev) for rows in (sources, targets))
        for layer in self.cache.layers:
            layer.keys[dst, :, start:c] = layer.keys[src, :, start:c]
            layer.values[dst, :, start:c] = layer.values[src, :, start:c]
        self.mask[dst] = self.mask[src]
        self.row_sample[targets] = self.row_sample[sources]
        self.row_sample[sources] = -1

    # ----------------------------------------------------------------- the loop
    def _group(self, waiting: deque[int], free: int) -> list[int]:
        """The prompts to prefill together: the waiting ones in order, from the first, while
        their samples fit in ``free`` rows and the padded batch in ``prefill_tokens``
        (at least one prompt)."""
        plan = self.plan
        group: list[int] = []
        samples = width = 0
        for sample in waiting:
            prompt = int(self.prompt_of[sample])
            if group and prompt == group[-1]:
                continue
            samples += plan.n
            width = max(width, len(plan.prompts[prompt]))
            if group and (samples > free or (len(group) + 1) * width > plan.prefill_tokens):
                break
            group.append(prompt)
        return group

    def _admits(self, waiting: int) -> bool:
        """Whether to admit now: no sample decodes, or ``admit_rows`` rows are free (or as
        many as samples wait)."""
        free = int((self.row_sample < 0).sum())
        return free == self.plan.max_batch or free >= min(self.plan.admit_rows, waiting)

    def _admit(self, waiting: deque[int]) -> None:
        """Fill the free rows with waiting samples, prompt-major; a sample whose first draw ends it takes none."""
        free = deque(np.flatnonzero(self.row_sample < 0).tolist())
        placing: dict[int, list[int]] = {}  # prompt -> the rows taking its samples
        while waiting and free:
            sample = waiting[0]
            prompt = int(self.prompt_of[sample])
            if prompt not in self.prefilled:
                self._place(placing)  # the prefill cache is about to hold other prompts
                placing = {}
                self._prefill(self._group(waiting, len(free)))
            waiting.popleft()
            if self.done[sample]:
                continue
            row = free.popleft()
            self.row_sample[row] = sample
            placing.setdefault(prompt, []).append(row)
        self._place(placing)

    def _step(self) -> None:
        """One decode step of the first b rows, b the smallest step batch holding every row in
        use; each row in use takes its drawn token."""
        if self.counter == self.plan.slots:
            self.compact()
        b = self.step_batch(int(np.flatnonzero(self.row_sample >= 0)[-1]) + 1)
        owner = self.row_sample[:b].copy()
        used = owner >= 0
        samples = owner[used]
        staging = self.staging_view[:, :b]
        staging.fill(0)
        # The fed token is the sample's last drawn one, at position L + drawn - 1.
        staging[0, used] = self.last[samples]
        staging[1, used] = self.length[samples] + self.drawn[samples] - 1
        staging[2, used] = self.stream[samples]
        staging[3, used] = 1
        staging[4] = np.arange(b)
        if self.plan.shared_prompt_reads:
            staging[4, used], staging[5, used] = self._prompt_copies(np.flatnonzero(used), samples)
        self.inputs[:, :b].copy_(self.staging[:, :b], non_blocking=True)
        c = self.counter
        self.mask[:b].mul_(self.in_use[:b, None])  # rows not in use: only the slot written now
        self.mask[:b, c] = 1
        drawn = self._forward(b)
        self.counter = c + 1
        self._take(drawn, owner)
        ended = np.flatnonzero(used)[self.done[samples]]
        self.row_sample[ended] = -1

    def _prompt_copies(self, rows: np.ndarray, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(src, length) of the samples in ``rows`` (ascending): the lowest of those rows
        holding a sample of the same prompt, and the prompt's length. Every sample's row holds
        its prompt's keys and values bit for bit (one prefill's, copied), so the attention
        reads those of a prompt's samples once, from one row (``attention_by_bounds``'
        ``shared_keys``)."""
        _, first, group = np.unique(self.prompt_of[samples], return_index=True, return_inverse=True)
        return rows[first][group], self.length[samples]

    def _forward(self, b: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The decode step of the cache's first ``b`` rows: eager, or replayed from the graph
        captured at ``b`` (captured on its second use: the first, eager, compiled every kernel)."""
        plan, engine = self.plan, self.engine
        if b not in engine.caches:
            engine.caches[b] = self.cache if b == plan.max_batch else static_cache.first_rows(self.cache, b)
        cache = engine.caches[b]

        def step():
            return decode.decode_step(self.decoder, self.head, cache, self.ids[:b], self.mask[:b],
                                      self.positions[:b], temperature=plan.temperature, greedy=plan.greedy,
                                      seed=self.seed, streams=self.streams[:b], top_k=plan.top_k, top_p=plan.top_p,
                                      transform=plan.transform, queries_real=True,  # slot c is set in every row
                                      shared_keys=self.shared[:, :b].to(torch.int32).unbind(0))

        if not plan.cuda_graph:
            return step()
        graph = engine.graphs.setdefault(b, decode.DecodeGraph(None, cache, None))
        if graph.graph is None and graph.warm:
            graph.capture(step, engine.graph_pool)
        if graph.graph is not None:
            graph.graph.replay()
            return tuple(x.clone() for x in graph.graph_out)
        out = step()
        graph.warm = True
        return out

    def run(self) -> list[RolloutSample]:
        plan = self.plan
        if plan.max_new_tokens > 0:
            # Shortest prompts first: a prefill group pads to its longest prompt, so prompts
            # of about one length are prefilled together.
            waiting = deque(np.argsort(self.length, kind="stable").tolist())
            while True:
                if waiting and self._admits(len(waiting)):
                    self._admit(waiting)
                if not (self.row_sample >= 0).any():
                    break
                if not waiting:  # nothing will take the free rows: shrink the step
                    self.pack()
                self._step()
        return self._results()

    def _results(self) -> list[RolloutSample]:
        plan = self.plan
        dev = plan.device
        count = len(self.stream)
        if self.pool:
            owner = np.concatenate(self.pool_owner)
            kept = np.flatnonzero(owner >= 0)
            # Each sample's draws, in the order drawn: a stable sort by sample of the pool's rows.
            order = torch.from_numpy(kept[np.argsort(owner[kept], kind="stable")]).to(dev)
            lengths = np.bincount(owner[kept], minlength=count).tolist()
            tokens, logps, entropies, *thresholds = (torch.cat(part)[order].split(lengths)
                                                     for part in zip(*self.pool))
        else:
            tokens = [torch.zeros(0, dtype=torch.long, device=dev)] * count
            logps = entropies = [torch.zeros(0, dtype=torch.float32, device=dev)] * count
            thresholds = [logps] if plan.truncating else []
        return [RolloutSample(prompt=int(self.prompt_of[i]), sample=i % plan.n, stream=int(self.stream[i]),
                              tokens=tokens[i], logprobs=logps[i],
                              entropy=entropies[i] if plan.return_entropy else None,
                              finished=bool(self.finished[i]),
                              thresholds=thresholds[0][i] if plan.truncating else None)
                for i in range(count)]


def _run(model: nn.Module, plan: _Plan, batch_invariant: bool | None) -> list[RolloutSample]:
    with torch.no_grad(), mode_for(model, batch_invariant):
        # A graphed rollout keeps its engine for the next call whose steps launch the same
        # kernels on the same memory (generate's rule: decode.decode_key); an eager one keeps nothing.
        key = (decode.decode_key(model, plan.max_batch, plan.slots, plan.device, plan.temperature, plan.greedy,
                                 plan.top_k, plan.top_p) if plan.keep else None)

        def make() -> _Engine:
            return _Engine(key, model, plan)

        engine, kept = decode.acquire("rollout", model, key, make) if plan.keep else (make(), False)
        try:
            return _Rollout(model, plan, engine).run()
        except BaseException:
            if kept:
                decode.drop("rollout", model, engine)
            raise
        finally:
            engine.in_use = False


def _rollout(model: nn.Module, prompts: Sequence[Sequence[int] | torch.Tensor], *, n: int = 1, max_new_tokens: int,
             temperature: float = 1.0, do_sample: bool = True, seed: int | None = None,
             streams: Sequence[int] | torch.Tensor | None = None, eos_token_id: int | Sequence[int] | None = None,
             max_batch: int | None = None, cuda_graph: bool | None = None, return_entropy: bool = False,
             slots: int | None = None, smallest_step_batch: int = 8, step_spacing: int = 32,
             prefill_tokens: int = 8192, admit_rows: int | None = None, keep: bool | None = None,
             batch_invariant: bool | None = None, top_k: int = 0, top_p: float = 1.0,
             shared_prompt_reads: bool = True) -> list[RolloutSample]:
    """:func:`rollout` on any model, patched or not (``batch_invariant`` as in
    :func:`rlkernels.token_logprobs`), with the slot cache's length ``slots`` (None:
    :func:`default_slots`; at least the longest prompt plus
    ``max_new_tokens``), the smallest batch a decode step runs at and the spacing of the
    larger ones (:func:`step_batches`), the padded tokens a batch of prompts prefilled
    together may hold (at least one prompt), and the free rows ``admit_rows`` at which
    waiting samples are admitted while others decode (None: max(n, max_batch // 16)).
    ``keep`` (None: as the step is graphed): decode on the engine kept for the model and
    keep it for the next call (:class:`_Engine`); on the CPU, for tests of that reuse.
    ``shared_prompt_reads=False``: every row reads its own copy of its prompt's keys (the
    same bits). For comparisons and tuning: only a patched model's samples are their
    prompts' decodes alone."""
    plan = _plan(model, prompts, n=n, max_new_tokens=max_new_tokens, temperature=temperature, do_sample=do_sample,
                 seed=seed, streams=streams, eos_token_id=eos_token_id, max_batch=max_batch,
                 cuda_graph=cuda_graph, return_entropy=return_entropy, slots=slots,
                 smallest_step_batch=smallest_step_batch, step_spacing=step_spacing,
                 prefill_tokens=prefill_tokens, admit_rows=admit_rows, keep=keep, top_k=top_k, top_p=top_p,
                 shared_prompt_reads=shared_prompt_reads)
    if not plan.prompts:
        return []
    return fsdp.run_as_forward(model, _run, model, plan, batch_invariant)


def rollout(model: nn.Module, prompts: Sequence[Sequence[int] | torch.Tensor], *, n: int = 1, max_new_tokens: int,
            temperature: float = 1.0, do_sample: bool = True, seed: int | None = None,
            streams: Sequence[int] | torch.Tensor | None = None, eos_token_id: int | Sequence[int] | None = None,
            max_batch: int | None = None, cuda_graph: bool | None = None,
            return_entropy: bool = False, top_k: int = 0, top_p: float = 1.0) -> list[RolloutSample]:
    """Draw ``n`` samples of each prompt by continuous batching; each sample bitwise its prompt's decode alone.

    ``prompts``: a list of prompts, each a list of token ids or a 1-D integer tensor,
    unpadded (a 2-D tensor is refused: its padding would be ambiguous). Returns
    ``len(prompts) * n`` :class:`RolloutSample`, prompt-major: ``results[i * n + j]`` is
    sample j of prompt i, its ``tokens`` int64 [T] (T <= ``max_new_tokens``; an EOS token
    ends it and is kept, ``finished`` True), ``logprobs`` fp32 [T] (no autograd graph) and,
    with ``return_entropy``, ``entropy`` fp32 [T], on the model's device.

    Each sample's tokens and log-probs are bitwise those of
    ``rlkernels.generate(model, prompt[None], seed=seed, streams=[stream], temperature=T,
    do_sample=do_sample, max_new_tokens=..., eos_token_id=...)`` up to its EOS, whatever
    ``n``, ``max_batch``, the other prompts, their order and the step the sample was
    admitted at; and its log-probs are the trainer's
    (:func:`rlkernels.token_logprobs` of the prompt and its tokens at T). The draw of its
    token at position p is keyed by (``seed``, its stream, p), as ``generate`` keys a row.
    ``streams``: one distinct int per sample, in the results' order (None: ``i * n + j``);
    ``seed``: a Python int in [0, 2^63) (None: drawn from torch's default generator, as
    ``generate`` draws one; greedy needs none). ``do_sample=False`` takes each step's argmax
    (ties to the lowest id). ``eos_token_id``: an int or a list (None: the model's
    ``generation_config``'s). ``top_k`` (0: off) and ``top_p`` (1: off) draw each sampled
    token from the truncated distribution (:func:`rlkernels.linear_sample`): its log-prob is
    that distribution's, and each sample carries its draws' ``thresholds``, the
    ``logit_threshold`` under which ``token_logprobs`` gives those log-probs bitwise
    (``generate(..., top_k=, top_p=, return_thresholds=True)`` gives the same tokens).

    The samples share ``max_batch`` rows of one ``StaticCache`` of S = longest prompt + 1.5 x
    ``max_new_tokens`` slots (at least 64 past the window; module docstring): the keys and values take at most
    ``max_batch`` x S slots per layer. ``max_batch`` None: on CUDA, the rows half the free
    memory holds (logged at debug level), elsewhere 64; never more rows than samples. A
    graphed call keeps its cache and captured steps for the next call that fits them (the
    same T and sampling mode, the longest prompt plus ``max_new_tokens`` within its slots,
    ``max_batch`` None or the same), which then replays them;
    :func:`rlkernels.release_decode_graphs` frees them.
    ``cuda_graph`` None: the decode step is replayed as a CUDA graph on CUDA (eager for an
    FSDP2 model or a mixture-of-experts model on the torch backend, which
    ``cuda_graph=True`` refuses), eager elsewhere; graphed and eager give the same bits.

    Refused before any compute (ValueError or TypeError naming ``rlkernels.rollout``): a
    model that is not patched (:func:`rlkernels.patch_model`), a head that is not a plain
    linear layer, a 2-D tensor or anything but a list of prompts, an empty prompt, an id
    outside [0, vocab), a prompt longer than the model's ``max_position_embeddings``,
    ``n`` < 1, ``max_new_tokens`` < 0, a temperature that is not a finite number > 0,
    ``top_k`` < 0 or not an int, ``top_p`` outside (0, 1], a seed outside [0, 2^63), ``streams`` of the wrong length or with a repeated stream,
    ``max_batch`` < 1, and ``cuda_graph=True`` off CUDA or where the step cannot be captured.
    """
    _check_model(model)
    return _rollout(model, prompts, n=n, max_new_tokens=max_new_tokens, temperature=temperature,
                    do_sample=do_sample, seed=seed, streams=streams, eos_token_id=eos_token_id,
                    max_batch=max_batch, cuda_graph=cuda_graph, return_entropy=return_entropy,
                    top_k=top_k, top_p=top_p)
