"""Every environment switch of rlkernels, read one way.

``SWITCHES`` lists them (``rlkernels info`` prints it with each one's value; a test
checks that every ``RLKERNELS_*`` name the package reads is in it). None of them
changes a result's bits: they choose among producers of the same canonical chain,
or refuse.
"""
from __future__ import annotations

import os

from ._versions import fast_path

# name -> (effect, when it is read)
SWITCHES: dict[str, tuple[str, str]] = {
    "RLKERNELS_BACKEND": ("triton / torch / auto: the op backend", "every call"),
    "RLKERNELS_GEMM_BACKEND": ("auto / triton / cublaslt: the GEMM producer", "every call"),
    "RLKERNELS_DISABLE_TINY_GEMM": ("1: bmm skips its one-launch tiny-matrix kernel", "every call"),
    "RLKERNELS_FAST_LAUNCH": ("0: launch kernels through Triton's own launcher", "at import"),
    "RLKERNELS_L2_STREAMING": ("0: no streaming L2 window over decode GEMM weights", "at import"),
    "RLKERNELS_ATTN_CHECK_INDICES": ("0: attention skips reading cu_seqlens back", "every call"),
    "RLKERNELS_ATTN_WS": ("0: the attention forward stays on the Triton kernel", "every call"),
    "TRITON_INTERPRET": ("1: Triton kernels run on the CPU (the interpreter)", "every call"),
}

# os.environ.get re-encodes the name and wraps the lookup in three Python calls; the
# per-call switches are read on every op call, which for decode-size GEMMs is host-bound.
# On POSIX, CPython's os.environ keeps its bytes dict in ``_data`` (updated by every
# assignment): read directly within the Python versions that fast path was run with
# (_versions.FAST_PATHS["environ_data"]), else through os.environ.get.
_ENV_DATA = getattr(os.environ, "_data", None) if fast_path("environ_data")[0] else None


def env_get(name: str) -> str | None:
    """``os.environ.get(name)``, cheaply."""
    if _ENV_DATA is None:
        return os.environ.get(name)
    value = _ENV_DATA.get(name.encode())
    return None if value is None else value.decode("utf-8", "surrogateescape")


def switch_on(name: str, default: bool = True) -> bool:
    """A yes/no switch: unset gives ``default``; ``0``, ``false``, ``no`` and ``off`` are no."""
    value = env_get(name)
    if value is None or not value.strip():
        return default
    return value.strip().lower() not in ("0", "false", "no", "off")


def triton_interpret() -> bool:
    return env_get("TRITON_INTERPRET") not in (None, "", "0")
