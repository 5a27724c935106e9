"""Diagnostic: does the GEMM benchmark's eager (do_bench) time include host time?

    python benchmarks/host_exposure.py

For stock F.linear and rlkernels.linear at a few decode/mid sizes on 4096 x 4096: the
host µs per call (``bench.common.host_median_us``; session 12's figures,
benchmarks/results/host_exposure_h100_session12.log, were taken over 200 back-to-back
calls, host-bound at these sizes either way), the do_bench median, and the do_bench median
with a 40 µs host busy-wait added before the call. If the L2 flush before each timed
call covers the host work, the busy-wait does not move the median.
"""
from __future__ import annotations

import time

import torch

from rlkernels.bench.common import host_median_us, median_ms


def _busy(us: float) -> None:
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


def main() -> None:
    import rlkernels

    w = (torch.randn(4096, 4096, device="cuda") / 64).bfloat16()
    for m in (1, 16, 64, 128):
        x = torch.randn(m, 4096, device="cuda").bfloat16()
        for name, fn in (("stock", lambda: torch.nn.functional.linear(x, w)), ("rlkernels", lambda: rlkernels.linear(x, w))):
            host_us = host_median_us(fn)
            plain = median_ms(fn) * 1e3
            delayed = median_ms(lambda: (_busy(40), fn())) * 1e3
            print(f"M={m:4d} {name:10s} host {host_us:6.1f} us  do_bench {plain:6.1f} us  with +40 us host {delayed:6.1f} us",
                  flush=True)


if __name__ == "__main__":
    main()
