"""rlkernels: batch-invariant, deterministic GPU kernels for RL post-training of LLMs.

Every row's result is bitwise identical whatever the batch size, chunking,
padding, row position, run and process -- on every backend.
"""
from __future__ import annotations

from .ops.matmul import TOKEN_BLOCK, linear, matmul
from .nn import Linear
from .registry import BackendUnavailableError, get_op, registered_ops, select_backend

__version__ = "0.1.0"

__all__ = [
    "TOKEN_BLOCK",
    "BackendUnavailableError",
    "Linear",
    "get_op",
    "linear",
    "matmul",
    "registered_ops",
    "select_backend",
]
