"""Triton, or None where it isn't installed (it is a hard dependency on Linux only).

Kernel modules define their ``@triton.jit`` functions under ``if triton is not None``
so that the torch backend still imports on other platforms.
"""
try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover
    triton = None
    tl = None

__all__ = ["triton", "tl"]
