"""Device math functions with ATen's CUDA bits, shared by kernels that must reproduce an
elementwise torch op exactly (``expf``: the exp of torch.exp / F.silu on float32), and
``tanhf`` (CUDA's tanhf; the attention's logit soft-cap)."""
from __future__ import annotations

from .._env import triton_interpret
from ._triton import tl, triton

if triton is not None:
    from triton.language.extra import libdevice

    if triton_interpret():
        @triton.jit
        def expf(x):
            return tl.exp(x)  # the interpreter runs no libdevice: numpy's exp

        @triton.jit
        def tanhf(x):
            # No tanh in tl: 1 - 2 / (e^2x + 1), exact at the saturated ends (e = 0 or inf).
            return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)
    else:
        @triton.jit
        def expf(x):
            # CUDA's expf, as ATen's exp and silu call it; tl.exp is an approximate exp2 on NVIDIA GPUs.
            return libdevice.exp(x)

        @triton.jit
        def tanhf(x):
            return libdevice.tanh(x)

else:  # pragma: no cover - the torch backend still imports without Triton
    expf = tanhf = None
