"""GEMM forward: rlkernels (auto, Triton-only) vs stock cuBLAS, cuBLASLt-no-split, sgemm-bi.

bf16 over K x N in {4096x4096, 4096x12288, 12288x4096, 4096x151936} and
M in {1, 4, 16, 64, 128, 1024, 4096, 16384}; fp32 (IEEE, TF32 off) on FP32_GRID.
"""
from __future__ import annotations

import argparse
import math

import torch

from .common import (cycling, graph_median_us, host_median_us, interleaved_median_ms, l2_cold_copies, median_ms,
                     optional_import, print_table, write_json)

SHAPES = [(4096, 4096), (4096, 12288), (12288, 4096), (4096, 151936)]
MS = [1, 4, 16, 64, 128, 1024, 4096, 16384]
# fp32: (K, N) and its M values (the lm head up to M = 1024: its fp32 weight alone is 2.5 GB).
FP32_GRID = [((4096, 4096), [1, 4, 8, 16, 64, 128, 1024, 4096]), ((4096, 12288), [1, 4, 8, 16, 64, 128, 1024]),
             ((4096, 151936), [1, 4, 16, 64, 128, 1024])]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ms", default=None, help="comma-separated M values")
    parser.add_argument("--dtypes", default="bf16,fp32", help="which grids to time: bf16, fp32 or both")
    parser.add_argument("--layouts", default="nk",
                        help="B's layout for bf16: nk (an nn.Linear weight [N, K]), kn (a row-major [K, N] matrix, "
                             "rlkernels.matmul(x, b) vs x @ b), or both")


def _geomean(values: list[float]) -> float | None:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def _summary(rows: list[dict], fp32_rows: list[dict]) -> dict:
    """The issue's goals, read off the grid (None where the grid was not run)."""
    graph_rows = [r for r in rows if "graph_ratio_vs_stock" in r]
    return {
        "geomean_ratio_vs_stock": _geomean([r["ratio_vs_stock"] for r in rows]),
        "max_graph_ratio_m_le_16": max((r["graph_ratio_vs_stock"] for r in graph_rows if r["M"] <= 16), default=None),
        "max_graph_cold_ratio_m_le_16": max((r["graph_cold_ratio_vs_stock"] for r in graph_rows if r["M"] <= 16),
                                            default=None),
        "geomean_graph_cold_ratio_m_le_128": _geomean([r["graph_cold_ratio_vs_stock"] for r in graph_rows]),
        "max_ratio_vs_stock": max((r["ratio_vs_stock"] for r in rows), default=None),
        # The A/A pair's largest deviation from 1: the method's resolution over the grid.
        "max_stock_aa_deviation": max((abs(r["stock_aa_ratio"] - 1) for r in rows if "stock_aa_ratio" in r),
                                      default=None),
        "max_ratio_m_le_16": max((r["ratio_vs_stock"] for r in rows if r["M"] <= 16), default=None),
        "min_triton_throughput_vs_stock_m_ge_1024": min((1 / r["triton_ratio_vs_stock"] for r in rows if r["M"] >= 1024),
                                                        default=None),
        "fp32_geomean_ratio_vs_stock": _geomean([r["ratio_vs_stock"] for r in fp32_rows]),
        "fp32_max_ratio_vs_stock": max((r["ratio_vs_stock"] for r in fp32_rows), default=None),
    }


