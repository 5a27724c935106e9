"""A static-cache decode loop for a patched Hugging Face causal LM, replayed as a CUDA graph.

One step of it is :func:`decode_step`: a patched model's forward of the newest tokens on a
``StaticCache`` (:func:`new_cache`), then the :func:`rlkernels.linear_sample` draw of each
row's next token. :func:`static_generate` runs that step in a loop over a batch of prompts
(``rlkernels.generate`` calls it through :func:`decode_under_mode`).

Rollout engines decode through CUDA graphs: one decode step is dozens of small
kernels per layer, and launching them from Python costs more than running them.
This loop keeps every input of a decode step in a fixed buffer (token ids, position
ids, the padding mask over the whole cache, the draw's seed and streams, a
``StaticCache`` whose write position is a device counter), so the step -- decoder,
final norm, LM head and draw -- can be captured once with ``torch.cuda.graph`` and
replayed for every new token.

Replaying changes no bit: a graph replays the launches it recorded, and the patched
model's step is the same computation whatever the key length (a ``StaticCache``
hands the attention all its slots, ``L + max_new_tokens`` or the caller's ``cache_len``;
the slots past a row's end are masked out of the fixed chain, so the eager step and the
replayed one agree, and the cache's length changes no bit). The
draw is in the graph too: :func:`rlkernels.linear_sample` keys its noise by the seed,
the row's stream and the token's position, which live in fixed buffers (the seed as
an int64 tensor the kernels read). The prompt is prefilled eagerly; the first decode
step on a new :class:`DecodeGraph` runs eagerly too (it compiles every kernel and does
every one-time host query), and the next one is captured.

The cache's layers write their keys and values with one launch each, at one device
counter all layers share and the last one advances (:mod:`.static_cache`), instead of
transformers' five launches per layer.

Reuse across calls
------------------
With ``cuda_graph=True`` the cache, the buffers and the captured step are kept, one
:class:`DecodeGraph` per model (a ``weakref.WeakKeyDictionary``: it goes when the model
goes), and a later call whose step would launch the same kernels on the same memory
replays it from its first decode step: no eager step, no capture. The step bakes in
what :func:`decode_key` lists -- the batch size and the cache length (``L +
max_new_tokens``, or ``cache_len`` where the caller pins it: the buffers' and the
cache's shapes), the device, T and greedy vs
sampled (kernel arguments), the attention implementation, the batch-invariant mode,
autocast, training mode, the ``RLKERNELS_*`` switches, and every parameter's and
buffer's address, dtype, shape and strides plus every module's identity (the
addresses the launches read). The prompt length L is not in it: transformers 5.x's
``StaticLayer`` counts its writes in a device tensor (``cumulative_length``), which the
cache update and the attention's query offset read on the device, and 4.x writes at
the slots a ``cache_position`` buffer names; neither is a host value the graph bakes.
The seed and the streams are copied into their buffers, so they are not in it either.
A call with another key replaces the model's entry (the old cache and graph are freed
with it): the entry keeps only the most recent key. A loop whose prompt lengths vary
pins ``cache_len`` (its longest prompt plus ``max_new_tokens``) to keep one key.

Each reused call rewinds the cache (each layer's write counter to 0, one launch; with
transformers 4.x, whose static layers keep no counter, transformers' own ``reset()``,
which zeroes the keys and values) and refills the mask (0, then the prompt's), the seed
and the streams. Slots written by another call are not cleared: every slot the attention
reads in this call is written in this call first (the prompt's by the prefill, slot
``L + t`` by step t), and the rest are masked out of the chain, their K and V loads
masked to 0 (``docs/operators/attention.md``), so stale or even NaN values there change
no bit. An optimizer step or ``load_state_dict`` writes the weights in place and keeps
the graph valid; a new Parameter object, ``model.to(...)`` or a swapped module changes
the key and the next call captures again. What the key cannot see -- a hook added to
a module, a config field the forward reads on the host -- needs
:func:`release_decode_graphs` after the change.

Memory: the entry holds the ``StaticCache`` (B x cache length slots of keys and values
per layer) and the graph's private pool (one step's activations) after the call
returns, until the model goes, a call with another key replaces it, or
:func:`release_decode_graphs` drops it. ``cuda_graph=False`` keeps nothing.
"""
from __future__ import annotations

