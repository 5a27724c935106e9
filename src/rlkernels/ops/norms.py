"""Batch-invariant ``rms_norm``: the HF Llama/Qwen RMSNorm, forward and backward,
with its row sums and its weight gradient's column sums in the fixed orders of
:mod:`rlkernels.ops.reductions`. On the Triton backend the forward and grad_x run
fused, one program per row, with the row sums in that order.

``add_rms_norm(x, residual, weight)`` is a decoder layer's residual add and the norm after
it: one launch on the Triton backend without gradients, the two ops' bits.

``layer_norm(x, weight)`` is Cohere's LayerNorm (no bias): the mean and the variance of
the centred row by the same fixed-order row sums, the weight applied in fp32 and the
result rounded once; its backward's row sums and weight gradient likewise. It runs as
torch elementwise ops around those sums on either backend.
"""
from __future__ import annotations

import torch

from . import _validate as V
from ..gemm.chain import accumulator_dtype
from ..kernels.norms import rms_norm_bwd_kernel, rms_norm_fwd_kernel
from ..registry import OpImpl, register_backends
from ..runtime.launcher import cached_launcher
from .reductions import (NUM_STAGES, ROW_BLOCK, TorchReductionBackend, TritonReductionBackend, blocked_col_sum,
                         reduction_backend_for)

_launch_rms_fwd = cached_launcher(rms_norm_fwd_kernel)
_launch_rms_bwd = cached_launcher(rms_norm_bwd_kernel)


