"""``set_batch_invariant_mode``: route stock torch calls to the invariant kernels.

While the mode is on, these ATen ops are re-implemented for the CPU and CUDA
dispatch keys through ``torch.library`` (so ``torch.mm``, ``@``, ``F.linear``,
``torch.softmax`` ... and autograd's derivative formulas, which call the same
ops, all land here):

=========================================  ==========================================
op                                         implementation
=========================================  ==========================================
``mm``, ``addmm``, ``bmm``, ``baddbmm``    the canonical K-chain GEMM (``ops.matmul``)
``_softmax``, ``_log_softmax``             ``ops.softmax`` (fixed-order row sum)
``_softmax_backward_data``,                ``ops.softmax`` backward
``_log_softmax_backward_data``
``mean.dim``, ``mean``                     fixed-order sum / count (``ops.reductions``)
``silu``, ``silu_backward`` (CPU only)     ``x / (1 + exp(-x))`` from single-rounding ops
=========================================  ==========================================

Why silu: ATen's CPU silu runs a Sleef vector body and a scalar tail whose bits
differ (measured: ~0.5% of elements), and which elements fall in the tail depends
on the tensor's size -- so a token's MLP activation changed with the batch.
``exp``, ``log``, ``rsqrt``, ``sin``, ``cos``, ``+``, ``*``, ``/`` were measured
position-independent and are left alone.

An override must never call the op it overrides (the dispatcher would re-enter
it): the GEMMs call the Triton kernel directly (never the cuBLASLt path, which is
``F.linear``) or the elementwise chain; the reductions use ``ops.reductions``' backends,
which are built from elementwise ops, ``amax`` and Triton.

Every override first makes stock's own argument checks (:mod:`.checks`): it
raises what stock raises for inputs stock rejects and runs what stock runs.

State: the overrides act in every thread, so the state is process-wide. Each
thread's wish is kept apart (a plain call sets it; a ``with`` block restores the
calling thread's previous wish on exit, exception or not, so blocks nest), and the
overrides are installed while at least one thread wishes the mode on: no thread's
block ever runs with the mode off, and the mode is off after the last holder
leaves. A thread asking for "off" while another holds the mode on gets the
overrides anyway (they cannot be removed for one thread only).
"""
from __future__ import annotations

import contextlib
import threading
import warnings
from typing import Iterator, Sequence

import torch

from . import checks as C
from ...runtime import mode_state as _mode_state
from ...ops._validate import refuse_interpreted_bf16
from ...gemm.chain import accumulator_dtype
from ...ops.activations import silu_chain, silu_chain_backward
from ...ops.matmul import gemm_backend_for
from ...ops.reductions import TorchReductionBackend, TritonReductionBackend, reduction_backend_for
from ...ops.softmax import softmax_backward, softmax_forward

__all__ = ["set_batch_invariant_mode", "is_batch_invariant_mode_enabled", "COVERED_OPS"]

COVERED_OPS: tuple[str, ...] = (
    "mm", "addmm", "bmm", "baddbmm", "mv", "addmv", "dot", "_softmax", "_log_softmax", "_softmax_backward_data",
    "_log_softmax_backward_data", "mean.dim", "mean", "silu (CPU)", "silu_backward (CPU)",
)

_FLOAT = C.FLOAT_DTYPES
# The mode's wishes, guarded by mode_state.LOCK: the plain calls' process-wide setting, and
# each thread's stack of open ``with`` blocks (innermost last).
_PLAIN_ON = [False]
_BLOCKS: dict[threading.Thread, list[bool]] = {}
_LIB: list[torch.library.Library] = []


# ---------------------------------------------------------------- backends


def _gemm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None,
          out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """a [M,K] or [B,M,K] @ b [K,N] or [B,K,N] (+ 1-D bias) by the canonical K-chain.

    The registry's GEMM backend for the device (fp64: the torch chain); inside the
    mode the Triton GEMM backend never detours through cuBLASLt, whose entry point
    (F.linear) is itself overridden here. Arguments are already checked.
    """
    if a.dtype in _FLOAT:
        gemm_backend = gemm_backend_for(a.device, "torch" if a.dtype == torch.float64 else None)
        refuse_interpreted_bf16("set_batch_invariant_mode (mm)", gemm_backend.name, a)
        return gemm_backend.gemm(a, b, bias=bias, out_dtype=out_dtype)
    if a.is_complex():
        # Four real chains: each output's real and imaginary part is a fixed function of its own row.
        ar, ai, br, bi = (t.contiguous() for t in (a.real, a.imag, b.real, b.imag))
        out = torch.complex(_gemm(ar, br) - _gemm(ai, bi), _gemm(ar, bi) + _gemm(ai, br))
        return out + bias if bias is not None else out
    # Integer products are exact: any summation order gives the same bits.
    out = (a.unsqueeze(-1) * b.unsqueeze(-3)).sum(-2)
    return out + bias if bias is not None else out


