"""Experiment: wider N tiles for the lm head at M = 5-16.

    python benchmarks/explore_lm_head_tiles.py [--json PATH]

At M = 16 the lm head's table tile (16x64x256) reads 0.94x stock against 0.925x at M = 1:
each of its 2374 programs reads all 16 activation rows from L2 (~300 MB in all, next to
the 1.2 GB weight from HBM). Wider N tiles read them fewer times. Per tile and M, eager
time (do_bench, alternating rounds) beside stock F.linear, and the bits against the
table's tile.
"""
from __future__ import annotations

import argparse
from typing import Any

import torch

from rlkernels.bench.common import interleaved_median_ms, print_table, write_json
from rlkernels.ops import gemm
from rlkernels.ops.gemm import GemmConfig as C

CANDIDATES = [C(16, 64, 256, 1, 4, 4), C(16, 128, 128, 1, 4, 4), C(16, 128, 128, 1, 8, 4), C(16, 128, 256, 1, 8, 3),
              C(16, 256, 64, 1, 8, 4), C(16, 256, 128, 1, 8, 3), C(16, 128, 64, 1, 4, 6)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--ms", default="1,4,8,16")
    args = parser.parse_args(argv)
    k, n = 4096, 151936
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(n, k, device="cuda", generator=gen) / k ** 0.5).bfloat16()
    rows: list[dict[str, Any]] = []
    for m in (int(v) for v in args.ms.split(",")):
        x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
        want = gemm.triton_gemm(x, w, config=gemm.gemm_config(m, n, x.dtype), b_transposed=True)
        fns = {"stock": lambda: torch.nn.functional.linear(x, w)}
        same = {}
        for cfg in CANDIDATES:
            try:
                same[cfg.short()] = torch.equal(gemm.triton_gemm(x, w, config=cfg, b_transposed=True), want)
            except Exception as e:  # out of shared memory
                print(cfg.short(), "failed:", type(e).__name__, flush=True)
                continue
            fns[cfg.short()] = lambda cfg=cfg: gemm.triton_gemm(x, w, config=cfg, b_transposed=True)
        times = interleaved_median_ms(fns, rounds=5, warmup_ms=20, rep_ms=60)
        for name, t in times.items():
            if name == "stock":
                continue
            row = {"M": m, "tile": name, "us": t * 1e3, "ratio": t / times["stock"], "same_bits": same[name],
                   "stock_us": times["stock"] * 1e3}
            rows.append(row)
            print(row, flush=True)
    print_table("lm head 4096 x 151936, eager", rows, ["M", "tile", "us", "stock_us", "ratio", "same_bits"])
    write_json(args.json, "explore_lm_head_tiles", rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
