"""Triton kernels only (``@triton.jit`` functions); host code lives in ``rlkernels.ops``."""
