"""Batch-invariant ``softmax`` and ``log_softmax``: elementwise work around one row sum
in the fixed order of :mod:`rlkernels.ops.reductions`.

``log_softmax`` of fp32 input (fp32 out) is the exception: it follows the LSE order of
the token distribution (``ops.lm_head.lse``: 2048-column splits, 256-column tiles with
fixed-point masses), on which ``linear_logprob``, ``linear_sample`` and
``token_logprobs`` agree. Its tiles start at column 0, so it is invariant to the batch
and to trailing (right) padding, but not to leading (left) padding.
"""
from __future__ import annotations

import torch

from . import _validate as V
from ..gemm.chain import accumulator_dtype
from ..registry import OpImpl, register_backends
from .lm_head.lse import log_softmax_rows
from .reductions import TorchReductionBackend, TritonReductionBackend, reduction_backend_for


def softmax_forward(x: torch.Tensor, dim: int, out_dtype: torch.dtype | None, log: bool,
                    reduction_backend: TorchReductionBackend | TritonReductionBackend) -> torch.Tensor:
    """(log_)softmax of ``x`` over ``dim``, no autograd; computed in fp32 (fp64 for fp64)."""
    out_dtype = out_dtype or x.dtype
    if x.dim() == 0:
        x1 = x.reshape(1, 1)
        return softmax_forward(x1, -1, out_dtype, log, reduction_backend).reshape(())
    dim = dim % x.dim()
    xt = x.movedim(dim, -1)
    shape = xt.shape
    R = shape[-1]
    adt = accumulator_dtype(torch.promote_types(x.dtype, out_dtype))
    if xt.numel() == 0:
        return torch.empty(shape, dtype=out_dtype, device=x.device).movedim(-1, dim)
    if log and x.dtype == torch.float32 and out_dtype == torch.float32:
        # fp32 logits: the LSE order, so that log_softmax of a patched LM head's logits
        # (divided by T) at a token is that token's linear_logprob bit for bit.
        backend = "torch" if x.device.type == "meta" else reduction_backend.name
        return log_softmax_rows(xt.reshape(-1, R).contiguous(), backend).reshape(shape).movedim(-1, dim)
    xf = xt.reshape(-1, R).to(adt)
    # max is exact in any order. A row whose max is -inf (all -inf) gets a 0 shift: its
    # sum is 0 and every output NaN (0/0, -inf - -inf), as stock. A +inf or NaN max is
    # kept: x - m is then NaN at the max and the NaN reaches the row's sum, so the whole
    # row is NaN, as stock (a 0 shift would give 0 / inf = 0 beside the +inf entry).
    m = torch.amax(xf, dim=-1, keepdim=True)
    m = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    shifted = xf - m
    e = torch.exp(shifted)
    s = reduction_backend.row_dot(e)[:, None]
    out = shifted - torch.log(s) if log else e / s
    return out.to(out_dtype).reshape(shape).movedim(-1, dim)


def softmax_backward(grad: torch.Tensor, out: torch.Tensor, dim: int, log: bool,
                     reduction_backend: TorchReductionBackend | TritonReductionBackend,
                     in_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Gradient wrt the (log_)softmax input from the output ``out``; no autograd."""
    in_dtype = in_dtype or out.dtype
    if out.dim() == 0:
        return torch.zeros_like(grad, dtype=in_dtype)
    dim = dim % out.dim()
    gt, yt = grad.movedim(dim, -1), out.movedim(dim, -1)
    shape = yt.shape
    R = shape[-1]
    adt = accumulator_dtype(out.dtype)
    if yt.numel() == 0:
        return torch.zeros(shape, dtype=in_dtype, device=out.device).movedim(-1, dim)
    g, y = gt.reshape(-1, R).to(adt), yt.reshape(-1, R).to(adt)
    if log:
        dx = g - torch.exp(y) * reduction_backend.row_dot(g)[:, None]
    else:
        dx = y * (g - reduction_backend.row_dot(g, y)[:, None])
    return dx.to(in_dtype).reshape(shape).movedim(-1, dim)


class _SoftmaxFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, out_dtype, log, reduction_backend):  # type: ignore[override]
        out = softmax_forward(x, dim, out_dtype, log, reduction_backend)
        ctx.save_for_backward(out)
        ctx.dim, ctx.log, ctx.reduction_backend, ctx.in_dtype = dim, log, reduction_backend, x.dtype
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        (out,) = ctx.saved_tensors
        grad_x = softmax_backward(grad, out, ctx.dim, ctx.log, ctx.reduction_backend, ctx.in_dtype)
        return grad_x, None, None, None, None


def _check_softmax(op: str, x: torch.Tensor, dim: int, dtype: torch.dtype | None) -> int:
    """The checks of (log_)softmax; returns ``dim`` wrapped into [0, x.dim())."""
    V.require_tensor(op, "x", x)
    V.require_float(op, "x", x)
    if dtype is not None and dtype not in V.FLOAT_DTYPES_WITH_FP64:
        raise ValueError(f"rlkernels.{op}: dtype must be a float dtype, got {dtype}")
    return V.require_dim(op, dim, x.dim())


def softmax(x: torch.Tensor, dim: int = -1, *, dtype: torch.dtype | None = None,
            backend: str | None = None) -> torch.Tensor:
    """Batch-invariant ``torch.softmax(x, dim, dtype=dtype)`` (fp32 math, fp64 for fp64)."""
    dim = _check_softmax("softmax", x, dim, dtype)
    return _SoftmaxFunction.apply(x, dim, dtype, False, reduction_backend_for("softmax", x.device, backend))


def log_softmax(x: torch.Tensor, dim: int = -1, *, dtype: torch.dtype | None = None,
                backend: str | None = None) -> torch.Tensor:
    """Batch-invariant ``torch.log_softmax(x, dim, dtype=dtype)`` (fp32 math, fp64 for fp64)."""
    dim = _check_softmax("log_softmax", x, dim, dtype)
    return _SoftmaxFunction.apply(x, dim, dtype, True, reduction_backend_for("log_softmax", x.device, backend))


# ---------------------------------------------------------------- registry entries


class _SoftmaxOp(OpImpl):
    op_class = "softmax"
    log = False
    backend_impl: TorchReductionBackend | TritonReductionBackend

    def forward(self, x: torch.Tensor, dim: int = -1, *, dtype: torch.dtype | None = None) -> torch.Tensor:
        dim = _check_softmax(self.op_name, x, dim, dtype)
        return _SoftmaxFunction.apply(x, dim, dtype, self.log, self.backend_impl)

    def forward_fp32(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return self.forward(x, dim, dtype=accumulator_dtype(x.dtype))

    def invariance_case(self, device, dtype, generator):
        n = 97 if device.type == "cpu" else 4099
        x = (3 * torch.randn(33, n, generator=generator)).to(device=device, dtype=dtype)
        return (lambda rows: self.forward(rows, -1)), x


class _LogSoftmaxOp(_SoftmaxOp):
    op_class = "log_softmax"
    log = True


register_backends("softmax", _SoftmaxOp, {"triton": TritonReductionBackend(), "torch": TorchReductionBackend()})
register_backends("log_softmax", _LogSoftmaxOp, {"triton": TritonReductionBackend(), "torch": TorchReductionBackend()})
