"""SiLU with the same bits in every batch, on every device, with the batch-invariant mode on or off.

ATen's CPU ``silu`` runs a vectorized body and a scalar tail whose bits differ, and which
elements fall in the tail depends on the tensor's size: a token's activation changed
with the batch. Here the CPU computes ``x / (1 + exp(-x))`` in the accumulator dtype from
ops that round each element alone, rounded once to ``x``'s dtype; the backward likewise.
These are the formulas the batch-invariant mode installs for ATen's CPU ``silu``, so a
patched model's bits do not depend on the mode either. CUDA keeps ATen's ``silu``, whose
elements are computed alike wherever they sit. ``sigmoid`` (the gate of Qwen2-MoE's shared
expert) and ``gelu_tanh`` (Gemma's MLP activation) are built the same way.

``silu_mul(gate, up)`` is the gated MLP's ``silu(gate) * up``: on CUDA, where no input
needs a gradient, one launch that reproduces ATen's two (``kernels.activations``; a GPU
test compares the bits); elsewhere :func:`silu` and torch's multiply.

``linear_silu_mul(x, gate_weight, up_weight)`` is the MLP's gate and up projections with
that product: at decode sizes on CUDA one launch for all three (``gemm_silu_mul_kernel``,
two canonical chains and the same epilogue), elsewhere the three ops; the bits are the
three ops' either way.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..gemm.chain import accumulator_dtype
from ..gemm.table import SILU_MUL_MAX_M
from ..gemm.triton import triton_gemm_silu_mul
from ..kernels._triton import cdiv
from ..kernels.activations import silu_mul_kernel
from ..registry import triton_usable
from ..runtime.launcher import NO_FP_FUSION, cached_launcher
from ..runtime.opaque import opaque_to_compile
from .matmul import fused_decode_gemm_ok, linear

SILU_MUL_BLOCK = 1024  # elements per program; elementwise, so any width gives the same bits
_launch_silu_mul = cached_launcher(silu_mul_kernel, leading_tensors=3, options=NO_FP_FUSION)


def silu_chain(x: torch.Tensor) -> torch.Tensor:
    """``x / (1 + exp(-x))`` elementwise in the accumulator dtype, rounded once to x's dtype."""
    xf = x.to(accumulator_dtype(x.dtype))
    return (xf / (1 + torch.exp(-xf))).to(x.dtype)


