"""FSDP2 (``torch.distributed.fsdp.fully_shard``): the library's scoring as the root module's forward.

FSDP2 all-gathers a module's parameters in hooks around ``module.forward`` (and frees
or reduce-scatters them around its backward). :func:`rlkernels.token_logprobs` runs the
decoder and the LM head itself, without the root's ``forward``: the root's own
parameters (embedding, final norm, LM head) would stay sharded DTensors. Here the whole
scoring runs as one FSDP forward method of the root (``register_fsdp_forward_method``),
so it sees the gathered parameters, and the backward reduce-scatters their gradients.
Gathering and reduce-scattering copy or sum whole parameters: a token's forward is the
one-GPU forward's, bit for bit.
"""
from __future__ import annotations

import sys
import types
from typing import Any, Callable, TypeVar

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

R = TypeVar("R")

# The root's registered forward method: it calls the function it is given.
METHOD = "_rlkernels_fsdp_forward"


def _call(self: nn.Module, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    # FSDP hangs its pre-backward hook on the outputs; on a view an in-place op of the
    # caller's would drop it (FSDP warns): views ([B, T] log-probs) are returned as copies.
    return tree_map_only(torch.Tensor, lambda t: t.clone() if t._is_view() else t, fn(*args, **kwargs))


def is_fsdp(model: nn.Module) -> bool:
    """Whether ``model`` is managed by FSDP2 (``fully_shard``). Read without importing
    ``torch.distributed.fsdp`` (most of a second): a model that is an FSDP module was
    made by it, so it is imported already wherever the answer is yes."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(model, fsdp.FSDPModule)


def run_as_forward(model: nn.Module, fn: Callable[..., R], *args: Any, **kwargs: Any) -> R:
    """``fn(*args, **kwargs)`` inside ``model``'s FSDP2 pre- and post-forward (a plain call
    when ``model`` is not an FSDP2 module)."""
    if not is_fsdp(model):
        return fn(*args, **kwargs)
    if METHOD not in model.__dict__:
        from torch.distributed.fsdp import register_fsdp_forward_method

        setattr(model, METHOD, types.MethodType(_call, model))
        register_fsdp_forward_method(model, METHOD)
    return getattr(model, METHOD)(fn, *args, **kwargs)
