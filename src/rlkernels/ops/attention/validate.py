"""Input checks of the attention entry points: one error message per broken rule, named
after the public call that received the input."""
from __future__ import annotations

import math

import torch

from ..._env import switch_on
from ...runtime.device import can_read_back
from .. import _validate as V

MAX_HEAD_DIM = 256
# ``RLKERNELS_ATTN_CHECK_INDICES=0``: no index tensor is read back for its content checks.
CHECK_ENV = "RLKERNELS_ATTN_CHECK_INDICES"

_QKV_DTYPES = frozenset(V.FLOAT_DTYPES_WITH_FP64)


def check_qkv(op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rank: int,
              k_ranks: tuple[int, int] | None = None) -> None:
    """Tensors, float, one dtype and device, q of ``rank`` dims and k/v of ``rank`` (or
    ``k_ranks``: an inclusive range) with one shape, a shared head_dim, Hq % Hkv == 0."""
    lo, hi = k_ranks or (rank, rank)
    # Every condition below in one expression first (a decode step is host-bound: the
    # checks one by one cost 10-15 us); where any fails, the checks below name it.
    if (type(q) is torch.Tensor and type(k) is torch.Tensor and type(v) is torch.Tensor
            and q.dtype in _QKV_DTYPES and k.dtype is q.dtype and v.dtype is q.dtype
            and q.dim() == rank and lo <= k.dim() <= hi and k.shape == v.shape
            and q.device == k.device == v.device
            and q.shape[-1] == k.shape[-1] and 1 <= q.shape[-1] <= MAX_HEAD_DIM
            and k.shape[-2] >= 1 and q.shape[-2] % k.shape[-2] == 0):
        return
    for name, t, r0, r1 in (("q", q, rank, rank), ("k", k, lo, hi), ("v", v, lo, hi)):
        V.require_tensor(op, name, t)
        V.require_float(op, name, t)
        V.require_ndim(op, name, t, r0, r1)
    V.require_same_device(op, q=q, k=k, v=v)
    V.require_same_dtype(op, q=q, k=k, v=v)
    if k.shape != v.shape:
        raise ValueError(f"rlkernels.{op}: k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    hq, d = q.shape[-2], q.shape[-1]
    hkv, dk = k.shape[-2], k.shape[-1]
    if d != dk:
        raise ValueError(f"rlkernels.{op}: q and k must share head_dim, got {d} and {dk}")
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"rlkernels.{op}: unsupported head_dim {d} (supported: 1..{MAX_HEAD_DIM})")
    if hkv < 1 or hq % hkv:
        raise ValueError(f"rlkernels.{op}: query heads ({hq}) must be a multiple of KV heads ({hkv})")


