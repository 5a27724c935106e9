"""Experiment: cuBLASLt-no-split or a Triton tile around the dispatcher's M thresholds?

    python benchmarks/explore_mid_m.py [--json PATH] [--ms 33,48,64,80] [--shapes 4096x4096,...]
        [--tiles 64x32x256/w4/s4,128x64x64/w4/s4/g8,...]

The dispatcher sends M >= 65 to cuBLASLt-no-split and M <= 64 to the Triton table. At
M = 64 on 4096 x 4096 the Triton tile read 1.00-1.02x stock eager and 1.04x in graph
replay from HBM (runs 12-15). Both producers give the canonical bits (proven by
tests/test_matmul_gpu.py at these M), so only time decides. Per shape and M: stock,
cuBLASLt-no-split, the Triton table tile and any ``--tiles`` candidates, eager (do_bench,
alternating rounds) and graph replay with the weight from HBM; each Triton variant's bits
compared with cuBLASLt-no-split's.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch

from rlkernels.bench.common import (cycling, graph_median_us, interleaved_median_ms, l2_cold_copies, print_table,
                                    write_json)
from rlkernels.bench.gemm import SHAPES

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from explore_lm_head_tiles import parse_tile  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    from rlkernels.ops import gemm
    from rlkernels.ops.cublaslt import linear_no_split_k

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--ms", default="33,48,64,80")
    parser.add_argument("--shapes", default=None, help="KxN,... (default: the grid's four)")
    parser.add_argument("--tiles", default="", help="extra Triton tiles, e.g. 64x32x256/w4/s4,128x64x64/w4/s4/g8")
    args = parser.parse_args(argv)
    shapes = ([tuple(int(v) for v in text.split("x")) for text in args.shapes.split(",")] if args.shapes
              else SHAPES)
    extra = [parse_tile(text) for text in args.tiles.split(",") if text]
    rows: list[dict[str, Any]] = []
    for k, n in shapes:
        gen = torch.Generator(device="cuda").manual_seed(0)
        w = (torch.randn(n, k, device="cuda", generator=gen) / k ** 0.5).bfloat16()
        copies = l2_cold_copies(w)
        for m in (int(v) for v in args.ms.split(",")):
            x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
            cfg = gemm.gemm_config(m, n, x.dtype)
            fns = {"stock": lambda wc: torch.nn.functional.linear(x, wc),
                   "cublaslt": lambda wc: linear_no_split_k(x, wc, None),
                   "triton": lambda wc, cfg=cfg: gemm.triton_gemm(x, wc, config=cfg, b_transposed=True)}
            for tile in extra:
                # Row tiles near M only: up to 2M (64 at least) and at most 8 row tiles.
                if tile != cfg and tile.block_m <= max(64, 2 * m) and 8 * tile.block_m >= m:
                    fns[f"triton:{tile.short()}"] = lambda wc, tile=tile: gemm.triton_gemm(x, wc, config=tile,
                                                                                            b_transposed=True)
            want = fns["cublaslt"](w)
            row: dict[str, Any] = {"K": k, "N": n, "M": m, "triton_tile": cfg.short()}
            for name in [name for name in fns if name.startswith("triton")]:
                try:
                    row[f"same_bits_{name}"] = torch.equal(fns[name](w), want)
                except Exception as e:  # a candidate that does not fit in shared memory
                    print(f"{k}x{n} M={m} {name}: {type(e).__name__}: {str(e)[:100]}", flush=True)
                    del fns[name]
            eager = interleaved_median_ms({name: (lambda f=f: f(w)) for name, f in fns.items()})
            row["same_bits"] = all(v for key, v in row.items() if key.startswith("same_bits_"))
            for name, f in fns.items():
                row[f"eager_{name}_us"] = eager[name] * 1e3
                row[f"cold_{name}_us"] = graph_median_us(cycling(f, copies), replays=50)
            for name in fns:
                if name != "stock":
                    row[f"eager_{name}_ratio"] = row[f"eager_{name}_us"] / row["eager_stock_us"]
                    row[f"cold_{name}_ratio"] = row[f"cold_{name}_us"] / row["cold_stock_us"]
            best = min((name for name in fns if name.startswith("triton")), key=lambda name: eager[name])
            row["best_triton"], row["best_triton_eager_ratio"] = best, row[f"eager_{best}_ratio"]
            rows.append(row)
            print(row, flush=True)
        del w, copies
        torch.cuda.empty_cache()
    print_table("M around the cuBLASLt threshold (eager = do_bench; cold = graph replay from HBM)", rows,
                ["K", "N", "M", "triton_tile", "same_bits", "eager_stock_us", "eager_cublaslt_ratio",
                 "eager_triton_ratio", "cold_stock_us", "cold_cublaslt_ratio", "cold_triton_ratio", "best_triton",
                 "best_triton_eager_ratio"])
    write_json(args.json, "explore_mid_m", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
