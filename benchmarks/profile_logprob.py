"""Where the milliseconds of ``linear_logprob`` go, and which fused tile config is fastest.

    python benchmarks/profile_logprob.py [--shape N,D,V] [--dtype bfloat16] [--temperature T]
        [--json PATH] [--device cuda] [--quick] [--trace | --gemms-only]

Default shape: N=8192 tokens, D=4096, V=151936 (Qwen vocabulary), bf16, no bias.

1. Forward (fused partial + combine kernels) for the checked-in config and candidate
   FusedConfigs: ms, TFLOP/s (2*N*D*V) and max |dlogp|, |dent| against the default
   (a config changes the in-tile reduction order, so bits may differ; only the size matters).
2. Backward, piece by piece for ONE full V chunk of ``backward_chunk`` columns, scaled
   by V / chunk (work-proportional; the tail chunk's overhead shows up in "other"):
   grad_logits (per fused config), the dH accumulate GEMM and the dW GEMM (table pick
   and alternative GemmConfigs), cuBLAS ``torch.mm`` of the same three shapes as the
   speed of light, and the whole backward through ``torch.autograd.grad``.
   (Wc = W[0:cv], g = dL/dlogits of the chunk [N, cv]; dH accumulates in fp32.)
3. A summary: stage, ms at the default configs, cuBLAS ms of the same GEMM shapes and
   the ratio, and the fastest candidate per stage. Everything goes to ``--json``.
   ``--quick``: the default plus the first candidate of each sweep.

CPU smoke test (Triton interpreter; tiny shape, wall-clock timer, numbers meaningless):

    TRITON_INTERPRET=1 python benchmarks/profile_logprob.py --device cpu --dtype float32 \
        --shape 16,64,512 --quick
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from typing import Any, Callable

import torch

from rlkernels.bench.common import median_ms, print_table, write_json
from rlkernels.ops.gemm import GemmConfig, gemm_config, triton_gemm
from rlkernels.ops.linear_logprob import (FUSED_16BIT, FusedConfig, LinearLogprobFunction, TritonKernels,
                                          backward_chunk, fused_config)
from rlkernels.ops.matmul import engine_for

# Candidates around the checked-in 16-bit config (FUSED_16BIT: 128x256x64/split2048/g16/
# w8/s3, TMA operand loads, persistent g kernel), one knob at a time; the last one is the
# pointer-load version of the default. Pipeline smem = stages * (BM + BV) * BK * 2 bytes
# for 16-bit inputs; all stay under the H100's 227 KB per block (128x256x64 s4 = 192 KB,
# 128x128x128 s3 = 192 KB, 128x256x128 s2 = 192 KB). With --quick only the first one.
_R = dataclasses.replace
FUSED_CANDIDATES: tuple[FusedConfig, ...] = (
    _R(FUSED_16BIT, num_stages=4),
    _R(FUSED_16BIT, split_v=4096),
    _R(FUSED_16BIT, split_v=8192),
    _R(FUSED_16BIT, group_m=8),
    _R(FUSED_16BIT, group_m=32),
    _R(FUSED_16BIT, block_m=256, block_v=128),
    _R(FUSED_16BIT, block_m=256, block_v=128, num_stages=4),
    _R(FUSED_16BIT, block_v=128, num_stages=4),
    _R(FUSED_16BIT, block_v=128, block_k=128),
    _R(FUSED_16BIT, block_k=128, num_stages=2),
    _R(FUSED_16BIT, tma=False, persistent=False),
)
# Alternatives to the table's pick for the two backward GEMMs (dH: the chained fp32
# output; dW: dY^T @ H, bf16 out). Offline sm_90 builds (Triton 3.6) of the table's
# fp32-output tile show 255 registers and 712 bytes of stack (the C tile loaded through
# pointers arrives in a blocked layout and is converted to the MMA layout), yet on H100
# it beat every spill-free alternative tried in session 7 (128x128 tiles, C by TMA, L2
# prefetch of the next tile's C: 0.48-0.80 ms per 4096-column chunk vs 0.466;
# docs/perf_notes.md).
_G = GemmConfig
GEMM_CANDIDATES: tuple[GemmConfig, ...] = (
    _G(128, 256, 64, group_m=8, num_warps=8, num_stages=3, tma=True, persistent=True, warp_specialize=True),
    _G(128, 256, 64, group_m=8, num_warps=8, num_stages=4, tma=True, persistent=True),
    _G(128, 128, 64, group_m=8, num_warps=8, num_stages=4, tma=True, persistent=True),
    _G(128, 128, 64, group_m=8, num_warps=4, num_stages=4, tma=True, persistent=True),
    _G(256, 128, 64, group_m=8, num_warps=8, num_stages=3, tma=True, persistent=True),
)

Timer = Callable[[Callable[[], Any]], float]
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def cpu_median_ms(fn: Callable[[], Any], reps: int = 3) -> float:
    """Wall-clock median for the CPU smoke test (median_ms needs CUDA events)."""
    fn()  # warm-up: the interpreter's first call is slower
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def tflops(flops: float, ms: float | None) -> float | None:
    return flops / (ms * 1e9) if ms else None


def smem_kb(bm: int, bn: int, bk: int, stages: int, elem: int) -> float:
    """Pipeline shared memory estimate (operand tiles only; Triton may add scratch)."""
    return stages * (bm + bn) * bk * elem / 1024


def timed(timer: Timer, fn: Callable[[], Any]) -> tuple[float | None, str | None]:
    """(ms, None) or (None, error): one config that fails to compile (OutOfResources,
    register spills past limits) must not end the run."""
    try:
        return timer(fn), None
    except Exception as exc:  # noqa: BLE001 - recorded in the row
        first = (str(exc).strip().splitlines() or [""])[0]
        return None, f"{type(exc).__name__}: {first[:100]}"


def unique(items: list[Any], key: Callable[[Any], Any] = lambda x: x) -> list[Any]:
    seen: dict[Any, Any] = {}
    for it in items:
        seen.setdefault(key(it), it)
    return list(seen.values())


def profile_forward(timer: Timer, x: dict[str, Any], configs: list[FusedConfig]) -> list[dict[str, Any]]:
    h2, w, tgt, T = x["h2"], x["w"], x["tgt"], x["T"]
    ref_logp, ref_ent, _ = TritonKernels(configs[0]).forward(h2, w, None, tgt, T)
    rows = []
    for cfg in configs:
        k = TritonKernels(cfg)
        row: dict[str, Any] = {"section": "forward", "config": cfg.short(),
                               "smem_kb": smem_kb(cfg.block_m, cfg.block_v, cfg.block_k, cfg.num_stages,
                                                  h2.element_size())}
        ms, err = timed(timer, lambda: k.forward(h2, w, None, tgt, T))
        if err is None:
            logp, ent, _ = k.forward(h2, w, None, tgt, T)
            row.update(ms=ms, tflops=tflops(x["flops"], ms),
                       max_dlogp=float((logp - ref_logp).abs().max()), max_dent=float((ent - ref_ent).abs().max()))
        else:
            row["error"] = err
        rows.append(row)
    return rows


def profile_grad_logits(timer: Timer, x: dict[str, Any], configs: list[FusedConfig]) -> list[dict[str, Any]]:
    """One full chunk [0, cv) of the backward's first kernel, per config. split_v is a
    forward-only knob, so configs differing only in it are timed once."""
    h2, w, tgt, T, cv, g = x["h2"], x["w"], x["tgt"], x["T"], x["cv"], x["g"]
    rows = []
    for cfg in unique(configs, key=lambda c: dataclasses.replace(c, split_v=0)):
        k = TritonKernels(cfg)
        ms, err = timed(timer, lambda: k.grad_logits(h2, w, None, tgt, x["lse"], x["ent"], x["gl"], x["ge"],
                                                     T, 0, cv, g))
        rows.append(part_row("grad_logits", cfg.short(), ms, err, x))
    return rows


def part_row(part: str, config: str, ms: float | None, err: str | None, x: dict[str, Any]) -> dict[str, Any]:
    """A per-chunk timing and its estimate for the whole backward (x V / cv chunks)."""
    row: dict[str, Any] = {"section": "backward", "part": part, "config": config}
    if err is not None:
        row["error"] = err
        return row
    row.update(chunk_ms=ms, n_chunks=x["n_chunks"], est_total_ms=ms * x["n_chunks"],
               tflops=tflops(x["chunk_flops"], ms))
    return row


def profile_gemms(timer: Timer, x: dict[str, Any], alts: list[GemmConfig]) -> list[dict[str, Any]]:
    """The backward's two GEMMs for one chunk, exactly as it calls them, with the
    table's pick (config=None) and each alternative; then cuBLAS on the same shapes."""
    h2, w, cv, g, dt = x["h2"], x["w"], x["cv"], x["g"], x["h2"].dtype
    N, D = h2.shape
    wc = w[:cv]
    dh = torch.zeros(N, D, dtype=torch.float32, device=h2.device)  # the fp32 dH accumulator
    dw = torch.empty(cv, D, dtype=dt, device=h2.device)
    cases: list[tuple[str, Callable[[GemmConfig | None], Any], GemmConfig]] = [
        ("dH g@Wc (+=fp32)", lambda c: triton_gemm(g, wc, out=dh, accumulate=True, config=c),
         gemm_config(N, D, dt, token_reduction=True)),
        ("dW g^T@H", lambda c: triton_gemm(g.t(), h2, out=dw, config=c), gemm_config(cv, D, dt, token_reduction=True)),
    ]
    # Bits: each config's output from the same starting accumulator, against the table's.
    dh_start = torch.randn(N, D, generator=torch.Generator(device=h2.device).manual_seed(1), device=h2.device)

    def result(part: str, cfg: GemmConfig | None) -> torch.Tensor:
        if part.startswith("dH"):
            out = dh_start.clone()
            triton_gemm(g, wc, out=out, accumulate=True, config=cfg)
            return out
        return triton_gemm(g.t(), h2, config=cfg)

    rows = []
    for part, call, table_cfg in cases:
        ms, err = timed(timer, lambda: call(None))
        rows.append(part_row(part, f"table:{table_cfg.short()}", ms, err, x))
        ref = result(part, None)
        for cfg in alts:
            if cfg != table_cfg:
                ms, err = timed(timer, lambda: call(cfg))
                row = part_row(part, cfg.short(), ms, err, x)
                if err is None:
                    row["same_bits"] = bool(torch.equal(result(part, cfg), ref))
                rows.append(row)
        del ref
    # Speed of light: stock cuBLAS, bf16 out (no fp32 accumulate for dH, no epilogue).
    refs = [("cublas logits H@Wc^T", lambda: torch.mm(h2, wc.t())),
            ("cublas dH g@Wc", lambda: torch.mm(g, wc)),
            ("cublas dW g^T@H", lambda: torch.mm(g.t(), h2))]
    for part, fn in refs:
        ms, err = timed(timer, fn)
        rows.append(part_row(part, "torch.mm", ms, err, x))
    return rows