def check_index(op: str, name: str, t: torch.Tensor, n: int | None, device: torch.device) -> None:
    """An int32 1-D tensor of ``n`` entries (any number where n is None) on ``device``."""
    V.require_tensor(op, name, t)
    if t.dtype != torch.int32:
        raise ValueError(f"rlkernels.{op}: {name} must be int32, got {t.dtype}")
    if t.dim() != 1 or (n is not None and t.shape[0] != n):
        want = f"[{n}]" if n is not None else "1-D"
        raise ValueError(f"rlkernels.{op}: {name} must have shape {want}, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"rlkernels.{op}: all tensors must be on one device, got {name} on {t.device} and q on {device}")


def read_indices(t: torch.Tensor) -> list[int] | None:
    """The values of a small index tensor for the content checks, or None where reading
    them would sync a device at a bad time (CUDA-graph capture, torch.compile tracing)
    or the checks are switched off with RLKERNELS_ATTN_CHECK_INDICES=0."""
    if t.device.type == "cpu":
        return t.tolist()
    if not switch_on(CHECK_ENV) or not can_read_back(t):
        return None
    return t.tolist()


def check_cu(op: str, name: str, cu: list[int] | None, total: int, max_len: int, max_name: str) -> None:
    """cu_seqlens (values from :func:`read_indices`; None: unchecked) start at 0, never
    decrease, end at ``total`` and hold no sequence longer than ``max_len``."""
    if cu is None:
        return
    if cu[0] != 0:
        raise ValueError(f"rlkernels.{op}: {name} must start at 0, got {cu[0]}")
    for i in range(len(cu) - 1):
        if cu[i + 1] < cu[i]:
            raise ValueError(f"rlkernels.{op}: {name} must be non-decreasing, got {name}[{i}] = {cu[i]} > "
                             f"{name}[{i + 1}] = {cu[i + 1]}")
    if cu[-1] != total:
        raise ValueError(f"rlkernels.{op}: {name} must end at the total length {total}, got {cu[-1]}")
    longest = max((b - a for a, b in zip(cu[:-1], cu[1:])), default=0)  # B = 0: no sequence
    if longest > max_len:
        raise ValueError(f"rlkernels.{op}: a sequence of {longest} tokens exceeds {max_name} = {max_len}")


def check_cache_seqlens(op: str, vals: list[int] | None, lnew: int, slots: int) -> None:
    """Every cache_seqlens[b] (values from :func:`read_indices`; None: unchecked) >= 0 and
    room for ``lnew`` new tokens after it in a cache of ``slots``."""
    if vals is None:
        return
    negative = [(i, x) for i, x in enumerate(vals) if x < 0]
    if negative:
        i, x = negative[0]
        raise ValueError(f"rlkernels.{op}: cache_seqlens must be >= 0, got cache_seqlens[{i}] = {x}")
    bad = [(i, x) for i, x in enumerate(vals) if x > slots - lnew]
    if bad:
        i, x = bad[0]
        raise ValueError(f"rlkernels.{op}: cache_seqlens[{i}] = {x} with {lnew} new tokens is beyond the "
                         f"cache of {slots} slots")


def check_scale(op: str, scale: float | None, d: int) -> float:
    """The scale as a float: D**-0.5 where None, else positive and finite."""
    if scale is None:
        return 1.0 / math.sqrt(d)
    s = float(scale)
    # The chain takes the row max of the raw scores times the scale (exact for a positive scale only).
    if not math.isfinite(s) or s <= 0:
        raise ValueError(f"rlkernels.{op}: softmax_scale must be positive and finite, got {scale}")
    return s


def check_window(op: str, window_size, causal: bool) -> int:
    """FlashAttention's ``window_size = (left, right)`` as the kernels' window: query i sees
    keys no more than ``left`` positions before its own (-1: any). ``right`` bounds keys
    after it: with causal masking none are seen, so any right >= -1 is taken; without it
    only -1 (no bound) is supported."""
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(isinstance(w, int) and not isinstance(w, bool) for w in window_size)):
        raise TypeError(f"rlkernels.{op}: window_size must be a pair of ints (left, right), got {window_size!r}")
    left, right = window_size
    if left < -1 or right < -1:
        raise ValueError(f"rlkernels.{op}: window_size entries must be >= -1 (-1: unbounded), got {tuple(window_size)}")
    if right != -1 and not causal:
        raise ValueError(f"rlkernels.{op}: window_size={tuple(window_size)} bounds keys after the query, which is "
                         "supported with causal=True only (pass right = -1)")
    return left


def check_softcap(op: str, softcap) -> float:
    """FlashAttention's ``softcap``: a finite number >= 0 (0: no cap), as a float."""
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"rlkernels.{op}: softcap must be a Python number (0: no soft-cap), got {softcap!r}")
    if not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"rlkernels.{op}: softcap must be a finite number >= 0 (0: no soft-cap), got {softcap}")
    return float(softcap)


def check_sinks(op: str, sinks, hq: int, device: torch.device) -> None:
    """None, or a float tensor [Hq] on q's device: one sink logit per query head."""
    if sinks is None:
        return
    V.require_tensor(op, "sinks", sinks)
    V.require_float(op, "sinks", sinks)
    if sinks.dim() != 1 or sinks.shape[0] != hq:
        raise ValueError(f"rlkernels.{op}: sinks must be [{hq}] (one logit per query head), got {tuple(sinks.shape)}")
    if sinks.device != device:
        raise ValueError(f"rlkernels.{op}: all tensors must be on one device, got sinks on {sinks.device} and q on "
                         f"{device}")


def check_backend(op: str, backend: str, q: torch.Tensor) -> None:
    """What the Triton backend can't run: fp64, and bf16 on the CPU interpreter."""
    if backend == "triton":
        if q.dtype == torch.float64:
            raise ValueError(f"rlkernels.{op}: float64 runs on the torch backend only")
        if q.device.type == "cpu" and q.dtype == torch.bfloat16:
            raise ValueError(f"rlkernels.{op}: the Triton interpreter's tl.dot is wrong on bfloat16; "
                             "use float16/float32 or the torch backend on the CPU")
