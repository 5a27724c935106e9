"""fp32 (IEEE) canonical-chain tiles: tl.dot's FMA lowering, forward and swapped orientation.

    python benchmarks/explore_fp32.py [--json PATH] [--quick] [--families dot,small,swap,swap2] [--ms 1,4]

For each shape (K x N, weight in nn.Linear layout) and M: stock F.linear fp32 (TF32
off), then every candidate's do_bench median, its ratio to stock, and whether its
bits equal the current table config's (the fp32 chain: they must). Families:

* dot:   the forward orientation C = X @ W^T with BLOCK_M >= 16 (session 5's sweep);
* small: the same with BLOCK_M in 1..8 -- Triton >= 3.5 lowers an fp32 dot of any M
         without padding it to 16 rows;
* swap:  C^T = W @ X^T with X^T made contiguous ([K, M], one small copy): the weight
         becomes the row operand (one address per warp, a broadcast) and X^T the column
         operand, read by consecutive lanes at consecutive addresses; in the forward
         orientation each lane reads a k-contiguous weight column 256 bytes from its
         neighbour's (8-way bank conflicts). Timed with the transpose included;
* swap2: more swapped tiles (session 9), e.g. 8 warps on 64 x 64.

Session 5 also swept an explicit FMA-chain kernel (one thread per output column, no
tl.dot); the unpadded small-M dot beat it on every shape (explore_fp32_v2_h100.json)
and it was removed.
"""
from __future__ import annotations

import argparse
import dataclasses
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


SMALL = (
    C(1, 32, 64, 1, 1, 4), C(1, 32, 128, 1, 1, 4), C(1, 32, 64, 1, 1, 6), C(1, 64, 64, 1, 2, 4), C(1, 64, 32, 1, 2, 6),
    C(1, 128, 32, 1, 4, 4), C(2, 32, 64, 1, 1, 4), C(4, 32, 64, 1, 1, 4), C(4, 64, 32, 1, 2, 4), C(4, 32, 32, 1, 1, 6),
    C(8, 32, 64, 1, 2, 4), C(8, 32, 32, 1, 1, 4), C(16, 32, 64, 1, 2, 4),
    C(2, 32, 128, 1, 1, 4), C(2, 64, 64, 1, 2, 4), C(4, 32, 128, 1, 1, 4), C(4, 32, 64, 1, 1, 6), C(2, 32, 64, 1, 1, 6),
)
# Swapped orientation: block_m runs over the weight's rows (N), block_n over the tokens (M).
SWAP = (
    C(32, 16, 64, 1, 1, 4), C(64, 16, 32, 1, 2, 4), C(128, 16, 32, 1, 4, 4), C(32, 32, 32, 1, 2, 4),
    C(64, 32, 32, 1, 2, 4), C(32, 64, 32, 1, 4, 3), C(64, 64, 32, 1, 4, 3), C(128, 64, 16, 8, 4, 3),
    C(64, 128, 16, 8, 4, 3), C(128, 128, 16, 8, 4, 3), C(128, 128, 16, 8, 8, 3), C(128, 128, 32, 8, 8, 3),
    C(256, 128, 16, 8, 8, 3), C(128, 256, 16, 8, 8, 3),
    C(64, 32, 64, 1, 2, 4), C(32, 64, 64, 1, 2, 4), C(64, 64, 16, 1, 4, 4), C(32, 32, 64, 1, 1, 4),
    C(128, 32, 32, 1, 4, 4), C(64, 64, 32, 8, 4, 4),
    C(16, 16, 64, 1, 1, 4), C(16, 16, 128, 1, 1, 4), C(16, 32, 64, 1, 1, 4), C(32, 16, 128, 1, 1, 4),
)
# Session 9: swapped tiles with more warps per program (the 64-128 token points run one
# 4-warp program per SM) and the remaining 2/4/8-warp splits of 32-128 wide tiles.
SWAP2 = (
    C(64, 64, 32, 1, 8, 3), C(64, 64, 32, 1, 8, 4), C(64, 64, 16, 1, 8, 4), C(128, 64, 32, 1, 8, 3),
    C(64, 128, 32, 1, 8, 3), C(64, 32, 32, 1, 4, 4), C(32, 64, 32, 1, 2, 4), C(32, 32, 32, 1, 4, 4),
    C(128, 32, 32, 1, 8, 4), C(32, 128, 32, 1, 4, 3), C(32, 128, 32, 1, 8, 3),
)
SHAPES = ((4096, 4096), (4096, 12288), (4096, 151936))
MS = (1, 4, 16, 64, 128, 1024, 4096)


