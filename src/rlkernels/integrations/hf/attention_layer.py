"""A verified family's attention layer with its q/k norms, rotary embedding and KV-cache write in one launch.

The attention layers of Llama, Mistral, Qwen2 and Qwen3 run, in this order::

    query_states = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
    key_states = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
    value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    cos, sin = position_embeddings
    query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
    if past_key_values is not None:
        key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)
    attn_output, attn_weights = attention_interface(self, query_states, key_states, value_states, ...)
    attn_output = self.o_proj(attn_output.reshape(*input_shape, -1).contiguous())

(Llama, Mistral and Qwen2 without the two norms.) At a decode step that is four launches
between the projections and the attention: q-norm, k-norm, rotary, cache write.
:func:`install` binds each attention layer whose class's forward is exactly that (read
from its source, statement by statement; the cache argument is ``past_key_values`` or
``cache``) a forward that runs them as one launch,
:func:`rlkernels.ops.attention_inputs.attention_inputs`, with the separate ops' bits, where:

* the call runs inside a patched decoder without gradients, and the modeling module's
  rotary function is the library's dispatcher (transformers' formula, :mod:`.rotary`);
* the norms are the library's RMSNorm (Llama's order) without hooks;
* the cache is None or a static cache whose layer writes with one launch at the shared
  counter (:func:`.static_cache.counted_write`), already written once.

Every other call -- a prefill into a fresh cache, another cache, gradients, hooks -- runs
the class's forward.
"""
from __future__ import annotations

import ast
import functools
import inspect
import sys
import textwrap
import types
from typing import Any, NamedTuple

import torch
from torch import nn

from ...nn import RMSNorm
from ...ops.attention_inputs import attention_inputs
from . import binding, rotary, static_cache
from .coverage import CACHE_ARGUMENT_NAMES, VERIFIED_FAMILIES, class_modeling_module, family_of, has_hooks

_HEAD = ("input_shape = hidden_states.shape[:-1]", "hidden_shape = (*input_shape, -1, self.head_dim)")
_NORMED = ("query_states = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)",
           "key_states = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)",
           "value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)")
_PLAIN = ("query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)",
          "key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)",
          "value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)")
_ROTARY = ("cos, sin = position_embeddings",
           "query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)")
_INTERFACE = ("attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface("
              "self.config._attn_implementation, eager_attention_forward)")
_CALL_ARGS = "self, query_states, key_states, value_states, attention_mask"
_TAIL = ("attn_output = attn_output.reshape(*input_shape, -1).contiguous()", "attn_output = self.o_proj(attn_output)",
         "return (attn_output, attn_weights)")
# The sliding-window keyword's expressions in the verified families, and how each is read.
_WINDOWS = {"self.sliding_window": lambda m: m.sliding_window,
            "getattr(self.config, 'sliding_window', None)": lambda m: getattr(m.config, "sliding_window", None)}


class _Formula(NamedTuple):
    normed: bool  # q and k pass through q_norm and k_norm
    window: str | None  # the sliding_window keyword's expression, or None where none is passed


def _target(assign: ast.Assign) -> str:
    """The assignment's target as written (``ast.unparse`` puts a lone tuple in parentheses)."""
    return ast.unparse(assign.targets[0]).removeprefix("(").removesuffix(")")


def _update_call(stmt: ast.stmt, cache: str) -> bool:
    """``if <cache> is not None: key_states, value_states = <cache>.update(key_states, value_states, self.layer_idx, ...)``"""
    if not (isinstance(stmt, ast.If) and ast.unparse(stmt.test) == f"{cache} is not None" and not stmt.orelse
            and len(stmt.body) == 1 and isinstance(stmt.body[0], ast.Assign)):
        return False
    assign = stmt.body[0]
    call = assign.value
    return (_target(assign) == "key_states, value_states" and isinstance(call, ast.Call)
            and ast.unparse(call.func) == f"{cache}.update"
            and [ast.unparse(a) for a in call.args[:3]] == ["key_states", "value_states", "self.layer_idx"])


def _attention_call(stmt: ast.stmt, varkw: str) -> tuple[bool, str | None]:
    """(matches, the sliding-window expression) of ``attn_output, attn_weights =
    attention_interface(self, q, k, v, attention_mask, dropout=..., scaling=self.scaling[,
    sliding_window=...], **kwargs)``."""
    if not (isinstance(stmt, ast.Assign) and _target(stmt) == "attn_output, attn_weights"
            and isinstance(stmt.value, ast.Call) and ast.unparse(stmt.value.func) == "attention_interface"):
        return False, None
    call = stmt.value
    if ", ".join(ast.unparse(a) for a in call.args) != _CALL_ARGS:
        return False, None
    keywords = {kw.arg: ast.unparse(kw.value) for kw in call.keywords}
    window = keywords.pop("sliding_window", None)
    want = {"dropout": "0.0 if not self.training else self.attention_dropout", "scaling": "self.scaling",
            None: varkw}
    return keywords == want and (window is None or window in _WINDOWS), window


