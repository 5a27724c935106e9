"""Experiment: the lm head in weight chunks that each fit a streaming L2 window.

    python benchmarks/explore_lm_head_chunked_window.py [--json PATH] [--chunks 12672,16384]

A decode GEMM whose weight fits the device's largest access-policy window (H100: 128 MiB)
streams it through L2 under a ``streaming`` window (ops.l2_window): the weight no longer
evicts other lines, which kept do_bench's dirty flush lines from being written back during
the GEMM (session 13: -10% eager on the 100 MB shapes). The 1.2 GB lm head gets no window.
Split into row chunks of the weight (output column slices), each launch gets its own
window; every output element's K-chain is unchanged, so the bits are the table's. The
chunk sizes are whole waves of the decode tile (132 SMs x 3 programs x 32 columns = 12672
rows, 99 MiB) or the window's limit (16384 rows, 128 MiB). The cost: one launch per chunk
(host time, and a drain and fill of the GPU per launch).
"""
from __future__ import annotations

import argparse
from typing import Any
from unittest import mock

import torch

from rlkernels.bench.common import compare_variants, print_table, write_json
from rlkernels.ops import gemm


def chunked(x: torch.Tensor, w: torch.Tensor, rows: int) -> torch.Tensor:
    """x @ w^T by launches over ``rows``-row chunks of the [N, K] weight."""
    out = x.new_empty(x.shape[0], w.shape[0])
    for lo in range(0, w.shape[0], rows):
        hi = min(w.shape[0], lo + rows)
        gemm.triton_gemm(x, w[lo:hi], b_transposed=True, out=out[:, lo:hi])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--chunks", default="12672,16384")
    parser.add_argument("--ms", default="1,16")
    parser.add_argument("--shape", default="4096x151936", help="KxN")
    args = parser.parse_args(argv)
    k, n = (int(v) for v in args.shape.split("x"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(n, k, device="cuda", generator=gen) / k ** 0.5).bfloat16()
    rows: list[dict[str, Any]] = []
    for m in (int(v) for v in args.ms.split(",")):
        x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
        want = gemm.triton_gemm(x, w, b_transposed=True)
        fns = {"stock": lambda: torch.nn.functional.linear(x, w),
               "table (one launch)": lambda: gemm.triton_gemm(x, w, b_transposed=True)}
        for c in (int(v) for v in args.chunks.split(",")):
            fns[f"chunks of {c}"] = lambda c=c: chunked(x, w, c)

            def no_window(c=c):
                with mock.patch.object(gemm, "STREAM_ONCE_L2_WINDOW", False):
                    return chunked(x, w, c)
            fns[f"chunks of {c}, no window"] = no_window
        for row in compare_variants(fns, want):
            rows.append({"M": m, **row})
            print(rows[-1], flush=True)
    print_table(f"lm head K={k} N={n}: one launch vs windowed chunks", rows,
                ["M", "variant", "eager_us", "eager_ratio", "graph_us", "graph_ratio", "same_bits"])
    write_json(args.json, "explore_lm_head_chunked_window", rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