def rms_norm_forward_fused(x2: torch.Tensor, weight: torch.Tensor | None, eps: float,
                           keep_fp32: bool, residual: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Fused Triton RMSNorm rows: (y [M, N], rstd [M] fp32, s) for a contiguous x2 [M, N].

    y = weight * (x * rstd).to(x.dtype) in torch's promoted dtype (fp32 with ``keep_fp32``,
    where the fp32 xhat is kept); rstd = rsqrt(sum(x^2) / N + eps), the sum in
    row_dot's fixed order. With ``residual`` (contiguous [M, N], x's dtype) the rows normed
    are ``s = x + residual`` as torch's add rounds it, returned as s (else None).
    """
    M, N = x2.shape
    if keep_fp32:
        out_dt = torch.float32
    else:
        out_dt = x2.dtype if weight is None else torch.promote_types(weight.dtype, x2.dtype)
    y = torch.empty(M, N, dtype=out_dt, device=x2.device)
    rstd = torch.empty(M, dtype=torch.float32, device=x2.device)
    summed = None if residual is None else torch.empty_like(x2)
    if M == 0:
        return y, rstd, summed
    w = weight.contiguous() if weight is not None else x2
    r, s = (x2, x2) if residual is None else (residual, summed)
    _launch_rms_fwd((M,), (x2, w, y, rstd, r, s, N, x2.stride(0), y.stride(0), r.stride(0), s.stride(0), eps),
                    dict(HAS_W=weight is not None, KEEP_FP32=keep_fp32, ADD=residual is not None, BLOCK=ROW_BLOCK),
                    num_warps=4, num_stages=NUM_STAGES)
    return y, rstd, summed


def rms_norm_backward_fused(g2: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor | None, rstd: torch.Tensor,
                            keep_fp32: bool, need_dx: bool, need_dw: bool
                            ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Fused Triton RMSNorm backward for g2, x2 [M, N] contiguous, rstd [M] fp32.

    grad_x [M, N] in x's dtype (one program per row); grad_w [N] in weight's dtype,
    :func:`blocked_col_sum` of ``g * h``.
    """
    M, N = x2.shape
    grad_x = grad_w = None
    if need_dx:
        grad_x = torch.empty_like(x2)
        if M:
            w = weight.contiguous() if weight is not None else x2
            _launch_rms_bwd((M,), (g2, x2, w, rstd, grad_x, N, g2.stride(0), x2.stride(0), grad_x.stride(0)),
                            dict(HAS_W=weight is not None, BLOCK=ROW_BLOCK), num_warps=4, num_stages=NUM_STAGES)
    if need_dw and weight is not None:
        grad_w = torch.empty(N, dtype=weight.dtype, device=weight.device)
        blocked_col_sum(g2, grad_w, x2, rstd, keep_fp32)
    return grad_x, grad_w


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t [..., N] as rows [prod(...), N] (also where N = 0, which reshape(-1, N) cannot infer)."""
    return t.reshape(t.shape[:-1].numel(), t.shape[-1])


class _RMSNormFunction(torch.autograd.Function):
    """y = weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype) -- the HF Llama/Qwen formula."""

    @staticmethod
    def forward(ctx, x, weight, eps, reduction_backend, keep_fp32):  # type: ignore[override]
        N = x.shape[-1]
        x2 = _rows(x)
        ctx.fused = reduction_backend.fuses_rms_norm(x, weight)
        if ctx.fused:
            x2 = x2.contiguous()
            y, rstd, _ = rms_norm_forward_fused(x2, weight, eps, keep_fp32)
            ctx.save_for_backward(x2, weight, rstd)
            ctx.reduction_backend, ctx.keep_fp32, ctx.shape = reduction_backend, keep_fp32, x.shape
            return y.reshape(*x.shape[:-1], N)
        adt = accumulator_dtype(x.dtype)
        xf = x2.to(adt)
        mean_sq = reduction_backend.row_dot(xf, xf) / N
        rstd = torch.rsqrt(mean_sq + eps)
        xhat = xf * rstd[:, None]
        h = xhat if keep_fp32 else xhat.to(x.dtype)
        y = h if weight is None else (weight.to(adt) * h if keep_fp32 else weight * h)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.reduction_backend, ctx.keep_fp32, ctx.shape = reduction_backend, keep_fp32, x.shape
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x2, weight, rstd = ctx.saved_tensors
        reduction_backend = ctx.reduction_backend
        N = x2.shape[-1]
        if ctx.fused:
            grad_x, grad_w = rms_norm_backward_fused(
                _rows(grad).contiguous(), x2, weight, rstd, ctx.keep_fp32,
                ctx.needs_input_grad[0], weight is not None and ctx.needs_input_grad[1])
            return (grad_x.reshape(ctx.shape) if grad_x is not None else None), grad_w, None, None, None
        adt = accumulator_dtype(x2.dtype)
        g = _rows(grad).to(adt)
        xhat = x2.to(adt) * rstd[:, None]
        gw = g * weight.to(adt) if weight is not None else g
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            dot = reduction_backend.row_dot(gw, xhat) / N
            grad_x = (rstd[:, None] * (gw - xhat * dot[:, None])).to(x2.dtype).reshape(ctx.shape)
        if weight is not None and ctx.needs_input_grad[1]:
            # The forward multiplies the weight by xhat rounded to x.dtype; that rounded value is its factor.
            h = xhat if ctx.keep_fp32 else xhat.to(x2.dtype).to(adt)
            grad_w = reduction_backend.col_sum(g * h).to(weight.dtype)
        return grad_x, grad_w, None, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6, *, weight_in_fp32: bool = False,
             backend: str | None = None) -> torch.Tensor:
    """Batch-invariant RMSNorm over the last dim (HF Llama/Qwen semantics, forward and backward).

    x: [..., N] (bf16/fp16/fp32; fp64 on the torch backend); weight: [N] or None.
    The statistics are fp32 (fp64 for fp64); the output is ``weight * xhat.to(x.dtype)``
    with torch's type promotion (an fp32 weight gives an fp32 output, as in HF).
    ``weight_in_fp32``: ``(weight * xhat).to(x.dtype)`` instead, the product in the
    statistics' dtype and rounded once (OLMo 2's order); the same in fp32.
    """
    _check_rms("rms_norm", x, weight)
    reduction_backend = reduction_backend_for("rms_norm", x.device, backend)
    keep = bool(weight_in_fp32)
    if not (torch.is_grad_enabled() and (x.requires_grad or (weight is not None and weight.requires_grad))) \
            and reduction_backend.fuses_rms_norm(x, weight):
        # Inference (a decode step runs four norms per layer): the one fused launch, without
        # an autograd node -- the forward the Function would run, so the same bits.
        N = x.shape[-1]
        y, _, _ = rms_norm_forward_fused(_rows(x).contiguous(), weight, float(eps), keep)
        y = y.reshape(*x.shape[:-1], N)
    else:
        y = _RMSNormFunction.apply(x, weight, float(eps), reduction_backend, keep)
    return y.to(x.dtype) if keep else y


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6, *,
                 backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = residual + x`` and ``rms_norm(s, weight, eps)``: a decoder layer's residual add and
    the RMSNorm after it, returned as (normed, s).

    x, residual: [..., N] of one dtype, shape and device; weight: [N] or None. The bits are
    those of torch's add and :func:`rms_norm` on every path: on the Triton backend without
    gradients one launch (the sum formed in the norm's row program and stored), elsewhere
    the two ops.
    """
    if not (isinstance(x, torch.Tensor) and isinstance(residual, torch.Tensor)):
        raise TypeError(f"rlkernels.add_rms_norm: x and residual must be tensors, got {type(x).__name__} and "
                        f"{type(residual).__name__}")
    if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
        raise ValueError(f"rlkernels.add_rms_norm: residual must match x, got {tuple(residual.shape)} "
                         f"{residual.dtype} on {residual.device} for x {tuple(x.shape)} {x.dtype} on {x.device}")
    _check_rms("add_rms_norm", x, weight)
    grads = torch.is_grad_enabled() and (x.requires_grad or residual.requires_grad
                                         or (weight is not None and weight.requires_grad))
    if not grads and reduction_backend_for("rms_norm", x.device, backend).fuses_rms_norm(x, weight):
        N = x.shape[-1]
        y, _, summed = rms_norm_forward_fused(_rows(x).contiguous(), weight, float(eps), False,
                                              residual=_rows(residual).contiguous())
        return y.reshape(x.shape), summed.reshape(x.shape)
    summed = residual + x
    return rms_norm(summed, weight, eps, backend=backend), summed