def plausible_small(cfg: GemmConfig, m: int) -> bool:
    return m <= 16 and max(1, m // 4) <= cfg.block_m <= max(1, m)


def plausible_swap(cfg: GemmConfig, m: int) -> bool:
    # block_n covers the tokens: at most one tile's worth past M, at least 64 rows' worth for M >= 1024.
    return m >= 4 and cfg.block_n <= max(16, 2 * m) and (m < 1024 or cfg.block_n >= 64) and (m > 128 or cfg.block_m <= 128)


def swapped(x: torch.Tensor, w: torch.Tensor, cfg: GemmConfig) -> torch.Tensor:
    """C = X @ W^T computed as C^T = W @ X^T (ops.gemm's swap_ab), X^T made contiguous."""
    return triton_gemm(x, w.t(), config=dataclasses.replace(cfg, swap_ab=True))


def plausible(cfg: GemmConfig, m: int) -> bool:
    if m <= 16:
        return cfg.block_m <= 32
    if m <= 128:
        return cfg.block_m <= 128
    return cfg.block_m >= 64


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--families", default="dot,small,swap")
    p.add_argument("--ms", default=None)
    args = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    rows = []
    for k, n in SHAPES[:1] if args.quick else SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        w = torch.randn(n, k, device="cuda", generator=g) / k ** 0.5
        xs = torch.randn(max(MS), k, device="cuda", generator=g)
        for m in ([int(v) for v in args.ms.split(",")] if args.ms else MS):
            if n > 20000 and m > 64:
                continue
            x = xs[:m]
            table_cfg = gemm_config(m, n, torch.float32)
            ref = triton_gemm(x, w.t(), config=table_cfg)
            stock = median_ms(lambda: F.linear(x, w))
            row = {"K": k, "N": n, "M": m, "stock_ms": stock, "table": table_cfg.short(), "cands": {}}
            fams = args.families.split(",")
            cands = [(table_cfg.short(), lambda: triton_gemm(x, w.t(), config=table_cfg))]
            for cfg in DOT if "dot" in fams else ():
                if plausible(cfg, m):
                    cands.append((cfg.short(), lambda cfg=cfg: triton_gemm(x, w.t(), config=cfg)))
            for cfg in SMALL if "small" in fams else ():
                if plausible_small(cfg, m):
                    cands.append((cfg.short(), lambda cfg=cfg: triton_gemm(x, w.t(), config=cfg)))
            for family, cfgs in (("swap", SWAP), ("swap2", SWAP2)):
                for cfg in cfgs if family in fams else ():
                    if plausible_swap(cfg, m):
                        cands.append((cfg.short() + "/swap", lambda cfg=cfg: swapped(x, w, cfg)))
            for key, fn in dict(cands).items():
                try:
                    same = bool(torch.equal(fn(), ref))
                    t = median_ms(fn)
                    row["cands"][key] = {"ms": t, "ratio": t / stock, "same_bits": same, "tflops": 2 * m * n * k / t / 1e9}
                except Exception as e:  # noqa: BLE001 - out of resources etc.: record and go on
                    row["cands"][key] = {"error": f"{type(e).__name__}: {str(e)[:160]}"}
                    traceback.print_exc(limit=1)
            ok = {c: v["ms"] for c, v in row["cands"].items() if v.get("same_bits")}
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
