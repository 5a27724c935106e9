"""A verified family's decoder layer with its residual adds fused into the ops around them.

The decoder layers of the verified dense families run, in this order::

    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    hidden_states, _ = self.self_attn(hidden_states=hidden_states, ...)
    hidden_states = residual + hidden_states
    residual = hidden_states
    hidden_states = self.post_attention_layernorm(hidden_states)
    hidden_states = self.mlp(hidden_states)
    hidden_states = residual + hidden_states
    return hidden_states

:func:`install` binds each layer whose class's forward is exactly that (read from its
source, statement by statement, and its ``self_attn`` call passing on the layer's own
arguments) a forward that runs the same ops with two fusions, each with the bits of the
ops it replaces:

* the attention's residual add and the post-attention RMSNorm:
  :func:`rlkernels.ops.norms.add_rms_norm`, one launch on the Triton backend without
  gradients, where the norm is the library's RMSNorm (Llama's order) without hooks;
* the MLP's down projection and the residual add after it:
  :func:`rlkernels.ops.matmul.linear_residual`, one launch at decode sizes, where the MLP
  is the library's gated MLP (:mod:`.mlp`) with a plain down projection and no hooks.

Everything else -- other norms or MLPs, hooks, a mixture-of-experts block -- runs the
modules as the class's forward does.
"""
from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Any

import torch
from torch import nn

from ...nn import RMSNorm
from ...ops.matmul import linear_residual
from ...ops.norms import add_rms_norm
from . import binding, mlp as gated_mlp
from .coverage import VERIFIED_FAMILIES, family_of, has_hooks

# The class forward's statements after the signature, as ``ast.unparse`` writes them; the
# self_attn call (index 2) is checked by shape: see _passes_its_arguments.
_STATEMENTS = (
    "residual = hidden_states",
    "hidden_states = self.input_layernorm(hidden_states)",
    None,
    "hidden_states = residual + hidden_states",
    "residual = hidden_states",
    "hidden_states = self.post_attention_layernorm(hidden_states)",
    "hidden_states = self.mlp(hidden_states)",
    "hidden_states = residual + hidden_states",
    "return hidden_states",
)


def _passes_its_arguments(stmt: ast.stmt, fn: ast.FunctionDef) -> bool:
    """``hidden_states, _ = self.self_attn(hidden_states=hidden_states, p=p, ..., **kwargs)``
    with every parameter of the layer's forward passed on under its own name: then handing
    the attention whatever keywords the layer was given is the same call."""
    if not (isinstance(stmt, ast.Assign) and ast.unparse(stmt.targets[0]) in ("(hidden_states, _)", "hidden_states, _")
            and isinstance(stmt.value, ast.Call) and ast.unparse(stmt.value.func) == "self.self_attn"
            and not stmt.value.args):
        return False
    passed = {kw.arg for kw in stmt.value.keywords if kw.arg is not None and isinstance(kw.value, ast.Name)
              and kw.value.id == kw.arg}
    if len(passed) != sum(kw.arg is not None for kw in stmt.value.keywords):
        return False
    rest = [kw for kw in stmt.value.keywords if kw.arg is None]
    params = [a.arg for a in fn.args.args[1:] + fn.args.kwonlyargs]
    varkw = fn.args.kwarg.arg if fn.args.kwarg is not None else None
    if fn.args.vararg is not None or varkw is None or len(rest) != 1 or ast.unparse(rest[0].value) != varkw:
        return False
    return set(params) == passed and params[:1] == ["hidden_states"]


def is_fusable_decoder_layer(module: nn.Module) -> bool:
    """``module`` is a verified family's decoder layer whose class's forward is the formula above."""
    if family_of(module) not in VERIFIED_FAMILIES:
        return False
    try:
        source = textwrap.dedent(inspect.getsource(type(module).forward))
        fn = ast.parse(source).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        return False
    if not isinstance(fn, ast.FunctionDef):
        return False
    body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    if len(body) != len(_STATEMENTS):
        return False
    for stmt, want in zip(body, _STATEMENTS):
        if want is None:
            if not _passes_its_arguments(stmt, fn):
                return False
        elif ast.unparse(stmt) != want:
            return False
    return True


def _plain_norm(module: nn.Module) -> bool:
    return type(module) is RMSNorm and not module.weight_in_fp32 and not has_hooks(module)


def _fused_forward(self: nn.Module, hidden_states: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    hidden_states, _ = self.self_attn(hidden_states=hidden_states, **kwargs)
    norm = self.post_attention_layernorm
    if _plain_norm(norm):
        hidden_states, residual = add_rms_norm(hidden_states, residual, norm.weight, norm.variance_epsilon)
    else:
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = norm(hidden_states)
    mlp = self.mlp
    if gated_mlp.is_installed(mlp) and not has_hooks(mlp) and gated_mlp.plain_linear(mlp.down_proj):
        return linear_residual(gated_mlp.gated_hidden(mlp, hidden_states), mlp.down_proj.weight, residual)
    return residual + mlp(hidden_states)


# Bound per layer as its ``forward`` (``copy.deepcopy`` rebinds a bound method to the copy).
_fused_forward.__name__ = "forward"


def install(model: nn.Module) -> int:
    """Bind the fused forward to every such decoder layer of ``model``; returns how many."""
    return binding.bind_where(model, _fused_forward, is_fusable_decoder_layer)


def is_installed(module: nn.Module) -> bool:
    return binding.is_bound(module, "forward", _fused_forward)