def _check_rms(op: str, x: torch.Tensor, weight: torch.Tensor | None) -> None:
    V.require_tensor(op, "x", x)
    V.require_float(op, "x", x)
    V.require_ndim(op, "x", x, 1)
    if weight is not None:
        V.require_float(op, "weight", weight)
        V.require_same_device(op, x=x, weight=weight)
        # The weight fixes normalized_shape (as nn.RMSNorm's does): a mismatch is the input's.
        if weight.dim() != 1:
            raise ValueError(f"rlkernels.{op}: weight must be 1-D (normalized_shape (N,)), got shape "
                             f"{tuple(weight.shape)}")
        if weight.shape[0] != x.shape[-1]:
            raise ValueError(f"rlkernels.{op}: input's last dim is {x.shape[-1]} but the weight has "
                             f"{weight.shape[0]} elements (normalized_shape ({weight.shape[0]},)): expected "
                             f"input of shape [*, {weight.shape[0]}], got {tuple(x.shape)}")


class _LayerNormFunction(torch.autograd.Function):
    """y = (weight * ((x - mean) * rsqrt(var + eps))).to(x.dtype), the statistics and the
    product in fp32 (fp64 for fp64): Cohere's ``CohereLayerNorm``. ``weight`` has the
    shape of x's last ``weight.dim()`` dims; the rows normed are x's last dim."""

    @staticmethod
    def forward(ctx, x, weight, eps, reduction_backend):  # type: ignore[override]
        N = x.shape[-1]
        adt = accumulator_dtype(x.dtype)
        xf = _rows(x).to(adt)
        mean = reduction_backend.row_dot(xf) / N
        centred = xf - mean[:, None]
        rstd = torch.rsqrt(reduction_backend.row_dot(centred, centred) / N + eps)
        xhat = (centred * rstd[:, None]).reshape(x.shape)
        y = (weight.to(adt) * xhat).to(x.dtype)
        ctx.save_for_backward(xhat, weight, rstd)
        ctx.reduction_backend, ctx.dtype = reduction_backend, x.dtype
        return y

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        xhat, weight, rstd = ctx.saved_tensors
        reduction_backend = ctx.reduction_backend
        N = xhat.shape[-1]
        adt = xhat.dtype
        g = grad.to(adt)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            gx = _rows(weight.to(adt) * g)
            xh = _rows(xhat)
            mean_g = reduction_backend.row_dot(gx) / N
            mean_gx = reduction_backend.row_dot(gx, xh) / N
            grad_x = (rstd[:, None] * (gx - mean_g[:, None] - xh * mean_gx[:, None])).to(ctx.dtype)
            grad_x = grad_x.reshape(xhat.shape)
        if ctx.needs_input_grad[1]:
            # Over the leading rows, ascending (the weight's elements are the columns).
            cols = weight.numel()
            grad_w = reduction_backend.col_sum((g * xhat).reshape(-1, cols)).reshape(weight.shape).to(weight.dtype)
        return grad_x, grad_w, None, None