def _kn_rows(ms: list[int]) -> list[dict]:
    """bf16 with B a row-major [K, N] matrix: rlkernels.matmul(x, b) vs stock x @ b."""
    import rlkernels

    rows = []
    for k, n in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        b = (torch.randn(k, n, device="cuda", generator=g) / k ** 0.5).bfloat16()
        b_cold = l2_cold_copies(b) if min(ms) <= 128 else [b]
        xs = torch.randn(max(ms), k, device="cuda", generator=g).bfloat16()
        for m in ms:
            x = xs[:m]
            t = interleaved_median_ms({"stock": lambda: x @ b, "rlkernels": lambda: rlkernels.matmul(x, b),
                                       "stock_again": lambda: x @ b}, rounds=6)
            row = {"dtype": "bf16", "layout": "kn", "K": k, "N": n, "M": m,
                   **{f"{name}_us": v * 1e3 for name, v in t.items()},
                   "ratio_vs_stock": t["rlkernels"] / t["stock"], "stock_aa_ratio": t["stock_again"] / t["stock"]}
            if m <= 128:
                sg = graph_median_us(cycling(lambda bc: x @ bc, b_cold), replays=50)
                rg = graph_median_us(cycling(lambda bc: rlkernels.matmul(x, bc), b_cold), replays=50)
                row.update(stock_graph_cold_us=sg, rlkernels_graph_cold_us=rg, graph_cold_ratio_vs_stock=rg / sg)
            rows.append(row)
            print(f"[K,N] B: K={k} N={n} M={m}: stock {row['stock_us']:.1f}us rlk {row['rlkernels_us']:.1f}us "
                  f"({row['ratio_vs_stock']:.3f}x)", flush=True)
    print_table("GEMM bf16, B a row-major [K, N] matrix (us; ratio = time / stock x @ b)", rows,
                ["K", "N", "M", "stock_us", "rlkernels_us", "ratio_vs_stock", "stock_aa_ratio",
                 "graph_cold_ratio_vs_stock"])
    return rows


