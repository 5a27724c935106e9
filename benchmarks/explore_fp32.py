"""fp32 (IEEE) canonical-chain tiles: the tl.dot FMA lowering vs the explicit FMA-chain kernel.

    python benchmarks/explore_fp32.py [--json PATH] [--quick]

For each shape (K x N, weight in nn.Linear layout) and M: stock F.linear fp32 (TF32
off), then every candidate's do_bench median, its ratio to stock, and whether its
bits equal the current table config's (the fp32 chain: they must). The explicit
FMA-chain candidates (ops.gemm_fma) run at M <= 64; at M = 1 they are also timed
with a row-major B ([K, N], the matmul layout: one coalesced row per k).
"""
from __future__ import annotations

import argparse
import json
import traceback

import torch
import torch.nn.functional as F

from rlkernels.bench.common import environment, median_ms
from rlkernels.ops.gemm import GemmConfig, gemm_config, triton_gemm

C = GemmConfig
DOT = (
    C(16, 16, 32, 1, 1, 3), C(16, 32, 32, 1, 1, 3), C(16, 32, 64, 1, 2, 3), C(16, 64, 32, 1, 4, 3),
    C(16, 64, 16, 1, 2, 4), C(32, 32, 32, 4, 2, 3), C(32, 64, 32, 4, 4, 3), C(64, 64, 16, 8, 4, 4),
    C(64, 64, 32, 8, 4, 3), C(64, 128, 16, 8, 4, 3), C(128, 64, 16, 8, 4, 3), C(128, 128, 16, 8, 8, 3),
    C(128, 128, 32, 8, 8, 3), C(128, 128, 8, 8, 8, 4), C(128, 256, 16, 8, 8, 3), C(256, 128, 16, 8, 8, 3),
    C(64, 128, 32, 8, 8, 3), C(128, 64, 32, 8, 4, 3), C(64, 256, 16, 8, 8, 3), C(128, 128, 16, 8, 4, 3),
)


def F_(bm, bn, bk, w, stages=1) -> GemmConfig:
    return GemmConfig(bm, bn, bk, 1, w, stages, fma_vec=4)


FMA = (
    F_(1, 32, 16, 1), F_(1, 32, 32, 1), F_(1, 32, 64, 1), F_(1, 64, 32, 2), F_(1, 128, 16, 4), F_(1, 128, 32, 4),
    F_(1, 256, 16, 8), F_(2, 32, 32, 1), F_(4, 32, 16, 1), F_(4, 64, 16, 2), F_(4, 128, 8, 4), F_(8, 32, 8, 1),
    F_(8, 64, 8, 2), F_(16, 32, 4, 1), F_(16, 64, 4, 2), F_(16, 128, 4, 4), F_(1, 32, 32, 1, 3),
)
SHAPES = ((4096, 4096), (4096, 12288), (4096, 151936))
MS = (1, 4, 16, 64, 128, 1024, 4096)


def plausible(cfg: GemmConfig, m: int) -> bool:
    if cfg.fma_vec:
        return m <= 64 and cfg.block_m <= max(1, m) * 2 and (m <= 16 or cfg.block_m >= 8)
    if m <= 16:
        return cfg.block_m <= 32
    if m <= 128:
        return cfg.block_m <= 128
    return cfg.block_m >= 64


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    rows = []
    for k, n in SHAPES[:1] if args.quick else SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        w = torch.randn(n, k, device="cuda", generator=g) / k ** 0.5
        w_rowmajor = w.t().contiguous()  # [K, N]
        xs = torch.randn(max(MS), k, device="cuda", generator=g)
        for m in MS:
            if n > 20000 and m > 64:
                continue
            x = xs[:m]
            table_cfg = gemm_config(m, n, torch.float32)
            ref = triton_gemm(x, w.t(), config=table_cfg)
            stock = median_ms(lambda: F.linear(x, w))
            row = {"K": k, "N": n, "M": m, "stock_ms": stock, "table": table_cfg.short(), "cands": {}}
            for cfg in DOT + FMA:
                if not plausible(cfg, m):
                    continue
                layouts = [("linear", w.t())] + ([("rowmajor", w_rowmajor)] if cfg.fma_vec and m == 1 else [])
                for name, b in layouts:
                    key = cfg.short() + ("" if name == "linear" else "/rowmajorB")
                    try:
                        out = triton_gemm(x, b, config=cfg)
                        same = bool(torch.equal(out, ref))
                        t = median_ms(lambda: triton_gemm(x, b, config=cfg))
                        row["cands"][key] = {"ms": t, "ratio": t / stock, "same_bits": same,
                                             "tflops": 2 * m * n * k / t / 1e9}
                    except Exception as e:  # noqa: BLE001 - out of resources etc.: record and go on
                        row["cands"][key] = {"error": f"{type(e).__name__}: {str(e)[:160]}"}
                        traceback.print_exc(limit=1)
            ok = {c: v["ms"] for c, v in row["cands"].items() if v.get("same_bits") and "rowmajor" not in c}
            best = min(ok, key=ok.get) if ok else None
            row["best"], row["best_ms"] = best, ok.get(best)
            bad = [c for c, v in row["cands"].items() if v.get("same_bits") is False]
            tbl = row["cands"].get(table_cfg.short(), {}).get("ms")
            print(f"K={k} N={n} M={m:5d} stock {stock*1e3:9.1f}us table {table_cfg.short()} "
                  f"{(tbl or float('nan'))*1e3:9.1f}us best {best} {(row['best_ms'] or float('nan'))*1e3:9.1f}us "
                  f"ratio {(row['best_ms'] or float('nan'))/stock:.3f} mismatch {bad}", flush=True)
            top = sorted((v["ms"], c) for c, v in row["cands"].items() if "ms" in v)[:4]
            print("   top:", [(c, round(t * 1e3, 1)) for t, c in top], flush=True)
            rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": environment(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
