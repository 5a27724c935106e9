"""``rlkernels`` command line: ``info``, ``check`` (the main job) and ``bench``."""
from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import sys
import time
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ._versions import installed_version


# Column headers of the op table (the report's keys stay the check names).
CHECK_HEADERS = {"padding": "pad", "determinism": "det"}


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def cmd_info(args: argparse.Namespace, console: Console) -> int:
    import torch

    from .gemm import table as gemm_table
    from .registry import registered_ops, select_backend
    from ._env import SWITCHES, env_get

    versions = Table(title="rlkernels environment", show_header=False)
    from . import __version__

    versions.add_row("rlkernels", __version__)
    versions.add_row("python", platform.python_version())
    for mod in ("torch", "triton", "numpy", "rich", "transformers"):
        versions.add_row(mod, installed_version(mod) or "not installed")
    versions.add_row("cuda", str(torch.version.cuda))
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    versions.add_row("devices", ", ".join(gpus) or "cpu only")
    console.print(versions)

    switches = Table(title="environment switches")
    switches.add_column("variable", no_wrap=True, min_width=max(map(len, SWITCHES)))
    for col in ("value", "effect", "read"):
        switches.add_column(col)
    for var, (effect, read) in SWITCHES.items():
        switches.add_row(var, env_get(var) or "(unset)", effect, read)
    console.print(switches)

    paths = Table(title="fast paths through private internals (on only where tested; else the public API)")
    for col in ("fast path", "state", "why", "does"):
        paths.add_column(col, overflow="fold")
    for name, on, why, what in fast_path_rows():
        paths.add_row(name, "[green]on[/]" if on else "[yellow]off[/]", escape(why), escape(what))
    console.print(paths)

    device = torch.device(args.device or _default_device())
    ops = Table(title=f"backend per op on {device}")
    for col in ("op", "backends", "selected", "why"):
        ops.add_column(col)
    for name, backends in registered_ops().items():
        try:
            chosen, why = select_backend(name, device)
        except Exception as e:  # a forced backend that can't run here
            chosen, why = "ERROR", str(e)
        ops.add_row(name, ", ".join(backends), chosen, why)
    console.print(ops)

    table = Table(title="GEMM dispatch table (16-bit; checked in, never autotuned)")
    for col in ("M <=", "N >=", "tile BMxBNxBK/warps/stages"):
        table.add_column(col)
    for m_max, n_min, cfg in gemm_table.GEMM_TABLE_16BIT:
        table.add_row("inf" if m_max > 1 << 40 else str(m_max), str(n_min), cfg.short())
    console.print(table)
    from .gemm.backends import CUBLASLT_MIN_M, CUBLASLT_MIN_M_LM_HEAD, CUBLASLT_MIN_M_NARROW, LM_HEAD_N, WIDE_N

    console.print(f"cuBLASLt-no-split is used from M >= {CUBLASLT_MIN_M} (M >= {CUBLASLT_MIN_M_NARROW} for N < {WIDE_N}, "
                  f"M >= {CUBLASLT_MIN_M_LM_HEAD} for N >= {LM_HEAD_N}) for bf16/fp16 where a probe proves the same bits.")
    from .runtime import l2_window

    max_window = l2_window.max_window_bytes(device.index or 0) if device.type == "cuda" else 0
    if not l2_window.ENABLED:
        console.print("Decode weights: no L2 streaming window (RLKERNELS_L2_STREAMING=0).")
    elif max_window:
        console.print("Decode weights (one row of tiles) stream through L2 as a streaming access-policy window up to "
                      f"{max_window >> 20} MiB; larger ones with the normal policy.")
    else:
        console.print("Decode weights: no L2 streaming window here (it needs a CUDA device and its driver API).")
    if device.type == "cuda":
        from .gemm import cublaslt

        for dt in (torch.bfloat16, torch.float16):
            for k in (4096,):
                cublaslt.cublaslt_verified(device, dt, k, False)
        for key, ok in cublaslt.verification_report().items():
            console.print(f"  verified {key}: {'same bits as the Triton chain' if ok else 'DIFFERENT bits -> Triton only'}")
    return 0


