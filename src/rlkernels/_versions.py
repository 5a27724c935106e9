"""Installed versions: for reports (``rlkernels info``, benchmark JSON) and for the gates
of the fast paths that use private internals.

A fast path that calls a library's private internals (Triton's ``CompiledKernel.run``,
``torch._C`` accessors, CPython's ``os.environ._data``) is only as good as the versions
it was run with: a new Triton that specializes on something new would let the cached
launcher run a kernel where Triton compiles another, silently. :func:`fast_path` is the
one place that decides whether each of them is on; outside its tested range the public
API stands in (the same results, more host time), and ``rlkernels info`` says which are
on and why.
"""
from __future__ import annotations

import importlib
import os
import platform
import re
from importlib import metadata
from typing import NamedTuple


def installed_version(module: str) -> str | None:
    """The distribution's version (rich, for one, has no ``__version__``), or None."""
    try:
        return metadata.version(module)
    except metadata.PackageNotFoundError:
        pass
    try:
        return getattr(importlib.import_module(module), "__version__", "installed")
    except Exception:
        return None


def release(version: str | None) -> tuple[int, int] | None:
    """(major, minor) of a version string ("3.6.0", "2.11.0+cu130", "3.4.0.dev2025"), or None."""
    m = re.match(r"\s*(\d+)\.(\d+)", version or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def version_of(package: str) -> str | None:
    """The version a gate reads: "python" is the interpreter's own (tests replace this)."""
    if package == "python":
        return platform.python_version()
    return installed_version(package)


class FastPath(NamedTuple):
    package: str                  # whose version gates it
    low: tuple[int, int]          # tested from this release ...
    high: tuple[int, int]         # ... up to, not including, this one
    what: str                     # what it does, and what stands in outside the range


# Each range is the releases the fast path was run with (docs/design/host_time.md).
FAST_PATHS: dict[str, FastPath] = {
    # The cached launcher calls CompiledKernel.run positionally and keys its cache by a copy
    # of Triton's specialization rules (runtime/launcher.py). GPU-tested with Triton 3.2-3.6
    # (3.6 the newest); 3.9, which CPU CI installs, runs it never (the interpreter). A later
    # Triton may specialize on something new, and only a GPU test can tell: until one
    # passes there, kernel[grid](...) launches.
    "triton_launch": FastPath("triton", (3, 2), (3, 7),
                              "CompiledKernel.run from a cache; else kernel[grid](...)"),
    # torch._C._cuda_getDevice / _cuda_getCurrentRawStream skip the Python wrappers
    # (1-2 us a call). Run on the GPU with torch 2.11; 2.13 is the newest installed.
    "torch_cuda_accessors": FastPath("torch", (2, 4), (2, 14),
                                     "torch._C current device/stream; else torch.cuda's"),
    # torch._C's cuBLAS flag accessors carry the (allow_reduced_precision, allow_splitk)
    # pair from torch 2.9 on (gemm/cublaslt.py); GPU-run with 2.11, CPU with 2.13.
    "torch_cublas_flags": FastPath("torch", (2, 9), (2, 14),
                                   "torch._C cuBLAS flag pairs; else torch.backends.cuda.matmul"),
    # torch._assert_async(tensor, msg): the asynchronous device-side check torch.multinomial
    # makes on CUDA; linear_sample refuses a bad row with it instead of a host sync
    # (ops/linear_sample.py). Run on the GPU with torch 2.11.
    "torch_assert_async": FastPath("torch", (2, 4), (2, 14),
                                   "torch._assert_async on CUDA; else the status is read back"),
    # CPython's os.environ keeps its bytes dict in _data, updated by every assignment
    # (_env.py); unchanged in os.py from 3.10 (requires-python) through 3.14; run with 3.11.
    "environ_data": FastPath("python", (3, 10), (3, 15),
                             "os.environ._data reads; else os.environ.get"),
}


def fast_path(name: str) -> tuple[bool, str]:
    """(on, why) for the fast path ``name`` of :data:`FAST_PATHS`."""
    gate = FAST_PATHS[name]
    version = version_of(gate.package)
    rel = release(version)
    span = f"{gate.package} {gate.low[0]}.{gate.low[1]} <= v < {gate.high[0]}.{gate.high[1]}"
    if rel is None:
        return False, f"{gate.package} version unknown ({version!r}); tested: {span}"
    if gate.package == "python" and (platform.python_implementation() != "CPython" or os.name != "posix"):
        return False, f"{platform.python_implementation()} on {os.name}: tested on CPython, POSIX only"
    if not gate.low <= rel < gate.high:
        return False, f"{gate.package} {version} is outside the tested range {span}"
    return True, f"{gate.package} {version} within the tested range {span}"