def profile_whole_backward(timer: Timer, x: dict[str, Any], cfg: FusedConfig) -> dict[str, Any]:
    """The real backward (grad_logits + both GEMMs per chunk + setup/teardown); the
    graph is kept so every timed call runs the backward only."""
    h = x["h2"].detach().requires_grad_()
    w = x["w"].detach().requires_grad_()
    engine = engine_for(h.device, "triton")  # the GPU default; forced so the CPU smoke runs Triton too
    lp, ent = LinearLogprobFunction.apply(h, w, None, x["tgt"], x["T"], TritonKernels(cfg), engine)
    ms, err = timed(timer, lambda: torch.autograd.grad((lp, ent), (h, w), (x["gl"], x["ge"]), retain_graph=True))
    row: dict[str, Any] = {"section": "backward", "part": "whole (autograd)", "config": cfg.short()}
    if err is None:
        row.update(est_total_ms=ms, tflops=tflops(3 * x["flops"], ms))  # recompute + dH + dW
    else:
        row["error"] = err
    return row


def trace_fwd_bwd(x: dict[str, Any], iters: int = 2) -> list[dict[str, Any]]:
    """Per-kernel GPU time of whole forward+backward calls, as the benchmark runs them
    (``rlkernels.linear_logprob`` then ``autograd.grad`` with per-token upstream grads):
    the stages in their real sequence, plus what no isolated timing sees (setup kernels,
    idle gaps). Rows: kernel name (Triton kernels by function name), calls and ms per
    call of the op; the last rows compare the kernels' sum with the event-timed wall time."""
    from torch.profiler import ProfilerActivity, profile

    from rlkernels import linear_logprob

    h = x["h2"].detach().requires_grad_()
    w = x["w"].detach().requires_grad_()

    def fwd_bwd():
        lp, ent = linear_logprob(h, w, x["tgt"], temperature=x["T"], return_entropy=True)
        return torch.autograd.grad((lp, ent), (h, w), (x["gl"], x["ge"]))

    wall = median_ms(fwd_bwd)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fwd_bwd()
        torch.cuda.synchronize()
    per_kernel: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            name = ev.name.split("(")[0][:60]
            per_kernel.setdefault(name, []).append(ev.device_time / 1e3)  # us -> ms
    rows = [{"section": "trace", "kernel": k, "calls": len(v) / iters, "ms": sum(v) / iters}
            for k, v in per_kernel.items()]
    rows.sort(key=lambda r: -r["ms"])
    busy = sum(r["ms"] for r in rows)
    rows.append({"section": "trace", "kernel": "(sum of kernels)", "ms": busy})
    rows.append({"section": "trace", "kernel": "(wall, do_bench median)", "ms": wall})
    rows.append({"section": "trace", "kernel": "(idle = wall - sum)", "ms": wall - busy})
    return rows