def fast_path_rows() -> list[tuple[str, bool, str, str]]:
    """(name, on, why, what) for each gated fast path, as the modules that use it decided."""
    import torch

    from . import _env
    from ._versions import FAST_PATHS, fast_path
    from .gemm import cublaslt
    from .ops.linear_sample import ASYNC_ASSERT
    from .runtime import launcher

    state = {
        "triton_launch": launcher.fast_launch_status(),
        "torch_cuda_accessors": (launcher.current_device is not torch.cuda.current_device, None),
        "torch_cublas_flags": (cublaslt.FLAGS.direct, None),
        "torch_assert_async": (ASYNC_ASSERT is not None, None),
        "environ_data": (_env._ENV_DATA is not None, None),
    }
    rows = []
    for name, gate in FAST_PATHS.items():
        on, why = state[name]
        if why is None:
            gated_on, why = fast_path(name)
            if gated_on and not on:
                why = f"this {gate.package} lacks the internals it uses"
        rows.append((name, on, why, gate.what))
    return rows


def _op_dtypes(dtype: str | None, device: Any) -> tuple[Any, ...]:
    """The op table's dtypes: ``--dtype``'s alone, or by default float32 (and bfloat16 on a GPU)."""
    import torch

    from .check.model import resolve_dtype

    if dtype not in (None, "", "auto"):
        return (resolve_dtype(dtype, device),)
    return (torch.float32, torch.bfloat16) if device.type == "cuda" else (torch.float32,)


