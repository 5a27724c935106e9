"""The suite's own pytest configuration: skips are summarised one line per reason."""
from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[1]

TINY_SUITE = textwrap.dedent("""
    import pytest

    needs_gpu = pytest.mark.skipif(True, reason="needs a CUDA device")

    @needs_gpu
    def test_a(): pass

    @needs_gpu
    def test_b(): pass

    @pytest.mark.parametrize("n", range(3))
    def test_c(n):
        pytest.skip("needs TRITON_INTERPRET=1")

    def test_d(): pass
""")


def _run_pytest(tmp_path: pathlib.Path, *args: str) -> str:
    """pytest on a tiny suite with this repository's pyproject options and tests/conftest.py as a plugin."""
    (tmp_path / "test_tiny.py").write_text(TINY_SUITE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml"), "--rootdir",
                           str(tmp_path), "-p", "tests.conftest", "-p", "no:cacheprovider", *args, str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_skips_are_counted_one_line_per_reason(tmp_path):
    out = _run_pytest(tmp_path)
    lines = out.splitlines()
    assert not [ln for ln in lines if ln.startswith("SKIPPED")], out  # no line per skipping test
    assert [ln.split() for ln in lines if ln.strip().endswith(("CUDA device", "TRITON_INTERPRET=1"))] == [
        ["3", "needs", "TRITON_INTERPRET=1"], ["2", "needs", "a", "CUDA", "device"]], out
    assert re.fullmatch(r"=+ 1 passed, 5 skipped in [0-9.]+s =+", lines[-1]), lines[-1]  # pytest's own closing line


def test_dash_rs_brings_back_pytests_own_skip_lines(tmp_path):
    out = _run_pytest(tmp_path, "-rs")
    assert len([ln for ln in out.splitlines() if ln.startswith("SKIPPED")]) == 3, out  # one per skipping location
    assert "skipped, by reason" not in out, out


def test_gpu_tests_live_in_the_file_that_mirrors_their_module():
    # One convention: a test that needs a GPU is marked `gpu` in the test file of the module
    # it tests; there are no separate GPU test files.
    tests = ROOT / "tests"
    separate = sorted(str(p.relative_to(ROOT)) for p in tests.rglob("test_*.py")
                      if re.search(r"_gpus?\.py$", p.name))
    assert not separate, separate
    marked = [p for p in tests.rglob("test_*.py") if "pytest.mark.gpu" in p.read_text()]
    assert len(marked) > 10, "the gpu marker is how GPU tests are found (benchmarks/gpu_suite.sh: -m gpu)"
