"""Floors of the open performance goals, measured on the device: what no kernel beats.

    python benchmarks/floors.py [logprob] [decode] [bmm] [--json PATH]   (default: all three)

* logprob -- linear_logprob fwd+bwd (N = 8192, D = 4096, V = 151936, bf16) against its
  four GEMM-sized passes as bare cuBLAS GEMMs back to back (``four_gemm_passes``), and
  the forward against the logits GEMM, in alternating rounds in one process.
* decode -- the weight-streaming floor of a decode GEMM: the best of a few read-only
  Triton kernels over the weight (every byte read once, nothing else), beside stock
  ``F.linear`` and ``rlkernels.linear`` at M = 1, 4, 16; CUDA-graph replay with the
  weight cycled through copies that do not fit in L2, as the GEMM benchmark's "cold"
  columns; and timed as its eager columns (``do_bench``, whose L2 flush leaves the L2
  full of dirty lines), read-only passes with evict-first and with normal loads.
* bmm -- per bmm benchmark shape, the byte floor (a kernel that reads a and b and writes
  c once, timed like the bmm benchmark: graph replay, operands as they lie) and, for
  fp32, the FMA floor (the shape's FMAs at the fp32 FMA rate measured by a
  register-only kernel, plus the launch floor).

Each floor over the stock time is the best ratio any implementation could reach.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any

import torch
import triton
import triton.language as tl

from rlkernels.bench.bmm import SHAPES as BMM_SHAPES, launch_floor_us
from rlkernels.bench.common import (cycling, graph_median_us, interleaved_median_ms, l2_cold_copies, print_table,
                                    write_json)
from rlkernels.bench.gemm import SHAPES as GEMM_SHAPES
from rlkernels.bench.logprob import _rlkernels_case, four_gemm_passes, make_inputs


@triton.jit
def _read_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, EVICT_FIRST: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    if EVICT_FIRST:
        x = tl.load(x_ptr + offs, mask=offs < n, other=0.0, eviction_policy="evict_first")
    else:
        x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(out_ptr + tl.program_id(0), tl.sum(x.to(tl.float32), axis=0))


@triton.jit
def _touch_kernel(a_ptr, b_ptr, c_ptr, na, nb, nc, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(a_ptr + offs, mask=offs < na, other=0.0)
    y = tl.load(b_ptr + offs, mask=offs < nb, other=0.0)
    tl.store(c_ptr + offs, x + y, mask=offs < nc)


@triton.jit
def _fma_kernel(out_ptr, iters, BLOCK: tl.constexpr):
    # Four independent FMA chains per element, nothing but registers.
    x = tl.arange(0, BLOCK).to(tl.float32) * 1e-6 + tl.program_id(0).to(tl.float32)
    a0, a1, a2, a3 = x, x + 1.0, x + 2.0, x + 3.0
    for _ in range(iters):
        a0 = tl.fma(a0, 0.9999, 1e-4)
        a1 = tl.fma(a1, 0.9999, 1e-4)
        a2 = tl.fma(a2, 0.9999, 1e-4)
        a3 = tl.fma(a3, 0.9999, 1e-4)
    tl.store(out_ptr + tl.program_id(0) * BLOCK + tl.arange(0, BLOCK), a0 + a1 + a2 + a3)


_READ_VARIANTS = ((4096, 4), (8192, 8), (16384, 8), (32768, 16))


def _reader(n: int, block: int, warps: int, evict_first: bool) -> Any:
    grid = (triton.cdiv(n, block),)
    sink = torch.empty(grid[0], device="cuda")

    def fn(x: torch.Tensor) -> None:
        _read_kernel[grid](x, sink, n, BLOCK=block, EVICT_FIRST=evict_first, num_warps=warps)
    return fn


def read_floor_us(copies: list[torch.Tensor]) -> dict[str, float]:
    """Graph-replay µs of reading each copy once (cycled), per read-kernel variant."""
    n = copies[0].numel()
    return {f"read_{block}_w{warps}": graph_median_us(cycling(_reader(n, block, warps, True), copies), replays=50)
            for block, warps in _READ_VARIANTS}


def read_floor_eager_us(w: torch.Tensor) -> dict[str, float]:
    """The best read-only pass over ``w`` timed as the GEMM benchmark's eager columns
    (``do_bench``: the L2 is overwritten with zeros before every call, so it holds
    dirty lines a reader may have to write back), with the weight loaded evict-first
    and normally."""
    out = {}
    for evict_first in (True, False):
        fns = {f"{block}_w{warps}": (lambda f=_reader(w.numel(), block, warps, evict_first): f(w))
               for block, warps in _READ_VARIANTS}
        out["evict_first" if evict_first else "normal"] = min(interleaved_median_ms(fns, rounds=3).values()) * 1e3
    return out


def decode_floors() -> list[dict[str, Any]]:
    import rlkernels

    rows = []
    for k, n in GEMM_SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(0)
        w = (torch.randn(n, k, device="cuda", generator=gen) / k ** 0.5).bfloat16()
        copies = l2_cold_copies(w)
        variants = read_floor_us(copies)
        floor = min(variants.values())
        eager_floor = read_floor_eager_us(w)
        for m in (1, 4, 16):
            x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
            stock = graph_median_us(cycling(lambda wc: torch.nn.functional.linear(x, wc), copies), replays=50)
            ours = graph_median_us(cycling(lambda wc: rlkernels.linear(x, wc), copies), replays=50)
            eager = interleaved_median_ms({"stock": lambda: torch.nn.functional.linear(x, w),
                                           "rlkernels": lambda: rlkernels.linear(x, w)})
            rows.append({"K": k, "N": n, "M": m, "weight_MB": w.numel() * 2 / 1e6, "stock_us": stock,
                         "rlkernels_us": ours, "read_floor_us": floor, "floor_TBps": w.numel() * 2 / floor / 1e6,
                         "stock_TBps": w.numel() * 2 / stock / 1e6, "ratio_vs_stock": ours / stock,
                         "best_possible_ratio": floor / stock, "read_variants_us": variants,
                         "eager_stock_us": eager["stock"] * 1e3, "eager_rlkernels_us": eager["rlkernels"] * 1e3,
                         "eager_read_floor_us": eager_floor["evict_first"],
                         "eager_read_floor_normal_loads_us": eager_floor["normal"],
                         "eager_ratio_vs_stock": eager["rlkernels"] / eager["stock"],
                         "eager_best_possible_ratio": eager_floor["evict_first"] * 1e-3 / eager["stock"]})
            print(rows[-1], flush=True)
        del w, copies
        torch.cuda.empty_cache()
    print_table("decode: weight-streaming floor (graph replay, weight from HBM)", rows,
                ["K", "N", "M", "weight_MB", "stock_us", "rlkernels_us", "read_floor_us", "floor_TBps", "stock_TBps",
                 "ratio_vs_stock", "best_possible_ratio"])
    print_table("decode, eager (do_bench, L2 overwritten before each call)", rows,
                ["K", "N", "M", "eager_stock_us", "eager_rlkernels_us", "eager_read_floor_us",
                 "eager_read_floor_normal_loads_us", "eager_ratio_vs_stock", "eager_best_possible_ratio"])
    return rows


def fma_peak_tflops() -> float:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    block, warps, iters = 1024, 8, 4096
    grid = (sms * 8,)
    out = torch.empty(grid[0] * block, device="cuda")
    us = graph_median_us(lambda: _fma_kernel[grid](out, iters, BLOCK=block, num_warps=warps), replays=10, trials=7)
    return 2.0 * 4 * block * iters * grid[0] / (us * 1e-6) / 1e12


def bmm_floors() -> list[dict[str, Any]]:
    from rlkernels.bench.bmm import _operands
    from rlkernels.ops.bmm import bmm

    torch.backends.cuda.matmul.allow_tf32 = False
    launch_us = launch_floor_us(200)
    fma_tflops = fma_peak_tflops()
    print(f"launch floor {launch_us:.2f} us, fp32 FMA peak {fma_tflops:.1f} TFLOP/s", flush=True)
    rows = []
    for (B, m, n, k) in BMM_SHAPES:
        for dtype in (torch.float32, torch.bfloat16):
            a, b = _operands(B, m, n, k, dtype)
            c = torch.empty(B, m, n, device="cuda", dtype=dtype)
            na, nb, nc = a.numel(), b.numel(), c.numel()
            touch = {}
            for block in (1024, 2048, 4096):
                grid = (triton.cdiv(max(na, nb, nc), block),)
                touch[block] = graph_median_us(
                    lambda grid=grid, block=block: _touch_kernel[grid](a, b, c, na, nb, nc, BLOCK=block, num_warps=4),
                    replays=200)
            with torch.no_grad():
                ours = graph_median_us(lambda: bmm(a, b), replays=200)
                stock = graph_median_us(lambda: torch.bmm(a, b), replays=200)
            byte_floor = min(touch.values())
            fma_floor = launch_us + 2.0 * B * m * n * k / (fma_tflops * 1e6) if dtype == torch.float32 else None
            floor = max(byte_floor, fma_floor or 0.0)
            rows.append({"shape": f"{B}x{m}x{n}x{k}", "dtype": str(dtype)[6:], "rlkernels_us": ours,
                         "torch_bmm_us": stock, "speedup": stock / ours, "byte_floor_us": byte_floor,
                         "fma_floor_us": fma_floor, "floor_us": floor, "best_possible_speedup": stock / floor,
                         "goal_2x_us": stock / 2, "goal_reachable": stock / 2 >= floor})
            print(rows[-1], flush=True)
    print_table(f"bmm floors (graph replay; launch floor {launch_us:.2f} us, fp32 FMA {fma_tflops:.1f} TFLOP/s)", rows,
                ["shape", "dtype", "rlkernels_us", "torch_bmm_us", "speedup", "byte_floor_us", "fma_floor_us",
                 "best_possible_speedup", "goal_2x_us", "goal_reachable"])
    return rows + [{"launch_floor_us": launch_us, "fp32_fma_tflops": fma_tflops}]


def logprob_floor(n: int = 8192, d: int = 4096, v: int = 151936) -> list[dict[str, Any]]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    h, w, t, gl, ge = make_inputs(n, d, v, gen)
    fwd, fwd_bwd = _rlkernels_case(h, w, t, gl, ge)
    four = four_gemm_passes(h, w, gen)
    logits = torch.empty(n, v, device="cuda", dtype=torch.bfloat16)
    ms = interleaved_median_ms({"rlkernels_fwd_bwd": fwd_bwd, "four_gemms": four, "rlkernels_fwd": fwd,
                                "logits_gemm": lambda: torch.mm(h.detach(), w.detach().t(), out=logits)},
                               rounds=5, warmup_ms=100, rep_ms=400)
    flops = 2.0 * n * d * v
    row = {"N": n, "D": d, "V": v, **{f"{name}_ms": t_ for name, t_ in ms.items()},
           "four_gemms_tflops": 4 * flops / ms["four_gemms"] / 1e9,
           "fwd_bwd_vs_four_gemms": ms["rlkernels_fwd_bwd"] / ms["four_gemms"],
           "fwd_vs_logits_gemm": ms["rlkernels_fwd"] / ms["logits_gemm"],
           "goal_fwd_bwd_ms": 58.0, "goal_fwd_ms": 15.0}
    print_table("linear_logprob floor (alternating rounds)", [row],
                ["N", "D", "V", "rlkernels_fwd_ms", "logits_gemm_ms", "rlkernels_fwd_bwd_ms", "four_gemms_ms",
                 "four_gemms_tflops", "fwd_bwd_vs_four_gemms", "fwd_vs_logits_gemm"])
    return [row]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("parts", nargs="*", default=["logprob", "decode", "bmm"])
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    runs = {"logprob": logprob_floor, "decode": decode_floors, "bmm": bmm_floors}
    rows: list[dict[str, Any]] = []
    for part in args.parts:
        for row in runs[part]():
            rows.append({"part": part, **row})
        torch.cuda.empty_cache()
    write_json(args.json, "floors", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
