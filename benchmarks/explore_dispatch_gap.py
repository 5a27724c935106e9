"""Experiment: why the auto path read 3-4% over its own backend at 4096^2 M = 4096.

    python benchmarks/explore_dispatch_gap.py [--json PATH]

In grid runs 18-20 (session 13) ``rlkernels.linear`` at 4096 x 4096, M = 4096 read
194-196 us while ``linear_no_split_k`` -- the very call the auto path makes there --
read 188 us in the same alternating rounds (runs 11-17: within 1% of each other). The
suspects, each measured here in one process:

1. a host call that waits for the GPU: with the GPU busy (``torch.cuda._sleep``), a
   call whose host time reaches the sleep synchronized;
2. stream state left by the decode path's L2 window (set and restored around every
   M <= BLOCK_M launch): the large-M timings before and after a burst of decode calls
   and a graph capture, and the stream's window as the driver reports it;
3. plain spread: the two columns in more rounds.

Run it once with ``RLKERNELS_L2_STREAMING=0`` as well (the switch is read at import).
"""
from __future__ import annotations

import argparse
import ctypes
import time
from typing import Any

import torch

import rlkernels
from rlkernels.bench.common import graph_median_us, interleaved_median_ms, print_table, write_json
from rlkernels.ops import l2_window
from rlkernels.ops.cublaslt import linear_no_split_k


def _stream_window() -> dict[str, Any]:
    drv = l2_window._driver()
    if drv is None:
        return {}
    value = l2_window._StreamAttr()
    stream = torch._C._cuda_getCurrentRawStream(torch.cuda.current_device())
    rc = drv.get(ctypes.c_void_p(stream), l2_window._ACCESS_POLICY_WINDOW, value)
    w = value.window
    return {"rc": rc, "base": w.base_ptr or 0, "bytes": w.num_bytes, "hit_ratio": w.hit_ratio,
            "hit_prop": w.hit_prop, "miss_prop": w.miss_prop}


def _host_us_while_gpu_busy(fn, calls: int = 10, sleep_cycles: int = 200_000_000) -> float:
    """Host µs per call of ``fn`` queued behind ~0.1 s of GPU sleep: near the sleep if it syncs."""
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(sleep_cycles)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    return host


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args(argv)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows: list[dict[str, Any]] = []
    shapes = [(4096, 4096, 4096), (4096, 4096, 16384), (4096, 12288, 4096)]
    data = {}
    for k, n, m in shapes:
        w = (torch.randn(n, k, device="cuda", generator=gen) / k ** 0.5).bfloat16()
        x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
        data[(k, n, m)] = (x, w)
    decode_w = (torch.randn(4096, 4096, device="cuda", generator=gen) / 64).bfloat16()
    decode_x = torch.randn(1, 4096, device="cuda", generator=gen).bfloat16()

    def measure(phase: str) -> None:
        for (k, n, m), (x, w) in data.items():
            fns = {"stock": lambda: torch.nn.functional.linear(x, w),
                   "cublaslt_direct": lambda: linear_no_split_k(x, w, None),
                   "rlkernels_auto": lambda: rlkernels.linear(x, w)}
            t = interleaved_median_ms(fns, rounds=args.rounds, warmup_ms=10, rep_ms=40)
            busy = {name: _host_us_while_gpu_busy(fn) for name, fn in fns.items()}
            row = {"phase": phase, "K": k, "N": n, "M": m, **{f"{a}_us": v * 1e3 for a, v in t.items()},
                   "auto_vs_direct": t["rlkernels_auto"] / t["cublaslt_direct"],
                   **{f"{a}_host_busy_us": v for a, v in busy.items()}, "window": str(_stream_window())}
            rows.append(row)
            print(row, flush=True)

    print("window switch:", l2_window.ENABLED, "stream window at start:", _stream_window(), flush=True)
    measure("fresh process")
    for _ in range(500):
        rlkernels.linear(decode_x, decode_w)
    torch.cuda.synchronize()
    print("after 500 decode calls:", _stream_window(), flush=True)
    measure("after decode calls")
    graph_median_us(lambda: rlkernels.linear(decode_x, decode_w), replays=20, trials=3)
    print("after a graph capture:", _stream_window(), flush=True)
    measure("after graph capture")
    print_table("auto path vs its own backend (eager, alternating rounds)", rows,
                ["phase", "K", "N", "M", "stock_us", "cublaslt_direct_us", "rlkernels_auto_us", "auto_vs_direct",
                 "rlkernels_auto_host_busy_us"])
    write_json(args.json, "explore_dispatch_gap", rows, {"l2_streaming": l2_window.ENABLED})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
