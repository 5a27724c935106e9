"""Shared fixtures: which (backend, device, dtype) combinations this machine can test.

* torch backend on CPU: always (all dtypes, float64 too).
* triton backend on CPU: only with TRITON_INTERPRET=1 (CI); fp32/fp16 only, because
  the interpreter's tl.dot on bf16 operands is wrong (a known interpreter limit).
* both backends on CUDA: when a GPU is present (tests marked ``gpu``).
"""
from __future__ import annotations

import os
from collections import Counter

import pytest
import torch

from rlkernels._env import triton_interpret

HAS_CUDA = torch.cuda.is_available()


def machine_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto`` (pyproject's addopts): a worker per core on a CPU machine, none with a GPU.

    GPU tests in parallel would share one card's memory and clocks, so a machine with CUDA
    runs the suite in one process."""
    return 0 if HAS_CUDA else machine_cores()


if os.environ.get("PYTEST_XDIST_WORKER"):
    # The workers split the cores between them: intra-op threads past that only contend.
    torch.set_num_threads(max(1, machine_cores() // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))


def _fixed_order_interpreter_dot() -> None:
    """Make the interpreter's tl.dot sum each output element in one fixed order.

    The interpreter computes tl.dot with one np.matmul of the whole tile, and the BLAS
    numpy ships (OpenBLAS, DYNAMIC_ARCH) rounds an element differently depending on where
    it sits in the tile and on the tile's shape on some CPUs (AMD EPYC: 6 of 16 rows of a
    16 x 16 fp32 product). A GPU's MMA gives an element the same bits in any tile position,
    which is what the kernels' invariance rests on. Summing the products over k in
    ascending order (in the accumulator's dtype) gives the interpreter that property, so the
    interpreted tests check the kernels' indexing, masking and chains, not the CPU's BLAS.
    """
    import numpy as np
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    blas_dot = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.primitive_bitwidth == 8 or b.dtype.primitive_bitwidth == 8:
            return blas_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        acc_dtype = d.data.dtype
        x, y = a.data.astype(acc_dtype), b.data.astype(acc_dtype)
        total = np.zeros(np.broadcast_shapes(x.shape[:-1] + (1,), y.shape[:-2] + (1, y.shape[-1])), dtype=acc_dtype)
        for k in range(x.shape[-1]):
            total += x[..., k:k + 1] * y[..., k:k + 1, :]
        return interpreter.TensorHandle(total + d.data, d.dtype.scalar)

    builder.create_dot = create_dot


if triton_interpret():
    _fixed_order_interpreter_dot()


def xdist_group_of(nodeid: str) -> str:
    """The unit pytest-xdist hands one worker: a test file, or all of ``tests/parallel``.

    A file's module-scoped fixtures (models, gloo worlds) are then built once, and the
    package-scoped gloo worlds of ``tests/parallel`` once for its three files."""
    path = nodeid.split("::", 1)[0]
    return "tests/parallel" if path.startswith("tests/parallel/") else path


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    # tryfirst: xdist's own hook reads the group marks (``--dist loadgroup``) after this one.
    for item in items:
        item.add_marker(pytest.mark.xdist_group(xdist_group_of(item.nodeid)))
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def skip_reason_counts(skipped: list) -> Counter:
    """How many of the ``skipped`` test reports were skipped for each reason."""
    counts: Counter = Counter()
    for report in skipped:
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
        counts[reason.removeprefix("Skipped: ")] += 1
    return counts


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """One line per distinct skip reason with its count.

    pyproject's ``-rfExX`` leaves skips out of the short summary: ``-ra`` printed a line
    per skipping test location, about 120 of them on a machine without a GPU. With
    ``-rs`` or ``-ra`` on the command line those lines come back and this one is not
    printed. pytest's own closing line ("N passed, N skipped in ...") is unchanged.
    """
    skipped = terminalreporter.stats.get("skipped", [])
    if not skipped or terminalreporter.hasopt("skipped") or config.option.no_summary:
        return
    terminalreporter.section("skipped, by reason (-rs for each test)", sep="-")
    for reason, n in sorted(skip_reason_counts(skipped).items(), key=lambda item: (-item[1], item[0])):
        terminalreporter.line(f"{n:5d} {reason}")


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
