"""Entry point: ``python -m rlkernels.bench SUITE [--json PATH] [--quick]``.

Each suite lives in ``rlkernels/bench/<suite>.py`` and exposes ``run(args) -> list[dict]``
and ``add_arguments(parser)``.
"""
from __future__ import annotations

import argparse
import importlib
import sys

SUITES = ("gemm", "training", "logprob", "bmm")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlkernels bench", description=__doc__)
    parser.add_argument("suite", choices=SUITES + ("all",))
    parser.add_argument("--json", default=None, help="write results here (for 'all': a directory)")
    parser.add_argument("--quick", action="store_true", help="fewer shapes (smoke run)")
    args, rest = parser.parse_known_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("rlkernels bench: needs a CUDA GPU (timings are device-event medians)", file=sys.stderr)
        return 2
    suites = SUITES if args.suite == "all" else (args.suite,)
    for name in suites:
        mod = importlib.import_module(f"rlkernels.bench.{name}")
        sub = argparse.ArgumentParser(prog=f"rlkernels bench {name}")
        if hasattr(mod, "add_arguments"):
            mod.add_arguments(sub)
        sub_args = sub.parse_args(rest)
        sub_args.quick = args.quick
        if args.suite == "all" and args.json:
            import os

            os.makedirs(args.json, exist_ok=True)
            sub_args.json = os.path.join(args.json, f"{name}.json")
        else:
            sub_args.json = args.json
        mod.run(sub_args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
