"""transformers' rotary embedding in one launch inside a patched decoder.

The attention layers of the verified families call their modeling module's
``apply_rotary_pos_emb(q, k, cos, sin)``: ten elementwise launches per layer (four
multiplies, two negations, two concatenations, two adds), the largest share of a graphed
decode step's launches after the GEMMs. :func:`install` replaces that module function with
a dispatcher. Inside a patched decoder's forward (:func:`run_inside`, which
``patch_model``'s eager decoder forward enters) it runs
:func:`rlkernels.ops.rotary.rotary_embedding_fused`, one launch with transformers' bits
(the kernel reproduces each op's rounding), where the kernel takes the inputs
(:func:`rlkernels.ops.rotary.fused_ok`: no input needs a gradient, the layout is the
kernel's, the Triton backend can run there). Everywhere else, models that were not
patched included, it calls transformers' function. Only a function whose source is
transformers' formula is replaced (a modeling module whose function differs keeps it). Under
``torch.compile`` the dispatcher is the original function outright, so a compiled model of
the same family (transformers' static-cache ``generate`` traces with ``fullgraph=True``)
traces exactly what it did.
"""
from __future__ import annotations

import contextvars
import functools
import inspect
import sys
from typing import Any, Callable

import torch
from torch import nn

from ...ops.rotary import fused_ok, rotary_embedding_fused
from .coverage import VERIFIED_FAMILIES, family_of, hub_function, modeling_module, source_lines

FUNCTION = "apply_rotary_pos_emb"
_FORMULA = ("cos = cos.unsqueeze(unsqueeze_dim)", "sin = sin.unsqueeze(unsqueeze_dim)",
            "q_embed = (q * cos) + (rotate_half(q) * sin)", "k_embed = (k * cos) + (rotate_half(k) * sin)",
            "return q_embed, k_embed")
_ROTATE_HALF = ("x1 = x[..., : x.shape[-1] // 2]", "x2 = x[..., x.shape[-1] // 2 :]",
                "return torch.cat((-x2, x1), dim=-1)")
_PARAMETERS = ("q", "k", "cos", "sin", "unsqueeze_dim")

_INSIDE_PATCHED_DECODER: contextvars.ContextVar[bool] = contextvars.ContextVar("rlkernels_patched_decoder",
                                                                               default=False)


def run_inside(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` with the fused rotary on (a patched decoder's forward)."""
    token = _INSIDE_PATCHED_DECODER.set(True)
    try:
        return fn(*args, **kwargs)
    finally:
        _INSIDE_PATCHED_DECODER.reset(token)


def inside_patched_decoder() -> bool:
    """Whether this call runs inside a patched decoder's forward (:func:`run_inside`)."""
    return _INSIDE_PATCHED_DECODER.get()


def is_transformers_formula(module: Any) -> bool:
    """``module.apply_rotary_pos_emb`` is transformers' ``(q, k, cos, sin, unsqueeze_dim=1)``
    function with ``rotate_half = cat(-x2, x1)``, read from their source."""
    fn, half = hub_function(getattr(module, FUNCTION, None)), hub_function(getattr(module, "rotate_half", None))
    if not callable(fn) or not callable(half):
        return False
    try:
        params = tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return False
    fn_lines, half_lines = source_lines(fn), source_lines(half)
    return (params == _PARAMETERS and fn_lines is not None and half_lines is not None
            and set(_FORMULA) <= set(fn_lines) and set(_ROTATE_HALF) <= set(half_lines))


def _dispatcher(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(hub_function(original))
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if (not torch.compiler.is_compiling() and unsqueeze_dim == 1 and inside_patched_decoder()
                and fused_ok(q, k, cos, sin)):
            return rotary_embedding_fused(q, k, cos, sin)
        return original(q, k, cos, sin, unsqueeze_dim)

    apply_rotary_pos_emb.rlkernels_original = original  # type: ignore[attr-defined]
    return apply_rotary_pos_emb


def is_installed(module: Any) -> bool:
    return hasattr(getattr(module, FUNCTION, None), "rlkernels_original")


def install(model: nn.Module) -> list[str]:
    """Put the dispatcher in the modeling modules of ``model``'s verified-family layers
    whose function is transformers' formula; returns those modules' names (idempotent)."""
    names = sorted({modeling_module(m) for m in model.modules() if family_of(m) in VERIFIED_FAMILIES})
    installed = []
    for name in names:
        module = sys.modules.get(name)
        if module is None:
            continue
        if not is_installed(module):
            if not is_transformers_formula(module):
                continue
            setattr(module, FUNCTION, _dispatcher(getattr(module, FUNCTION)))
        installed.append(name)
    return installed
