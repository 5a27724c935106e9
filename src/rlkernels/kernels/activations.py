"""The gated MLP's ``silu(gate) * up`` in one launch. Host side: ``rlkernels.ops.activations``.

``silu_mul_kernel`` computes what ATen's CUDA ``silu`` followed by ``mul`` gives: ``g / (1 +
exp(-g))`` in fp32 with CUDA's ``expf`` and an IEEE division, rounded to the dtype, then the
product with ``up`` in fp32, rounded once (exact before the rounding for 16-bit operands).
The grouped MoE kernel's epilogue (``kernels.grouped_gemm``) computes the same formula.
An element's bits depend on its own gate and up values alone.
"""
from __future__ import annotations

from ._triton import tl, triton
from .cuda_math import expf

if triton is not None:

    @triton.jit
    def silu_mul_rounded(g, u, dt: tl.constexpr):
        """``silu(g) * u`` rounded to ``dt`` as ATen's two CUDA ops give it: g and u hold
        values of dtype ``dt`` (any float type); silu in fp32 (CUDA's ``expf``, an IEEE
        division) rounded to ``dt``, then the product in fp32 rounded once. Compile with
        ``NO_FP_FUSION``: ATen rounds each of these steps alone."""
        gf = g.to(tl.float32)
        s = tl.math.div_rn(gf, 1.0 + expf(-gf)).to(dt).to(tl.float32)
        return (s * u.to(tl.float32)).to(dt)

    @triton.jit
    def silu_mul_kernel(gate_ptr, up_ptr, out_ptr, N, BLOCK: tl.constexpr):
        """gate, up, out: N contiguous elements of one dtype. Grid: (cdiv(N, BLOCK),)."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < N
        g = tl.load(gate_ptr + offs, mask=mask, other=0.0)
        u = tl.load(up_ptr + offs, mask=mask, other=0.0)
        tl.store(out_ptr + offs, silu_mul_rounded(g, u, out_ptr.dtype.element_ty), mask=mask)
