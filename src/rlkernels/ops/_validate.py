"""Input validation shared by every public op.

Every check runs on the host before any kernel launch, so bad input never reaches
a kernel (nothing is written out of bounds, nothing is silently truncated).
"""
from __future__ import annotations

import math
import numbers
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


# The smallest temperature any op takes: one rule for the head's ops, the sampler and the
# model functions. Below it softmax(z / T) is a point mass for any logits a model produces
# (a gap of 1e-3 nats becomes 10 at T = 1e-4), and far below it z / T overflows float32
# (T = 1e-40 turns every logit into +-inf and the log-probs into NaN).
MIN_TEMPERATURE = 1e-4


def require_temperature(op: str, temperature: object) -> float:
    """``temperature`` as a float: a Python (or NumPy) real number, finite and >= MIN_TEMPERATURE.

    A tensor is refused rather than read: reading a GPU tensor's value is a host sync,
    and a tensor that requires grad would be silently treated as a constant."""
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
        hint = " (pass float(temperature))" if isinstance(temperature, torch.Tensor) else ""
        raise TypeError(f"rlkernels.{op}: temperature must be a Python number (float or int), got "
                        f"{type(temperature).__name__} {temperature!r}{hint}")
    value = float(temperature)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"rlkernels.{op}: temperature must be a finite number > 0, got {temperature!r}")
    if value < MIN_TEMPERATURE:
        raise ValueError(f"rlkernels.{op}: temperature must be >= {MIN_TEMPERATURE:g}, got {temperature!r}: below "
                         f"it the distribution is a point mass (and z / T overflows float32 further down); "
                         f"decode greedily instead")
    return value


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


def require_writable(op: str, name: str, t: torch.Tensor) -> None:
    """Refuse writing into ``t`` where one memory location backs several of its elements.

    A dim of size > 1 with stride 0 (an ``expand``-ed view) makes every write along it
    land in one place, so a later element silently overwrites another -- the
    case stock's in-place ops refuse ("more than one element of the written-to tensor
    refers to a single memory location")."""
    for d, (size, stride) in enumerate(zip(t.shape, t.stride())):
        if size > 1 and stride == 0:
            raise ValueError(f"rlkernels.{op}: {name} is written in place but its dim {d} (size {size}) has stride 0 "
                             f"(strides {tuple(t.stride())}: an expanded view?), so its {size} slices along that "
                             "dim share one memory location; pass a tensor with memory of its own (e.g. clone it "
                             "once and keep the clone: the write goes into it)")


_OVERLAP_SEARCH_BUDGET = 100_000


def may_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether some element of ``a`` and some element of ``b`` share a byte of memory.

    Exact for the layouts views of one buffer have (each element of a as an offset
    ``sum(i_d * stride_d)``, searched dim by dim with the other dims' reach bounding
    each index); a search that exceeds its budget answers True (overlap not ruled out).
    """
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device or a.is_meta:  # meta: no memory
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    # In bytes: element x of a meets element y of b where
    #   sum(x_d * stride_a_d) - sum(y_d * stride_b_d) + z == b's start - a's start,
    # z the gap between the two elements' first bytes that still leaves them sharing one.
    # One layout (views of one buffer: k/v slices of a stacked cache) pairs each dim's two
    # indices into one difference in (-n, n), which keeps the search to a few steps.
    ea, eb = a.element_size(), b.element_size()
    if a.shape == b.shape and a.stride() == b.stride() and ea == eb:
        terms = [(st * ea, -(n - 1), n - 1) for n, st in zip(a.shape, a.stride()) if n > 1]
    else:
        terms = [(st * ea, 0, n - 1) for n, st in zip(a.shape, a.stride()) if n > 1]
        terms += [(-st * eb, 0, n - 1) for n, st in zip(b.shape, b.stride()) if n > 1]
    terms.append((1, -(eb - 1), ea - 1))
    terms.sort(key=lambda t: -abs(t[0]))
    budget = [_OVERLAP_SEARCH_BUDGET]

    def reach(rest: list[tuple[int, int, int]]) -> tuple[int, int]:
        lo = sum(min(st * x0, st * x1) for st, x0, x1 in rest)
        hi = sum(max(st * x0, st * x1) for st, x0, x1 in rest)
        return lo, hi

    def hits(target: int, rest: list[tuple[int, int, int]]) -> bool:
        budget[0] -= 1
        if budget[0] < 0:
            return True
        if not rest:
            return target == 0
        (st, x0, x1), tail = rest[0], rest[1:]
        lo, hi = reach(tail)
        # st * x must land in [target - hi, target - lo].
        a_lo, a_hi = (target - hi, target - lo) if st > 0 else (lo - target, hi - target)
        s = abs(st)
        first, last = max(x0, -(-a_lo // s)), min(x1, a_hi // s)
        return any(hits(target - st * x, tail) for x in range(first, last + 1))

    return hits(b.data_ptr() - a.data_ptr(), terms)


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
