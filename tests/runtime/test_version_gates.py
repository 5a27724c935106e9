"""The fast paths through private internals are gated on the releases they were tested with:
outside them the public API stands in, with the same results."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from rlkernels import _env, _versions
from rlkernels.runtime import launcher as _launch

SRC = pathlib.Path(__file__).resolve().parents[2] / "src"


def _fake_versions(monkeypatch, **versions):
    real = _versions.version_of
    monkeypatch.setattr(_versions, "version_of", lambda package: versions.get(package, real(package)))


@pytest.mark.parametrize("text,want", [("3.6.0", (3, 6)), ("2.11.0+cu130", (2, 11)), ("3.4.0.dev20250101", (3, 4)),
                                       ("10.2", (10, 2)), ("installed", None), (None, None), ("", None)])
def test_release(text, want):
    assert _versions.release(text) == want


@pytest.mark.parametrize("name", sorted(_versions.FAST_PATHS))
def test_each_gate_is_on_inside_its_range_and_off_outside(monkeypatch, name):
    gate = _versions.FAST_PATHS[name]
    lo, hi = gate.low, gate.high
    newest = f"{hi[0]}.{hi[1] - 1}.0" if hi[1] else f"{hi[0] - 1}.99.0"
    outside = {f"{hi[0]}.{hi[1]}.0", f"{hi[0] + 1}.0.0", f"{lo[0]}.{lo[1] - 1}.0" if lo[1] else f"{lo[0] - 1}.0.0",
               "unknown", ""}
    if name == "environ_data" and not (os.name == "posix" and sys.implementation.name == "cpython"):
        pytest.skip("tested on CPython, POSIX only")
    for version in (f"{lo[0]}.{lo[1]}.0", newest):
        _fake_versions(monkeypatch, **{gate.package: version})
        assert _versions.fast_path(name)[0], (name, version)
    for version in outside:
        _fake_versions(monkeypatch, **{gate.package: version})
        on, why = _versions.fast_path(name)
        assert not on and gate.package in why, (name, version)


def test_cached_launch_is_off_for_an_untested_triton(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv(_launch.FAST_LAUNCH_ENV, raising=False)
    if _launch._knobs is None:
        pytest.skip("this Triton has no knobs module: the cached launch is off anyway")
    _fake_versions(monkeypatch, triton="3.6.0")
    assert _launch.fast_launch_status()[0]
    for version in ("3.7.0", "4.0.0", "3.1.0"):
        _fake_versions(monkeypatch, triton=version)
        on, why = _launch.fast_launch_status()
        assert not on and version in why and "outside the tested range" in why


class _FakeCompiledKernel:
    function, packed_metadata = "cu_function", ()

    def __init__(self):
        self.runs = []

    def run(self, *launch_args):
        self.runs.append(launch_args)


class _FakeJitFunction:
    """kernel[grid](*args, **options) records the call and returns the 'compiled' kernel."""

    def __init__(self):
        self.kernel, self.calls = _FakeCompiledKernel(), []

    def __getitem__(self, grid):
        def launch(*args, **options):
            self.calls.append((grid, args, options))
            return self.kernel
        return launch


@pytest.mark.parametrize("triton_version,cached", [("3.6.0", True), ("3.7.0", False), ("9.0.0", False)])
def test_launcher_takes_the_public_launch_outside_the_tested_triton(monkeypatch, triton_version, cached):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv(_launch.FAST_LAUNCH_ENV, raising=False)
    if _launch._knobs is None:
        pytest.skip("this Triton has no knobs module: the cached launch is off anyway")
    _fake_versions(monkeypatch, triton=triton_version)
    monkeypatch.setattr(_launch, "current_device", lambda: 0)
    monkeypatch.setattr(_launch, "current_raw_stream", lambda device: 7)
    monkeypatch.setattr(_launch, "launch_hooks_active", lambda: False)
    fn = _FakeJitFunction()
    launcher = _launch.CachedLauncher(fn)
    assert launcher.enabled is cached
    x = torch.randn(8)
    for _ in range(3):
        launcher((4,), (x, 5), (True,), num_warps=4, num_stages=3)
    call = ((4,), (x, 5, True), {"num_warps": 4, "num_stages": 3})
    # Untested: Triton's own kernel[grid](...) every time; tested: once, then the kernel's run.
    assert len(fn.calls) == (1 if cached else 3) and len(fn.kernel.runs) == (2 if cached else 0)
    assert all(c[0] == call[0] and c[1][0] is x and c[1][1:] == call[1][1:] and c[2] == call[2] for c in fn.calls)
    # Launch plans keep no key for a launcher that never launches from its cache.
    assert (_launch.kept_launch_key(launcher, (x, 5), (True,), 4, 3) is None) is not cached


def test_env_get_without_the_private_dict_reads_the_same(monkeypatch):
    monkeypatch.setenv("RLKERNELS_TEST_SWITCH", "off")
    names = ("RLKERNELS_TEST_SWITCH", "RLKERNELS_SURELY_UNSET", "PATH")
    fast = [_env.env_get(n) for n in names]
    monkeypatch.setattr(_env, "_ENV_DATA", None)
    assert [_env.env_get(n) for n in names] == fast == [os.environ.get(n) for n in names]
    assert not _env.switch_on("RLKERNELS_TEST_SWITCH")


_CHILD = r"""
import json, platform, sys
from importlib import metadata
import torch

# Every gated package at a release no fast path was tested with, before rlkernels is imported.
_real = metadata.version
metadata.version = lambda name: "99.0.0" if name in ("torch", "triton") else _real(name)
platform.python_version = lambda: "99.0.0"
import rlkernels
from rlkernels import _env
from rlkernels.cli import fast_path_rows
from rlkernels.gemm import cublaslt
from rlkernels.runtime import launcher

g = torch.Generator().manual_seed(0)
a, b = torch.randn(37, 64, generator=g), torch.randn(64, 48, generator=g)
torch.save({"matmul": rlkernels.matmul(a, b), "log_softmax": rlkernels.log_softmax(a, dim=-1)}, sys.argv[1])
print(json.dumps({"rows": [[name, on] for name, on, _, _ in fast_path_rows()],
                  "env_data": _env._ENV_DATA is not None, "direct": cublaslt.FLAGS.direct,
                  "launch": launcher.fast_launch_status()[0],
                  "public_device": launcher.current_device is torch.cuda.current_device,
                  "public_stream": launcher.current_raw_stream is launcher._public_raw_stream}))
"""


def test_untested_versions_take_every_public_path_with_the_same_results(tmp_path):
    import rlkernels

    path = tmp_path / "out.pt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    env.pop("TRITON_INTERPRET", None)
    res = subprocess.run([sys.executable, "-c", _CHILD, str(path)], capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout.strip().splitlines()[-1])
    assert report["rows"] == [[name, False] for name in _versions.FAST_PATHS]
    assert not report["env_data"] and not report["direct"] and not report["launch"]
    assert report["public_device"] and report["public_stream"]
    got = torch.load(path)
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(37, 64, generator=g), torch.randn(64, 48, generator=g)
    assert torch.equal(got["matmul"], rlkernels.matmul(a, b))
    assert torch.equal(got["log_softmax"], rlkernels.log_softmax(a, dim=-1))
