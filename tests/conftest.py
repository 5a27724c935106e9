"""Shared fixtures: which (backend, device, dtype) combinations this machine can test.

* torch backend on CPU: always (all dtypes, float64 too).
* triton backend on CPU: only with TRITON_INTERPRET=1 (CI); fp32/fp16 only, because
  the interpreter's tl.dot on bf16 operands is wrong (a known interpreter limit).
* both backends on CUDA: when a GPU is present (tests marked ``gpu``).
"""
from __future__ import annotations

import pytest
import torch

from rlkernels._env import triton_interpret

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def cpu_backend_cases(dtypes=(torch.float32, torch.float16, torch.bfloat16)):
    """pytest params of (backend, dtype) runnable on the CPU here."""
    cases = [pytest.param("torch", dt, id=f"torch-{str(dt)[6:]}") for dt in dtypes]
    if triton_interpret():
        cases += [pytest.param("triton", dt, id=f"triton_interp-{str(dt)[6:]}")
                  for dt in dtypes if dt != torch.bfloat16]
    return cases


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(20261123)


def randn(*shape, dtype=torch.float32, device="cpu", generator=None, scale=1.0):
    """Random normal data made on the CPU (same values on any device), then moved."""
    return (torch.randn(*shape, generator=generator) * scale).to(device=device, dtype=dtype)


interpreter_only = pytest.mark.skipif(not triton_interpret(), reason="needs TRITON_INTERPRET=1")
