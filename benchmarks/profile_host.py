"""Host-side cost of one decode-size call (GPU machine): where the microseconds go.

    python benchmarks/profile_host.py [--json PATH] [--breakdown-only]

Microseconds per call of back-to-back calls (host time, or the GPU time where the
GPU is the slower side) for F.linear, the Triton GEMM with Triton's normal launch,
the same with the cached launch (ops._launch), and the public rlkernels.linear;
then a cProfile of rlkernels.linear.
"""
import argparse
import contextlib
import cProfile
import json
import pstats
import time
from typing import Any, Callable
from unittest import mock

import torch

import rlkernels
from rlkernels.ops import cublaslt, gemm, gemm_tma
from rlkernels.ops._launch import CachedLauncher


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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    parser.add_argument("--shapes", default="1x4096x4096,16x4096x4096,1x4096x12288,128x4096x4096,300x1024x1024",
                        help="MxKxN,... for the per-call table")
    parser.add_argument("--profile-shapes", default="1x4096x4096,300x1024x1024",
                        help="MxKxN,... to cProfile rlkernels.linear and triton_gemm on")
    parser.add_argument("--plans-ab", type=int, default=0, metavar="ROUNDS",
                        help="host µs of rlkernels.linear with ops.gemm's launch plans on and off, alternating "
                             "in one process, on --shapes")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"), help="--plans-ab's dtype")
    parser.add_argument("--cublaslt-ab", type=int, default=0, metavar="ROUNDS",
                        help="host µs on the cuBLASLt-no-split path (routing kept or worked out per call, flags "
                             "set inline or by the context manager), alternating in one process, on --shapes")
    parser.add_argument("--host-only", action="store_true",
                        help="only host µs per call of rlkernels.linear and F.linear on --shapes, one line (A/B)")
    parser.add_argument("--breakdown-only", action="store_true",
                        help="only the launch breakdown, one line (for A/B runs across source trees)")
    args = parser.parse_args()
    if args.breakdown_only:
        print(json.dumps({"rlkernels": rlkernels.__file__, **launch_breakdown()}))
        return
    if args.plans_ab:
        print(json.dumps(plans_ab(_shapes(args.shapes), args.plans_ab,
                                  torch.float32 if args.dtype == "fp32" else torch.bfloat16)))
        return
    if args.cublaslt_ab:
        print(json.dumps(cublaslt_path_ab(_shapes(args.shapes), args.cublaslt_ab)))
        return
    if args.host_only:
        print(json.dumps({"rlkernels": rlkernels.__file__, **host_by_shape(_shapes(args.shapes))}))
        return
    rows = []
    # M = 300 on 1024 x 1024 takes the table's TMA row (host-built descriptors) and a
    # few microseconds of GPU time, so the host side shows.
    for m, k, n in _shapes(args.shapes):
        x = torch.randn(m, k, device="cuda").bfloat16()
        w = torch.randn(n, k, device="cuda").bfloat16()
        row = {"shape": f"M={m} K={k} N={n}", "config": gemm.gemm_config(m, n, x.dtype).short()}
        row["F.linear_us"] = per_call_us(lambda: torch.nn.functional.linear(x, w))
        row["cublaslt_no_split_us"] = per_call_us(lambda: cublaslt.linear_no_split_k(x, w, None))
        fast = (gemm._launch_gemm, gemm_tma._launch_tma)
        slow = CachedLauncher(gemm._gemm_kernel), CachedLauncher(gemm_tma._gemm_tma_kernel)
        for launcher in slow:
            launcher.enabled = False
        plans = getattr(gemm, "_PLANS", {})  # (launch plans keep the launcher's key: none across a swap)
        gemm._launch_gemm, gemm_tma._launch_tma = slow
        plans.clear()
        row["triton_gemm_jit_launch_us"] = per_call_us(lambda: gemm.triton_gemm(x, w.t()))
        gemm._launch_gemm, gemm_tma._launch_tma = fast
        plans.clear()
        row["triton_gemm_cached_launch_us"] = per_call_us(lambda: gemm.triton_gemm(x, w.t()))
        row["rlkernels.linear_us"] = per_call_us(lambda: rlkernels.linear(x, w))
        rows.append(row)
        print("  ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}: {v}" for k, v in row.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": __import__("triton").__version__}, f, indent=1)
    parts = launch_breakdown()
    print("  ".join(f"{k}={v:.1f}" for k, v in parts.items()))
    if args.json:
        with open(args.json) as f:
            doc = json.load(f)
        doc["launch_breakdown_us"] = parts
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    for m, k, n in _shapes(args.profile_shapes):
        x = torch.randn(m, k, device="cuda").bfloat16()
        w = torch.randn(n, k, device="cuda").bfloat16()
        for name, fn in (("rlkernels.linear", lambda: rlkernels.linear(x, w)),
                         ("triton_gemm", lambda: gemm.triton_gemm(x, w.t()))):
            print(f"--- cProfile: {name} M={m} K={k} N={n}")
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(2000):
                fn()
            pr.disable()
            torch.cuda.synchronize()
            pstats.Stats(pr).sort_stats("tottime").print_stats(14)


def host_by_shape(shapes: list[tuple[int, int, int]]) -> dict[str, float]:
    """Host µs per call (short bursts: the GPU never the slower side) of rlkernels.linear and
    F.linear, bf16, per MxKxN."""
    from rlkernels.bench.common import host_median_us

    out = {}
    for m, k, n in shapes:
        x = torch.randn(m, k, device="cuda").bfloat16()
        w = torch.randn(n, k, device="cuda").bfloat16()
        out[f"F.linear {m}x{k}x{n}"] = host_median_us(lambda: torch.nn.functional.linear(x, w))
        out[f"rlkernels.linear {m}x{k}x{n}"] = host_median_us(lambda: rlkernels.linear(x, w))
    return out


def alternating_host_us(variants: dict[str, tuple[Callable[[], Any], Callable[[], Any]]],
                        rounds: int) -> dict[str, Any]:
    """Host µs per call of each variant -- name: (context factory that switches it on, fn) --
    alternating in one process, the order rotated each round (a host's speed moved by 2x
    between processes); the median over rounds per variant and the median per-round
    ratio of each variant to the first."""
    from rlkernels.bench.common import host_median_us

    names = list(variants)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            switch, fn = variants[name]
            with switch():
                times[name].append(host_median_us(fn))
    out: dict[str, Any] = {name: sorted(ts)[len(ts) // 2] for name, ts in times.items()}
    for name in names[1:]:
        ratios = sorted(p / q for p, q in zip(times[name], times[names[0]]))
        out[f"{name}_over_{names[0]}"] = ratios[len(ratios) // 2]
    return out


def plans_ab(shapes: list[tuple[int, int, int]], rounds: int,
             dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """Host µs per call of rlkernels.linear with ops.gemm's launch plans off and on
    (gemm.LAUNCH_PLANS), F.linear beside (fp32: TF32 off, as the grid times it)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    out: dict[str, Any] = {}
    for m, k, n in shapes:
        x = torch.randn(m, k, device="cuda").to(dtype)
        w = torch.randn(n, k, device="cuda").to(dtype)
        out[f"{m}x{k}x{n}"] = alternating_host_us({
            "no_plans": (lambda: mock.patch.object(gemm, "LAUNCH_PLANS", False), lambda: rlkernels.linear(x, w)),
            "plans": (contextlib.nullcontext, lambda: rlkernels.linear(x, w)),
            "F.linear": (contextlib.nullcontext, lambda: torch.nn.functional.linear(x, w)),
        }, rounds)
    return out


def cublaslt_path_ab(shapes: list[tuple[int, int, int]], rounds: int) -> dict[str, Any]:
    """Host µs per call on the cuBLASLt-no-split path: rlkernels.linear with its routing
    worked out on every call (TritonEngine.use_cublaslt) and kept (cublaslt_route); the
    flags set around F.linear through the no_split_k context manager and inline
    (linear_no_split_k); F.linear with the flags set once for the whole measurement
    (cuBLASLt's own host cost); stock F.linear."""
    from rlkernels.ops import matmul as mm

    def through_context_manager(x, w):
        with cublaslt.no_split_k(x.dtype):
            return torch.nn.functional.linear(x, w)

    out: dict[str, Any] = {}
    for m, k, n in shapes:
        x = torch.randn(m, k, device="cuda").bfloat16()
        w = torch.randn(n, k, device="cuda").bfloat16()
        rlkernels.linear(x, w)
        assert mm.TritonEngine().cublaslt_route(x, n, None), f"{m}x{k}x{n} is not on the cuBLASLt path"
        out[f"{m}x{k}x{n}"] = alternating_host_us({
            "no_routes": (lambda: mock.patch.object(mm.TritonEngine, "cublaslt_route", mm.TritonEngine.use_cublaslt),
                          lambda: rlkernels.linear(x, w)),
            "routes": (contextlib.nullcontext, lambda: rlkernels.linear(x, w)),
            "no_split_k_context": (contextlib.nullcontext, lambda: through_context_manager(x, w)),
            "linear_no_split_k": (contextlib.nullcontext, lambda: cublaslt.linear_no_split_k(x, w, None)),
            # cuBLASLt's own host cost: the flags set once around the whole measurement.
            "F.linear_flags_held": (lambda: cublaslt.no_split_k(x.dtype), lambda: torch.nn.functional.linear(x, w)),
            "F.linear": (contextlib.nullcontext, lambda: torch.nn.functional.linear(x, w)),
        }, rounds)
    return out


def _shapes(text: str) -> list[tuple[int, int, int]]:
    return [tuple(int(v) for v in shape.split("x")) for shape in text.split(",") if shape]


def launch_breakdown() -> dict[str, float]:
    """Host µs per call of each step of a cached Triton GEMM launch, on a problem small
    enough (M = 1, K = N = 256) that the GPU never becomes the slower side."""
    from rlkernels.ops._launch import _args_key, launch_hooks_active

    x = torch.randn(1, 256, device="cuda").bfloat16()
    w = torch.randn(256, 256, device="cuda").bfloat16()
    out = torch.empty(1, 256, device="cuda", dtype=torch.bfloat16)
    b = w.t()
    gemm.triton_gemm(x, b, out=out)  # compiles and caches the kernel
    # The launch exactly as triton_gemm makes it, recorded rather than rebuilt here.
    launcher, seen = gemm._launch_gemm, []
    gemm._launch_gemm = lambda grid, args, constexprs, **kw: seen.append((grid, args, constexprs, kw))
    try:
        gemm.triton_gemm(x, b, out=out)
    finally:
        gemm._launch_gemm = launcher
    (grid, args, constexprs, kw), = seen
    kernel = launcher.kernels[launcher.key(args, constexprs, kw["num_warps"], kw["num_stages"])]
    stream = torch._C._cuda_getCurrentRawStream(0)

    def run() -> None:
        kernel.run(grid[0], grid[1], 1, stream, kernel.function, kernel.packed_metadata, None, None, None, *args,
                   *constexprs)

    x128 = torch.randn(128, 256, device="cuda").bfloat16()  # M >= 65: the cuBLASLt-no-split path
    return {
        "F.linear_m128": per_call_us(lambda: torch.nn.functional.linear(x128, w)),
        "rlkernels.linear_m128_cublaslt": per_call_us(lambda: rlkernels.linear(x128, w)),
        "linear_no_split_k_m128": per_call_us(lambda: cublaslt.linear_no_split_k(x128, w, None)),
        "F.linear": per_call_us(lambda: torch.nn.functional.linear(x, w)),
        "rlkernels.linear": per_call_us(lambda: rlkernels.linear(x, w)),
        "triton_gemm": per_call_us(lambda: gemm.triton_gemm(x, b)),
        "triton_gemm_out_given": per_call_us(lambda: gemm.triton_gemm(x, b, out=out)),
        "launcher_call": per_call_us(lambda: launcher(grid, args, constexprs, **kw)),
        "kernel.run": per_call_us(run),
        "torch.empty": per_call_us(lambda: torch.empty((1, 256), dtype=torch.bfloat16, device="cuda")),
        "current_device": per_call_us(torch.cuda.current_device),
        "raw_stream": per_call_us(lambda: torch._C._cuda_getCurrentRawStream(0)),
        "args_key": per_call_us(lambda: _args_key(args)),
        "key": per_call_us(lambda: launcher.key(args, constexprs, kw["num_warps"], kw["num_stages"])),
        "hooks_active": per_call_us(launch_hooks_active),
        "gemm_config": per_call_us(lambda: gemm.gemm_config(1, 256, x.dtype)),
    }


if __name__ == "__main__":
    main()