def run(args: argparse.Namespace) -> list[dict]:
    import rlkernels
    from rlkernels.gemm.cublaslt import linear_no_split_k as cublaslt_linear
    from rlkernels.gemm.triton import triton_gemm

    torch.backends.cuda.matmul.allow_tf32 = False
    sgemm_bi = optional_import("sgemm_bi")
    ms_arg = [int(m) for m in args.ms.split(",")] if getattr(args, "ms", None) else None
    ms = ms_arg or ([1, 16, 1024, 4096] if args.quick else MS)
    dtypes = getattr(args, "dtypes", "bf16,fp32").split(",")
    rows: list[dict] = []
    nk = "nk" in getattr(args, "layouts", "nk").split(",")
    for k, n in SHAPES if "bf16" in dtypes and nk else ():
        g = torch.Generator(device="cuda").manual_seed(0)
        w = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).bfloat16()
        w_kn = w.t().contiguous() if sgemm_bi is not None else None
        w_cold = l2_cold_copies(w) if min(ms) <= 128 else [w]
        xs = torch.randn(max(ms), k, device="cuda", generator=g).bfloat16()
        for m in ms:
            x = xs[:m]
            flops, nbytes = 2.0 * m * n * k, 2.0 * (m * k + k * n + m * n)
            # Eager timing in alternating rounds (clock drift shared out between variants).
            # Stock twice (an A/A pair): their ratio is the method's own spread at this point,
            # against which a ratio near 1 must be read.
            t = interleaved_median_ms({
                "stock": lambda: torch.nn.functional.linear(x, w),
                "cublaslt_nosplit": lambda: cublaslt_linear(x, w, None),
                "rlkernels": lambda: rlkernels.linear(x, w),
                # The Triton producer alone (what RLKERNELS_GEMM_BACKEND=triton routes every M to).
                "rlkernels_triton": lambda: triton_gemm(x, w, b_transposed=True),
                "stock_again": lambda: torch.nn.functional.linear(x, w),
            }, rounds=8)
            if sgemm_bi is not None:
                try:
                    t["sgemm_bi"] = median_ms(lambda: sgemm_bi.deterministic_linear(x, w_kn, None, tensor_cores=True))
                except Exception as e:  # a peer failing must not stop the run
                    t["sgemm_bi"] = None
                    print(f"sgemm-bi failed at M={m}: {e}")
            if m <= 128:
                # Decode regime: CUDA-graph replay (as rollout engines run decode) separates
                # GPU time from host overhead, which eager timing includes.
                t["stock_graph"] = graph_median_us(lambda: torch.nn.functional.linear(x, w), replays=50) / 1e3
                t["rlkernels_graph"] = graph_median_us(lambda: rlkernels.linear(x, w), replays=50) / 1e3
                # ... and with the weight read from HBM, as in a real decode step (a
                # 32 MB weight called back to back stays in the 50 MB L2).
                t["stock_graph_cold"] = graph_median_us(
                    cycling(lambda wc: torch.nn.functional.linear(x, wc), w_cold), replays=50) / 1e3
                t["rlkernels_graph_cold"] = graph_median_us(cycling(lambda wc: rlkernels.linear(x, wc), w_cold),
                                                            replays=50) / 1e3
                # Host time per call: where it nears the GPU time of a do_bench iteration
                # the eager columns above include it (slow hosts; docs/design/host_time.md).
                t["stock_host"] = host_median_us(lambda: torch.nn.functional.linear(x, w)) / 1e3
                t["rlkernels_host"] = host_median_us(lambda: rlkernels.linear(x, w)) / 1e3
            row = {"dtype": "bf16", "K": k, "N": n, "M": m}
            for name, ms_ in t.items():
                row[f"{name}_us"] = None if ms_ is None else ms_ * 1e3
            row["rlk_tflops"] = flops / (t["rlkernels"] * 1e-3) / 1e12
            row["rlk_gbps"] = nbytes / (t["rlkernels"] * 1e-3) / 1e9
            row["ratio_vs_stock"] = t["rlkernels"] / t["stock"]
            row["triton_ratio_vs_stock"] = t["rlkernels_triton"] / t["stock"]
            row["cublaslt_ratio_vs_stock"] = t["cublaslt_nosplit"] / t["stock"]
            row["stock_aa_ratio"] = t["stock_again"] / t["stock"]
            if "rlkernels_graph" in t:
                row["graph_ratio_vs_stock"] = t["rlkernels_graph"] / t["stock_graph"]
                row["graph_cold_ratio_vs_stock"] = t["rlkernels_graph_cold"] / t["stock_graph_cold"]
            if t.get("sgemm_bi"):
                row["sgemm_bi_ratio_vs_stock"] = t["sgemm_bi"] / t["stock"]
            rows.append(row)
            print(f"K={k} N={n} M={m}: stock {row['stock_us']:.1f}us rlk {row['rlkernels_us']:.1f}us "
                  f"({row['ratio_vs_stock']:.3f}x) triton-only {row['triton_ratio_vs_stock']:.3f}x", flush=True)
    kn_rows = _kn_rows(ms) if "kn" in getattr(args, "layouts", "nk").split(",") and "bf16" in dtypes else []
    fp32_rows = []
    for (k, n), fp32_ms in FP32_GRID if "fp32" in dtypes else ():
        w = torch.randn(n, k, device="cuda") / k ** 0.5
        for m in ([m for m in fp32_ms if m in (1, 1024)] if args.quick else fp32_ms):
            if ms_arg and m not in ms_arg:
                continue
            x = torch.randn(m, k, device="cuda")
            tt = interleaved_median_ms({"stock": lambda: torch.nn.functional.linear(x, w),
                                        "rlkernels": lambda: rlkernels.linear(x, w)})
            ts, tr = tt["stock"], tt["rlkernels"]
            fp32_rows.append({"dtype": "fp32", "K": k, "N": n, "M": m, "stock_us": ts * 1e3, "rlkernels_us": tr * 1e3,
                              "ratio_vs_stock": tr / ts, "rlk_tflops": 2.0 * m * n * k / (tr * 1e-3) / 1e12})
        del w
    summary = _summary(rows, fp32_rows)
    summary["kn_max_ratio_vs_stock"] = max((r["ratio_vs_stock"] for r in kn_rows), default=None)
    summary["kn_max_graph_cold_ratio_m_le_16"] = max(
        (r["graph_cold_ratio_vs_stock"] for r in kn_rows if r["M"] <= 16), default=None)
    print_table("GEMM bf16 (us; ratio = time / stock cuBLAS)", rows,
                ["K", "N", "M", "stock_us", "cublaslt_nosplit_us", "rlkernels_us", "rlkernels_triton_us", "sgemm_bi_us",
                 "ratio_vs_stock", "triton_ratio_vs_stock", "stock_aa_ratio", "graph_ratio_vs_stock",
                 "graph_cold_ratio_vs_stock",
                 "stock_host_us", "rlkernels_host_us", "rlk_tflops", "rlk_gbps"])
    print_table("GEMM fp32 IEEE (TF32 off)", fp32_rows, ["K", "N", "M", "stock_us", "rlkernels_us", "ratio_vs_stock", "rlk_tflops"])
    print(summary)
    write_json(args.json, "gemm", rows + kn_rows + fp32_rows, {"summary": summary})
    return rows + kn_rows + fp32_rows
