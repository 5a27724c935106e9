"""Do TMA tile loads (and persistent / warp-specialized schedules) speed up the chain?

    python benchmarks/explore_tma.py [--json PATH] [--sections gemm,logprob,decode] [--quick]

For each candidate: time (do_bench median, or CUDA-graph replay with the weight cycled
past the L2 for decode sizes), TFLOP/s, ratio to stock cuBLAS in the same run, and
whether its bits equal the pointer kernel's (the canonical K-chain: they must).

Sections:
  gemm     F.linear shapes (K x N) 4096x4096, 4096x12288, 12288x4096, 4096x151936 at
           M = 1024, 4096, 16384; plus linear_logprob's two backward GEMMs (dH: fp32
           chained accumulate; dW: A read transposed) at 8192 x 4096 x 4096.
  logprob  the fused forward and grad_logits kernels, pointer vs TMA operand loads.
  decode   M = 1, 4, 16 with one-tile-per-program TMA configs.
  lpbwd    linear_logprob's backward pieces: grad_logits (pointer / TMA / persistent)
           and the dH (fp32 chained) and dW GEMMs with TMA tiles.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import traceback
from typing import Any, Callable

import torch
import torch.nn.functional as F

from rlkernels.bench.common import environment, graph_median_us, l2_cold_copies, median_ms
from rlkernels.ops.cublaslt import linear_no_split_k
from rlkernels.ops.gemm import GemmConfig, gemm_config, triton_gemm
from rlkernels.ops.gemm_tma import tma_gemm
from rlkernels.ops.linear_logprob import FUSED_16BIT, TritonKernels, backward_chunk


def T(*args, **kw) -> GemmConfig:
    return GemmConfig(*args, tma=True, **kw)


LARGE_M_TMA = (
    T(128, 256, 64, group_m=8, num_warps=8, num_stages=3),
    T(128, 256, 64, group_m=8, num_warps=8, num_stages=3, persistent=True),
    T(128, 256, 64, group_m=8, num_warps=8, num_stages=3, persistent=True, warp_specialize=True),
    T(128, 128, 64, group_m=8, num_warps=8, num_stages=4, persistent=True, warp_specialize=True),
    T(128, 128, 64, group_m=8, num_warps=4, num_stages=4),
    T(128, 128, 64, group_m=8, num_warps=4, num_stages=4, persistent=True),
    T(256, 128, 64, group_m=8, num_warps=8, num_stages=3),
    T(128, 256, 64, group_m=16, num_warps=8, num_stages=3, persistent=True, warp_specialize=True),
)
DECODE_TMA = (
    T(16, 64, 256, group_m=1, num_warps=4, num_stages=4),
    T(16, 32, 256, group_m=1, num_warps=4, num_stages=5),
    T(16, 64, 128, group_m=1, num_warps=4, num_stages=6),
    T(16, 32, 512, group_m=1, num_warps=4, num_stages=3),
)
POINTER_LARGE_M = GemmConfig(256, 128, 64, group_m=8, num_warps=8, num_stages=3)  # the table's before TMA
SHAPES = ((4096, 4096), (4096, 12288), (12288, 4096), (4096, 151936))


def attempt(fn: Callable[[], Any]) -> tuple[Any, str | None]:
    try:
        return fn(), None
    except Exception as exc:  # noqa: BLE001 - one failing candidate must not end the run
        first = (str(exc).strip().splitlines() or [""])[0]
        return None, f"{type(exc).__name__}: {first[:160]}"


def record(rows: list[dict[str, Any]], row: dict[str, Any], path: str | None) -> None:
    rows.append(row)
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    if path:
        with open(path, "w") as f:
            json.dump({"environment": environment(), "rows": rows}, f, indent=1)


def section_gemm(rows, path, quick):
    dev = torch.device("cuda")
    for K, N in SHAPES:
        w = torch.randn(N, K, device=dev, dtype=torch.bfloat16) / K ** 0.5
        for M in (1024, 4096, 16384):
            if quick and M != 4096:
                continue
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            flops = 2.0 * M * N * K
            base = {"section": "gemm", "K": K, "N": N, "M": M}
            ref = triton_gemm(x, w.t(), config=POINTER_LARGE_M)
            stock = median_ms(lambda: F.linear(x, w))
            record(rows, {**base, "impl": "stock", "ms": stock, "tflops": flops / stock / 1e9}, path)
            lt, err = attempt(lambda: median_ms(lambda: linear_no_split_k(x, w, None)))
            same = bool(torch.equal(linear_no_split_k(x, w, None), ref)) if err is None else None
            record(rows, {**base, "impl": "cublaslt", "ms": lt, "ratio": lt and lt / stock, "same_bits": same,
                          "error": err}, path)
            ms = median_ms(lambda: triton_gemm(x, w.t(), config=POINTER_LARGE_M))
            record(rows, {**base, "impl": "ptr:" + POINTER_LARGE_M.short(), "ms": ms,
                          "ratio": ms / stock, "tflops": flops / ms / 1e9, "same_bits": True}, path)
            out = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
            for cfg in LARGE_M_TMA[:2] if quick else LARGE_M_TMA:
                out.fill_(float("nan"))
                _, err = attempt(lambda: tma_gemm(x, w.t(), cfg, out=out))
                row = {**base, "impl": cfg.short(), "error": err}
                if err is None:
                    row["same_bits"] = bool(torch.equal(out, ref))
                    ms = median_ms(lambda: tma_gemm(x, w.t(), cfg, out=out))
                    row.update(ms=ms, ratio=ms / stock, tflops=flops / ms / 1e9)
                record(rows, row, path)
            del x, out, ref
        del w
        torch.cuda.empty_cache()
    # linear_logprob's backward GEMMs, one 4096-column V chunk at N = 8192 tokens.
    Nt, D, cv = 8192, 4096, 4096
    g = torch.randn(Nt, cv, device=dev, dtype=torch.bfloat16) * 1e-3
    wc = torch.randn(cv, D, device=dev, dtype=torch.bfloat16) / 64
    h = torch.randn(Nt, D, device=dev, dtype=torch.bfloat16)
    acc0 = torch.randn(Nt, D, device=dev, dtype=torch.float32)
    flops = 2.0 * Nt * D * cv
    cases = {
        "dH g@Wc (+=fp32)": (g, wc, True, lambda: torch.mm(g, wc)),
        "dW g^T@H": (g.t(), h, False, lambda: torch.mm(g.t(), h)),
    }
    for name, (a, b, acc, cublas) in cases.items():
        base = {"section": "logprob_bwd_gemm", "part": name}
        stock = median_ms(cublas)
        record(rows, {**base, "impl": "stock torch.mm (bf16 out)", "ms": stock, "tflops": flops / stock / 1e9}, path)
        out_ref = acc0.clone() if acc else torch.empty(a.shape[0], b.shape[1], device=dev, dtype=torch.bfloat16)
        triton_gemm(a, b, out=out_ref, accumulate=acc)
        out = out_ref.clone()
        ms = median_ms(lambda: triton_gemm(a, b, out=out, accumulate=acc))
        cfg0 = gemm_config(a.shape[0], b.shape[1], a.dtype, token_reduction=True)
        record(rows, {**base, "impl": "ptr:" + cfg0.short(), "ms": ms, "ratio": ms / stock,
                      "tflops": flops / ms / 1e9}, path)
        for cfg in LARGE_M_TMA[:2] if quick else LARGE_M_TMA:
            out = acc0.clone() if acc else torch.empty_like(out_ref)
            _, err = attempt(lambda: tma_gemm(a, b, cfg, out=out, accumulate=acc))
            row = {**base, "impl": cfg.short(), "error": err}
            if err is None:
                row["same_bits"] = bool(torch.equal(out, out_ref))
                ms = median_ms(lambda: tma_gemm(a, b, cfg, out=out, accumulate=acc))
                row.update(ms=ms, ratio=ms / stock, tflops=flops / ms / 1e9)
            record(rows, row, path)
    del g, wc, h, acc0
    torch.cuda.empty_cache()


def logprob_data():
    """(N, D, V, hidden, weight, targets with every 7th ignored, g_logp, g_ent, backward chunk)."""
    dev = torch.device("cuda")
    N, D, V = 8192, 4096, 151936
    torch.manual_seed(0)
    h = torch.randn(N, D, device=dev, dtype=torch.bfloat16)
    w = torch.randn(V, D, device=dev, dtype=torch.bfloat16) / D ** 0.5
    t = torch.randint(0, V, (N,), device=dev)
    t[::7] = -1
    gl, ge = torch.randn(N, device=dev), torch.randn(N, device=dev)
    return N, D, V, h, w, t, gl, ge, backward_chunk(N, V, 2)


def section_logprob(rows, path, quick):
    N, D, V, h, w, t, gl, ge, cv = logprob_data()
    dev = h.device
    g_ref = torch.empty(N, cv, device=dev, dtype=torch.bfloat16)
    stock = median_ms(lambda: torch.mm(h, w.t()))
    record(rows, {"section": "logprob", "part": "cublas logits h@W^T", "ms": stock}, path)
    cfgs = [FUSED_16BIT, dataclasses.replace(FUSED_16BIT, tma=True)]
    if not quick:
        cfgs += [dataclasses.replace(FUSED_16BIT, tma=True, num_stages=4),
                 dataclasses.replace(FUSED_16BIT, tma=True, block_m=256, block_v=128),
                 dataclasses.replace(FUSED_16BIT, tma=True, block_v=128, num_stages=4)]
    ref = None
    for cfg in cfgs:
        k = TritonKernels(cfg)
        out, err = attempt(lambda: k.forward(h, w, None, t, 1.0))
        row: dict[str, Any] = {"section": "logprob", "part": "forward", "impl": cfg.short(), "error": err}
        if err is None:
            ref = ref or out
            row["same_bits"] = all(bool(torch.equal(a, b)) for a, b in zip(out, ref))
            ms = median_ms(lambda: k.forward(h, w, None, t, 1.0))
            row.update(ms=ms, ratio=ms / stock, tflops=2.0 * N * D * V / ms / 1e9)
        record(rows, row, path)
    lse, ent = ref[2], ref[1]
    TritonKernels(FUSED_16BIT).grad_logits(h, w, None, t, lse, ent, gl, ge, 1.0, 0, cv, g_ref)
    for cfg in cfgs:
        k = TritonKernels(cfg)
        g = torch.empty_like(g_ref)
        _, err = attempt(lambda: k.grad_logits(h, w, None, t, lse, ent, gl, ge, 1.0, 0, cv, g))
        row = {"section": "logprob", "part": f"grad_logits chunk x{math.ceil(V / cv)}", "impl": cfg.short(),
               "error": err}
        if err is None:
            row["same_bits"] = bool(torch.equal(g, g_ref))
            ms = median_ms(lambda: k.grad_logits(h, w, None, t, lse, ent, gl, ge, 1.0, 0, cv, g))
            row.update(ms=ms, est_total_ms=ms * V / cv)
        record(rows, row, path)


def section_decode(rows, path, quick):
    dev = torch.device("cuda")
    for K, N in SHAPES:
        w0 = torch.randn(N, K, device=dev, dtype=torch.bfloat16) / K ** 0.5
        ws = l2_cold_copies(w0)
        for M in (1, 4, 16):
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            base = {"section": "decode", "K": K, "N": N, "M": M}
            ref = triton_gemm(x, w0.t())
            import itertools
            def cyc(fn):
                it = itertools.cycle(ws)
                return lambda: fn(next(it))
            stock = graph_median_us(cyc(lambda w: F.linear(x, w)), replays=len(ws) * 4)
            record(rows, {**base, "impl": "stock", "us": stock}, path)
            us = graph_median_us(cyc(lambda w: triton_gemm(x, w.t())), replays=len(ws) * 4)
            record(rows, {**base, "impl": "ptr:" + gemm_config(M, N, x.dtype).short(), "us": us,
                          "ratio": us / stock}, path)
            out = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
            for cfg in DECODE_TMA[:1] if quick else DECODE_TMA:
                _, err = attempt(lambda: tma_gemm(x, w0.t(), cfg, out=out))
                row = {**base, "impl": cfg.short(), "error": err}
                if err is None:
                    row["same_bits"] = bool(torch.equal(out, ref))
                    us, err = attempt(lambda: graph_median_us(cyc(lambda w: tma_gemm(x, w.t(), cfg, out=out)),
                                                              replays=len(ws) * 4))
                    row.update(us=us, ratio=us and us / stock, error=err)
                record(rows, row, path)
        del ws, w0
        torch.cuda.empty_cache()


BWD_GEMM = (
    T(128, 256, 64, group_m=8, num_warps=8, num_stages=3, persistent=True),
    T(128, 256, 64, group_m=8, num_warps=8, num_stages=3, persistent=True, warp_specialize=True),
    T(128, 256, 64, group_m=8, num_warps=8, num_stages=3),
    T(256, 128, 64, group_m=8, num_warps=8, num_stages=3, persistent=True),
    GemmConfig(128, 256, 64, group_m=8, num_warps=8, num_stages=3),
)


def section_lpbwd(rows, path, quick):
    N, D, V, h, w, t, gl, ge, cv = logprob_data()
    dev = h.device
    logp, ent, lse = TritonKernels(FUSED_16BIT).forward(h, w, None, t, 1.0)
    ptr = dataclasses.replace(FUSED_16BIT, tma=False)
    g_ref = torch.empty(N, cv, device=dev, dtype=torch.bfloat16)
    TritonKernels(ptr).grad_logits(h, w, None, t, lse, ent, gl, ge, 1.0, 0, cv, g_ref)
    for cfg in (ptr, FUSED_16BIT, dataclasses.replace(FUSED_16BIT, persistent=True),
                dataclasses.replace(FUSED_16BIT, persistent=True, num_stages=4),
                dataclasses.replace(FUSED_16BIT, persistent=True, group_m=8)):
        k = TritonKernels(cfg)
        g = torch.empty_like(g_ref)
        _, err = attempt(lambda: k.grad_logits(h, w, None, t, lse, ent, gl, ge, 1.0, 0, cv, g))
        row = {"section": "lpbwd", "part": "grad_logits", "impl": cfg.short(), "error": err}
        if err is None:
            row["same_bits"] = bool(torch.equal(g, g_ref))
            ms = median_ms(lambda: k.grad_logits(h, w, None, t, lse, ent, gl, ge, 1.0, 0, cv, g))
            row.update(ms=ms, est_total_ms=ms * V / cv)
        record(rows, row, path)
    wc = w[:cv]
    acc0 = torch.randn(N, D, device=dev, dtype=torch.float32)
    flops = 2.0 * N * D * cv
    for name, a, b, acc in (("dH", g_ref, wc, True), ("dW", g_ref.t(), h, False)):
        ref = acc0.clone() if acc else torch.empty(cv, D, device=dev, dtype=torch.bfloat16)
        triton_gemm(a, b, out=ref, accumulate=acc, config=BWD_GEMM[-1])
        stock = median_ms(lambda: torch.mm(a, b))
        record(rows, {"section": "lpbwd", "part": name, "impl": "torch.mm bf16", "ms": stock}, path)
        for cfg in BWD_GEMM:
            out = acc0.clone() if acc else torch.empty_like(ref)
            _, err = attempt(lambda: triton_gemm(a, b, out=out, accumulate=acc, config=cfg))
            row = {"section": "lpbwd", "part": name, "impl": cfg.short(), "error": err}
            if err is None:
                row["same_bits"] = bool(torch.equal(out, ref))
                ms = median_ms(lambda: triton_gemm(a, b, out=out, accumulate=acc, config=cfg))
                row.update(ms=ms, ratio=ms / stock, tflops=flops / ms / 1e9, est_total_ms=ms * V / cv)
            record(rows, row, path)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    p.add_argument("--sections", default="gemm,logprob,decode")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    rows: list[dict[str, Any]] = []
    sections = {"gemm": section_gemm, "logprob": section_logprob, "decode": section_decode,
                "lpbwd": section_lpbwd}
    for name in args.sections.split(","):
        try:
            sections[name](rows, args.json, args.quick)
        except Exception:  # noqa: BLE001
            traceback.print_exc()


if __name__ == "__main__":
    main()
