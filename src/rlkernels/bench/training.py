"""Linear layer forward+backward: rlkernels vs torch autograd (cuBLAS), M = 8192 tokens, bf16.

Also times the dX and dW kernels alone (TFLOP/s) and, if installed, sgemm-bi.
"""
from __future__ import annotations

import argparse

import torch

from .common import median_ms, optional_import, print_table, write_json

SHAPES = [(4096, 4096), (4096, 12288), (12288, 4096)]  # (K, N)
TOKENS = 8192


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=int, default=TOKENS)


def run(args: argparse.Namespace) -> list[dict]:
    import rlkernels
    from rlkernels.ops.matmul import gemm_backend_for

    torch.backends.cuda.matmul.allow_tf32 = False
    sgemm_bi = optional_import("sgemm_bi")
    T = getattr(args, "tokens", TOKENS)
    gemm_backend = gemm_backend_for(torch.device("cuda"))
    rows = []
    for k, n in SHAPES[:1] if args.quick else SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(T, k, device="cuda", generator=g).bfloat16().requires_grad_()
        dy = torch.randn(T, n, device="cuda", generator=g).bfloat16()
        w = torch.nn.Parameter((torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).bfloat16())
        w_mg = torch.nn.Parameter(w.detach().clone())
        w_mg.main_grad = torch.zeros(n, k, device="cuda")

        def step(fn, param):
            def run_once():
                x.grad = None
                param.grad = None
                fn(x, param).backward(dy)
            return run_once

        t = {
            "torch_fwd": median_ms(lambda: torch.nn.functional.linear(x, w)),
            "rlk_fwd": median_ms(lambda: rlkernels.linear(x, w)),
            "torch_fwdbwd": median_ms(step(torch.nn.functional.linear, w)),
            "rlk_fwdbwd": median_ms(step(rlkernels.linear, w)),
            "rlk_fwdbwd_main_grad": median_ms(step(rlkernels.linear, w_mg)),
            "torch_dx": median_ms(lambda: dy @ w),
            "rlk_dx": median_ms(lambda: gemm_backend.gemm(dy, w)),
            "torch_dw": median_ms(lambda: dy.t() @ x.detach()),
            "rlk_dw": median_ms(lambda: gemm_backend.gemm(dy.t(), x.detach(), out=w_mg.main_grad, accumulate=True)),
        }
        if sgemm_bi is not None:
            w_kn = w.detach().t().contiguous().requires_grad_()
            try:
                t["sgemm_bi_fwdbwd"] = median_ms(step(lambda xx, ww: sgemm_bi.deterministic_linear(xx, ww, None, tensor_cores=True), w_kn))
            except Exception as e:
                print(f"sgemm-bi failed: {e}")
        flop = 2.0 * T * n * k
        row = {"T": T, "K": k, "N": n, **{f"{a}_ms": b for a, b in t.items()}}
        row["fwdbwd_ratio"] = t["rlk_fwdbwd"] / t["torch_fwdbwd"]
        row["fwdbwd_main_grad_ratio"] = t["rlk_fwdbwd_main_grad"] / t["torch_fwdbwd"]
        row["dx_tflops"] = flop / (t["rlk_dx"] * 1e-3) / 1e12
        row["dw_tflops"] = flop / (t["rlk_dw"] * 1e-3) / 1e12
        row["torch_dx_tflops"] = flop / (t["torch_dx"] * 1e-3) / 1e12
        row["torch_dw_tflops"] = flop / (t["torch_dw"] * 1e-3) / 1e12
        if "sgemm_bi_fwdbwd" in t:
            row["sgemm_bi_ratio"] = t["sgemm_bi_fwdbwd"] / t["torch_fwdbwd"]
        rows.append(row)
    print_table(f"Linear forward+backward, {T} tokens, bf16 (ms; ratio = rlkernels / torch autograd)", rows,
                ["K", "N", "torch_fwdbwd_ms", "rlk_fwdbwd_ms", "fwdbwd_ratio", "fwdbwd_main_grad_ratio",
                 "torch_dx_tflops", "dx_tflops", "torch_dw_tflops", "dw_tflops", "sgemm_bi_fwdbwd_ms"])
    write_json(args.json, "training", rows)
    return rows
