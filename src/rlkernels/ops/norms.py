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

``log_softmax`` of fp32 input (fp32 out) is the exception: it follows the LSE order of
the token distribution (``ops.lm_head.lse``: 2048-column splits, 256-column tiles with
fixed-point masses), on which ``linear_logprob``, ``linear_sample`` and
``token_logprobs`` agree. Its tiles start at column 0, so it is invariant to the batch
and to trailing (right) padding, but not to leading (left) padding.

The RMSNorm weight gradient reduces over the M rows (tokens) of a call in an
order fixed by M alone -- never by M's size class, the device or tuning:

* ``torch``: ascending over rows, one row per step (a chain of row adds in fp64).
* ``triton``: rows split into fixed blocks of :data:`ROWS_PER_BLOCK` aligned to
  row 0; block p's partial is an fp32 chain over its rows ascending (from 0.0),
  computed in parallel over blocks and column tiles; then each column's fp32
  chain over the partials, p ascending (from 0.0), rounded once to the weight's
  dtype. No atomics. RMSNorm's forward and grad_x run fused, one program per
  row, with the row sums in the ``triton`` order above.
"""
from __future__ import annotations

import torch

from . import _validate as V
from ..registry import OpImpl, implementation, register, select_backend
from .lm_head.lse import log_softmax_rows
from ..gemm.chain import accumulator_dtype

from ..kernels._triton import cdiv
from ..kernels.norms import (col_finish_kernel, col_partial_kernel, rms_norm_bwd_kernel, rms_norm_fwd_kernel,
                             row_dot_kernel)
from ..runtime.launcher import cached_launcher

ROW_BLOCK = 1024  # must match pairwise_sum_1024; Triton tile width of the per-row sum (fixed: the order must not depend on R's size class)
COL_BLOCK = 128   # Triton column tile of the column sums (each column is its own chain: any width gives the same bits)
# Triton column sums: rows [p*ROWS_PER_BLOCK, (p+1)*ROWS_PER_BLOCK) form partial p. Fixed, aligned
# to row 0 and independent of M's size class, the GPU and any tuning: the order is a function of M.
ROWS_PER_BLOCK = 128
SUM_UNROLL = 16   # rows (partials) whose loads one step of a column chain issues together; order unchanged
NUM_STAGES = 3    # Triton's CUDA default; the loops' pipelining does not change the order
CHAIN_MAX = 16384  # torch backend: sequential chain up to this row length
LANES = 1024       # torch backend: lane count of the long-row sum

# Every Triton launch here goes through the cached launcher (runtime.launcher).
_launch_row_dot = cached_launcher(row_dot_kernel)
_launch_rms_fwd = cached_launcher(rms_norm_fwd_kernel)
_launch_rms_bwd = cached_launcher(rms_norm_bwd_kernel)
_launch_col_partial = cached_launcher(col_partial_kernel)
_launch_col_finish = cached_launcher(col_finish_kernel)
_FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class TorchReductionBackend:
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

    def fuses_rms_norm(self, x: torch.Tensor, weight: torch.Tensor | None) -> bool:
        """Never: rms_norm runs torch elementwise ops around :meth:`row_dot` / :meth:`col_sum`."""
        return False

    def col_sum(self, x: torch.Tensor) -> torch.Tensor:
        """sum_i x[i, j] over rows, ascending; fp32 (fp64 for fp64)."""
        acc = torch.zeros(x.shape[1], dtype=torch.float64, device=x.device)
        for i in range(x.shape[0]):
            acc.add_(x[i].double())
        return acc.to(accumulator_dtype(x.dtype))


class TritonReductionBackend:
    """Fixed-tile Triton sums (fp32 accumulation)."""

    name = "triton"

    def row_dot(self, a: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        if a.dtype == torch.float64:
            return TorchReductionBackend().row_dot(a, b)
        a = a.contiguous()
        b = b.contiguous() if b is not None else None
        M, R = a.shape
        out = torch.empty(M, dtype=torch.float32, device=a.device)
        if M == 0:
            return out
        if R == 0:
            return out.zero_()
        bb = b if b is not None else a
        _launch_row_dot((M,), (a, bb, out, R, a.stride(0), bb.stride(0)), dict(HAS_B=b is not None, BLOCK=ROW_BLOCK),
                        num_warps=4, num_stages=NUM_STAGES)
        return out

    def col_sum(self, x: torch.Tensor) -> torch.Tensor:
        """sum_i x[i, j] for a 2-D ``x`` [M, N], fp32 (fp64 for fp64): blocked, see :func:`blocked_col_sum`."""
        if x.dtype == torch.float64:
            return TorchReductionBackend().col_sum(x)
        x = x.contiguous()
        out = torch.zeros(x.shape[1], dtype=torch.float32, device=x.device)
        blocked_col_sum(x, out)
        return out

    def fuses_rms_norm(self, x: torch.Tensor, weight: torch.Tensor | None) -> bool:
        """Whether rms_norm runs the fused row kernels (fp16/bf16/fp32 operands, rows not empty)."""
        return (x.dtype in _FUSED_DTYPES and (weight is None or weight.dtype in _FUSED_DTYPES)
                and x.shape[-1] > 0)


def blocked_col_sum(a: torch.Tensor, out: torch.Tensor, x: torch.Tensor | None = None,
                    rstd: torch.Tensor | None = None, keep_fp32: bool = False) -> None:
    """``out[j] = sum_i v[i, j]`` on the Triton backend, in a fixed order that depends on M alone.

    a: [M, N] contiguous (fp16/bf16/fp32); out: [N] (fp16/bf16/fp32), written once, the
    fp32 sum rounded to its dtype. ``v = a``, or with ``x`` [M, N] and ``rstd`` [M] (fp32)
    the RMSNorm weight-gradient term ``v = a * h`` with ``h = x * rstd`` rounded to x's
    dtype (not with ``keep_fp32``). Order: partial p = fp32 chain over rows
    p*ROWS_PER_BLOCK.. ascending, from 0.0; then out = fp32 chain over the partials, p
    ascending, from 0.0. No atomics.
    """
    M, N = a.shape
    if N == 0:
        return
    if M == 0:
        out.zero_()
        return
    P = cdiv(M, ROWS_PER_BLOCK)
    part = torch.empty(P, N, dtype=torch.float32, device=a.device)
    norm = x is not None
    xx = x if x is not None else a
    rs = rstd if rstd is not None else a
    _launch_col_partial((P, cdiv(N, COL_BLOCK)), (a, xx, rs, part, M, N, a.stride(0), xx.stride(0)),
                        dict(NORM=norm, KEEP_FP32=keep_fp32, ROWS=ROWS_PER_BLOCK, UNROLL=SUM_UNROLL,
                             BLOCK_N=COL_BLOCK), num_warps=4, num_stages=NUM_STAGES)
    _launch_col_finish((cdiv(N, COL_BLOCK),), (part, out, P, N), dict(UNROLL=SUM_UNROLL, BLOCK_N=COL_BLOCK),
                       num_warps=4, num_stages=NUM_STAGES)


def rms_norm_forward_fused(x2: torch.Tensor, weight: torch.Tensor | None, eps: float,
                           keep_fp32: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused Triton RMSNorm rows: (y [M, N], rstd [M] fp32) for a contiguous x2 [M, N].

    y = weight * (x * rstd).to(x.dtype) in torch's promoted dtype (fp32 with ``keep_fp32``,
    where the fp32 xhat is kept); rstd = rsqrt(sum(x^2) / N + eps), the sum in
    row_dot's fixed order.
    """
    M, N = x2.shape
    if keep_fp32:
        out_dt = torch.float32
    else:
        out_dt = x2.dtype if weight is None else torch.promote_types(weight.dtype, x2.dtype)
    y = torch.empty(M, N, dtype=out_dt, device=x2.device)
    rstd = torch.empty(M, dtype=torch.float32, device=x2.device)
    if M == 0:
        return y, rstd
    w = weight.contiguous() if weight is not None else x2
    _launch_rms_fwd((M,), (x2, w, y, rstd, N, x2.stride(0), y.stride(0), eps),
                    dict(HAS_W=weight is not None, KEEP_FP32=keep_fp32, BLOCK=ROW_BLOCK), num_warps=4,
                    num_stages=NUM_STAGES)
    return y, rstd


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


