"""rlkernels: batch-invariant, deterministic GPU kernels for RL post-training of LLMs.

Every row's result is bitwise identical whatever the batch size, chunking,
padding, row position, run and process -- on every backend.
"""
from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any, Callable

from .integrations.aten_mode import is_batch_invariant_mode_enabled, set_batch_invariant_mode
from .integrations.hf import (RolloutSample, generate, is_patched, patch_model, release_decode_graphs, rollout,
                              token_logprobs)
from .nn import Linear, RMSNorm
from .ops.attention import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from .ops.bmm import bmm
from .ops.linear_logprob import linear_logprob
from .ops.linear_sample import linear_sample
from .ops.matmul import TOKEN_BLOCK, linear, matmul
from .ops.norms import rms_norm
from .ops.softmax import log_softmax, softmax
from .registry import BackendUnavailableError, get_op, registered_ops, select_backend

__version__ = "0.1.0"

__all__ = [
    "TOKEN_BLOCK",
    "BackendUnavailableError",
    "Linear",
    "RMSNorm",
    "RolloutSample",
    "bmm",
    "flash_attn_func",
    "flash_attn_varlen_func",
    "flash_attn_with_kvcache",
    "generate",
    "get_op",
    "is_batch_invariant_mode_enabled",
    "is_patched",
    "linear",
    "linear_logprob",
    "linear_sample",
    "log_softmax",
    "matmul",
    "patch_model",
    "registered_ops",
    "release_decode_graphs",
    "rms_norm",
    "rollout",
    "select_backend",
    "set_batch_invariant_mode",
    "softmax",
    "tensor_parallel",
    "token_logprobs",
]

# Public submodules reached as attributes (``rlkernels.testing.assert_batch_invariant``)
# but imported on first use, so that ``import rlkernels`` stays as light as it is.
_LAZY_SUBMODULES = ("check", "contract", "parallel", "reference", "testing")
# Public functions whose modules load a lazy submodule (``tensor_parallel``: rlkernels.parallel).
_LAZY_FUNCTIONS = {"tensor_parallel": ".integrations.hf.tensor_parallel"}


def __getattr__(name: str) -> ModuleType | Callable[..., Any]:
    """PEP 562: import a public submodule, or the module of a lazy function, the first time
    it is reached as an attribute."""
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f".{name}", __name__)  # also binds it here: no second call
    if name in _LAZY_FUNCTIONS:
        value = getattr(importlib.import_module(_LAZY_FUNCTIONS[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    """The module's names and the lazily imported ones."""
    return sorted(set(globals()) | set(_LAZY_SUBMODULES) | set(_LAZY_FUNCTIONS))
