"""A decode weight streamed through L2 as a *streaming* access-policy window.

Why: a decode GEMM reads each weight element once. With the normal L2 policy the
weight's 20-100 MB push everything else out of the 50 MB L2 -- the activations and KV
cache the next kernels read, and lines earlier kernels left dirty, which must then be
written back to HBM while the weight is being read. Marked streaming, the weight's lines
are the first ones replaced.

How: Triton 3.6 drops an evict-first hint from the ``cp.async`` its pipelined loads
become, and put back into the PTX by hand those copies trap on the H100 ("illegal
instruction"; docs/design/l2_window.md). CUDA's access-policy window
does the same job from the host: set on a stream, it marks every access to an address
range by the kernels launched into that stream. :func:`set_streaming` sets one over the
weight's bytes (``hitProp`` streaming, everything outside it normal) before the launch
and :func:`restore` puts the stream's previous window back right after it, so the
caller's stream state is unchanged. In CUDA-graph capture the captured kernel keeps the
window for every replay, at no host cost there.

A cache policy changes which lines L2 keeps, never a value: the results are bitwise
those without the window (tests/runtime/test_l2_window.py). Where the driver API is missing,
or the weight is larger than the device's largest window (the 1.2 GB lm heads), the
launch runs without one. ``RLKERNELS_L2_STREAMING=0`` (read at import) turns it off.

Measured (H100; docs/design/l2_window.md): under do_bench, which leaves the
L2 full of dirty lines, 4096 x 12288 M = 1 went 0.984x -> 0.882x stock, 12288 x 4096
M = 16 0.971x -> 0.862x, 4096^2 M = 16 0.941x -> 0.847x, same bits; 5 us of host time per
call. A weight re-read while still in L2 loses those hits (one 32 MB weight back to
back); a decode step reads each layer's weight once.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import threading
from typing import Iterator

import torch

from .._env import switch_on

L2_WINDOW_ENV = "RLKERNELS_L2_STREAMING"

_ACCESS_POLICY_WINDOW = 1  # CU_STREAM_ATTRIBUTE_ACCESS_POLICY_WINDOW (== CU_LAUNCH_ATTRIBUTE_...)
_MAX_WINDOW_ATTRIBUTE = 109  # CU_DEVICE_ATTRIBUTE_MAX_ACCESS_POLICY_WINDOW_SIZE
_NORMAL, _STREAMING = 0, 1  # CUaccessProperty


class _Window(ctypes.Structure):
    _fields_ = [("base_ptr", ctypes.c_void_p), ("num_bytes", ctypes.c_size_t), ("hit_ratio", ctypes.c_float),
                ("hit_prop", ctypes.c_int), ("miss_prop", ctypes.c_int)]


class _StreamAttr(ctypes.Union):
    # CUstreamAttrValue / CUlaunchAttributeValue: a 64-byte union.
    _fields_ = [("window", _Window), ("pad", ctypes.c_char * 64)]


class _Driver:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self.get = lib.cuStreamGetAttribute
        self.set = lib.cuStreamSetAttribute
        self.device_attribute = lib.cuDeviceGetAttribute
        for fn in (self.get, self.set):
            fn.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(_StreamAttr))
            fn.restype = ctypes.c_int
        self.device_attribute.argtypes = (ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int)
        self.device_attribute.restype = ctypes.c_int


@functools.lru_cache(maxsize=None)
def _driver() -> _Driver | None:
    try:
        return _Driver(ctypes.CDLL("libcuda.so.1"))
    except (OSError, AttributeError):
        return None


def _enabled_from_env() -> bool:
    return switch_on(L2_WINDOW_ENV)


# Read once, like RLKERNELS_FAST_LAUNCH: this runs on every decode call.
ENABLED = _enabled_from_env()

# Held from set_streaming to restore: two threads launching into one stream must not
# restore each other's window (stream state is shared, like cuBLASLt's flags).
_LOCK = threading.RLock()
_MAX_WINDOW: dict[int, int] = {}
_VALUES: dict[tuple[int, int], _StreamAttr] = {}  # (first byte, bytes) -> the window to set


def max_window_bytes(device_index: int) -> int:
    """The largest access-policy window the device takes (H100: 128 MiB); 0 if unknown."""
    if device_index not in _MAX_WINDOW:
        drv = _driver()
        value = ctypes.c_int()
        ok = drv is not None and drv.device_attribute(ctypes.byref(value), _MAX_WINDOW_ATTRIBUTE, device_index) == 0
        _MAX_WINDOW[device_index] = max(0, value.value) if ok else 0
    return _MAX_WINDOW[device_index]


def span_bytes(t: torch.Tensor) -> int:
    """Bytes from ``t``'s first to one past its last element (any strides, no negatives)."""
    if t.numel() == 0:
        return 0
    return (sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) + 1) * t.element_size()


