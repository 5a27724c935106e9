"""transformers' ``StaticCache`` with one launch per layer for its writes.

A 5.x ``StaticLayer.update`` builds the slots from its device counter (an ``arange`` and an
add), advances the counter (an in-place add) and copies the keys and the values
(two ``index_copy_``): five launches per layer and step. :func:`count_once` gives each
layer of a cache the decode loop made an update that copies both with one launch of
:func:`rlkernels.ops.kv_cache.write_kv_slots`, at one device counter shared by every layer
and advanced once per forward, by the last layer. Between forwards every layer's
``cumulative_length`` is that counter, so what transformers reads from the cache (its
sequence length, the queries' offset, taken before the first layer writes) is what its own
layers would give; only within a forward do the layers count as one. Copies only: the
keys and values in the cache are the same bits.
"""
from __future__ import annotations

import copy
import functools
from typing import Any, NamedTuple

import torch

from ...ops.kv_cache import write_kv_slots


class _Counter:
    """The write counter every layer of one cache shares (created with the first layer's
    storage, on its device)."""

    def __init__(self) -> None:
        self.slots: torch.Tensor | None = None


def _update(layer: Any, counter: _Counter, is_last: bool, key_states: torch.Tensor, value_states: torch.Tensor,
            *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if not layer.is_initialized:
        layer.lazy_initialization(key_states, value_states)
        if counter.slots is None:
            counter.slots = layer.cumulative_length  # 0, on the keys' device
        layer.cumulative_length = counter.slots
    write_kv_slots(layer.keys, layer.values, key_states, value_states, counter.slots)
    if is_last:  # every layer of this forward has read the counter
        counter.slots.add_(key_states.shape[-2])
    return layer.keys, layer.values


class CountedWrite(NamedTuple):
    """Where a :func:`count_once` layer's next write goes: its keys and values [B, H, S, D],
    the shared counter (the first slot), and whether this layer advances it."""

    keys: torch.Tensor
    values: torch.Tensor
    slots: torch.Tensor
    advances: bool


def counted_write(cache: Any, layer_idx: int) -> CountedWrite | None:
    """The :class:`CountedWrite` of layer ``layer_idx`` of ``cache``, where that layer has the
    one-launch update and has been written (its storage exists); else None. Whoever writes
    the layer's slots itself, instead of calling its update, calls :func:`written` after."""
    layers = getattr(cache, "layers", None)
    if layers is None or getattr(cache, "offloading", False) or not 0 <= layer_idx < len(layers):
        return None
    layer = layers[layer_idx]
    update = vars(layer).get("update")
    if type(update) is not functools.partial or update.func is not _update or not layer.is_initialized:
        return None
    _, counter, is_last = update.args
    return CountedWrite(layer.keys, layer.values, counter.slots, is_last)


def written(write: CountedWrite, tokens: int) -> None:
    """What the update does after its copy: the last layer advances the shared counter."""
    if write.advances:
        write.slots.add_(tokens)


def count_once(cache: Any) -> bool:
    """Give every layer of an empty 5.x ``StaticCache`` the one-launch update; returns
    whether it did (False, cache unchanged: another transformers, layers of another kind,
    or a cache already written)."""
    try:
        from transformers.cache_utils import StaticLayer
    except ImportError:  # transformers without per-layer caches
        return False
    layers = getattr(cache, "layers", None)
    if not layers or any(type(layer) is not StaticLayer or layer.is_initialized for layer in layers):
        return False
    counter = _Counter()
    for layer in layers:
        layer.update = functools.partial(_update, layer, counter, layer is layers[-1])
    return True


def keep_every_key(cache: Any, length: int) -> None:
    """Replace the empty sliding-window layers of a 5.x ``StaticCache`` by full ``StaticLayer``
    s of ``length`` slots, in place. A sliding layer keeps the last ``window`` keys in its
    slots, rolled once full, so a key's slot stops being its position; the invariant chain
    counts keys from a sequence's first. Memory: ``length`` slots for those layers too."""
    try:
        from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer
    except ImportError:  # transformers without per-layer caches: nothing rolls
        return
    cache.layers = [StaticLayer(max_cache_len=length)
                    if type(layer) is StaticSlidingWindowLayer and not layer.is_initialized else layer
                    for layer in cache.layers]


def first_rows(cache: Any, rows: int) -> Any:
    """A cache over the first ``rows`` rows of ``cache`` -- a written :func:`count_once` cache --
    whose layers' keys and values are views of ``cache``'s and whose writes advance the same
    device counter: a forward of ``rows`` rows on it reads and writes those rows only."""
    layers = cache.layers
    if not all(layer.is_initialized for layer in layers) or not 0 < rows <= layers[0].keys.shape[0]:
        raise ValueError(f"first_rows: needs a written cache of at least {rows} rows")
    counter = _Counter()
    counter.slots = layers[0].cumulative_length
    view = copy.copy(cache)
    view.layers = []
    for layer in layers:
        part = copy.copy(layer)
        part.keys, part.values = layer.keys[:rows], layer.values[:rows]
        part.batch_size = rows
        part.update = functools.partial(_update, part, counter, layer is layers[-1])
        view.layers.append(part)
    return view
