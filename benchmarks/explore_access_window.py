"""Experiment: the decode weight as a streaming L2 access-policy window.

    python benchmarks/explore_access_window.py [--json PATH]

The decode tile's ``cp.async`` copies cannot carry an evict-first hint (Triton 3.6 drops
it; put back by hand they trap: benchmarks/repro_async_copy_cache_hint.py). CUDA's access-policy window marks every access to an
address range made by kernels launched into a stream: with ``hitProp = streaming`` the
weight's lines are the first replaced, so lines other kernels left in L2 (and their
dirty data) stay. Set through the driver API around the launch, restored after (ops.l2_window).
Per shape and M: the table's Triton tile with and without the window, cuBLASLt-no-split
with and without it (M > 16), stock F.linear; eager (do_bench, alternating rounds) and
host time per call; bits compared. (The first version of this script, set through its
own ctypes calls and with graph replay from HBM, produced
explore_access_window_h100_session13.json; this one uses ops.l2_window.)
"""
from __future__ import annotations

import argparse
from typing import Any

import torch

from rlkernels.bench.common import host_median_us, interleaved_median_ms, print_table, write_json


def main(argv: list[str] | None = None) -> int:
    from rlkernels.ops import gemm, l2_window
    from rlkernels.ops.cublaslt import linear_no_split_k

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--ms", default="1,4,16,32,64,128")
    args = parser.parse_args(argv)
    print("max access policy window bytes:", l2_window.max_window_bytes(0), flush=True)
    side = torch.cuda.Stream()
    rows: list[dict[str, Any]] = []
    for k, n in ((4096, 4096), (4096, 12288), (12288, 4096)):
        gen = torch.Generator(device="cuda").manual_seed(0)
        w = (torch.randn(n, k, device="cuda", generator=gen) / k ** 0.5).bfloat16()
        for m in (int(v) for v in args.ms.split(",")):
            x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
            cfg = gemm.gemm_config(m, n, x.dtype)

            def triton_with(window: bool):
                def run() -> torch.Tensor:
                    gemm.STREAM_ONCE_L2_WINDOW = window
                    try:
                        return gemm.triton_gemm(x, w, config=cfg, b_transposed=True)
                    finally:
                        gemm.STREAM_ONCE_L2_WINDOW = True
                return run

            def cublaslt_windowed() -> torch.Tensor:
                with l2_window.streaming_window(w, torch.cuda.current_stream().cuda_stream):
                    return linear_no_split_k(x, w, None)

            fns = {"stock": lambda: torch.nn.functional.linear(x, w), "triton": triton_with(False),
                   "triton_window": triton_with(True)}
            if m > 16:
                fns["cublaslt"] = lambda: linear_no_split_k(x, w, None)
                fns["cublaslt_window"] = cublaslt_windowed
            row: dict[str, Any] = {"K": k, "N": n, "M": m, "tile": cfg.short(), "stream_once": m <= cfg.block_m}
            with torch.cuda.stream(side):  # a stream of its own, as a serving engine's would be
                want = fns["triton"]()
                row["same_bits"] = all(torch.equal(fn(), want) for name, fn in fns.items() if name != "stock")
                eager = interleaved_median_ms(fns)
                for name, t in eager.items():
                    row[f"eager_{name}_us"] = t * 1e3
                for name in ("triton", "triton_window"):
                    row[f"host_{name}_us"] = host_median_us(fns[name])
            for name in fns:
                if name != "stock":
                    row[f"eager_{name}_ratio"] = row[f"eager_{name}_us"] / row["eager_stock_us"]
            rows.append(row)
            print(row, flush=True)
        del w
        torch.cuda.empty_cache()
    print_table("streaming access-policy window on the decode weight (eager = do_bench)", rows,
                ["K", "N", "M", "tile", "stream_once", "same_bits", "eager_stock_us", "eager_triton_ratio",
                 "eager_triton_window_ratio", "eager_cublaslt_ratio", "eager_cublaslt_window_ratio",
                 "host_triton_us", "host_triton_window_us"])
    write_json(args.json, "explore_access_window", rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