def reduction_backend_for(op: str, device: torch.device,
                          backend: str | None = None) -> TorchReductionBackend | TritonReductionBackend:
    """The reduction backend object the registry picks for ``op`` on ``device``."""
    name, _ = select_backend(op, device, backend)
    return implementation(op, name).backend_impl  # type: ignore[attr-defined]


# ---------------------------------------------------------------- softmax / log_softmax


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


# ---------------------------------------------------------------- RMSNorm


class _RMSNormFunction(torch.autograd.Function):
    """y = weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype) -- the HF Llama/Qwen formula."""

    @staticmethod
    def forward(ctx, x, weight, eps, reduction_backend, keep_fp32):  # type: ignore[override]
        N = x.shape[-1]
        x2 = x.reshape(-1, N)
        ctx.fused = reduction_backend.fuses_rms_norm(x, weight)
        if ctx.fused:
            x2 = x2.contiguous()
            y, rstd = rms_norm_forward_fused(x2, weight, eps, keep_fp32)
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
                grad.reshape(-1, N).contiguous(), x2, weight, rstd, ctx.keep_fp32,
                ctx.needs_input_grad[0], weight is not None and ctx.needs_input_grad[1])
            return (grad_x.reshape(ctx.shape) if grad_x is not None else None), grad_w, None, None, None
        adt = accumulator_dtype(x2.dtype)
        g = grad.reshape(-1, N).to(adt)
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


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6, *,
             backend: str | None = None) -> torch.Tensor:
    """Batch-invariant RMSNorm over the last dim (HF Llama/Qwen semantics, forward and backward).

    x: [..., N] (bf16/fp16/fp32; fp64 on the torch backend); weight: [N] or None.
    The statistics are fp32 (fp64 for fp64); the output is ``weight * xhat.to(x.dtype)``
    with torch's type promotion (an fp32 weight gives an fp32 output, as in HF).
    """
    _check_rms("rms_norm", x, weight)
    reduction_backend = reduction_backend_for("rms_norm", x.device, backend)
    if not (torch.is_grad_enabled() and (x.requires_grad or (weight is not None and weight.requires_grad))) \
            and reduction_backend.fuses_rms_norm(x, weight):
        # Inference (a decode step runs four norms per layer): the one fused launch, without
        # an autograd node -- the forward the Function would run, so the same bits.
        N = x.shape[-1]
        y, _ = rms_norm_forward_fused(x.reshape(-1, N).contiguous(), weight, float(eps), False)
        return y.reshape(*x.shape[:-1], N)
    return _RMSNormFunction.apply(x, weight, float(eps), reduction_backend, False)


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


# ---------------------------------------------------------------- registry entries


class _RMSNormBase(OpImpl):
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


class _SoftmaxBase(OpImpl):
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


@register("rms_norm", "triton")
class RMSNormTriton(_RMSNormBase):
    backend_impl = TritonReductionBackend()


@register("rms_norm", "torch")
class RMSNormTorch(_RMSNormBase):
    backend_impl = TorchReductionBackend()


@register("softmax", "triton")
class SoftmaxTriton(_SoftmaxBase):
    op_class = "softmax"
    backend_impl = TritonReductionBackend()


@register("softmax", "torch")
class SoftmaxTorch(_SoftmaxBase):
    op_class = "softmax"
    backend_impl = TorchReductionBackend()


@register("log_softmax", "triton")
class LogSoftmaxTriton(_SoftmaxBase):
    op_class = "log_softmax"
    log = True
    backend_impl = TritonReductionBackend()


@register("log_softmax", "torch")
class LogSoftmaxTorch(_SoftmaxBase):
    op_class = "log_softmax"
    log = True
    backend_impl = TorchReductionBackend()
