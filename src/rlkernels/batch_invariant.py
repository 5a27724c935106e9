"""``set_batch_invariant_mode``: route stock torch calls to the invariant kernels.

While the mode is on, these ATen ops are re-implemented for the CPU and CUDA
dispatch keys through ``torch.library`` (so ``torch.mm``, ``@``, ``F.linear``,
``torch.softmax`` ... and autograd's derivative formulas, which call the same
ops, all land here):

=========================================  ==========================================
op                                         implementation
=========================================  ==========================================
``mm``, ``addmm``, ``bmm``, ``baddbmm``    the canonical K-chain GEMM (``ops.matmul``)
``_softmax``, ``_log_softmax``             ``ops.norms`` (fixed-order row sum)
``_softmax_backward_data``,                ``ops.norms`` backward
``_log_softmax_backward_data``
``mean.dim``, ``mean``                     fixed-order sum / count (``ops.norms``)
``silu``, ``silu_backward`` (CPU only)     ``x / (1 + exp(-x))`` from single-rounding ops
=========================================  ==========================================

Why silu: ATen's CPU silu runs a Sleef vector body and a scalar tail whose bits
differ (measured: ~0.5% of elements), and which elements fall in the tail depends
on the tensor's size -- so a token's MLP activation changed with the batch.
``exp``, ``log``, ``rsqrt``, ``sin``, ``cos``, ``+``, ``*``, ``/`` were measured
position-independent and are left alone.

An override must never call the op it overrides (the dispatcher would re-enter
it): the GEMMs call the Triton kernel directly (never the cuBLASLt path, which is
``F.linear``) or the elementwise chain; the reductions use ``ops.norms`` engines,
which are built from elementwise ops, ``amax`` and Triton.

Nesting: each call records the state it replaced; leaving a ``with`` block
restores that state, also after an exception. The overrides are installed once
(a ``torch.library.Library`` object) and removed when the last holder leaves.
"""
from __future__ import annotations

import contextlib
import threading
import warnings
from typing import Iterator, Sequence

import torch

from .ops.chain import accumulator_dtype
from .ops.matmul import engine_for
from .ops.norms import TorchReducer, TritonReducer, softmax_backward, softmax_forward
from .registry import select_backend

__all__ = ["set_batch_invariant_mode", "is_batch_invariant_mode_enabled", "COVERED_OPS"]

COVERED_OPS: tuple[str, ...] = (
    "mm", "addmm", "bmm", "baddbmm", "_softmax", "_log_softmax", "_softmax_backward_data",
    "_log_softmax_backward_data", "mean.dim", "mean", "silu (CPU)", "silu_backward (CPU)",
)

_LOCK = threading.RLock()
_STATE = {"enabled": False, "lib": None}
_FLOAT = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# ---------------------------------------------------------------- engines


def _gemm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None,
          out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """a [M,K] or [B,M,K] @ b [K,N] or [B,K,N] (+ 1-D bias) by the canonical K-chain.

    The registry's GEMM engine for the device (fp64: the torch chain); inside the
    mode the Triton engine never detours through cuBLASLt, whose entry point
    (F.linear) is itself overridden here.
    """
    if a.dtype not in _FLOAT or b.dtype not in _FLOAT:
        # Integer products are exact: any summation order gives the same bits.
        out = (a.unsqueeze(-1) * b.unsqueeze(-3)).sum(-2)
        return out + bias if bias is not None else out
    engine = engine_for(a.device, "torch" if a.dtype == torch.float64 else None)
    return engine.gemm(a, b, bias=bias, out_dtype=out_dtype)


def _reducer(t: torch.Tensor) -> TorchReducer | TritonReducer:
    name, _ = select_backend("rms_norm", t.device)
    return TritonReducer() if name == "triton" and t.dtype != torch.float64 else TorchReducer()


def _scaled(x: torch.Tensor, s) -> torch.Tensor:
    return x if s == 1 else x * s


# ---------------------------------------------------------------- overrides (no autograd here)


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _gemm(a, b)


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _gemm(a, b)


def _addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta=1, alpha=1) -> torch.Tensor:
    if beta == 1 and alpha == 1 and bias.dim() == 1 and bias.dtype == a.dtype and bias.shape[0] == b.shape[1]:
        return _gemm(a, b, bias)  # bias added to the fp32 accumulator, rounded once (like cuBLAS epilogues)
    prod = _scaled(_gemm(a, b), alpha)
    if beta == 0:
        return prod
    return prod + _scaled(bias, beta)


def _baddbmm(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta=1, alpha=1) -> torch.Tensor:
    prod = _scaled(_gemm(a, b), alpha)
    if beta == 0:
        return prod
    return prod + _scaled(base, beta)


def _softmax(x: torch.Tensor, dim: int, half_to_float: bool) -> torch.Tensor:
    out_dtype = torch.float32 if half_to_float and x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    return softmax_forward(x, dim, out_dtype, False, _reducer(x))


def _log_softmax(x: torch.Tensor, dim: int, half_to_float: bool) -> torch.Tensor:
    out_dtype = torch.float32 if half_to_float and x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    return softmax_forward(x, dim, out_dtype, True, _reducer(x))