import inspect
import math
import threading
import weakref
from typing import Any, Callable

import torch
from torch import nn

from ..._env import SWITCHES, env_get
from ...ops.linear_sample import linear_sample, validate_seed
from ...ops.lm_head.config import NO_TRANSFORM, LogitTransform
from ...ops.lm_head.truncation import truncates
from ..aten_mode import is_batch_invariant_mode_enabled
from . import static_cache
from .attention import QUERIES_REAL, SHARED_KEYS
from .coverage import cache_kwargs, decoder_of, logit_transform, mode_for, parallel_modules

OP = "generate"

# What the loop knows how to do; anything else in generate_kwargs is refused.
SUPPORTED_OPTIONS = frozenset({"max_new_tokens", "do_sample", "pad_token_id", "eos_token_id"})

# One step's draw: (token [B] int64, logp [B] fp32, entropy [B] fp32), and each row's
# truncation threshold [B] fp32 where the draw truncates (top_k / top_p).
Drawn = tuple[torch.Tensor, ...]


class _StepBuffers:
    """The fixed inputs of one decode step (B rows; the mask spans the whole cache)."""

    def __init__(self, batch: int, total: int, device: torch.device, cache_position: bool) -> None:
        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.long, device=device)

        self.ids = zeros(batch, 1)          # [B, 1] long: the token fed to this step
        self.mask = zeros(batch, total)     # [B, L + T] long: 1 for every real key written so far
        self.positions = zeros(batch, 1)    # [B, 1] long: the position of the fed token
        self.seed = zeros()                 # [] int64: the draw's seed, read by the kernels
        self.streams = zeros(batch)         # [B] int64: each row's stream
        # [1] long: the slot the step writes (transformers 4.x); None where the cache counts.
        self.cache_position = zeros(1) if cache_position else None


