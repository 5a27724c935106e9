"""Entry point: ``python -m rlkernels.bench SUITE [--json PATH] [--quick]``.

Each suite lives in ``rlkernels/bench/<suite>.py`` and exposes ``run(args) -> list[dict]``
and ``add_arguments(parser)``.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

SUITES = ("gemm", "training", "logprob", "bmm")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlkernels bench", description=__doc__)
    parser.add_argument("suite", help=f"one of {', '.join(SUITES)}, a comma-separated list, or all")
    parser.add_argument("--json", default=None,
                        help="write results here (a directory for several suites: one <suite>.json each)")
    parser.add_argument("--quick", action="store_true", help="fewer shapes (smoke run)")
    args, rest = parser.parse_known_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("rlkernels bench: needs a CUDA GPU (timings are device-event medians)", file=sys.stderr)
        return 2
    suites = SUITES if args.suite == "all" else tuple(args.suite.split(","))
    unknown = [s for s in suites if s not in SUITES]
    if unknown:
        parser.error(f"unknown suite(s) {unknown}; expected {SUITES} or all")
    for name in suites:
        mod = importlib.import_module(f"rlkernels.bench.{name}")
        sub = argparse.ArgumentParser(prog=f"rlkernels bench {name}")
        if hasattr(mod, "add_arguments"):
            mod.add_arguments(sub)
        sub_args = sub.parse_args(rest)
        sub_args.quick = args.quick
        if args.json and (len(suites) > 1 or os.path.isdir(args.json)):
            os.makedirs(args.json, exist_ok=True)
            sub_args.json = os.path.join(args.json, f"{name}.json")
        else:
            sub_args.json = args.json
        mod.run(sub_args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