def _reduction_backend(t: torch.Tensor) -> TorchReductionBackend | TritonReductionBackend:
    """The reduction backend of softmax for the device (every reduction the mode overrides)."""
    return reduction_backend_for("softmax", t.device)


def _scaled(x: torch.Tensor, s) -> torch.Tensor:
    return x if s == 1 else x * s


def _plain_pair(a: torch.Tensor, b: torch.Tensor, ndim: int) -> bool:
    """The common case, in a few attribute reads: one float dtype, one device, matching inner dims."""
    return (a.dtype is b.dtype and a.dtype in _FLOAT and a.dim() == ndim and b.dim() == ndim
            and a.shape[-1] == b.shape[-2] and a.device == b.device and (ndim == 2 or a.shape[0] == b.shape[0]))


def _into(out: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
    """Stock's ``out=`` contract: same dtype and device, resized to the result's shape."""
    if out.dtype != result.dtype:
        raise RuntimeError(f"Expected out tensor to have dtype {result.dtype}, but got {out.dtype} instead")
    C.require_same_device(out, result)
    if out.shape != result.shape:
        if out.numel():
            warnings.warn(f"An output with one or more elements was resized since it had shape {list(out.shape)}, "
                          f"which does not match the required output shape {list(result.shape)}.", stacklevel=3)
        out.resize_(result.shape)
    return out.copy_(result)


# ---------------------------------------------------------------- overrides (no autograd here)


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if not _plain_pair(a, b, 2):
        C.check_mm(a, b)
    return _gemm(a, b)


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if not _plain_pair(a, b, 3):
        C.check_bmm(a, b)
    return _gemm(a, b)


def _addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta=1, alpha=1) -> torch.Tensor:
    if not (_plain_pair(a, b, 2) and bias.dtype is a.dtype and bias.device == a.device and bias.dim() == 1
            and bias.shape[0] == b.shape[1]):
        C.check_addmm(bias, a, b)
    if beta == 1 and alpha == 1 and bias.dim() == 1 and bias.shape[0] == b.shape[1] and a.dtype in _FLOAT:
        return _gemm(a, b, bias)  # bias added to the fp32 accumulator, rounded once (like cuBLAS epilogues)
    prod = _scaled(_gemm(a, b), alpha)
    if beta == 0:
        return prod
    return prod + _scaled(bias, beta)


def _baddbmm(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta=1, alpha=1) -> torch.Tensor:
    C.check_baddbmm(base, a, b)
    prod = _scaled(_gemm(a, b), alpha)
    if beta == 0:
        return prod
    return prod + _scaled(base, beta)