@functools.lru_cache(maxsize=None)
def _formula(cls: type) -> _Formula | None:
    """The :class:`_Formula` of an attention class whose forward is the one above, else None."""
    try:
        fn = ast.parse(textwrap.dedent(inspect.getsource(cls.forward))).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        return None
    if not isinstance(fn, ast.FunctionDef) or fn.args.vararg is not None or fn.args.kwarg is None:
        return None
    params = [a.arg for a in fn.args.args]
    if params[:4] != ["self", "hidden_states", "position_embeddings", "attention_mask"] or len(params) != 5 \
            or params[4] not in CACHE_ARGUMENT_NAMES or fn.args.kwonlyargs:
        return None
    body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    if len(body) != 13:
        return None
    lines = [ast.unparse(s) for s in body]
    if tuple(lines[:2]) != _HEAD or tuple(lines[5:7]) != _ROTARY or lines[8] != _INTERFACE or tuple(lines[10:]) != _TAIL:
        return None
    if tuple(lines[2:5]) not in (_NORMED, _PLAIN) or not _update_call(body[7], params[4]):
        return None
    ok, window = _attention_call(body[9], fn.args.kwarg.arg)
    return _Formula(tuple(lines[2:5]) == _NORMED, window) if ok else None


def _modeling(cls: type) -> types.ModuleType | None:
    return sys.modules.get(class_modeling_module(cls) or "")


def _plain_norm(module: nn.Module) -> bool:
    return (type(module) is RMSNorm and not module.weight_in_fp32 and not module.weight_offset
            and not has_hooks(module))


def _fused_forward(self: nn.Module, hidden_states: torch.Tensor, position_embeddings: Any = None,
                   attention_mask: torch.Tensor | None = None, past_key_values: Any = None, cache: Any = None,
                   **kwargs: Any) -> tuple[torch.Tensor, Any]:
    kv = cache if cache is not None else past_key_values
    formula = _formula(type(self))
    write = None if kv is None else static_cache.counted_write(kv, self.layer_idx)
    if (formula is None or (kv is not None and write is None) or hidden_states.dim() != 3
            or not rotary.inside_patched_decoder() or torch.is_grad_enabled() or torch.compiler.is_compiling()
            or (formula.normed and not (_plain_norm(self.q_norm) and _plain_norm(self.k_norm)))):
        if past_key_values is not None and cache is not None:  # both names: the class's forward says what it takes
            kwargs["past_key_values"] = past_key_values
        return type(self).forward(self, hidden_states, position_embeddings, attention_mask, kv, **kwargs)
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    q = self.q_proj(hidden_states).view(hidden_shape)
    k = self.k_proj(hidden_states).view(hidden_shape)
    v = self.v_proj(hidden_states).view(hidden_shape)
    cos, sin = position_embeddings
    norms = {}
    if formula.normed:
        norms = dict(q_norm=(self.q_norm.weight, self.q_norm.variance_epsilon),
                     k_norm=(self.k_norm.weight, self.k_norm.variance_epsilon))
    target = None if write is None else (write.keys, write.values, write.slots)
    query, keys, values = attention_inputs(q, k, v, cos, sin, cache=target, **norms)
    if write is not None:
        static_cache.written(write, hidden_states.shape[1])
    modeling = _modeling(type(self))
    interface = modeling.ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                                modeling.eager_attention_forward)
    if formula.window is not None:
        kwargs["sliding_window"] = _WINDOWS[formula.window](self)
    attn_output, attn_weights = interface(self, query, keys, values, attention_mask,
                                          dropout=0.0 if not self.training else self.attention_dropout,
                                          scaling=self.scaling, **kwargs)
    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    return self.o_proj(attn_output), attn_weights


# Bound per layer as its ``forward`` (``copy.deepcopy`` rebinds a bound method to the copy).
_fused_forward.__name__ = "forward"


def is_fusable_attention(module: nn.Module) -> bool:
    """``module`` is a verified family's attention layer whose class's forward is the formula
    above, in a modeling module whose rotary function is the library's dispatcher."""
    if family_of(module) not in VERIFIED_FAMILIES or _formula(type(module)) is None:
        return False
    modeling = _modeling(type(module))
    return modeling is not None and rotary.is_installed(modeling) and all(
        hasattr(modeling, name) for name in ("ALL_ATTENTION_FUNCTIONS", "eager_attention_forward"))


def install(model: nn.Module) -> int:
    """Bind the fused forward to every such attention layer of ``model``; returns how many."""
    return binding.bind_where(model, _fused_forward, is_fusable_attention)


def is_installed(module: nn.Module) -> bool:
    return binding.is_bound(module, "forward", _fused_forward)