def silu_chain_backward(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """d silu(x) * grad elementwise: ``grad * s * (1 + x (1 - s))`` with s = sigmoid(x)."""
    xf = x.to(accumulator_dtype(x.dtype))
    sig = 1 / (1 + torch.exp(-xf))
    return (grad.to(xf.dtype) * sig * (1 + xf * (1 - sig))).to(grad.dtype)


class _ElementwiseChain(torch.autograd.Function):
    """``forward(x)`` with the gradient ``backward(grad, x)``: an activation's fixed chains."""

    @staticmethod
    def forward(ctx, x, forward, backward):  # type: ignore[override]
        ctx.save_for_backward(x)
        ctx.chain_backward = backward
        return forward(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        (x,) = ctx.saved_tensors
        return ctx.chain_backward(grad, x), None, None


def silu(x: torch.Tensor) -> torch.Tensor:
    """SiLU of a float tensor: the fixed elementwise chain on the CPU, ATen's kernel elsewhere."""
    if x.device.type == "cpu" and x.is_floating_point():
        return _ElementwiseChain.apply(x, silu_chain, silu_chain_backward)
    return F.silu(x)


def silu_mul_fused_ok(gate: torch.Tensor, up: torch.Tensor) -> bool:
    """The one-launch kernel takes these: CUDA, one float dtype and shape, contiguous, no gradient."""
    if not (gate.is_cuda and up.device == gate.device and gate.dtype == up.dtype and gate.shape == up.shape):
        return False
    if gate.dtype not in (torch.float32, torch.bfloat16, torch.float16) or not triton_usable(gate.device):
        return False
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return False
    return gate.is_contiguous() and up.is_contiguous()


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` with the bits of the two ops (one launch on CUDA without gradients)."""
    if not silu_mul_fused_ok(gate, up):
        return silu(gate) * up
    out = torch.empty_like(gate)
    n = gate.numel()
    if n:
        _launch_silu_mul((cdiv(n, SILU_MUL_BLOCK),), (gate, up, out, n), dict(BLOCK=SILU_MUL_BLOCK), num_warps=4,
                         num_stages=1)
    return out


def _one_launch_linear_silu_mul(x: torch.Tensor, gate_weight: torch.Tensor, up_weight: torch.Tensor) -> bool:
    """The gated GEMM takes these: a decode-size fused launch's inputs (at most
    SILU_MUL_MAX_M rows) with two weights of one shape."""
    return fused_decode_gemm_ok(x, (gate_weight, up_weight), SILU_MUL_MAX_M) and gate_weight.shape == up_weight.shape


def _linear_silu_mul_launch(x: torch.Tensor, gate_weight: torch.Tensor, up_weight: torch.Tensor) -> torch.Tensor:
    k = gate_weight.shape[1]
    out = triton_gemm_silu_mul(x.reshape(x.numel() // k, k), gate_weight, up_weight)
    return out.reshape(*x.shape[:-1], gate_weight.shape[0])


# Under torch.compile a graph break, as every Triton launch of the library.
_linear_silu_mul_opaque = opaque_to_compile(_linear_silu_mul_launch)


def linear_silu_mul(x: torch.Tensor, gate_weight: torch.Tensor, up_weight: torch.Tensor) -> torch.Tensor:
    """``silu(linear(x, gate_weight)) * linear(x, up_weight)``: a gated MLP's hidden state.

    x: [..., K]; gate_weight, up_weight: [N, K]; returns [..., N] in x's dtype, with the bits
    of :func:`~rlkernels.linear` twice and :func:`silu_mul` on whatever path. Inference on
    CUDA with 16-bit operands and at most ``SILU_MUL_MAX_M`` rows (decode steps, small
    chunks) runs one launch that chains both projections and applies the product in its
    epilogue; everything else (gradients, larger M, fp32, the CPU) runs the three ops.
    """
    if _one_launch_linear_silu_mul(x, gate_weight, up_weight):
        return _linear_silu_mul_opaque(x, gate_weight, up_weight)
    return silu_mul(linear(x, gate_weight), linear(x, up_weight))


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


# ATen's constants of the tanh approximation: sqrt(2 / pi) and the cubic term's weight.
GELU_TANH_BETA = math.sqrt(2.0 / math.pi)
GELU_TANH_KAPPA = 0.044715


def gelu_tanh_chain(x: torch.Tensor) -> torch.Tensor:
    """``0.5 x (1 + tanh(beta (x + kappa x^3)))`` elementwise in the accumulator dtype, rounded
    once to x's dtype (ops that round each element alone on the CPU: mul, add, tanh)."""
    xf = x.to(accumulator_dtype(x.dtype))
    inner = GELU_TANH_BETA * (xf + GELU_TANH_KAPPA * (xf * xf * xf))
    return (0.5 * xf * (1 + torch.tanh(inner))).to(x.dtype)


def gelu_tanh_chain_backward(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """d gelu_tanh(x) * grad: ``0.5 (1 + t) + 0.5 x (1 - t^2) beta (1 + 3 kappa x^2)``, t the tanh."""
    xf = x.to(accumulator_dtype(x.dtype))
    t = torch.tanh(GELU_TANH_BETA * (xf + GELU_TANH_KAPPA * (xf * xf * xf)))
    d = 0.5 * (1 + t) + 0.5 * xf * (1 - t * t) * GELU_TANH_BETA * (1 + 3 * GELU_TANH_KAPPA * (xf * xf))
    return (grad.to(xf.dtype) * d).to(grad.dtype)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation (``F.gelu(x, approximate="tanh")``, Gemma's
    ``gelu_pytorch_tanh``) of a float tensor: the fixed elementwise chain on the CPU, whose
    ATen kernel gives an fp32 element other bits in its vector body than in its scalar tail,
    ATen's kernel elsewhere (an element's bits do not depend on where it sits)."""
    if x.device.type == "cpu" and x.is_floating_point():
        return _ElementwiseChain.apply(x, gelu_tanh_chain, gelu_tanh_chain_backward)
    return F.gelu(x, approximate="tanh")
