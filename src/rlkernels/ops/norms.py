"""Batch-invariant row reductions: ``rms_norm``, ``softmax``, ``log_softmax``.

Every op here is "elementwise work + one sum per row". Elementwise torch ops give
each element the same bits wherever it sits in a tensor (one IEEE rounding per
op; ``exp``/``log``/``rsqrt`` measured position-independent on CPU and CUDA), so
invariance only needs the per-row sum to have a fixed order:

* ``torch`` backend (any device): a sequential chain over the row,
  ``fl(...fl(fl(x_0) + x_1)... + x_{R-1})`` in fp64, rounded once to fp32 at the
  end, one elementwise add per step over all rows at once. The order depends on R alone,
  and zeros at *either* end add exactly 0, so left- and right-padded attention
  rows match. Rows longer than :data:`CHAIN_MAX` switch (by R alone) to
  :data:`LANES` lane accumulators stepped tile by tile, then a chain over lanes:
  still R-only and invariant to trailing zeros.
* ``triton`` backend (CUDA, or CPU under ``TRITON_INTERPRET=1``): one program per
  row, a fp32 accumulator vector of fixed width :data:`ROW_BLOCK` stepped over the
  row's tiles in ascending order, then a fixed pairwise tree over lane indices
  (layout-independent, unlike ``tl.sum``). Trailing zeros
  (masked keys, right padding, a longer KV length) land in extra tiles or masked
  lanes and add exactly 0; *leading* zeros shift lanes, so left padding is not
  bit-invariant here (nor in the tensor-core P@V).

The RMSNorm weight gradient reduces over tokens: ascending over rows, one row per
step (``torch``: a chain of row adds; ``triton``: one program per column block
looping over rows), so it is independent of how the rows were batched.
"""
from __future__ import annotations

import torch

from . import _validate as V
from ..registry import OpImpl, implementation, register, select_backend
from ..gemm.chain import accumulator_dtype

from ..kernels._triton import cdiv
from ..kernels.norms import col_sum_kernel, row_dot_kernel

ROW_BLOCK = 1024  # must match pairwise_sum_1024; Triton tile width of the per-row sum (fixed: the order must not depend on R's size class)
COL_BLOCK = 128   # Triton column block of the dW row loop (any width gives the same bits)
CHAIN_MAX = 16384  # torch backend: sequential chain up to this row length
LANES = 1024       # torch backend: lane count of the long-row sum


