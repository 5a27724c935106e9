"""Host-side cost of one decode-size call (GPU machine): where the microseconds go.

    python benchmarks/profile_host.py
"""
import cProfile
import pstats
import time

import torch

import rlkernels
from rlkernels.ops.gemm import triton_gemm

x = torch.randn(1, 4096, device="cuda").bfloat16()
w = torch.randn(4096, 4096, device="cuda").bfloat16()


def per_call_us(fn, n=2000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return host


print("host us/call: F.linear %.1f | triton_gemm %.1f | rlkernels.linear %.1f" % (
    per_call_us(lambda: torch.nn.functional.linear(x, w)), per_call_us(lambda: triton_gemm(x, w.t())),
    per_call_us(lambda: rlkernels.linear(x, w))))
pr = cProfile.Profile()
pr.enable()
for _ in range(2000):
    rlkernels.linear(x, w)
pr.disable()
torch.cuda.synchronize()
pstats.Stats(pr).sort_stats("tottime").print_stats(18)
