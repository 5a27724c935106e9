"""An attention layer's q, k and v projections in one launch at decode sizes, in a patched model.

The attention forwards of the verified families call ``self.q_proj(hidden_states)``, then
``k_proj`` and ``v_proj`` on the same tensor: three launches at a decode step, each shorter
than its launch and pipeline fill. :func:`install` binds the three projections of each such
layer a forward that shares one :class:`QkvGroup`. The q projection's call runs
:func:`rlkernels.ops.matmul.linear_group` over the three weights (one launch on CUDA at
decode sizes: 16-bit, no gradient, at most ``LINEAR_GROUP_MAX_M`` rows; one ``linear`` per
weight elsewhere) and keeps the k and v results with the input they came from; the k and v
calls given that same tensor, unmodified, take theirs. Every other call -- another input,
one modified in place -- runs the projection's own ``linear``.

``linear_group`` gives each output the bits (and autograd graph) of its own ``linear``, so
a kept result and a recomputed one are the same values: the group is a cache, never
another formula. Layers
whose projections are not the library's plain Linear (a bias, as Qwen2's; a LoRA or
tensor-parallel module) are left alone.
"""
from __future__ import annotations

import torch
from torch import nn

from ...nn import Linear
from ...ops.matmul import linear_group
from .coverage import VERIFIED_FAMILIES, family_of

_ROLES = ("q_proj", "k_proj", "v_proj")


class QkvGroup:
    """The q, k and v projections of one attention layer, and the k and v outputs the q
    projection's grouped launch kept: ``(input, its version, k, v)``, replaced whole."""

    __slots__ = ("q", "k", "v", "kept")

    def __init__(self, q: Linear, k: Linear, v: Linear) -> None:
        self.q, self.k, self.v = q, k, v
        self.kept: tuple | None = None

    def project_q(self, x: torch.Tensor) -> torch.Tensor:
        self.kept = None
        q, k, v = self.q, self.k, self.v
        # (Traced by torch.compile, given a bias since install, or a subclass taking gradients,
        # as a tensor-parallel layout's column-parallel projection: its own class forward.)
        if (torch.compiler.is_compiling() or q.bias is not None or k.bias is not None or v.bias is not None
                or (type(q) is not Linear and torch.is_grad_enabled())):
            return type(q).forward(q, x)
        out_q, out_k, out_v = linear_group(x, (q.weight, k.weight, v.weight))
        self.kept = (x, x._version, out_k, out_v)
        return out_q

    def take(self, x: torch.Tensor, slot: int, module: Linear) -> torch.Tensor:
        kept = self.kept  # read once: another thread may replace it
        if kept is not None and kept[0] is x and kept[1] == x._version:
            if slot == 3:
                self.kept = None  # v is the last: nothing of x is needed any more
            return kept[slot]
        return type(module).forward(module, x)


class _Projection:
    """The ``forward`` bound to one projection of a :class:`QkvGroup` (``slot``: 0 for q,
    2 for k, 3 for v, where ``QkvGroup.kept`` holds their outputs)."""

    __slots__ = ("group", "slot")

    def __init__(self, group: QkvGroup, slot: int) -> None:
        self.group, self.slot = group, slot

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.slot == 0:
            return self.group.project_q(x)
        return self.group.take(x, self.slot, self.group.k if self.slot == 2 else self.group.v)


def _plain(module: object) -> bool:
    return type(module) is Linear and module.bias is None and "forward" not in vars(module)


def is_qkv_attention(module: nn.Module) -> bool:
    """``module`` is a verified family's attention layer whose q, k and v projections are the
    library's plain Linear (no bias) of one input width."""
    if family_of(module) not in VERIFIED_FAMILIES:
        return False
    projections = [getattr(module, name, None) for name in _ROLES]
    if not all(_plain(p) for p in projections):
        return False
    return len({p.in_features for p in projections}) == 1


def install(model: nn.Module) -> int:
    """Bind the grouped q/k/v forward to every such attention layer of ``model``; returns how many."""
    count = 0
    for module in model.modules():
        if is_qkv_attention(module):
            group = QkvGroup(module.q_proj, module.k_proj, module.v_proj)
            for slot, proj in zip((0, 2, 3), (group.q, group.k, group.v)):
                proj.forward = _Projection(group, slot)
            count += 1
    return count


def is_installed(module: nn.Module) -> bool:
    """``module``'s projections share a :class:`QkvGroup`."""
    forwards = [vars(getattr(module, name, nn.Module())).get("forward") for name in _ROLES]
    return all(isinstance(f, _Projection) for f in forwards) and len({id(f.group) for f in forwards}) == 1
