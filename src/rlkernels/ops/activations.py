"""SiLU with the same bits in every batch, on every device, with the batch-invariant mode on or off.

ATen's CPU ``silu`` runs a vectorized body and a scalar tail whose bits differ, and which
elements fall in the tail depends on the tensor's size: a token's activation changed
with the batch. Here the CPU computes ``x / (1 + exp(-x))`` in the accumulator dtype from
ops that round each element alone, rounded once to ``x``'s dtype; the backward likewise.
These are the formulas the batch-invariant mode installs for ATen's CPU ``silu``, so a
patched model's bits do not depend on the mode either. CUDA keeps ATen's ``silu``, whose
elements are computed alike wherever they sit. ``sigmoid`` (the gate of Qwen2-MoE's shared
expert) is built the same way.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..gemm.chain import accumulator_dtype


def silu_chain(x: torch.Tensor) -> torch.Tensor:
    """``x / (1 + exp(-x))`` elementwise in the accumulator dtype, rounded once to x's dtype."""
    xf = x.to(accumulator_dtype(x.dtype))
    return (xf / (1 + torch.exp(-xf))).to(x.dtype)


def silu_chain_backward(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """d silu(x) * grad elementwise: ``grad * s * (1 + x (1 - s))`` with s = sigmoid(x)."""
    xf = x.to(accumulator_dtype(x.dtype))
    sig = 1 / (1 + torch.exp(-xf))
    return (grad.to(xf.dtype) * sig * (1 + xf * (1 - sig))).to(grad.dtype)


class _SiLUChain(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        ctx.save_for_backward(x)
        return silu_chain(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        (x,) = ctx.saved_tensors
        return silu_chain_backward(grad, x)


def silu(x: torch.Tensor) -> torch.Tensor:
    """SiLU of a float tensor: the fixed elementwise chain on the CPU, ATen's kernel elsewhere."""
    if x.device.type == "cpu" and x.is_floating_point():
        return _SiLUChain.apply(x)
    return F.silu(x)


def sigmoid_chain(x: torch.Tensor) -> torch.Tensor:
    """``1 / (1 + exp(-x))`` elementwise in the accumulator dtype, rounded once to x's dtype."""
    xf = x.to(accumulator_dtype(x.dtype))
    return (1 / (1 + torch.exp(-xf))).to(x.dtype)


class _SigmoidChain(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        y = sigmoid_chain(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        (y,) = ctx.saved_tensors
        yf = y.to(accumulator_dtype(y.dtype))
        return (grad.to(yf.dtype) * yf * (1 - yf)).to(grad.dtype)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """Sigmoid of a float tensor: the fixed elementwise chain on the CPU (ATen's CPU sigmoid
    has the same vector-body / scalar-tail split as its silu), ATen's kernel elsewhere."""
    if x.device.type == "cpu" and x.is_floating_point():
        return _SigmoidChain.apply(x)
    return torch.sigmoid(x)