def best(rows: list[dict[str, Any]], key: str) -> dict[str, Any] | None:
    ok = [r for r in rows if r.get(key) is not None]
    return min(ok, key=lambda r: r[key]) if ok else None


def summarize(fwd: list[dict[str, Any]], parts: list[dict[str, Any]], whole: dict[str, Any]) -> list[dict[str, Any]]:
    """Stage -> ms (default configs), with the best alternative and cuBLAS alongside."""
    def part(name: str, default_only: bool = True) -> list[dict[str, Any]]:
        rows = [r for r in parts if r["part"] == name]
        return rows[:1] if default_only else rows  # the first row of each part is the default

    def ms(rows: list[dict[str, Any]]) -> float | None:
        return rows[0].get("est_total_ms") if rows else None

    ref = {k: ms(part(f"cublas {k}")) for k in ("logits H@Wc^T", "dH g@Wc", "dW g^T@H")}
    stages = [("fwd", fwd[0].get("ms"), fwd[0]["config"], best(fwd, "ms"), "ms", ref["logits H@Wc^T"])]
    for label, name, sol in (("bwd grad_logits", "grad_logits", ref["logits H@Wc^T"]),
                             ("bwd dH GEMM", "dH g@Wc (+=fp32)", ref["dH g@Wc"]),
                             ("bwd dW GEMM", "dW g^T@H", ref["dW g^T@H"])):
        d = part(name)
        stages.append((label, ms(d), d[0]["config"] if d else "-", best(part(name, False), "est_total_ms"),
                       "est_total_ms", sol))
    out = [{"stage": label, "ms": t, "config": cfg, "cublas_ms": sol,
            "best_ms": b[key] if b else None, "best_config": b["config"] if b else None}
           for label, t, cfg, b, key, sol in stages]
    bwd_parts = [r["ms"] for r in out[1:]]
    parts_sum = sum(bwd_parts) if all(v is not None for v in bwd_parts) else None
    whole_ms = whole.get("est_total_ms")
    sol_sum = sum(v for v in ref.values() if v is not None)
    out.append({"stage": "bwd sum of parts", "ms": parts_sum, "cublas_ms": sol_sum})
    out.append({"stage": "bwd whole (measured)", "ms": whole_ms, "config": whole["config"], "cublas_ms": sol_sum})
    out.append({"stage": "bwd other (whole - parts)",
                "ms": whole_ms - parts_sum if whole_ms is not None and parts_sum is not None else None})
    fwd_ms = out[0]["ms"]
    total = fwd_ms + whole_ms if fwd_ms is not None and whole_ms is not None else None
    out.append({"stage": "fwd + bwd", "ms": total, "cublas_ms": sol_sum + (ref["logits H@Wc^T"] or 0.0)})
    for r in out:  # how far from the cuBLAS GEMMs of the same shapes (1.0 = as fast)
        if r.get("ms") is not None and r.get("cublas_ms"):
            r["x_cublas"] = r["ms"] / r["cublas_ms"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="8192,4096,151936", help="N,D,V")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--device", default="cuda")
    p.add_argument("--json", default=None)
    p.add_argument("--quick", action="store_true", help="the default plus one candidate per tile sweep")
    p.add_argument("--trace", action="store_true",
                   help="only the per-kernel trace of whole forward+backward calls (CUDA)")
    p.add_argument("--gemms-only", action="store_true", help="only the backward GEMM tile sweep")
    args = p.parse_args()
    N, D, V = (int(s) for s in args.shape.split(","))
    dt, dev = DTYPES[args.dtype], torch.device(args.device)
    timer: Timer = median_ms if dev.type == "cuda" else cpu_median_ms
    limit = 1 if args.quick else None

    # Drawn on the device: the 151936 x 4096 weight would take seconds on the host.
    gen = torch.Generator(device=dev).manual_seed(0)
    x: dict[str, Any] = {
        "h2": torch.randn(N, D, generator=gen, device=dev, dtype=dt),
        # Scaled by 1/sqrt(D) so logits are O(1), like a trained lm head.
        "w": torch.randn(V, D, generator=gen, device=dev, dtype=dt).mul_(D ** -0.5),
        "tgt": torch.randint(0, V, (N,), generator=gen, device=dev),
        "gl": torch.randn(N, generator=gen, device=dev),  # upstream grads (fp32, as the backward sees them)
        "ge": torch.randn(N, generator=gen, device=dev),
        "T": args.temperature, "flops": 2.0 * N * D * V,
    }
    default = fused_config(dt)
    # The backward's chunk width (the caller clamps it to V) and the work-proportional count.
    x["cv"] = cv = min(backward_chunk(N, V, x["h2"].element_size()), V)
    x["n_chunks"], x["chunk_flops"] = V / cv, 2.0 * N * D * cv
    _, x["ent"], x["lse"] = TritonKernels(default).forward(x["h2"], x["w"], None, x["tgt"], x["T"])
    x["g"] = torch.empty(N, cv, dtype=dt, device=dev)
    TritonKernels(default).grad_logits(x["h2"], x["w"], None, x["tgt"], x["lse"], x["ent"], x["gl"], x["ge"],
                                       x["T"], 0, cv, x["g"])  # real g values for the GEMM timings
    print(f"N={N} D={D} V={V} {args.dtype} T={args.temperature} on {dev}: default {default.short()}, "
          f"backward chunk {cv} cols ({V / cv:.2f} chunks)")

    meta = {"shape": {"N": N, "D": D, "V": V}, "dtype": args.dtype, "temperature": args.temperature,
            "default_fused_config": default.short(), "backward_chunk": cv}
    if args.trace:
        rows = trace_fwd_bwd(x)
        print_table("forward+backward trace: ms per call", rows, ["kernel", "calls", "ms"])
        write_json(args.json, "profile_logprob_trace", rows, meta)
        return
    if args.gemms_only:
        rows = profile_gemms(timer, x, list(GEMM_CANDIDATES[:limit]))
        print_table(f"backward GEMMs: one {cv}-col chunk, est = chunk x {V / cv:.2f}", rows,
                    ["part", "config", "chunk_ms", "est_total_ms", "tflops", "same_bits", "error"])
        write_json(args.json, "profile_logprob_gemms", rows, meta)
        return

    configs = unique([default, *FUSED_CANDIDATES])[: 1 + limit if limit else None]
    fwd = profile_forward(timer, x, configs)
    print_table("forward: fused partial + combine", fwd,
                ["config", "smem_kb", "ms", "tflops", "max_dlogp", "max_dent", "error"])

    gl_rows = profile_grad_logits(timer, x, configs)
    gemm_rows = profile_gemms(timer, x, list(GEMM_CANDIDATES[:limit]))
    whole = profile_whole_backward(timer, x, default)
    parts = gl_rows + gemm_rows
    print_table(f"backward pieces: one {cv}-col chunk, est = chunk x {V / cv:.2f}", parts + [whole],
                ["part", "config", "chunk_ms", "est_total_ms", "tflops", "error"])

    summary = summarize(fwd, parts, whole)
    print_table("summary (default configs; best = fastest candidate)", summary,
                ["stage", "config", "ms", "cublas_ms", "x_cublas", "best_ms", "best_config"])
    write_json(args.json, "profile_logprob", fwd + parts + [whole], {**meta, "summary": summary})


if __name__ == "__main__":
    main()
