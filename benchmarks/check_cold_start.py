"""Wall time of ``rlkernels check`` from a cold Triton cache, with and without the compile warm-up.

    PYTHONPATH=<tree>/src python benchmarks/check_cold_start.py [--runs 2] [--json $OUT/check_cold.json]

Each run is a fresh process (``python -m rlkernels.cli check --json ...``) with
``TRITON_CACHE_DIR`` set to a new empty directory, so every Triton kernel -- and
Triton's own launcher stubs -- is compiled again, as on a fresh machine. The variants
alternate (``--compile-workers 0``: no warm-up, the op table compiles one kernel
after another; default: the warm-up's threads), so a drift in the machine's load
hits both alike. Printed per run: the process's wall time (interpreter start and
imports included) and the command's own per-section times from its JSON report.
Extra arguments after ``--`` go to ``rlkernels check``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

VARIANTS = {"no warm-up": ["--compile-workers", "0"], "warm-up": []}


def cold_run(extra: list[str]) -> dict:
    """One ``rlkernels check`` in a fresh process with an empty Triton cache: its times and verdict."""
    with tempfile.TemporaryDirectory(prefix="triton-cold-") as cache, tempfile.TemporaryDirectory() as out:
        report_path = os.path.join(out, "report.json")
        env = dict(os.environ, TRITON_CACHE_DIR=cache)
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "rlkernels.cli", "check", "--json", report_path, *extra],
                              env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if proc.returncode not in (0, 1) or not os.path.exists(report_path):
            raise RuntimeError(f"rlkernels check failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        with open(report_path) as f:
            report = json.load(f)
    return {"process_seconds": wall, "ok": report["ok"], **report["seconds"]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=2, help="cold runs per variant (alternating)")
    ap.add_argument("--json", default=None, help="write every run's times here")
    args, extra = ap.parse_known_args(argv)
    extra = [a for a in extra if a != "--"]
    results: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    for run in range(args.runs):
        for name, flags in VARIANTS.items():
            res = cold_run(flags + extra)
            results[name].append(res)
            sections = ", ".join(f"{k} {v:.1f} s" for k, v in res.items() if k not in ("process_seconds", "ok"))
            print(f"run {run + 1} {name:>10}: process {res['process_seconds']:.1f} s ({sections}), ok={res['ok']}",
                  flush=True)
    for name, runs in results.items():
        ops = min(r.get("op warm-up", 0.0) + r["op table"] for r in runs)
        print(f"{name:>10}: best process time {min(r['process_seconds'] for r in runs):.1f} s, "
              f"best op part (warm-up + table) {ops:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
