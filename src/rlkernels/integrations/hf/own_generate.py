"""Hugging Face's own ``generate`` on a patched model with sliding-window layers.

For a layer with a sliding window, transformers' caches keep the last ``window - 1`` keys
and roll them, so a key's slot stops being its position. The invariant attention counts
a sequence's keys from its first; it refuses a cache that has dropped keys, in the mask
hook (:mod:`.attention`). :func:`install` gives such a model two bound methods:

* a ``generate`` that, where a call brings no cache of its own, asks for no cache
  implementation and leaves ``use_cache`` on, hands transformers a ``DynamicCache()``
  built without the config: every layer of that cache is a full one;
* a ``_prepare_static_cache`` (what ``generate`` calls for ``cache_implementation="static"``)
  whose ``StaticCache`` has full layers where transformers' has sliding ones, of the
  cache's length (:func:`.static_cache.keep_every_key`, as ``rlkernels.generate``'s).

Either way every key is kept at its position, and the attention applies the window itself
(its ``sliding_window`` argument). The tokens are those of the rolling cache, and each
token's bits those of ``token_logprobs``. Memory: every key of a sequence, as a
full-attention model's cache holds. A cache the call brings is its own, and a rolling one
is still refused.
"""
from __future__ import annotations

import inspect
from typing import Any

from torch import nn

from . import binding
from .coverage import CACHE_ARGUMENT_NAMES, cache_kwargs
from .static_cache import keep_every_key


def has_windows(model: nn.Module) -> bool:
    """Whether a layer of ``model``'s (text) config attends through a sliding window."""
    config = getattr(model, "config", None)
    if config is None:
        return False
    get_text = getattr(config, "get_text_config", None)
    text = get_text(decoder=True) if callable(get_text) else config
    layer_types = getattr(text, "layer_types", None)
    if layer_types is not None:
        return any("sliding" in str(kind) for kind in layer_types)
    return getattr(text, "sliding_window", None) is not None


def _keeps_its_own_cache(model: nn.Module, kwargs: dict[str, Any]) -> bool:
    """The call brings a cache, names a cache implementation, or turns the cache off (itself
    or through its or the model's generation config)."""
    if any(kwargs.get(name) is not None for name in CACHE_ARGUMENT_NAMES) or kwargs.get("cache_implementation") is not None:
        return True
    if kwargs.get("use_cache") is False:
        return True
    for config in (kwargs.get("generation_config"), getattr(model, "generation_config", None)):
        if config is not None and (getattr(config, "cache_implementation", None) is not None
                                   or getattr(config, "use_cache", True) is False):
            return True
    return False


def _generate(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    if not _keeps_its_own_cache(self, kwargs):
        from transformers import DynamicCache

        kwargs.update(cache_kwargs(self, DynamicCache()))
    return type(self).generate(self, *args, **kwargs)


# Bound per model as its ``generate`` (``copy.deepcopy`` rebinds a bound method to the copy).
_generate.__name__ = "generate"


def _static_length(model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> int | None:
    """The slots transformers' ``_prepare_static_cache`` allocates for this call: the call's
    length, or the longer one transformers keeps on the model for its static caches (None
    where the signature is not read)."""
    try:
        bound = inspect.signature(type(model)._prepare_static_cache).bind(model, *args, **kwargs)
    except TypeError:
        return None
    length = bound.arguments.get("max_cache_len", bound.arguments.get("max_length"))
    if not isinstance(length, int):
        return None
    return max(length, getattr(model, "_previous_max_cache_length", -1))


def _prepare_static_cache(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    length = _static_length(self, args, kwargs)
    cache = type(self)._prepare_static_cache(self, *args, **kwargs)
    layers = getattr(getattr(cache, "self_attention_cache", cache), "layers", ())
    # A full layer's slots are the cache's length; with none, the length the call asked for.
    full = [layer.max_cache_len for layer in layers if not getattr(layer, "is_sliding", False)
            and isinstance(getattr(layer, "max_cache_len", None), int)]
    length = max(full) if full else length
    if length is not None:
        keep_every_key(getattr(cache, "self_attention_cache", cache), length)
    return cache


_prepare_static_cache.__name__ = "_prepare_static_cache"


def install(model: nn.Module) -> bool:
    """Bind the key-keeping ``generate`` (and, where transformers' generation has one, the
    key-keeping ``_prepare_static_cache``) to ``model`` where it has sliding-window layers
    and a ``generate`` of transformers'; returns whether it did (idempotent)."""
    if is_installed(model):
        return True
    if not has_windows(model) or not callable(getattr(type(model), "generate", None)):
        return False
    binding.bind(model, "generate", _generate)
    if callable(getattr(type(model), "_prepare_static_cache", None)):
        binding.bind(model, "_prepare_static_cache", _prepare_static_cache)
    return True


def is_installed(model: nn.Module) -> bool:
    return binding.is_bound(model, "generate", _generate)