def cmd_check(args: argparse.Namespace, console: Console) -> int:
    import torch

    from .check import status
    from .check.ops import CHECKS, default_compile_workers, op_check_rows, rows_ok, warm_up

    if args.locate and args.ops_only:
        args.subparser.error("argument --locate: not allowed with --ops-only (it runs the model)")
    start = time.perf_counter()
    seconds: dict[str, float] = {}
    device = torch.device(args.device or _default_device())
    dtypes = _op_dtypes(args.dtype, device)
    report: dict[str, Any] = {"device": str(device)}
    ok = True
    if not args.model_only:
        t0 = time.perf_counter()
        with status(console, "compiling the op table's kernels..."):
            workers = default_compile_workers() if args.compile_workers is None else args.compile_workers
            if warm_up(device, dtypes, workers):
                seconds["op warm-up"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        with status(console, "op-level invariance checks..."):
            rows = op_check_rows(device, dtypes)
        seconds["op table"] = time.perf_counter() - t0  # after the warm-up: the sequential pass alone
        # Short headers and one-word cells keep the table inside 80 columns (details follow it).
        table = Table(title=f"op invariance on {device} (bitwise)",
                      caption="each row's bits unchanged: batch = in a smaller batch, chunk = in chunks,\n"
                              "pad = among other rows, order = rows shuffled, det = over 2 runs")
        table.add_column("op", no_wrap=True)
        table.add_column("backend", no_wrap=True)
        table.add_column("dtype", no_wrap=True)
        for c in CHECKS:
            table.add_column(CHECK_HEADERS.get(c, c), no_wrap=True)
        for r in rows:
            if "error" in r:
                word = "skipped" if r["error"].startswith("skipped") else "error"
                cells = [f"[yellow]{word}[/]" if word == "skipped" else f"[red]{word}[/]"] + [""] * (len(CHECKS) - 1)
            else:
                cells = ["[green]ok[/]" if r.get(c) == "ok" else "[red]FAIL[/]" for c in CHECKS]
            table.add_row(r["op"], r["backend"], r["dtype"], *cells)
        console.print(table)
        ops_ok = rows_ok(rows)
        for r in rows:
            if "error" in r:
                console.print(f"{'[yellow]' if r['error'].startswith('skipped') else '[red]'}"
                              f"{r['op']} {r['dtype']}: {r['error']}[/]")
                continue
            for c in CHECKS:
                if r.get(c, "ok") != "ok":
                    console.print(f"[red]{r['op']} {r['dtype']} {c}: {r[c]}[/]")
        report["ops"] = rows
        ok &= ops_ok
    if not args.ops_only:
        try:
            importlib.import_module("transformers")
        except Exception:
            console.print("[yellow]model-level check skipped: transformers is not installed "
                          "(pip install 'rlkernels[hf]')[/]")
            report["model"] = "skipped: transformers not installed"
        else:
            from .check import model as model_check

            t0 = time.perf_counter()
            model_report = model_check.run(device=str(device), dtype=args.dtype, seqs=args.seqs,
                                           model_path=args.model, json_path=None, console=console)
            seconds["model table"] = time.perf_counter() - t0
            report["model_ok"] = model_report["ok"]
            report["model"] = model_report
            ok &= model_report["ok"]
            if args.locate:
                from .check import locate

                t0 = time.perf_counter()
                locate_report = locate.run(device=str(device), dtype=args.dtype, seqs=args.seqs,
                                           model_path=args.model, console=console)
                seconds["locate"] = time.perf_counter() - t0
                report["locate"] = locate_report
                ok &= locate_report["ok"]
    seconds["total"] = time.perf_counter() - start
    report["ok"] = ok
    report["seconds"] = seconds
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    console.print("wall time: " + ", ".join(f"{k} {v:.1f} s" for k, v in seconds.items()), highlight=False)
    console.print("[bold green]all bitwise invariant[/]" if ok else "[bold red]invariance check FAILED[/]")
    return 0 if ok else 1


def _device_arg(value: str) -> str:
    """argparse type for --device: a device this machine has (cpu, cuda, cuda:N) or auto."""
    from .check.model import resolve_device

    try:
        return str(resolve_device(value))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _dtype_arg(value: str) -> str:
    from .check.model import DTYPE_CHOICES, _DTYPES

    if value.lower() != "auto" and value.lower().replace("torch.", "") not in _DTYPES:
        raise argparse.ArgumentTypeError(f"unknown dtype {value!r}; expected one of {DTYPE_CHOICES}")
    return value


def _positive_int(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}")
    return n


def _non_negative_int(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value!r}")
    return n


def _model_arg(value: str) -> str:
    from .check.model import check_model_path

    try:
        check_model_path(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def _json_arg(value: str) -> str:
    """argparse type for an output file: checked before the work whose report it receives."""
    parent = os.path.dirname(os.path.abspath(value))
    if os.path.isdir(value):
        raise argparse.ArgumentTypeError(f"{value!r} is a directory; expected a file path")
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"directory {parent!r} does not exist")
    return value


def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    from .bench.__main__ import ALL, SUITES

    parser = argparse.ArgumentParser(prog="rlkernels", description="batch-invariant kernels for RL post-training")
    parser.add_argument("--version", action="version", version=f"rlkernels {__version__}")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="{info,check,bench}")
    device_help = "auto (default: cuda if available, else cpu), cpu, cuda or cuda:N"
    p_info = sub.add_parser("info", help="versions, devices, and which backend each op uses and why")
    p_info.add_argument("--device", default=None, type=_device_arg, help=device_help)
    p_info.set_defaults(subparser=p_info)
    p_check = sub.add_parser("check", help="prove rollout-style and training-style log-probs agree bit for bit")
    p_check.add_argument("--device", default=None, type=_device_arg, help=device_help)
    p_check.add_argument("--dtype", default=None, type=_dtype_arg,
                         help="dtype of both tables: float32, bfloat16 or float16; auto (default): the op table "
                              "in float32 and, on a GPU, bfloat16, the model in bfloat16 on a GPU, float32 on the CPU. "
                              "An op whose backend refuses the dtype by design (bfloat16 on the Triton backend "
                              "under TRITON_INTERPRET=1) shows as skipped, with the reason")
    p_check.add_argument("--seqs", type=_positive_int, default=None,
                         help="number of sequences, >= 1 (default: 8)")
    p_check.add_argument("--model", default=None, type=_model_arg,
                         help="local Hugging Face checkpoint directory (default: a tiny random Qwen3)")
    p_check.add_argument("--json", default=None, type=_json_arg, metavar="PATH", help="write the full report here")
    p_check.add_argument("--compile-workers", type=_non_negative_int, default=None, metavar="N",
                         help="threads that compile the op table's Triton kernels up front on a GPU, before the "
                              "table's own sequential pass (default: one per core, at most 16; 0 or 1: none)")
    p_check.add_argument("--locate", action="store_true",
                         help="also name the first module whose output drifts between one-at-a-time and "
                              "batched runs, stock vs rlkernels (docs/operators/drift_locator.md)")
    only = p_check.add_mutually_exclusive_group()
    only.add_argument("--ops-only", action="store_true", help="skip the model-level check")
    only.add_argument("--model-only", action="store_true", help="skip the op-level checks")
    p_check.set_defaults(subparser=p_check)
    sub.add_parser("bench", help=f"benchmarks: suites {', '.join(SUITES)} (all = {', '.join(ALL)}); "
                                 "rlkernels bench --help for more", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.cmd == "bench":
        from .bench.__main__ import main as bench_main

        return bench_main(rest)
    if rest:
        args.subparser.error(f"unrecognized arguments: {' '.join(rest)}")
    return {"info": cmd_info, "check": cmd_check}[args.cmd](args, Console())


if __name__ == "__main__":
    sys.exit(main())