class DecodeGraph:
    """One model's decode state for one :func:`decode_key`: the ``StaticCache``, the step's
    buffers and, once captured, the step's CUDA graph with its outputs.

    ``captures`` counts the graphs captured into it (at most 1), ``calls`` the decode
    calls that used it; ``warm`` is True once an eager decode step ran on it (kernels
    compiled, one-time host queries made), after which a step may be captured.
    """

    def __init__(self, key: tuple | None, cache: Any, buffers: _StepBuffers) -> None:
        self.key = key
        self.cache = cache
        self.buffers = buffers
        self.graph: torch.cuda.CUDAGraph | None = None
        self.graph_out: Drawn | None = None
        self.warm = False
        self.captures = 0
        self.calls = 0
        self.in_use = False

    def capture(self, step: Callable[[], Drawn], pool: tuple | None = None) -> None:
        """Record ``step`` (recording runs nothing: the cache's write counter advances only
        when the graph replays). ``pool``: a ``torch.cuda.graph_pool_handle()`` shared with
        other graphs that never replay concurrently with this one (None: a pool of its own)."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = step()
        self.graph, self.graph_out = graph, out
        self.captures += 1


# The decode state kept per model while the model lives, one entry per kind: "generate"'s
# DecodeGraph and "rollout"'s engine (:mod:`.continuous_batching`). An entry holds no
# reference to the model: caches, buffers and graphs only.
_KEPT: dict[str, "weakref.WeakKeyDictionary[nn.Module, Any]"] = {
    "generate": weakref.WeakKeyDictionary(), "rollout": weakref.WeakKeyDictionary()}
_GRAPHS_LOCK = threading.Lock()


def decode_graph(model: nn.Module) -> DecodeGraph | None:
    """The :class:`DecodeGraph` kept for ``model``, or None."""
    return kept_state("generate", model)


def kept_state(kind: str, model: nn.Module) -> Any:
    """The state of ``kind`` ("generate" or "rollout") kept for ``model``, or None."""
    with _GRAPHS_LOCK:
        return _KEPT[kind].get(model)


def release_decode_graphs(model: nn.Module | None = None) -> None:
    """Drop the decode state ``generate(..., cuda_graph=True)`` and ``rollout`` keep for
    ``model`` (None: for every model): their ``StaticCache`` and captured graphs are freed
    once no call uses them (to torch's caching allocator; ``torch.cuda.empty_cache()``
    hands them back to the device). The next graphed call captures again."""
    with _GRAPHS_LOCK:
        for store in _KEPT.values():
            if model is None:
                store.clear()
            else:
                store.pop(model, None)


def _autocast_state(device: torch.device) -> tuple:
    try:
        return torch.is_autocast_enabled(device.type), torch.get_autocast_dtype(device.type)
    except (TypeError, AttributeError):  # torch < 2.4's autocast queries take no device type
        return (torch.is_autocast_enabled(),)


def _memory_fingerprint(model: nn.Module) -> tuple:
    """Every module's identity and type, each followed by its own parameters' and buffers'
    (address, dtype, shape, strides): which code recorded the launches and what memory
    they read. One walk over the modules (a few hundred microseconds for a 28-layer model;
    ``parameters()`` and ``buffers()`` would walk them twice more)."""
    parts: list = []
    for module in model.modules():
        parts.append((id(module), type(module)))
        for tensors in (module._parameters, module._buffers):
            for t in tensors.values():
                if t is not None:
                    parts.append((t.data_ptr(), t.dtype, t.shape, t.stride()))
    return tuple(parts)


def decode_key(model: nn.Module, batch: int, total: int, device: torch.device, temperature: float,
               greedy: bool, top_k: int = 0, top_p: float = 1.0) -> tuple:
    """Everything a captured decode step bakes in, for :class:`DecodeGraph` reuse: shapes
    (B, cache length), device, T, greedy vs sampled, top-k and top-p, the model's logit transform
    (:func:`~rlkernels.integrations.hf.coverage.logit_transform`), its attention implementation,
    the batch-invariant mode, autocast, training mode, the ``RLKERNELS_*`` / Triton
    switches, and :func:`_memory_fingerprint`. Not the prompt length, seed or streams
    (read from buffers at replay)."""
    return (batch, total, device, float(temperature), bool(greedy), int(top_k), float(top_p), logit_transform(model),
            getattr(getattr(model, "config", None), "_attn_implementation", None),
            is_batch_invariant_mode_enabled(), model.training, _autocast_state(device),
            tuple([env_get(name) for name in SWITCHES]), _memory_fingerprint(model))


def takes_cache_position(decoder: nn.Module) -> bool:
    """Whether ``decoder``'s forward takes ``cache_position`` (transformers 4.x: a static cache writes at the
    slots it names; 5.x counts its writes on the device)."""
    return "cache_position" in inspect.signature(type(decoder).forward).parameters


def rewind(cache: Any) -> None:
    """Put ``cache``'s write position back at slot 0 for a new prefill.

    transformers 5.x's ``StaticLayer`` keeps it in a device tensor, zeroed in place (the
    graph reads that tensor). Any other layer (4.x's, which keep none, or a kind with host
    state) gets transformers' own ``reset()``. The slots are not cleared: see the module
    docstring for why stale slots change no bit."""
    try:
        from transformers.cache_utils import StaticLayer
    except ImportError:  # a transformers without per-layer caches: its own reset
        StaticLayer = None
    if StaticLayer is None or not hasattr(cache, "layers"):
        cache.reset()
        return
    counters: dict[int, torch.Tensor] = {}  # by identity: the layers may share one (static_cache)
    for layer in cache.layers:
        counter = getattr(layer, "cumulative_length", None)
        if type(layer) is StaticLayer and isinstance(counter, torch.Tensor):
            counters[id(counter)] = counter
        else:
            layer.reset()
    if counters:
        torch._foreach_zero_(list(counters.values()))


def _check_streams(streams: object, batch: int, device: torch.device) -> torch.Tensor:
    """The caller's streams, checked before they are copied into the step's buffer (a copy
    would broadcast a wrong shape or convert a wrong dtype silently)."""
    if not isinstance(streams, torch.Tensor) or streams.dtype != torch.int64 or tuple(streams.shape) != (batch,) \
            or streams.device != device:
        what = (f"{streams.dtype} {tuple(streams.shape)} on {streams.device}" if isinstance(streams, torch.Tensor)
                else type(streams).__name__)
        raise ValueError(f"rlkernels.{OP}: streams must be an int64 tensor of shape ({batch},) on {device}, "
                         f"got {what}")
    return streams


def acquire(kind: str, model: nn.Module, key: tuple, make: Callable[[], Any]) -> tuple[Any, bool]:
    """(the model's kept state of ``kind`` for ``key``, whether it is the kept one), marked
    in use (``state.in_use``; the caller clears it). A state has a ``key`` attribute.

    A kept entry with another key is replaced. While a call (another thread's, or one
    this call runs inside) uses the model's entry, this call decodes with a state of its
    own, not kept."""
    store = _KEPT[kind]
    with _GRAPHS_LOCK:
        state = store.get(model)
        if state is not None and state.in_use:
            state = make()
            kept = False
        else:
            if state is None or state.key != key:
                store.pop(model, None)  # the old cache and graph go before the new cache fills
                state = store[model] = make()
            kept = True
        state.in_use = True
        return state, kept


def drop(kind: str, model: nn.Module, state: Any) -> None:
    """Forget ``state`` if it is the model's kept one: a call that failed part-way (a
    capture, a refusal) leaves nothing to reuse."""
    with _GRAPHS_LOCK:
        if _KEPT[kind].get(model) is state:
            del _KEPT[kind][model]


def new_cache(model: nn.Module, length: int) -> Any:
    """An empty ``StaticCache`` of ``length`` slots for ``model``, its layers' writes one
    launch each (:func:`~rlkernels.integrations.hf.static_cache.count_once`). Every layer
    keeps every key at its position's slot: transformers' sliding-window layers (the last
    ``window`` keys, rolled) become full ones, and the attention's window masks instead."""
    from transformers import StaticCache  # transformers is the optional "hf" extra

    cache = StaticCache(config=model.config, max_cache_len=length)
    static_cache.keep_every_key(cache, length)
    static_cache.count_once(cache)  # one launch per layer for its writes
    return cache


