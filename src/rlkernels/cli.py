"""``rlkernels`` command line: ``info``, ``check`` (the main job) and ``bench``."""
from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import sys
from typing import Any

from rich.console import Console
from rich.table import Table

from ._versions import installed_version


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def cmd_info(args: argparse.Namespace, console: Console) -> int:
    import torch

    from .ops import gemm
    from .registry import registered_ops, select_backend, triton_interpret

    versions = Table(title="rlkernels environment", show_header=False)
    from . import __version__

    versions.add_row("rlkernels", __version__)
    versions.add_row("python", platform.python_version())
    for mod in ("torch", "triton", "numpy", "rich", "transformers"):
        versions.add_row(mod, installed_version(mod) or "not installed")
    versions.add_row("cuda", str(torch.version.cuda))
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    versions.add_row("devices", ", ".join(gpus) or "cpu only")
    versions.add_row("TRITON_INTERPRET", "on" if triton_interpret() else "off")
    for var in ("RLKERNELS_BACKEND", "RLKERNELS_GEMM_BACKEND", "RLKERNELS_DISABLE_TINY_GEMM", "RLKERNELS_FAST_LAUNCH",
                "RLKERNELS_L2_STREAMING"):
        versions.add_row(var, os.environ.get(var, "(unset)"))
    console.print(versions)

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
    for m_max, n_min, cfg in gemm.GEMM_TABLE_16BIT:
        table.add_row("inf" if m_max > 1 << 40 else str(m_max), str(n_min), cfg.short())
    console.print(table)
    from .ops.matmul import CUBLASLT_MIN_M, CUBLASLT_MIN_M_LM_HEAD, CUBLASLT_MIN_M_NARROW, LM_HEAD_N, WIDE_N

    console.print(f"cuBLASLt-no-split is used from M >= {CUBLASLT_MIN_M} (M >= {CUBLASLT_MIN_M_NARROW} for N < {WIDE_N}, "
                  f"M >= {CUBLASLT_MIN_M_LM_HEAD} for N >= {LM_HEAD_N}) for bf16/fp16 where a probe proves the same bits.")
    from .ops import l2_window

    max_window = l2_window.max_window_bytes(device.index or 0) if device.type == "cuda" else 0
    if not l2_window.ENABLED:
        console.print("Decode weights: no L2 streaming window (RLKERNELS_L2_STREAMING=0).")
    elif max_window:
        console.print("Decode weights (one row of tiles) stream through L2 as a streaming access-policy window up to "
                      f"{max_window >> 20} MiB; larger ones with the normal policy.")
    else:
        console.print("Decode weights: no L2 streaming window here (it needs a CUDA device and its driver API).")
    if device.type == "cuda":
        from .ops import cublaslt

        for dt in (torch.bfloat16, torch.float16):
            for k in (4096,):
                cublaslt.cublaslt_verified(device, dt, k, False)
        for key, ok in cublaslt.verification_report().items():
            console.print(f"  verified {key}: {'same bits as the Triton chain' if ok else 'DIFFERENT bits -> Triton only'}")
    return 0


def cmd_check(args: argparse.Namespace, console: Console) -> int:
    import torch

    from .check_ops import CHECKS, op_check_rows, rows_ok

    device = torch.device(args.device or _default_device())
    dtypes = (torch.float32, torch.bfloat16) if device.type == "cuda" else (torch.float32,)
    report: dict[str, Any] = {"device": str(device)}
    ok = True
    if not args.model_only:
        with console.status("op-level invariance checks..."):
            rows = op_check_rows(device, dtypes)
        table = Table(title=f"op invariance on {device} (bitwise)")
        for col in ("op", "backend", "dtype") + CHECKS:
            table.add_column(col)
        for r in rows:
            cells = [r.get(c, "") for c in CHECKS] if "error" not in r else [r["error"]] + [""] * (len(CHECKS) - 1)
            table.add_row(r["op"], r["backend"], r["dtype"],
                          *[("[green]ok[/]" if c == "ok" else f"[red]{c[:60]}[/]" if c else "") for c in cells])
        console.print(table)
        ops_ok = rows_ok(rows)
        for r in rows:
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
            from . import model_check

            model_ok = model_check.run(device=str(device), dtype=args.dtype, seqs=args.seqs,
                                       model_path=args.model, json_path=None, console=console)
            report["model_ok"] = model_ok
            report["model"] = getattr(model_check, "LAST_REPORT", None)
            ok &= model_ok
    report["ok"] = ok
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    console.print("[bold green]all bitwise invariant[/]" if ok else "[bold red]invariance check FAILED[/]")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlkernels", description="batch-invariant kernels for RL post-training")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_info = sub.add_parser("info", help="versions, devices, and which backend each op uses and why")
    p_info.add_argument("--device", default=None)
    p_check = sub.add_parser("check", help="prove rollout-style and training-style log-probs agree bit for bit")
    p_check.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p_check.add_argument("--dtype", default=None, help="model dtype (default: bfloat16 on GPU, float32 on CPU)")
    p_check.add_argument("--seqs", type=int, default=None, help="number of sequences (default: the model check's)")
    p_check.add_argument("--model", default=None, help="local Hugging Face checkpoint directory")
    p_check.add_argument("--json", default=None, help="write the full report here")
    p_check.add_argument("--ops-only", action="store_true", help="skip the model-level check")
    p_check.add_argument("--model-only", action="store_true", help="skip the op-level checks")
    sub.add_parser("bench", help="benchmarks (GPU): rlkernels bench {gemm,training,logprob,bmm,all} [--json PATH]",
                   add_help=False)
    args, rest = parser.parse_known_args(argv)
    console = Console()
    if args.cmd == "bench":
        from .bench.__main__ import main as bench_main

        return bench_main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return {"info": cmd_info, "check": cmd_check}[args.cmd](args, console)


if __name__ == "__main__":
    sys.exit(main())
