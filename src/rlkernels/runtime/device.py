"""Device queries the launch paths make on every call, answered once per device."""
from __future__ import annotations

import torch

_CAPABILITY: dict[int, tuple[int, int]] = {}


def capability(device: torch.device) -> tuple[int, int]:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _CAPABILITY:
        _CAPABILITY[idx] = torch.cuda.get_device_capability(idx)
    return _CAPABILITY[idx]


_SM_COUNT: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few programs, so the persistent loop is exercised
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def can_read_back(t: torch.Tensor) -> bool:
    """Whether a host-side value check may read ``t`` now: a tensor with values (not meta),
    and no torch.compile trace or CUDA-graph capture under way, where a read back would
    break the trace or the capture."""
    if t.device.type == "meta" or torch.compiler.is_compiling():
        return False
    return not (t.device.type == "cuda" and torch.cuda.is_current_stream_capturing())