def last_hidden(decoder: nn.Module, cache: Any, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                cache_position: torch.Tensor | None = None, queries_real: bool = False,
                shared_keys: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The forward half of :func:`decode_step`: the final hidden state [B, H] of each row's
    last fed token, the keys and values of ``ids`` [B, Lq] written into ``cache`` (the
    arguments as there)."""
    extra = {"cache_position": cache_position} if cache_position is not None else {}
    if queries_real:
        extra[QUERIES_REAL] = True
    if shared_keys is not None:
        extra[SHARED_KEYS] = shared_keys
    out = decoder(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                  **cache_kwargs(decoder, cache), **extra)
    return (out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0])[:, -1]


def decode_step(decoder: nn.Module, head: nn.Module, cache: Any, ids: torch.Tensor, mask: torch.Tensor,
                positions: torch.Tensor, *, temperature: float, greedy: bool, seed: torch.Tensor,
                streams: torch.Tensor, cache_position: torch.Tensor | None = None, top_k: int = 0,
                top_p: float = 1.0, transform: LogitTransform = NO_TRANSFORM, queries_real: bool = False,
                shared_keys: tuple[torch.Tensor, torch.Tensor] | None = None) -> Drawn:
    """One forward of a patched decoder on a static cache, then the draw of each row's next token.

    ``ids`` [B, Lq] long are fed at ``positions`` [B, Lq] long; their keys and values are
    written into ``cache``; ``mask`` [B, S] long is 1 for every real key of the cache, these
    included (S: the cache's length). ``head`` is the LM head. The next token follows the
    last fed one: :func:`rlkernels.linear_sample` of the last final hidden state at
    ``temperature``, the argmax (``greedy``) or a draw keyed by ``seed`` (an int64 [] tensor),
    the row's stream (``streams``, int64 [B]) and its position ``positions[:, -1] + 1``.
    ``cache_position`` [Lq] long: the slots written, for transformers 4.x (5.x counts them
    on the device). ``top_k``/``top_p`` truncate the draw (:func:`rlkernels.linear_sample`);
    ``transform``: the model's logits from the head's (Gemma's final soft-cap, Cohere's scale).
    ``queries_real``: every fed token is real and its slot is 1 in ``mask`` (a decode step's,
    never a left-padded prefill's), so the attention has no padding row to zero.
    ``shared_keys``: rows that hold the same prompt's keys, read once
    (:func:`rlkernels.ops.attention.attention_by_bounds`' argument; same bits).
    Returns (token [B] int64, logp [B] fp32, entropy [B] fp32), and each row's threshold
    [B] fp32 where (top_k, top_p) truncate. No host sync: the step can be captured into a
    CUDA graph whose inputs are these tensors.
    """
    hidden = last_hidden(decoder, cache, ids, mask, positions, cache_position, queries_real, shared_keys)
    # The token drawn here is the row's next one: its position follows the last fed token's.
    return draw(head, hidden, temperature=temperature, greedy=greedy, seed=seed, streams=streams,
                positions=positions[:, -1] + 1, top_k=top_k, top_p=top_p, transform=transform)


def draw(head: nn.Module, hidden: torch.Tensor, *, temperature: float, greedy: bool, seed: torch.Tensor | int,
         streams: torch.Tensor, positions: torch.Tensor, top_k: int = 0, top_p: float = 1.0,
         transform: LogitTransform = NO_TRANSFORM) -> Drawn:
    """Each row's next token from the final hidden states [B, D] through ``head`` and the
    model's logit ``transform``: the :func:`rlkernels.linear_sample` draw keyed by (seed,
    stream, position), or a tensor-parallel model's vocabulary-parallel sampler. Returns
    (token, logp, entropy), and the threshold where (top_k, top_p) truncate."""
    parallel = parallel_modules()
    if parallel is not None and isinstance(head, parallel.VocabParallelHead):
        return head.sample(hidden, temperature=temperature, seed=seed, streams=streams, positions=positions,
                           greedy=greedy, top_k=top_k, top_p=top_p, logit_scale=transform.scale,
                           logit_softcap=transform.softcap)
    return linear_sample(hidden, head.weight, getattr(head, "bias", None), temperature=temperature,
                         seed=seed, streams=streams, positions=positions,
                         greedy=greedy, return_entropy=True, top_k=top_k, top_p=top_p,
                         return_threshold=truncates(top_k, top_p, head.weight.shape[0]),
                         logit_scale=transform.scale, logit_softcap=transform.softcap)


def decode_under_mode(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      batch_invariant: bool | None, options: dict[str, Any]
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`static_generate` of ``model``'s base decoder with ``options``, under
    :func:`~rlkernels.integrations.hf.coverage.mode_for` ``(model, batch_invariant)``:
    ``rlkernels.generate``'s decode (run as an FSDP2 root's forward where ``model`` is one)."""
    with mode_for(model, batch_invariant):
        return static_generate(model, decoder_of(model), input_ids, attention_mask, **options)


def static_generate(model: nn.Module, decoder: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, *,
                    max_new_tokens: int, greedy: bool = True, temperature: float = 1.0, seed: int = 0,
                    streams: torch.Tensor | None = None, pad_token_id: int | None = None,
                    eos_token_ids: list[int] | tuple[int, ...] = (), cuda_graph: bool = True,
                    keep: bool | None = None, cache_len: int | None = None, top_k: int = 0, top_p: float = 1.0,
                    return_thresholds: bool = False) -> tuple[torch.Tensor, ...]:
    """Decode up to ``max_new_tokens`` tokens after left-padded prompts with a ``StaticCache``.

    input_ids, attention_mask: [B, L] (long; left padding). ``decoder`` is the model's base
    decoder (returns the final, normed hidden states). Each token is drawn by
    :func:`decode_step`, :func:`rlkernels.linear_sample` of the final hidden state that
    precedes it: the argmax of the fp32 logits / T (``greedy``), or a
    draw keyed by (``seed``, the row's stream, the token's position counted from the row's
    first real token), so left padding and batch-mates change nothing. ``seed``: a Python
    int in [0, 2^63); ``streams``: int64 [B] (None: ``arange(B)``). ``top_k``/``top_p``
    truncate each draw (:func:`rlkernels.linear_sample`). Returns ``(sequences [B, L + T],
    logp [B, T], entropy [B, T])``: the prompts followed by the new tokens (``pad_token_id``
    after a row's EOS, with log-prob and entropy 0), each new token's log-prob and entropy
    at T, bitwise ``linear_logprob``'s (with the draw's threshold as ``logit_threshold``
    where truncating); with ``return_thresholds`` also each draw's threshold [B, T] (-inf
    after a row's EOS, and everywhere where nothing is truncated). T < ``max_new_tokens``
    only where every row has ended.

    ``cuda_graph``: replay decode steps from one captured graph (CUDA only); False runs
    every step eagerly (the same loop, for CPUs and for comparison). ``keep`` (None: as
    ``cuda_graph``): use and keep the model's :class:`DecodeGraph` across calls (module
    docstring); a kept state that already holds a graph replays it from the first decode
    step. With ``keep`` and ``cuda_graph=False`` the same reuse runs with an eager step
    where the graph would replay. ``cache_len``: the ``StaticCache``'s length (None:
    ``L + max_new_tokens``; at least that): the slots past a row's keys are masked out of
    the attention's chain, so it changes no bit, and a pinned length lets calls with other
    prompt lengths share one kept state.
    """
    B, L = input_ids.shape
    dev = input_ids.device
    keep = cuda_graph if keep is None else keep
    total = L + max_new_tokens if cache_len is None else cache_len
    if total < L + max_new_tokens:
        raise ValueError(f"rlkernels.{OP}: cache_len must be at least the prompt length plus max_new_tokens "
                         f"({L} + {max_new_tokens}), got {cache_len}")
    if not greedy:
        validate_seed(seed, dev)
        streams = torch.arange(B, device=dev) if streams is None else _check_streams(streams, B, dev)
    slot_buffer = takes_cache_position(decoder)
    key = decode_key(model, B, total, dev, temperature, greedy, top_k, top_p) if keep else None

    def make() -> DecodeGraph:
        return DecodeGraph(key, new_cache(model, total), _StepBuffers(B, total, dev, slot_buffer))

    state, kept = acquire("generate", model, key, make) if keep else (make(), False)
    try:
        out = _decode(state, model, decoder, input_ids, attention_mask, max_new_tokens=max_new_tokens,
                       greedy=greedy, temperature=temperature, seed=seed, streams=streams,
                       pad_token_id=pad_token_id, eos_token_ids=eos_token_ids, cuda_graph=cuda_graph,
                       top_k=top_k, top_p=top_p)
        if not return_thresholds:
            return out[:3]
        thresholds = out[3] if out[3] is not None else torch.full_like(out[1], -math.inf)
        return (*out[:3], thresholds)
    except BaseException:
        if kept:
            drop("generate", model, state)
        raise
    finally:
        state.in_use = False


def _decode(state: DecodeGraph, model: nn.Module, decoder: nn.Module, input_ids: torch.Tensor,
            attention_mask: torch.Tensor, *, max_new_tokens: int, greedy: bool, temperature: float, seed: int,
            streams: torch.Tensor | None, pad_token_id: int | None, eos_token_ids: list[int] | tuple[int, ...],
            cuda_graph: bool, top_k: int = 0, top_p: float = 1.0
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The loop of :func:`static_generate` on ``state``'s cache and buffers."""
    B, L = input_ids.shape
    dev = input_ids.device
    head = model.get_output_embeddings()
    transform, _ = logit_transform(model)
    buffers, cache = state.buffers, state.cache
    mask_long = attention_mask.long()
    if state.calls:
        rewind(cache)
        buffers.mask.zero_()
    state.calls += 1
    buffers.mask[:, :L] = mask_long
    if not greedy:
        buffers.seed.fill_(seed)
        buffers.streams.copy_(streams)

    # transformers 4.x writes a static cache at the slots ``cache_position`` names; 5.x
    # counts the writes on the device itself and takes no such argument.
    cache_position = torch.arange(L, device=dev) if buffers.cache_position is not None else None

    def forward(ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, queries_real: bool) -> Drawn:
        return decode_step(decoder, head, cache, ids, mask, positions, temperature=temperature, greedy=greedy,
                           seed=buffers.seed, streams=buffers.streams, cache_position=cache_position,
                           top_k=top_k, top_p=top_p, transform=transform, queries_real=queries_real)

    def step() -> Drawn:
        # Every row's token is real: its slot L + t is set in the mask before the step.
        return forward(buffers.ids, buffers.mask, buffers.positions, True)

    eos = torch.tensor(list(eos_token_ids), dtype=torch.long, device=dev) if eos_token_ids else None
    pad = pad_token_id if pad_token_id is not None else (int(eos[0]) if eos is not None else 0)
    unfinished = torch.ones(B, dtype=torch.bool, device=dev)
    next_position = mask_long.sum(dim=1, keepdim=True)  # each row's real tokens so far

    with torch.no_grad():
        # Prefill: the prompt's keys fill slots [0, L); the mask's later slots are still 0.
        drawn = forward(input_ids, buffers.mask, (mask_long.cumsum(-1) - 1).clamp(min=0), False)
        new_tokens: list[torch.Tensor] = []
        logps: list[torch.Tensor] = []
        entropies: list[torch.Tensor] = []
        thresholds: list[torch.Tensor] = []
        for t in range(max_new_tokens):
            token, logp, ent = drawn[:3]
            zero = torch.zeros((), dtype=logp.dtype, device=dev)
            new_tokens.append(torch.where(unfinished, token, torch.full_like(token, pad)))
            logps.append(torch.where(unfinished, logp, zero))
            entropies.append(torch.where(unfinished, ent, zero))
            if len(drawn) > 3:  # a padded position keeps every logit: nothing was drawn there
                thresholds.append(torch.where(unfinished, drawn[3], torch.full_like(drawn[3], -math.inf)))
            if eos is not None:
                unfinished &= ~torch.isin(token, eos)
                if not bool(unfinished.any()):
                    break
            if t + 1 == max_new_tokens:
                break
            # The token just drawn is the next step's input, written into slot L + t.
            buffers.ids.copy_(new_tokens[-1][:, None])
            buffers.positions.copy_(next_position)
            buffers.mask[:, L + t] = 1
            if buffers.cache_position is not None:  # from here on one fixed buffer, the slot the step writes
                buffers.cache_position.fill_(L + t)
                cache_position = buffers.cache_position
            next_position += 1
            if cuda_graph and state.graph is None and state.warm:
                # An eager step on these shapes compiled every kernel and made every one-time
                # host query: record this one, then replay it.
                state.capture(step)
            if cuda_graph and state.graph is not None:
                state.graph.replay()
                drawn = tuple(x.clone() for x in state.graph_out)
            else:
                drawn = step()
                state.warm = True
    sequences = torch.cat([input_ids, torch.stack(new_tokens, dim=1)], dim=1)
    return (sequences, torch.stack(logps, dim=1), torch.stack(entropies, dim=1),
            torch.stack(thresholds, dim=1) if thresholds else None)
