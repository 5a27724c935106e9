"""Experiment: wider N tiles for the lm head at M = 5-16, and the weight as the row operand.

    python benchmarks/explore_lm_head_tiles.py [--json PATH] [--shapes 4096x151936,...]

At M = 16 the lm head's table tile (16x64x256) reads 0.94x stock against 0.925x at M = 1:
each of its 2374 programs reads all 16 activation rows from L2 (~300 MB in all, next to
the 1.2 GB weight from HBM). Wider N tiles read them fewer times. Per tile and M, eager
time (do_bench, alternating rounds) beside stock F.linear, and the bits against the
table's tile.

Session 13 refuted the wider tiles. Session 14 adds the other orientation,
C^T = W @ X^T ("rows" tiles: BLOCK_M over the weight's output features, BLOCK_N over
the tokens): from BLOCK_M = 64 the dot runs as Hopper's warpgroup MMA (wgmma), with both
operands read from shared memory, where a 16-token tile runs mma.sync and every warp
loads the activation fragment from shared memory into registers. The output is written
through C^T's strides straight into [M, N]; no copy either way.
"""
from __future__ import annotations

import argparse
from typing import Any

import torch

from rlkernels.bench.common import (cycling, graph_median_us, interleaved_median_ms, l2_cold_copies, print_table,
                                    write_json)
from rlkernels.ops import gemm
from rlkernels.ops.gemm import GemmConfig as C

CANDIDATES = [C(16, 64, 256, 1, 4, 4), C(16, 128, 128, 1, 4, 4), C(16, 128, 128, 1, 8, 4), C(16, 128, 256, 1, 8, 3),
              C(16, 256, 64, 1, 8, 4), C(16, 256, 128, 1, 8, 3), C(16, 128, 64, 1, 4, 6)]
# C^T = W @ X^T: (weight rows, tokens, k) tiles.
ROW_CANDIDATES = [C(64, 16, 256, 1, 4, 4), C(64, 16, 128, 1, 4, 6), C(128, 16, 128, 1, 4, 4), C(128, 16, 128, 1, 8, 4),
                  C(128, 16, 256, 1, 8, 3), C(64, 16, 512, 1, 4, 2), C(256, 16, 64, 1, 8, 4), C(128, 16, 64, 1, 4, 6)]


def parse_tile(text: str) -> C:
    """'16x32x256/w4/s6' -> GemmConfig, as GemmConfig.short() prints it; optional parts:
    '/g8' (group_m, default 1), '/tma', '/pers', '/pers-ws'."""
    dims, warps, stages, *rest = text.split("/")
    bm, bn, bk = (int(v) for v in dims.split("x"))
    group = next((int(part[1:]) for part in rest if part.startswith("g")), 1)
    return C(bm, bn, bk, group_m=group, num_warps=int(warps[1:]), num_stages=int(stages[1:]), tma="tma" in rest,
             persistent=any(part.startswith("pers") for part in rest), warp_specialize="pers-ws" in rest)


def _weight_rows(x: torch.Tensor, w: torch.Tensor, cfg: C) -> torch.Tensor:
    """x @ w^T computed as (w @ x^T)^T with ``cfg`` over (weight rows, tokens)."""
    out = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
    gemm.triton_gemm(w, x.t(), out=out.t(), config=cfg)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--ms", default="1,4,8,16")
    parser.add_argument("--shapes", default="4096x151936", help="KxN,... (comma-separated)")
    parser.add_argument("--only-rows", action="store_true", help="the table tile and the rows tiles only")
    parser.add_argument("--tiles", default=None,
                        help="instead of the built-in lists: comma-separated tiles such as 16x32x256/w4/s6")
    args = parser.parse_args(argv)
    if args.tiles:
        tiles, row_tiles = [parse_tile(t) for t in args.tiles.split(",")], []
    else:
        tiles, row_tiles = ([] if args.only_rows else CANDIDATES), ROW_CANDIDATES
    rows: list[dict[str, Any]] = []
    for shape in args.shapes.split(","):
        k, n = (int(v) for v in shape.split("x"))
        rows += _shape(k, n, [int(v) for v in args.ms.split(",")], tiles, row_tiles)
    print_table("eager, alternating rounds", rows, ["K", "N", "M", "tile", "us", "stock_us", "ratio", "graph_cold_ratio",
                                                    "same_bits"])
    write_json(args.json, "explore_lm_head_tiles", rows)
    return 0


def _shape(k: int, n: int, ms: list[int], tiles: list[C], row_tiles: list[C]) -> list[dict[str, Any]]:
    """Rows for one shape: the table's tile, ``tiles`` (x @ w^T) and ``row_tiles`` (w @ x^T)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(n, k, device="cuda", generator=gen) / k ** 0.5).bfloat16()
    w_cold = l2_cold_copies(w)
    rows: list[dict[str, Any]] = []
    for m in ms:
        x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
        want = gemm.triton_gemm(x, w, config=gemm.gemm_config(m, n, x.dtype), b_transposed=True)
        fns = {"stock": lambda: torch.nn.functional.linear(x, w)}
        same = {}
        table_cfg = gemm.gemm_config(m, n, x.dtype)
        calls = {}  # name -> (x, w) -> y
        for cfg in dict.fromkeys([table_cfg] + tiles):
            calls[cfg.short()] = lambda x, w, cfg=cfg: gemm.triton_gemm(x, w, config=cfg, b_transposed=True)
        for cfg in row_tiles:
            calls["rows " + cfg.short()] = lambda x, w, cfg=cfg: _weight_rows(x, w, cfg)
        for name, call in calls.items():
            try:
                same[name] = torch.equal(call(x, w), want)
            except Exception as e:  # out of shared memory
                print(name, "failed:", type(e).__name__, e, flush=True)
                continue
            fns[name] = lambda call=call: call(x, w)
        times = interleaved_median_ms(fns, rounds=5, warmup_ms=20, rep_ms=60)
        # Graph replay with the weight read from HBM (cycled L2-cold copies), as in a decode step.
        cold = {name: graph_median_us(cycling(lambda wc, fn=fn: fn(x, wc), w_cold), replays=30, trials=7)
                for name, fn in [("stock", lambda x, wc: torch.nn.functional.linear(x, wc))]
                + [(name, calls[name]) for name in fns if name != "stock"]}
        for name, t in times.items():
            if name == "stock":
                continue
            row = {"K": k, "N": n, "M": m, "tile": name, "us": t * 1e3, "ratio": t / times["stock"],
                   "same_bits": same[name], "stock_us": times["stock"] * 1e3, "graph_cold_us": cold[name],
                   "graph_cold_ratio": cold[name] / cold["stock"]}
            rows.append(row)
            print(row, flush=True)
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