def window_bytes(t: torch.Tensor, span: int | None = None) -> int:
    """The bytes of the window :func:`set_streaming` sets for ``t`` (:func:`span_bytes`, or
    ``span`` where the caller has it), or 0 where none applies: not a CUDA tensor, larger
    than the device's largest window, no driver API, or the switch off."""
    if not (ENABLED and t.is_cuda) or _driver() is None:
        return 0
    n = span_bytes(t) if span is None else span
    return n if n <= max_window_bytes(t.get_device()) else 0


def window_applies(t: torch.Tensor) -> bool:
    """Whether :func:`set_streaming` sets a window for ``t`` (:func:`window_bytes`)."""
    return window_bytes(t) > 0


def set_streaming(t: torch.Tensor, stream: int, span: int | None = None) -> _StreamAttr | None:
    """Make ``t``'s bytes a streaming L2 window on raw ``stream`` for the launches that
    follow; returns the stream's previous window, to hand to :func:`restore` right after
    them (a lock is held until then), or None where no window was set
    (:func:`window_applies`, or the driver refused). ``span``: :func:`span_bytes` of ``t``,
    where the caller has the strides at hand (host time per decode call).

    Also while ``stream`` is being captured into a CUDA graph: the captured kernel keeps
    the window for every replay (docs/design/l2_window.md), which is
    where decode runs in serving engines -- with no host cost at replay.
    """
    n = window_bytes(t, span)
    if not n:
        return None
    key = (t.data_ptr(), n)
    ours = _VALUES.get(key)
    if ours is None:
        if len(_VALUES) > 4096:  # weights come and go (tests, reloads); keep the cache bounded
            _VALUES.clear()
        ours = _VALUES[key] = _StreamAttr()
        ours.window = _Window(key[0], key[1], 1.0, _STREAMING, _NORMAL)
    drv = _driver()
    handle = ctypes.c_void_p(stream)
    saved = _StreamAttr()
    _LOCK.acquire()
    if drv.get(handle, _ACCESS_POLICY_WINDOW, saved) != 0 or drv.set(handle, _ACCESS_POLICY_WINDOW, ours) != 0:
        _LOCK.release()
        return None
    return saved


def restore(stream: int, saved: _StreamAttr) -> None:
    """Put back the window :func:`set_streaming` found on ``stream`` (and release its lock)."""
    try:
        rc = _driver().set(ctypes.c_void_p(stream), _ACCESS_POLICY_WINDOW, saved)
    finally:
        _LOCK.release()
    if rc != 0:  # pragma: no cover - the driver refused a value it handed out
        raise RuntimeError(f"rlkernels: could not restore the stream's L2 access-policy window (CUresult {rc})")


@contextlib.contextmanager
def streaming_window(t: torch.Tensor, stream: int) -> Iterator[bool]:
    """:func:`set_streaming` and :func:`restore` around a block (for callers off the hot
    path); yields whether a window was set."""
    saved = set_streaming(t, stream)
    try:
        yield saved is not None
    finally:
        if saved is not None:
            restore(stream, saved)
