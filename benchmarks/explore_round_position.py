"""Experiment: does a variant's place within an alternating round move its time?

    python benchmarks/explore_round_position.py [--json PATH] [--rounds 12] [--shape KxNxM]

``interleaved_median_ms`` times the variants in rounds, each round rotated by one place,
and takes the median over rounds. With 4 variants and 5 rounds the rotation is not
balanced: the third and fourth variants (rlkernels and rlkernels-forced-Triton in
``rlkernels.bench gemm``) sit in places {0, 1, 2, 2, 3} and {0, 1, 2, 3, 3}, the first
two in {0, 0, 1, 2, 3} and {0, 1, 1, 2, 3}. If a measurement runs slower later in a
round (a GPU that heats up under back-to-back compute-bound GEMMs), the median favours
the first two. Here the bench's four variants at one compute-bound point, every
(variant, place) pair timed equally often, and the mean time per place over all variants.
"""
from __future__ import annotations

import argparse
import statistics
from typing import Any

import torch

import rlkernels
from rlkernels.bench.common import median_ms, print_table, write_json
from rlkernels.bench.gemm import _forced
from rlkernels.ops.cublaslt import linear_no_split_k


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--shape", default="4096x4096x4096", help="KxNxM")
    args = parser.parse_args(argv)
    k, n, m = (int(v) for v in args.shape.split("x"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(n, k, device="cuda", generator=gen) / k ** 0.5).bfloat16()
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    fns = {"stock": lambda: torch.nn.functional.linear(x, w),
           "cublaslt_nosplit": lambda: linear_no_split_k(x, w, None),
           "rlkernels": lambda: rlkernels.linear(x, w),
           "rlkernels_triton": _forced("triton", lambda: rlkernels.linear(x, w))}
    names = list(fns)
    samples: list[dict[str, Any]] = []
    for r in range(args.rounds):
        shift = r % len(names)
        for place, name in enumerate(names[shift:] + names[:shift]):
            samples.append({"round": r, "place": place, "variant": name,
                            "us": median_ms(fns[name], warmup_ms=10, rep_ms=40) * 1e3})
    rows = []
    for name in names:
        ts = [s["us"] for s in samples if s["variant"] == name]
        five = [s["us"] for s in samples if s["variant"] == name and s["round"] < 5]
        rows.append({"variant": name, "median_balanced_us": statistics.median(ts),
                     "median_first_5_rounds_us": statistics.median(five),
                     **{f"place{p}_us": statistics.median([s["us"] for s in samples
                                                           if s["variant"] == name and s["place"] == p])
                        for p in range(len(names))}})
    by_place = {p: statistics.mean([s["us"] / rows[names.index(s["variant"])]["median_balanced_us"]
                                    for s in samples if s["place"] == p]) for p in range(len(names))}
    print_table(f"K={k} N={n} M={m}: median per variant, per place", rows,
                ["variant", "median_balanced_us", "median_first_5_rounds_us"] + [f"place{p}_us" for p in range(len(names))])
    print("time by place, relative to each variant's balanced median:", {p: round(v, 4) for p, v in by_place.items()})
    write_json(args.json, "explore_round_position", rows, {"samples": samples, "by_place": by_place})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
