"""Input validation shared by every public op.

Every check runs on the host before any kernel launch, so bad input never reaches
a kernel (nothing is written out of bounds, nothing is silently truncated).
"""
from __future__ import annotations

import operator
from typing import Iterable

import torch

from ..registry import BackendUnavailableError

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# float64 is accepted by the torch backend only (gradcheck, references).
FLOAT_DTYPES_WITH_FP64 = FLOAT_DTYPES + (torch.float64,)


def require_tensor(op: str, name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"rlkernels.{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def require_float(op: str, name: str, t: torch.Tensor, dtypes: Iterable[torch.dtype] = FLOAT_DTYPES_WITH_FP64) -> None:
    require_tensor(op, name, t)
    dtypes = tuple(dtypes)
    if t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(f"rlkernels.{op}: {name} has dtype {t.dtype}; supported: {names}")


def require_ndim(op: str, name: str, t: torch.Tensor, min_ndim: int, max_ndim: int | None = None) -> None:
    if t.dim() < min_ndim or (max_ndim is not None and t.dim() > max_ndim):
        want = f"{min_ndim}" if max_ndim == min_ndim else f">= {min_ndim}" if max_ndim is None else f"{min_ndim}..{max_ndim}"
        raise ValueError(f"rlkernels.{op}: {name} must have {want} dims, got shape {tuple(t.shape)}")


def require_dim(op: str, dim: object, ndim: int) -> int:
    """``dim`` wrapped into [0, ndim), or stock's IndexError (naming the op) when it is out of range.

    A 0-dim tensor takes dim -1 and 0, as in stock. Wrapping an out-of-range dim modulo
    ndim would reduce over a dim the caller never named."""
    if isinstance(dim, bool) or not hasattr(dim, "__index__"):
        raise TypeError(f"rlkernels.{op}: dim must be int, not {type(dim).__name__}")
    dim = operator.index(dim)
    rank = max(ndim, 1)
    if not -rank <= dim < rank:
        raise IndexError(f"rlkernels.{op}: Dimension out of range (expected to be in range of "
                         f"[{-rank}, {rank - 1}], but got {dim})")
    return dim % rank


def _require_one(op: str, what: str, tensors: dict[str, torch.Tensor | None], attr: str, sep: str) -> object:
    """The shared value of ``attr`` over the non-None tensors, or a ValueError listing them."""
    values = {k: getattr(v, attr) for k, v in tensors.items() if v is not None}
    first = next(iter(values.values()))
    if any(v != first for v in values.values()):
        desc = ", ".join(f"{k}{sep}{v}" for k, v in values.items())
        raise ValueError(f"rlkernels.{op}: {what}, got {desc}")
    return first


def require_same_device(op: str, **tensors: torch.Tensor | None) -> torch.device:
    return _require_one(op, "all tensors must be on one device", tensors, "device", " on ")  # type: ignore[return-value]


def require_same_dtype(op: str, **tensors: torch.Tensor | None) -> torch.dtype:
    return _require_one(op, "tensors must share one dtype", tensors, "dtype", " ")  # type: ignore[return-value]


def refuse_interpreted_bf16(op: str, backend: str, t: torch.Tensor) -> None:
    """bf16 on the Triton backend on the CPU is refused before any launch.

    On the CPU the Triton backend runs through ``TRITON_INTERPRET=1``, whose ``tl.dot``
    returns wrong values for bf16 operands (values near 1e10 where the answer is ~5).
    Every op whose kernels multiply with ``tl.dot`` calls this first.
    """
    if backend == "triton" and t.dtype == torch.bfloat16 and t.device.type == "cpu":
        raise BackendUnavailableError(
            f"rlkernels.{op}: bfloat16 on the Triton backend under TRITON_INTERPRET=1 is refused: the Triton "
            "interpreter's tl.dot gives wrong results for bfloat16 operands; use float16 or float32 there, "
            "or the torch backend (RLKERNELS_BACKEND=torch)")


def autocast(*tensors: torch.Tensor | None) -> list[torch.Tensor | None] | tuple[torch.Tensor | None, ...]:
    """The float tensors cast to the autocast dtype where autocast is on (as stock ops are)."""
    # is_cuda first: building the device object costs more than the autocast query.
    dev = "cuda" if tensors[0].is_cuda else tensors[0].device.type
    if dev in ("cuda", "cpu") and torch.is_autocast_enabled(dev):
        dt = torch.get_autocast_dtype(dev)
        return [t.to(dt) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in tensors]
    return tensors
