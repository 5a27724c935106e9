"""transformers' gated MLP with ``silu(gate) * up`` in one launch, in a patched model.

The MLPs of the verified families compute ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``:
after :func:`~rlkernels.integrations.hf.patch.patch_model` swaps ``act_fn`` for
:class:`rlkernels.nn.SiLU`, the SiLU and the product are two launches per layer.
:func:`install` binds each such MLP a forward that computes the same with
:func:`rlkernels.ops.activations.silu_mul` (one launch on CUDA without gradients, the same
bits; the two ops elsewhere), and where the gate and up projections are the library's
plain Linear (no bias, no hooks), :func:`rlkernels.ops.activations.linear_silu_mul`: at
decode sizes one launch for both projections and the product, the same bits. An MLP is
taken only where its class's forward is that formula, read from its source, and its
activation is the library's SiLU.
"""
from __future__ import annotations

import torch
from torch import nn

from ...nn import Linear, SiLU
from ...ops.activations import linear_silu_mul, silu_mul
from . import binding
from .coverage import VERIFIED_FAMILIES, family_of, has_hooks, source_lines

_FORMULA = "down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))"


def plain_linear(module: nn.Module) -> bool:
    """A Linear whose call is ``linear(x, weight)``: the library's class, no bias, no hooks."""
    return type(module) is Linear and module.bias is None and not has_hooks(module)


def gated_hidden(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``act_fn(gate_proj(x)) * up_proj(x)`` of an installed MLP: the down projection's input."""
    gate, up = mlp.gate_proj, mlp.up_proj
    if plain_linear(gate) and plain_linear(up):
        return linear_silu_mul(x, gate.weight, up.weight)
    return silu_mul(gate(x), up(x))


def _gated_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(gated_hidden(self, x))


# Bound per module as its ``forward`` (``copy.deepcopy`` rebinds a bound method to the copy).
_gated_forward.__name__ = "forward"


def is_gated_silu_mlp(module: nn.Module) -> bool:
    """``module`` is a verified family's gated MLP whose activation is the library's SiLU."""
    if family_of(module) not in VERIFIED_FAMILIES or not isinstance(getattr(module, "act_fn", None), SiLU):
        return False
    if not all(isinstance(getattr(module, name, None), nn.Module) for name in ("gate_proj", "up_proj", "down_proj")):
        return False
    return _FORMULA in (source_lines(type(module).forward) or ())


def install(model: nn.Module) -> int:
    """Bind the one-launch forward to every gated SiLU MLP of ``model``; returns how many."""
    return binding.bind_where(model, _gated_forward, is_gated_silu_mlp)


def is_installed(module: nn.Module) -> bool:
    return binding.is_bound(module, "forward", _gated_forward)
