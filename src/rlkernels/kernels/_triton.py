"""Triton, or None where it isn't installed (it is a hard dependency on Linux only).

Kernel modules define their ``@triton.jit`` functions under ``if triton is not None``
(``@gluon.jit`` ones under ``if gluon is not None``) so that the torch backend still
imports on other platforms.
"""
try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover
    triton = None
    tl = None

try:  # Gluon (Triton >= 3.5): kernels that place warps, layouts and barriers themselves
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor
except Exception:  # pragma: no cover - older or absent Triton
    gluon = None
    gl = None
    GluonTensorDescriptor = None


def _dot_any_m() -> bool:
    """Whether tl.dot takes fewer than 16 rows (Triton >= 3.5 pads them itself)."""
    try:
        major, minor = (int(p) for p in triton.__version__.split(".")[:2])
    except Exception:  # no Triton, or an unparsable dev version: assume the older rule
        return False
    return (major, minor) >= (3, 5)


DOT_ANY_M = _dot_any_m()


def cdiv(a: int, b: int) -> int:
    """Ceiling division for launch grids on the host. ``triton.cdiv`` is a
    ``constexpr_function`` in Triton >= 3.5 and cost 2.7 us per host call here and
    6 us on the H100 host (docs/design/host_time.md) -- more than a decode GEMM's
    launch itself."""
    return -(-a // b)


def pow2_at_least(x: int, floor: int = 1) -> int:
    """The smallest power of two >= max(x, floor), for tile widths on the host (plain
    Python for the reason :func:`cdiv` is)."""
    return max(floor, 1 << max(0, (x - 1).bit_length()))


__all__ = ["DOT_ANY_M", "GluonTensorDescriptor", "cdiv", "gl", "gluon", "pow2_at_least", "triton", "tl"]
