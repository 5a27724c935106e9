"""Experiment: cuBLASLt-no-split or the Triton tile at 33 <= M <= 64?

    python benchmarks/explore_mid_m.py [--json PATH]

The dispatcher sends M >= 65 to cuBLASLt-no-split and M <= 64 to the Triton table. At
M = 64 on 4096 x 4096 the Triton tile read 1.00-1.02x stock eager and 1.04x in graph
replay from HBM (runs 12-15). Both producers give the canonical bits (proven by
tests/test_matmul_gpu.py at these M), so only time decides. Per shape and M: stock,
cuBLASLt-no-split and the Triton table tile, eager (do_bench, alternating rounds)
and graph replay with the weight from HBM; bits compared.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

from rlkernels.bench.common import (cycling, graph_median_us, interleaved_median_ms, l2_cold_copies, print_table,
                                    write_json)
from rlkernels.bench.gemm import SHAPES


def main(argv: list[str] | None = None) -> int:
    from rlkernels.ops import gemm
    from rlkernels.ops.cublaslt import linear_no_split_k

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--ms", default="33,48,64,80")
    args = parser.parse_args(argv)
    rows: list[dict[str, Any]] = []
    for k, n in SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(0)
        w = (torch.randn(n, k, device="cuda", generator=gen) / k ** 0.5).bfloat16()
        copies = l2_cold_copies(w)
        for m in (int(v) for v in args.ms.split(",")):
            x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
            cfg = gemm.gemm_config(m, n, x.dtype)
            fns = {"stock": lambda wc: torch.nn.functional.linear(x, wc),
                   "cublaslt": lambda wc: linear_no_split_k(x, wc, None),
                   "triton": lambda wc, cfg=cfg: gemm.triton_gemm(x, wc, config=cfg, b_transposed=True)}
            eager = interleaved_median_ms({name: (lambda f=f: f(w)) for name, f in fns.items()})
            row: dict[str, Any] = {"K": k, "N": n, "M": m, "triton_tile": cfg.short(),
                                   "same_bits": torch.equal(fns["cublaslt"](w), fns["triton"](w))}
            for name, f in fns.items():
                row[f"eager_{name}_us"] = eager[name] * 1e3
                row[f"cold_{name}_us"] = graph_median_us(cycling(f, copies), replays=50)
            for name in ("cublaslt", "triton"):
                row[f"eager_{name}_ratio"] = row[f"eager_{name}_us"] / row["eager_stock_us"]
                row[f"cold_{name}_ratio"] = row[f"cold_{name}_us"] / row["cold_stock_us"]
            rows.append(row)
            print(row, flush=True)
        del w, copies
        torch.cuda.empty_cache()
    print_table("M around the cuBLASLt threshold (eager = do_bench; cold = graph replay from HBM)", rows,
                ["K", "N", "M", "triton_tile", "same_bits", "eager_stock_us", "eager_cublaslt_ratio",
                 "eager_triton_ratio", "cold_stock_us", "cold_cublaslt_ratio", "cold_triton_ratio"])
    write_json(args.json, "explore_mid_m", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