def layer_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5, *, backend: str | None = None
               ) -> torch.Tensor:
    """Batch-invariant LayerNorm without a bias over the last dim, Cohere's formula, forward
    and backward: ``(weight.float() * ((x - mean) * rsqrt(var + eps))).to(x.dtype)`` with x
    in fp32 and var the mean of the centred row's squares.

    x: [..., N] (bf16/fp16/fp32; fp64 on the torch backend); weight: x's last
    ``weight.dim()`` dims, [N] or Cohere's per-head [heads, N] for its q/k norms. Both
    means are :mod:`~rlkernels.ops.reductions` row sums in a fixed order, / N; the weight
    gradient sums over the leading rows in a fixed order.
    """
    op = "layer_norm"
    V.require_tensor(op, "x", x)
    V.require_tensor(op, "weight", weight)
    V.require_float(op, "x", x)
    V.require_float(op, "weight", weight)
    V.require_ndim(op, "x", x, 1)
    V.require_same_device(op, x=x, weight=weight)
    if weight.dim() < 1 or weight.dim() > x.dim() or tuple(weight.shape) != tuple(x.shape[x.dim() - weight.dim():]):
        raise ValueError(f"rlkernels.{op}: weight {tuple(weight.shape)} must be the last dims of x "
                         f"{tuple(x.shape)} (normalized over the last one)")
    reduction_backend = reduction_backend_for(op, x.device, backend)
    return _LayerNormFunction.apply(x, weight, float(eps), reduction_backend)


# ---------------------------------------------------------------- registry entries


class _RMSNormOp(OpImpl):
    op_class = "rms_norm"
    backend_impl: TorchReductionBackend | TritonReductionBackend

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6) -> torch.Tensor:
        _check_rms("rms_norm", x, weight)
        return _RMSNormFunction.apply(x, weight, float(eps), self.backend_impl, False)

    def forward_fp32(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6) -> torch.Tensor:
        _check_rms("rms_norm", x, weight)
        return _RMSNormFunction.apply(x, weight, float(eps), self.backend_impl, True)

    def invariance_case(self, device, dtype, generator):
        n = 96 if device.type == "cpu" else 2048
        x = torch.randn(33, n, generator=generator).to(device=device, dtype=dtype)
        w = (1 + 0.1 * torch.randn(n, generator=generator)).to(device=device, dtype=dtype)
        return (lambda rows: self.forward(rows, w, 1e-6)), x


register_backends("rms_norm", _RMSNormOp, {"triton": TritonReductionBackend(), "torch": TorchReductionBackend()})


class _LayerNormOp(OpImpl):
    op_class = "layer_norm"
    backend_impl: TorchReductionBackend | TritonReductionBackend

    def forward(self, x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
        return layer_norm(x, weight, eps, backend=self.backend)

    def forward_fp32(self, x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
        # The statistics and the product are fp32 already: the same math without the last rounding.
        acc = accumulator_dtype(x.dtype)
        return layer_norm(x.to(acc), weight.to(acc), eps, backend=self.backend)

    def invariance_case(self, device, dtype, generator):
        n = 96 if device.type == "cpu" else 2048
        x = (3 + torch.randn(33, n, generator=generator)).to(device=device, dtype=dtype)
        w = (1 + 0.1 * torch.randn(n, generator=generator)).to(device=device, dtype=dtype)
        return (lambda rows: self.forward(rows, w, 1e-5)), x


register_backends("layer_norm", _LayerNormOp, {"triton": TritonReductionBackend(), "torch": TorchReductionBackend()})
