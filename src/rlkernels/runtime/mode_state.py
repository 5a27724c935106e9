"""The batch-invariant mode's process-wide state, below every op.

The mode's overrides are ``torch.library`` registrations, which act in every
thread, so the state that decides them is process-wide too. It lives here, with
no rlkernels import, so that low layers (the cuBLASLt probe, the GEMM router)
can read it and hold it still without importing the mode itself.

``LOCK`` guards every change. Code that must run with the stock kernels (the
cuBLASLt probe compares real cuBLASLt with the Triton chain) takes the lock and
checks :func:`overrides_installed`: while it holds the lock no thread can turn the
mode on.
"""
from __future__ import annotations

import threading

LOCK = threading.RLock()
_installed = [False]


def overrides_installed() -> bool:
    """True while the mode's ATen overrides are registered (the mode is on)."""
    return _installed[0]


def set_installed(value: bool) -> None:
    """Record the overrides' state; only the mode calls this, holding ``LOCK``."""
    _installed[0] = value