class TorchReducer:
    """Sequential-chain sums (any device). Accumulates in fp64 and rounds once to the
    op's accumulator dtype (fp32; fp64 for fp64): products of fp32 values are exact in
    fp64 and a long sequential fp32 chain loses accuracy (measured 6.9e-6 rel on a
    16384-wide softmax), while the order -- and so the invariance -- is unchanged."""

    name = "torch"

    def row_dot(self, a: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        """sum_j a[i, j] * b[i, j] (or sum_j a[i, j]) for a 2-D ``a``; fp32 (fp64 for fp64)."""
        out_dt = accumulator_dtype(a.dtype)
        x = a.double() if b is None else a.double() * b.double()
        M, R = x.shape
        acc = torch.zeros(M, dtype=torch.float64, device=x.device)
        if R <= CHAIN_MAX:
            for j in range(R):
                acc.add_(x[:, j])
            return acc.to(out_dt)
        lanes = torch.zeros(M, LANES, dtype=torch.float64, device=x.device)
        for start in range(0, R, LANES):
            tile = x[:, start:start + LANES]
            lanes[:, :tile.shape[1]].add_(tile)
        for j in range(LANES):
            acc.add_(lanes[:, j])
        return acc.to(out_dt)

    def col_sum(self, x: torch.Tensor) -> torch.Tensor:
        """sum_i x[i, j] over rows, ascending; fp32 (fp64 for fp64)."""
        acc = torch.zeros(x.shape[1], dtype=torch.float64, device=x.device)
        for i in range(x.shape[0]):
            acc.add_(x[i].double())
        return acc.to(accumulator_dtype(x.dtype))


class TritonReducer:
    """Fixed-tile Triton sums (fp32 accumulation)."""

    name = "triton"

    def row_dot(self, a: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        if a.dtype == torch.float64:
            return TorchReducer().row_dot(a, b)
        a = a.contiguous()
        b = b.contiguous() if b is not None else None
        M, R = a.shape
        out = torch.empty(M, dtype=torch.float32, device=a.device)
        if M == 0:
            return out
        if R == 0:
            return out.zero_()
        row_dot_kernel[(M,)](a, b if b is not None else a, out, R, a.stride(0),
                              (b if b is not None else a).stride(0),
                              HAS_B=b is not None, BLOCK=ROW_BLOCK, num_warps=4)
        return out

    def col_sum(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float64:
            return TorchReducer().col_sum(x)
        x = x.contiguous()
        M, N = x.shape
        out = torch.zeros(N, dtype=torch.float32, device=x.device)
        if M == 0 or N == 0:
            return out
        col_sum_kernel[(cdiv(N, COL_BLOCK),)](x, out, M, N, x.stride(0), BLOCK_N=COL_BLOCK, num_warps=4)
        return out


def reducer_for(op: str, device: torch.device, backend: str | None = None) -> TorchReducer | TritonReducer:
    """The reduction engine of the backend the registry picks for ``op`` on ``device``."""
    name, _ = select_backend(op, device, backend)
    return implementation(op, name).reducer  # type: ignore[attr-defined]


# ---------------------------------------------------------------- softmax / log_softmax


def softmax_forward(x: torch.Tensor, dim: int, out_dtype: torch.dtype | None, log: bool,
                    reducer: TorchReducer | TritonReducer) -> torch.Tensor:
    """(log_)softmax of ``x`` over ``dim``, no autograd; computed in fp32 (fp64 for fp64)."""
    out_dtype = out_dtype or x.dtype
    if x.dim() == 0:
        x1 = x.reshape(1, 1)
        return softmax_forward(x1, -1, out_dtype, log, reducer).reshape(())
    dim = dim % x.dim()
    xt = x.movedim(dim, -1)
    shape = xt.shape
    R = shape[-1]
    adt = accumulator_dtype(torch.promote_types(x.dtype, out_dtype))
    if xt.numel() == 0:
        return torch.empty(shape, dtype=out_dtype, device=x.device).movedim(-1, dim)
    xf = xt.reshape(-1, R).to(adt)
    # max is exact in any order; a row of -inf keeps a finite shift (stock gives NaN there too).
    m = torch.amax(xf, dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    shifted = xf - m
    e = torch.exp(shifted)
    s = reducer.row_dot(e)[:, None]
    out = shifted - torch.log(s) if log else e / s
    return out.to(out_dtype).reshape(shape).movedim(-1, dim)


def softmax_backward(grad: torch.Tensor, out: torch.Tensor, dim: int, log: bool,
                     reducer: TorchReducer | TritonReducer, in_dtype: torch.dtype | None = None) -> torch.Tensor:
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
        dx = g - torch.exp(y) * reducer.row_dot(g)[:, None]
    else:
        dx = y * (g - reducer.row_dot(g, y)[:, None])
    return dx.to(in_dtype).reshape(shape).movedim(-1, dim)


class _SoftmaxFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, out_dtype, log, reducer):  # type: ignore[override]
        out = softmax_forward(x, dim, out_dtype, log, reducer)
        ctx.save_for_backward(out)
        ctx.dim, ctx.log, ctx.reducer, ctx.in_dtype = dim, log, reducer, x.dtype
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        (out,) = ctx.saved_tensors
        return softmax_backward(grad, out, ctx.dim, ctx.log, ctx.reducer, ctx.in_dtype), None, None, None, None


def _check_softmax(op: str, x: torch.Tensor, dtype: torch.dtype | None) -> None:
    V.require_tensor(op, "x", x)
    V.require_float(op, "x", x)
    if dtype is not None and dtype not in V.FLOAT_DTYPES_WITH_FP64:
        raise ValueError(f"rlkernels.{op}: dtype must be a float dtype, got {dtype}")


def softmax(x: torch.Tensor, dim: int = -1, *, dtype: torch.dtype | None = None,
            backend: str | None = None) -> torch.Tensor:
    """Batch-invariant ``torch.softmax(x, dim, dtype=dtype)`` (fp32 math, fp64 for fp64)."""
    _check_softmax("softmax", x, dtype)
    return _SoftmaxFunction.apply(x, dim, dtype, False, reducer_for("softmax", x.device, backend))


def log_softmax(x: torch.Tensor, dim: int = -1, *, dtype: torch.dtype | None = None,
                backend: str | None = None) -> torch.Tensor:
    """Batch-invariant ``torch.log_softmax(x, dim, dtype=dtype)`` (fp32 math, fp64 for fp64)."""
    _check_softmax("log_softmax", x, dtype)
    return _SoftmaxFunction.apply(x, dim, dtype, True, reducer_for("log_softmax", x.device, backend))


# ---------------------------------------------------------------- RMSNorm


class _RMSNormFunction(torch.autograd.Function):
    """y = weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype) -- the HF Llama/Qwen formula."""

    @staticmethod
    def forward(ctx, x, weight, eps, reducer, keep_fp32):  # type: ignore[override]
        N = x.shape[-1]
        x2 = x.reshape(-1, N)
        adt = accumulator_dtype(x.dtype)
        xf = x2.to(adt)
        mean_sq = reducer.row_dot(xf, xf) / N
        rstd = torch.rsqrt(mean_sq + eps)
        xhat = xf * rstd[:, None]
        h = xhat if keep_fp32 else xhat.to(x.dtype)
        y = h if weight is None else (weight.to(adt) * h if keep_fp32 else weight * h)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.reducer, ctx.keep_fp32, ctx.shape = reducer, keep_fp32, x.shape
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x2, weight, rstd = ctx.saved_tensors
        reducer = ctx.reducer
        N = x2.shape[-1]
        adt = accumulator_dtype(x2.dtype)
        g = grad.reshape(-1, N).to(adt)
        xhat = x2.to(adt) * rstd[:, None]
        gw = g * weight.to(adt) if weight is not None else g
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            dot = reducer.row_dot(gw, xhat) / N
            grad_x = (rstd[:, None] * (gw - xhat * dot[:, None])).to(x2.dtype).reshape(ctx.shape)
        if weight is not None and ctx.needs_input_grad[1]:
            # The forward multiplies the weight by xhat rounded to x.dtype; that rounded value is its factor.
            h = xhat if ctx.keep_fp32 else xhat.to(x2.dtype).to(adt)
            grad_w = reducer.col_sum(g * h).to(weight.dtype)
        return grad_x, grad_w, None, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6, *,
             backend: str | None = None) -> torch.Tensor:
    """Batch-invariant RMSNorm over the last dim (HF Llama/Qwen semantics, forward and backward).

    x: [..., N] (bf16/fp16/fp32; fp64 on the torch backend); weight: [N] or None.
    The statistics are fp32 (fp64 for fp64); the output is ``weight * xhat.to(x.dtype)``
    with torch's type promotion (an fp32 weight gives an fp32 output, as in HF).
    """
    _check_rms("rms_norm", x, weight)
    return _RMSNormFunction.apply(x, weight, float(eps), reducer_for("rms_norm", x.device, backend), False)


def _check_rms(op: str, x: torch.Tensor, weight: torch.Tensor | None) -> None:
    V.require_tensor(op, "x", x)
    V.require_float(op, "x", x)
    V.require_ndim(op, "x", x, 1)
    if weight is not None:
        V.require_float(op, "weight", weight)
        V.require_same_device(op, x=x, weight=weight)
        if tuple(weight.shape) != (x.shape[-1],):
            raise ValueError(f"rlkernels.{op}: weight must have shape ({x.shape[-1]},), got {tuple(weight.shape)}")


# ---------------------------------------------------------------- registry entries


class _RMSNormBase(OpImpl):
    op_class = "rms_norm"
    reducer: TorchReducer | TritonReducer

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6) -> torch.Tensor:
        _check_rms("rms_norm", x, weight)
        return _RMSNormFunction.apply(x, weight, float(eps), self.reducer, False)

    def forward_fp32(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6) -> torch.Tensor:
        _check_rms("rms_norm", x, weight)
        return _RMSNormFunction.apply(x, weight, float(eps), self.reducer, True)

    def invariance_case(self, device, dtype, generator):
        n = 96 if device.type == "cpu" else 2048
        x = torch.randn(33, n, generator=generator).to(device=device, dtype=dtype)
        w = (1 + 0.1 * torch.randn(n, generator=generator)).to(device=device, dtype=dtype)
        return (lambda rows: self.forward(rows, w, 1e-6)), x


class _SoftmaxBase(OpImpl):
    log = False
    reducer: TorchReducer | TritonReducer

    def forward(self, x: torch.Tensor, dim: int = -1, *, dtype: torch.dtype | None = None) -> torch.Tensor:
        _check_softmax(self.op_name, x, dtype)
        return _SoftmaxFunction.apply(x, dim, dtype, self.log, self.reducer)

    def forward_fp32(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return self.forward(x, dim, dtype=accumulator_dtype(x.dtype))

    def invariance_case(self, device, dtype, generator):
        n = 97 if device.type == "cpu" else 4099
        x = (3 * torch.randn(33, n, generator=generator)).to(device=device, dtype=dtype)
        return (lambda rows: self.forward(rows, -1)), x


@register("rms_norm", "triton")
class RMSNormTriton(_RMSNormBase):
    reducer = TritonReducer()


@register("rms_norm", "torch")
class RMSNormTorch(_RMSNormBase):
    reducer = TorchReducer()


@register("softmax", "triton")
class SoftmaxTriton(_SoftmaxBase):
    op_class = "softmax"
    reducer = TritonReducer()


@register("softmax", "torch")
class SoftmaxTorch(_SoftmaxBase):
    op_class = "softmax"
    reducer = TorchReducer()


@register("log_softmax", "triton")
class LogSoftmaxTriton(_SoftmaxBase):
    op_class = "log_softmax"
    log = True
    reducer = TritonReducer()


@register("log_softmax", "torch")
class LogSoftmaxTorch(_SoftmaxBase):
    op_class = "log_softmax"
    log = True
    reducer = TorchReducer()
