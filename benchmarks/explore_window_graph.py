"""Experiment: does a stream's access-policy window set during CUDA-graph capture stay with
the captured kernel, and what does it give in replay? And what does setting it cost on
the host, per driver call?

    python benchmarks/explore_window_graph.py [--json PATH]

The regime is do_bench's in graph form: each replayed step first overwrites a 256 MB
buffer (the L2 left full of dirty lines), then runs the decode GEMM. Variants: stock
F.linear, the Triton tile without the window, and with it (set on the capturing stream
by ops.l2_window; the session-13 run lifted a capture check the first version had).
The flush-only graph's time is subtracted. Bits compared.
"""
from __future__ import annotations

import argparse
import ctypes
import time
from typing import Any, Callable

import torch

from rlkernels.bench.common import graph_median_us, print_table, write_json


def step_us(fn: Callable[[], Any], flush: torch.Tensor, steps: int = 20, trials: int = 9) -> float:
    """Per-step µs of a graph of ``steps`` x (overwrite ``flush``, then ``fn``)."""
    def step() -> None:
        flush.zero_()
        fn()

    return graph_median_us(step, replays=steps, trials=trials)


def main(argv: list[str] | None = None) -> int:
    from rlkernels.ops import gemm, l2_window

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    flush_us = step_us(lambda: None, flush)
    # Host cost of the pieces, per call.
    drv = l2_window._driver()
    w0 = torch.randn(4096, 4096, device="cuda").bfloat16()
    side = torch.cuda.Stream()
    host: dict[str, float] = {}
    value = l2_window._StreamAttr()
    for name, stream in (("default", 0), ("side", side.cuda_stream)):
        handle = ctypes.c_void_p(stream)
        for what, call in (("get", lambda: drv.get(handle, 1, ctypes.byref(value))),
                           ("set", lambda: drv.set(handle, 1, ctypes.byref(value))),
                           ("set_restore", lambda: l2_window.restore(stream, l2_window.set_streaming(w0, stream)))):
            call()
            t = time.perf_counter()
            for _ in range(2000):
                call()
            host[f"{what}_{name}_us"] = (time.perf_counter() - t) / 2000 * 1e6
    for what, call in (("window_applies", lambda: l2_window.window_applies(w0)),
                       ("capturing", torch.cuda.is_current_stream_capturing),
                       ("raw_stream", lambda: torch._C._cuda_getCurrentRawStream(0))):
        t = time.perf_counter()
        for _ in range(2000):
            call()
        host[f"{what}_us"] = (time.perf_counter() - t) / 2000 * 1e6
    print("host:", {k: round(v, 2) for k, v in host.items()}, flush=True)
    rows: list[dict[str, Any]] = []
    for k, n in ((4096, 4096), (4096, 12288), (12288, 4096)):
        w = (torch.randn(n, k, device="cuda") / k ** 0.5).bfloat16()
        for m in (1, 16):
            x = torch.randn(m, k, device="cuda").bfloat16()

            def plain() -> torch.Tensor:
                gemm.STREAM_ONCE_L2_WINDOW = False
                try:
                    return gemm.triton_gemm(x, w, b_transposed=True)
                finally:
                    gemm.STREAM_ONCE_L2_WINDOW = True

            def windowed() -> torch.Tensor:
                return gemm.triton_gemm(x, w, b_transposed=True)

            row: dict[str, Any] = {"K": k, "N": n, "M": m, "same_bits": torch.equal(plain(), windowed())}
            for name, fn in (("stock", lambda: torch.nn.functional.linear(x, w)), ("plain", plain),
                             ("window", windowed), ("plain_again", plain)):
                row[f"{name}_us"] = step_us(fn, flush) - flush_us
            row["plain_ratio"] = row["plain_us"] / row["stock_us"]
            row["window_ratio"] = row["window_us"] / row["stock_us"]
            rows.append(row)
            print(row, flush=True)
    print_table("graph replay after a 256 MB overwrite (flush time subtracted)", rows,
                ["K", "N", "M", "same_bits", "stock_us", "plain_us", "window_us", "plain_again_us", "plain_ratio",
                 "window_ratio"])
    write_json(args.json, "explore_window_graph", rows, {"flush_us": flush_us, "host_us": host})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
