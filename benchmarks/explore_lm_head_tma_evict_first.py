"""Experiment: the lm head's decode tile with TMA loads and an evict-first L2 policy on the weight.

    python benchmarks/explore_lm_head_tma_evict_first.py [--json PATH] [--ms 1,16]

What it would be worth, not a way to ship it. The 1.2 GB lm head gets no streaming
window (the H100's largest is 128 MiB), and Triton 3.6 puts no cache policy on the copies
its pipelined loads become. Session 13 found that the TMA tile's bulk copies do run with
an evict-first policy put back into the PTX (``repro_async_copy_cache_hint.py``, whose
patcher this reuses: the weight descriptor's copies only). Here, for the lm head: the
table's pointer tile, the same tile through TMA loads, and that TMA kernel with the
weight's copies evict-first -- eager (do_bench: an L2 full of dirty lines) and in graph
replay (a clean L2), bits against the table.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Any
from unittest import mock

import torch

from rlkernels.bench.common import compare_variants, print_table, write_json
from rlkernels.ops import gemm, gemm_tma
from rlkernels.ops._launch import CachedLauncher

sys.path.insert(0, os.path.dirname(__file__))
from explore_lm_head_tiles import parse_tile  # noqa: E402
from repro_async_copy_cache_hint import hinted_kernel  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--ms", default="1,16")
    parser.add_argument("--shape", default="4096x151936", help="KxN")
    parser.add_argument("--tiles", default="16x32x256/w4/s6,16x64x256/w4/s4")
    args = parser.parse_args(argv)
    k, n = (int(v) for v in args.shape.split("x"))
    ms = [int(v) for v in args.ms.split(",")]
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(n, k, device="cuda", generator=gen) / k ** 0.5).bfloat16()
    xs = {m: torch.randn(m, k, device="cuda", generator=gen).bfloat16() for m in ms}
    tiles = [dataclasses.replace(parse_tile(text), tma=True) for text in args.tiles.split(",")]
    plain = gemm_tma._launch_tma
    for cfg in tiles:  # compile every (tile, M) through Triton, then hint copies of them
        for x in xs.values():
            gemm.triton_gemm(x, w, config=cfg, b_transposed=True)
    torch.cuda.synchronize()
    hinted = CachedLauncher(gemm_tma._gemm_tma_kernel)
    hinted.kernels = {key: hinted_kernel(kernel, "tma") for key, kernel in plain.kernels.items()}
    patched = [kernel.patched for kernel in hinted.kernels.values()]

    def through(launcher, cfg, x):
        def call():
            with mock.patch.object(gemm_tma, "_launch_tma", launcher):
                return gemm.triton_gemm(x, w, config=cfg, b_transposed=True)
        return call

    rows: list[dict[str, Any]] = []
    for m, x in xs.items():
        want = gemm.triton_gemm(x, w, b_transposed=True)
        fns = {"stock": lambda: torch.nn.functional.linear(x, w),
               "table (pointer)": lambda: gemm.triton_gemm(x, w, b_transposed=True)}
        for cfg in tiles:
            fns[f"tma {cfg.short()}"] = through(plain, cfg, x)
            fns[f"tma {cfg.short()} evict-first"] = through(hinted, cfg, x)
        for row in compare_variants(fns, want):
            rows.append({"M": m, **row})
            print(rows[-1], flush=True)
    print_table(f"lm head K={k} N={n}: TMA loads, weight evict-first", rows,
                ["M", "variant", "eager_us", "eager_ratio", "graph_us", "graph_ratio", "same_bits"])
    print("weight copies hinted, per compiled kernel:", patched)
    write_json(args.json, "explore_lm_head_tma_evict_first", rows, {"copies_hinted": patched})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
