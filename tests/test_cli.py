"""``rlkernels info``: versions, backends and the dispatch table, on any machine."""
from __future__ import annotations

import re
from pathlib import Path

import torch

from rlkernels._env import SWITCHES
from rlkernels.gemm import table as gemm_table

from rlkernels import cli
from rlkernels._versions import FAST_PATHS, installed_version
from rlkernels.gemm import triton as gemm


def test_installed_version():
    assert installed_version("torch").split("+")[0] == torch.__version__.split("+")[0]
    assert installed_version("rich")  # a distribution without a __version__ attribute
    assert installed_version("surely_not_a_module_rlkernels") is None


def test_info_lists_versions_backends_and_the_table(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert installed_version("rich") in out and "not installed" not in out.split("transformers")[0]
    assert "linear_logprob" in out and "matmul" in out
    for _, _, cfg in gemm_table.GEMM_TABLE_16BIT:
        assert cfg.short() in out
    assert "L2 streaming window" in out
    for name in FAST_PATHS:  # each gated fast path, on or off
        assert name in out
    for var in SWITCHES:
        assert var in out


def test_every_switch_the_package_reads_is_listed():
    src = Path(cli.__file__).parent
    read = set()
    for path in src.rglob("*.py"):
        read |= set(re.findall(r"[\"'](RLKERNELS_[A-Z0-9_]+)[\"']", path.read_text()))
    assert read and read <= set(SWITCHES), sorted(read - set(SWITCHES))
    assert "TRITON_INTERPRET" in SWITCHES


# ---------------------------------------------------------------- argument validation

import sys  # noqa: E402
import types  # noqa: E402
import warnings  # noqa: E402

import pytest  # noqa: E402

from rlkernels import __version__

from rlkernels.check import ops as check_ops, model as model_check  # noqa: E402
from rlkernels.bench import __main__ as bench_main  # noqa: E402

HAS_CUDA = torch.cuda.is_available()


def _no_work(monkeypatch):
    """Make any check work fail loudly: a bad argument must stop before it."""
    def boom(*a, **k):
        raise AssertionError("work started before the arguments were validated")

    monkeypatch.setattr(check_ops, "op_check_rows", boom)
    monkeypatch.setattr(model_check, "run", boom)


def _usage_error(capsys, argv: list[str]) -> str:
    """Run the CLI, expect argparse's exit code 2, return the one error line."""
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err, "no error message"
    return err[-1]


BAD_ARGS = [
    (["check", "--device", "gpu"], "rlkernels check: error: argument --device:", ["'gpu'", "cpu", "cuda"]),
    (["check", "--device", "cuda:99"], "rlkernels check: error: argument --device:", ["cuda:99"]),
    (["check", "--dtype", "int8"], "rlkernels check: error: argument --dtype:", ["'int8'", "float32", "bfloat16"]),
    (["check", "--seqs", "0"], "rlkernels check: error: argument --seqs:", ["positive", "'0'"]),
    (["check", "--seqs", "-2"], "rlkernels check: error: argument --seqs:", ["positive", "'-2'"]),
    (["check", "--seqs", "many"], "rlkernels check: error: argument --seqs:", ["positive", "'many'"]),
    (["check", "--model", "/nonexistent/ckpt"], "rlkernels check: error: argument --model:",
     ["/nonexistent/ckpt", "checkpoint directory"]),
    (["check", "--json", "/nonexistent/dir/report.json"], "rlkernels check: error: argument --json:",
     ["/nonexistent/dir", "does not exist"]),
    (["check", "--ops-only", "--model-only"], "rlkernels check: error: argument --model-only:", ["--ops-only"]),
    (["check", "--bogus"], "rlkernels check: error: unrecognized arguments:", ["--bogus"]),
    (["check", "--compile-workers", "-1"], "rlkernels check: error: argument --compile-workers:", [">= 0", "'-1'"]),
    (["info", "--device", "gpu"], "rlkernels info: error: argument --device:", ["'gpu'", "cpu", "cuda"]),
]


@pytest.mark.parametrize("argv,prefix,words", BAD_ARGS, ids=[" ".join(a[0]) for a in BAD_ARGS])
def test_bad_argument_is_a_one_line_usage_error(capsys, monkeypatch, argv, prefix, words):
    _no_work(monkeypatch)
    line = _usage_error(capsys, argv)
    assert line.startswith(prefix), line
    for w in words:
        assert w in line, (w, line)


def test_model_dir_without_config_is_rejected(capsys, monkeypatch, tmp_path):
    _no_work(monkeypatch)
    line = _usage_error(capsys, ["check", "--model", str(tmp_path)])
    assert line.startswith("rlkernels check: error: argument --model:") and "config.json" in line


@pytest.mark.skipif(HAS_CUDA, reason="needs a machine without CUDA")
@pytest.mark.parametrize("cmd", ["check", "info"])
def test_cuda_device_without_cuda_says_so(capsys, monkeypatch, cmd):
    _no_work(monkeypatch)
    line = _usage_error(capsys, [cmd, "--device", "cuda"])
    assert line.startswith(f"rlkernels {cmd}: error: argument --device:") and "no CUDA device" in line


def test_model_check_run_rejects_zero_seqs():
    with pytest.raises(ValueError, match="seqs must be >= 1"):
        model_check.run("cpu", None, 0)


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"rlkernels {__version__}"


# ---------------------------------------------------------------- bench


@pytest.mark.parametrize("suite", ["foo", "gemm,foo", "all,nope", "gemm,"])
def test_bench_unknown_suite_comes_before_the_gpu(capsys, suite):
    line = _usage_error(capsys, ["bench", suite])
    bad = suite.split(",")[-1]  # "gemm," names the empty suite
    assert line.startswith("rlkernels bench: error: unknown suite") and repr(bad) in line
    for name in bench_main.SUITES:
        assert name in line


def test_bench_without_a_suite(capsys):
    line = _usage_error(capsys, ["bench"])
    assert line.startswith("rlkernels bench: error: missing suite") and "gemm" in line


def test_bench_help_is_user_help(capsys):
    assert cli.main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: rlkernels bench")
    for name in (*bench_main.SUITES, "all", "--json", "--quick"):
        assert name in out, name
    assert "exposes" not in out and "add_arguments" not in out  # not the module's developer docstring


def test_bench_suite_help_lists_its_options(capsys):
    assert cli.main(["bench", "gemm", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: rlkernels bench gemm") and "--ms" in out and "--quick" in out
    assert "needs a CUDA GPU" in out


@pytest.mark.skipif(HAS_CUDA, reason="needs a machine without CUDA")
def test_bench_gpu_suite_without_cuda(capsys):
    line = _usage_error(capsys, ["bench", "gemm"])
    assert line.startswith("rlkernels bench: error: suite gemm needs a CUDA GPU")


def _fake_suite(monkeypatch, name: str, needs_cuda: bool | None) -> list:
    ran: list = []
    mod = types.ModuleType(f"rlkernels.bench.{name}")
    mod.add_arguments = lambda p: p.add_argument("--size", type=int, default=1)
    mod.run = lambda args: ran.append(args)
    if needs_cuda is not None:
        mod.NEEDS_CUDA = needs_cuda
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    monkeypatch.setattr(bench_main, "SUITES", bench_main.SUITES + (name,))
    monkeypatch.setitem(bench_main.SUITE_HELP, name, "a test suite")
    return ran


def test_bench_suite_that_needs_no_cuda_runs_anywhere(monkeypatch, tmp_path):
    ran = _fake_suite(monkeypatch, "fakecpu", needs_cuda=False)
    assert cli.main(["bench", "fakecpu", "--quick", "--size", "3", "--json", str(tmp_path / "r.json")]) == 0
    assert len(ran) == 1 and ran[0].size == 3 and ran[0].quick and ran[0].json == str(tmp_path / "r.json")


@pytest.mark.skipif(HAS_CUDA, reason="needs a machine without CUDA")
def test_bench_suite_needs_cuda_by_default(capsys, monkeypatch):
    ran = _fake_suite(monkeypatch, "fakegpu", needs_cuda=None)
    line = _usage_error(capsys, ["bench", "fakegpu"])
    assert "fakegpu needs a CUDA GPU" in line and not ran


# ---------------------------------------------------------------- check output


def test_check_op_table_fits_80_columns(capsys, monkeypatch):
    rows = [{"op": "linear_logprob", "backend": "triton", "dtype": "bfloat16", **{c: "ok" for c in check_ops.CHECKS}},
            {"op": "log_softmax", "backend": "torch", "dtype": "float32", **{c: "ok" for c in check_ops.CHECKS}}]
    rows[1]["determinism"] = "FAIL: " + "bits differ between runs " * 5
    monkeypatch.setattr(check_ops, "op_check_rows", lambda device, dtypes: rows)
    monkeypatch.setenv("COLUMNS", "80")
    assert cli.main(["check", "--ops-only", "--device", "cpu"]) == 1
    out = capsys.readouterr().out
    table = out.split("each row's bits")[0]
    assert "…" not in table
    assert all(len(line) <= 80 for line in out.splitlines())
    for word in ("linear_logprob", "log_softmax", "backend", "bfloat16", "batch", "chunk", "pad", "order", "det"):
        assert word in table, word
    assert "log_softmax float32 determinism: FAIL: bits differ" in out.replace("\n", " ")


def test_check_on_cpu_prints_no_future_warning(capsys, monkeypatch):
    pytest.importorskip("transformers")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cli.main(["check", "--model-only", "--device", "cpu", "--seqs", "2"]) == 0
    future = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
    assert not future, future[:3]
    assert "all bitwise invariant" in capsys.readouterr().out


def _check_in_a_pipe(*args: str) -> str:
    """``rlkernels check`` in a fresh process, stdout and stderr a pipe; its output."""
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE")}
    proc = subprocess.run([sys.executable, "-m", "rlkernels.cli", "check", *args], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout + proc.stderr


def test_check_in_a_pipe_prints_tables_and_no_progress(tmp_path):
    import json
    import re

    pytest.importorskip("transformers")
    out = _check_in_a_pipe("--device", "cpu", "--seqs", "1", "--json", str(tmp_path / "report.json"))
    assert "\r" not in out and "\x1b" not in out, repr(out[:400])  # no redrawn frames, no cursor control
    # A rich progress bar's row: a name, the bar, "done/total", the elapsed time.
    bars = [line for line in out.splitlines() if re.search(r"━.* \d+/\d+ +\d+:\d\d:\d\d", line)]
    assert not bars, bars
    for text in ("op invariance on cpu", "per-token log-prob invariance", "all bitwise invariant"):
        assert text in out, text
    times = next(line for line in out.splitlines() if line.startswith("wall time:"))
    assert "op table" in times and "model table" in times and "total" in times, times
    seconds = json.loads((tmp_path / "report.json").read_text())["seconds"]
    assert set(seconds) == {"op table", "model table", "total"} and seconds["total"] > 0, seconds


def test_check_dtype_sets_both_tables(capsys):
    pytest.importorskip("transformers")
    assert cli.main(["check", "--device", "cpu", "--seqs", "1", "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    op_table, model_table = out.split("per-token log-prob invariance")
    assert "bfloat16" in op_table and "float32" not in op_table
    assert "bfloat16" in model_table and "float32" not in model_table


def test_check_dtype_default_on_cpu_is_float32(monkeypatch):
    seen: dict = {}

    def rows(device, dtypes):
        seen["ops"] = dtypes
        return []

    def model_run(**kwargs):
        seen["model"] = kwargs["dtype"]
        return {"ok": True}

    monkeypatch.setattr(check_ops, "op_check_rows", rows)
    monkeypatch.setattr(model_check, "run", model_run)
    monkeypatch.setitem(sys.modules, "transformers", types.ModuleType("transformers"))
    assert cli.main(["check", "--device", "cpu"]) == 0
    assert seen == {"ops": (torch.float32,), "model": None}  # the model resolves None: float32 on the CPU
    assert cli.main(["check", "--device", "cpu", "--dtype", "fp16"]) == 0
    assert seen == {"ops": (torch.float16,), "model": "fp16"}