def _mv(a: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    C.check_mv(a, v)
    return _gemm(a, v.unsqueeze(1)).squeeze(1)


def _addmv(base: torch.Tensor, a: torch.Tensor, v: torch.Tensor, *, beta=1, alpha=1) -> torch.Tensor:
    C.check_addmv(base, a, v)
    prod = _scaled(_gemm(a, v.unsqueeze(1)).squeeze(1), alpha)
    if beta == 0:
        return prod
    return prod + _scaled(base, beta)


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    C.check_dot(a, b)
    return _gemm(a.unsqueeze(0), b.unsqueeze(1)).reshape(())


def _softmax_out_dtype(x: torch.Tensor, half_to_float: bool) -> torch.dtype:
    return torch.float32 if half_to_float and x.dtype in (torch.float16, torch.bfloat16) else x.dtype


def _softmax(x: torch.Tensor, dim: int, half_to_float: bool) -> torch.Tensor:
    C.check_softmax(x, dim, half_to_float, log=False)
    return softmax_forward(x, dim, _softmax_out_dtype(x, half_to_float), False, _reduction_backend(x))


def _log_softmax(x: torch.Tensor, dim: int, half_to_float: bool) -> torch.Tensor:
    C.check_softmax(x, dim, half_to_float, log=True)
    return softmax_forward(x, dim, _softmax_out_dtype(x, half_to_float), True, _reduction_backend(x))


def _softmax_bwd(grad: torch.Tensor, out: torch.Tensor, dim: int, input_dtype: torch.dtype) -> torch.Tensor:
    C.check_softmax_backward(grad, out, dim)
    return softmax_backward(grad, out, dim, False, _reduction_backend(out), input_dtype)


def _log_softmax_bwd(grad: torch.Tensor, out: torch.Tensor, dim: int, input_dtype: torch.dtype) -> torch.Tensor:
    C.check_softmax_backward(grad, out, dim)
    return softmax_backward(grad, out, dim, True, _reduction_backend(out), input_dtype)


def _mean_dim(x: torch.Tensor, dim: Sequence[int] | None, keepdim: bool = False, *,
              dtype: torch.dtype | None = None) -> torch.Tensor:
    C.check_mean(x, dtype)
    dims = C.mean_dims(x, dim)
    out_dtype = dtype or x.dtype
    if out_dtype.is_complex or x.is_complex():
        # Real and imaginary parts through the same fixed-order chain.
        xc = x.to(out_dtype) if x.dtype != out_dtype else x
        real = _mean_dim(xc.real, dims, keepdim)
        return torch.complex(real, _mean_dim(xc.imag, dims, keepdim))
    nd = x.dim()
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
        total = _reduction_backend(x).row_dot(xt.reshape(-1, count).to(adt)).to(adt)
        out = (total / count).to(out_dtype).reshape(kept_shape)
    if keepdim:
        for d in dims:
            out = out.unsqueeze(d)
    return out


def _mean_all(x: torch.Tensor, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    return _mean_dim(x, None, False, dtype=dtype)


def _silu(x: torch.Tensor) -> torch.Tensor:
    C.check_elementwise_float("silu_cpu", x)
    return silu_chain(x)


def _silu_backward(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    C.check_elementwise_float("silu_backward_cpu", grad, x)
    if grad.shape != x.shape:
        torch.broadcast_shapes(grad.shape, x.shape)  # stock's broadcast error, if any
    return silu_chain_backward(grad, x)


def _out_variant(fn):
    """The ``out=`` overload of an override: the same checks and bits, written into ``out``."""
    def out_variant(*args, out, **kwargs):
        return _into(out, fn(*args, **kwargs))
    out_variant.__name__ = fn.__name__ + "_out"
    return out_variant


_BOTH = ("CPU", "CUDA")
_FUNCTIONAL = (
    ("mm", _mm, _BOTH),
    ("addmm", _addmm, _BOTH),
    ("bmm", _bmm, _BOTH),
    ("baddbmm", _baddbmm, _BOTH),
    ("mv", _mv, _BOTH),
    ("addmv", _addmv, _BOTH),
    ("dot", _dot, _BOTH),
    ("_softmax", _softmax, _BOTH),
    ("_log_softmax", _log_softmax, _BOTH),
    ("_softmax_backward_data", _softmax_bwd, _BOTH),
    ("_log_softmax_backward_data", _log_softmax_bwd, _BOTH),
    ("mean.dim", _mean_dim, _BOTH),
    ("mean", _mean_all, _BOTH),
    ("silu", _silu, ("CPU",)),
    ("silu_backward", _silu_backward, ("CPU",)),
)
# ``out=`` spellings reach other overloads; without these they would run stock kernels.
_OUT = (
    ("mm.out", _mm, _BOTH),
    ("addmm.out", _addmm, _BOTH),
    ("bmm.out", _bmm, _BOTH),
    ("baddbmm.out", _baddbmm, _BOTH),
    ("mv.out", _mv, _BOTH),
    ("addmv.out", _addmv, _BOTH),
    ("dot.out", _dot, _BOTH),
    ("_softmax.out", _softmax, _BOTH),
    ("_log_softmax.out", _log_softmax, _BOTH),
    ("mean.out", _mean_dim, _BOTH),
)
_OVERRIDES = _FUNCTIONAL + tuple((name, _out_variant(fn), keys) for name, fn, keys in _OUT)


def _install() -> torch.library.Library:
    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Overriding a previously registered kernel.*")
        warnings.filterwarnings("ignore", message=".*Warning only once for all operators.*")
        for name, fn, keys in _OVERRIDES:
            for key in keys:
                lib.impl(name, fn, key)
    return lib


def _wanted() -> bool:
    """On while any thread's innermost block is on; else the plain setting, unless a
    thread's innermost block is off (an "off" block overrides a plain "on" but never
    another thread's "on" block: the overrides cannot be removed for one thread only)."""
    tops = [stack[-1] for stack in _BLOCKS.values() if stack]
    return any(tops) or (_PLAIN_ON[0] and all(tops))


def _sync() -> None:
    """Install the overrides while wanted; remove them otherwise. Holds LOCK."""
    want = _wanted()
    if want and not _LIB:
        _LIB.append(_install())
    elif not want and _LIB:
        _LIB.pop()._destroy()  # restores the stock kernels
    _mode_state.set_installed(want)


class _ModeGuard(contextlib.AbstractContextManager):
    """Returned by :func:`set_batch_invariant_mode`.

    Not entered, the call was a plain setting, and the guard's ``__exit__`` undoes it:
    the plain setting goes back to what it was before the call, as leaving a ``with``
    block would (so ``g = set_batch_invariant_mode(True)`` ... ``g.__exit__(None, None,
    None)`` is a block spelled without ``with``, e.g. for an ``ExitStack`` or a test's
    setup and teardown). Entered, it becomes a block of the calling thread instead, and
    leaving the block restores what was there before it.
    """

    def __init__(self, enabled: bool, previous_plain: bool) -> None:
        self.enabled, self.previous_plain = enabled, previous_plain
        # Threads that entered this guard and have not left it yet (one entry per open
        # block: a guard may be re-entered), guarded by LOCK.
        self._open: list[threading.Thread] = []
        # The plain call is still in force as this guard's (not yet entered or undone).
        self._plain = True

    def __enter__(self) -> "_ModeGuard":
        with _mode_state.LOCK:
            if self._plain:  # a block, not a plain setting: the plain one goes back to its value before the call
                _PLAIN_ON[0] = self.previous_plain
                self._plain = False
            thread = threading.current_thread()
            self._open.append(thread)
            _BLOCKS.setdefault(thread, []).append(self.enabled)
            _sync()
        return self

    def __exit__(self, *exc: object) -> None:
        with _mode_state.LOCK:
            if self._open:
                # The block of the calling thread, or (left from elsewhere) of the thread that entered last.
                current = threading.current_thread()
                thread = current if current in self._open else self._open[-1]
                self._open.remove(thread)
                stack = _BLOCKS.get(thread, [])
                if stack:
                    stack.pop()
                if not stack:
                    _BLOCKS.pop(thread, None)
            elif self._plain:  # never entered: undo the plain call, once
                _PLAIN_ON[0] = self.previous_plain
                self._plain = False
            _sync()
        return None


def set_batch_invariant_mode(enabled: bool = True) -> _ModeGuard:
    """Turn the batch-invariant overrides on (or off).

    Plain call: a process-wide setting that stays until changed -- or until the
    returned guard's ``__exit__`` is called, which puts the plain setting back to
    what it was before this call (the same as leaving a ``with`` block).
    ``with set_batch_invariant_mode(enabled):`` a block of the calling thread; leaving
    it (exception or not) restores what was there before, so blocks nest. The
    overrides themselves are process-wide (``torch.library`` registrations act in
    every thread): they are on while any thread's innermost block is on -- so no
    block runs with the mode off because another thread left its own block -- or,
    with no such block, while the plain setting is on and no thread's innermost
    block is off. They are off once the last holder has left.
    """
    with _mode_state.LOCK:
        previous = _PLAIN_ON[0]
        _PLAIN_ON[0] = bool(enabled)
        _sync()
        return _ModeGuard(bool(enabled), previous)


def is_batch_invariant_mode_enabled() -> bool:
    """True while the overrides are installed (some thread holds the mode on)."""
    return _mode_state.overrides_installed()


@contextlib.contextmanager
def batch_invariant_mode(enabled: bool = True) -> Iterator[None]:
    """Context-manager spelling of :func:`set_batch_invariant_mode`."""
    with set_batch_invariant_mode(enabled):
        yield
