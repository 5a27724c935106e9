"""Triton kernels only (``@triton.jit`` functions). Their host code lives above them: the ops' in
``rlkernels.ops``, the GEMM producers' in ``rlkernels.gemm``, the launcher in ``rlkernels.runtime``."""