def _softmax_bwd(grad: torch.Tensor, out: torch.Tensor, dim: int, input_dtype: torch.dtype) -> torch.Tensor:
    return softmax_backward(grad, out, dim, False, _reducer(out), input_dtype)


def _log_softmax_bwd(grad: torch.Tensor, out: torch.Tensor, dim: int, input_dtype: torch.dtype) -> torch.Tensor:
    return softmax_backward(grad, out, dim, True, _reducer(out), input_dtype)


def _mean_dim(x: torch.Tensor, dim: Sequence[int] | None, keepdim: bool = False, *,
              dtype: torch.dtype | None = None) -> torch.Tensor:
    out_dtype = dtype or x.dtype
    if not (x.is_floating_point() and out_dtype in _FLOAT):
        raise RuntimeError(f"rlkernels batch-invariant mean: unsupported dtype {x.dtype} -> {out_dtype}")
    nd = x.dim()
    dims = sorted({d % nd for d in dim}) if dim is not None and len(dim) and nd else list(range(nd))
    keep = [d for d in range(nd) if d not in dims]
    xt = x.permute(*keep, *dims) if nd else x.reshape(1)
    kept_shape = [x.shape[d] for d in keep]
    count = 1
    for d in dims:
        count *= x.shape[d]
    adt = accumulator_dtype(torch.promote_types(x.dtype, out_dtype))
    if count == 0:  # the mean of nothing is NaN, as in stock torch
        out = torch.full(kept_shape, float("nan"), dtype=out_dtype, device=x.device)
    else:
        total = _reducer(x).row_dot(xt.reshape(-1, count).to(adt)).to(adt)
        out = (total / count).to(out_dtype).reshape(kept_shape)
    if keepdim:
        for d in dims:
            out = out.unsqueeze(d)
    return out


def _mean_all(x: torch.Tensor, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    return _mean_dim(x, None, False, dtype=dtype)


def _silu(x: torch.Tensor) -> torch.Tensor:
    xf = x.to(accumulator_dtype(x.dtype))
    return (xf / (1 + torch.exp(-xf))).to(x.dtype)


def _silu_backward(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    xf = x.to(accumulator_dtype(x.dtype))
    sig = 1 / (1 + torch.exp(-xf))
    return (grad.to(xf.dtype) * sig * (1 + xf * (1 - sig))).to(grad.dtype)


_OVERRIDES = (
    ("mm", _mm, ("CPU", "CUDA")),
    ("addmm", _addmm, ("CPU", "CUDA")),
    ("bmm", _bmm, ("CPU", "CUDA")),
    ("baddbmm", _baddbmm, ("CPU", "CUDA")),
    ("_softmax", _softmax, ("CPU", "CUDA")),
    ("_log_softmax", _log_softmax, ("CPU", "CUDA")),
    ("_softmax_backward_data", _softmax_bwd, ("CPU", "CUDA")),
    ("_log_softmax_backward_data", _log_softmax_bwd, ("CPU", "CUDA")),
    ("mean.dim", _mean_dim, ("CPU", "CUDA")),
    ("mean", _mean_all, ("CPU", "CUDA")),
    ("silu", _silu, ("CPU",)),
    ("silu_backward", _silu_backward, ("CPU",)),
)


def _install() -> torch.library.Library:
    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Overriding a previously registered kernel.*")
        warnings.filterwarnings("ignore", message=".*Warning only once for all operators.*")
        for name, fn, keys in _OVERRIDES:
            for key in keys:
                lib.impl(name, fn, key)
    return lib


def _apply(enabled: bool) -> None:
    if enabled and _STATE["lib"] is None:
        _STATE["lib"] = _install()
    elif not enabled and _STATE["lib"] is not None:
        _STATE["lib"]._destroy()  # restores the stock kernels
        _STATE["lib"] = None
    _STATE["enabled"] = enabled


class _ModeGuard(contextlib.AbstractContextManager):
    """Returned by :func:`set_batch_invariant_mode`; as a context manager it restores the previous state."""

    def __init__(self, previous: bool) -> None:
        self.previous = previous

    def __enter__(self) -> "_ModeGuard":
        return self

    def __exit__(self, *exc) -> None:
        with _LOCK:
            _apply(self.previous)
        return None


def set_batch_invariant_mode(enabled: bool = True) -> _ModeGuard:
    """Turn the batch-invariant overrides on (or off) now.

    Plain call: the new state stays until changed. ``with set_batch_invariant_mode():``
    restores the state found on entry when the block exits (exception or not), so
    blocks nest. The overrides are process-wide (every thread), like any
    ``torch.library`` registration.
    """
    with _LOCK:
        previous = _STATE["enabled"]
        _apply(bool(enabled))
        return _ModeGuard(previous)


def is_batch_invariant_mode_enabled() -> bool:
    return bool(_STATE["enabled"])


@contextlib.contextmanager
def batch_invariant_mode(enabled: bool = True) -> Iterator[None]:
    """Context-manager spelling of :func:`set_batch_invariant_mode`."""
    with set_batch_invariant_mode(enabled):
        yield
