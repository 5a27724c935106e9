"""Offline tuning of the checked-in GEMM dispatch table (run on the GPU, never at import).

For each shape and M it times candidate tile configs of the canonical-chain Triton
kernel against stock cuBLAS and cuBLASLt-no-split, and checks every candidate's
bits against cuBLASLt-no-split (a candidate that differs is disqualified). The
winners are copied by hand into ``GEMM_TABLE_*`` in ``src/rlkernels/gemm/table.py``.

    python benchmarks/tune_gemm.py --json $OUT/tune.json [--quick]
    python benchmarks/tune_gemm.py --decode --json $OUT/tune_decode.json   (small M, graph timing)
"""
from __future__ import annotations

import argparse
import json

import torch

from rlkernels.bench.common import cycling, environment, graph_median_us, l2_cold_copies, median_ms
from rlkernels import matmul as rlkernels_matmul
from rlkernels.gemm import cublaslt
from rlkernels.gemm.table import GemmConfig
from rlkernels.gemm.triton import triton_gemm

C = GemmConfig
CANDIDATES_16 = [
    C(16, 32, 256, 1, 4, 5), C(16, 64, 256, 1, 4, 4), C(16, 32, 128, 1, 4, 6), C(16, 64, 128, 1, 4, 5),
    C(16, 128, 128, 1, 4, 4), C(16, 32, 512, 1, 4, 3), C(32, 64, 128, 4, 4, 4), C(32, 32, 256, 4, 4, 4),
    C(64, 64, 128, 8, 4, 4), C(64, 128, 64, 8, 4, 4), C(64, 128, 128, 8, 4, 3), C(64, 256, 64, 8, 8, 3),
    C(128, 128, 64, 8, 4, 4), C(128, 128, 64, 8, 8, 4), C(128, 64, 64, 8, 4, 4),
    C(128, 256, 64, 8, 8, 3), C(256, 128, 64, 8, 8, 3), C(128, 256, 64, 8, 8, 4), C(128, 128, 128, 8, 8, 3),
]
# --decode: more small-M candidates (more programs in flight per SM; no split-K is
# allowed, so parallelism at decode comes only from N / BLOCK_N).
CANDIDATES_DECODE = [
    C(16, 16, 256, 1, 2, 6), C(16, 16, 512, 1, 4, 4), C(16, 16, 256, 1, 4, 6), C(16, 32, 256, 1, 2, 6),
    C(16, 32, 256, 1, 4, 6), C(16, 32, 256, 1, 8, 5), C(16, 64, 256, 1, 8, 4), C(16, 32, 512, 1, 8, 4),
    C(16, 64, 128, 1, 4, 6), C(16, 32, 256, 1, 4, 5), C(16, 64, 256, 1, 4, 4), C(32, 32, 256, 4, 4, 4),
    C(32, 64, 256, 4, 4, 3), C(64, 64, 128, 8, 4, 4), C(64, 128, 128, 8, 4, 3), C(32, 32, 128, 4, 4, 5),
    # M in (32, 64] on 4096-wide outputs: 64-row tiles with narrow N keep >= 128 programs.
    C(64, 32, 256, 1, 4, 4), C(64, 32, 128, 1, 4, 5), C(64, 16, 256, 1, 4, 4), C(64, 32, 256, 1, 8, 4),
    C(64, 16, 512, 1, 4, 3), C(32, 16, 256, 1, 4, 5),
    # Fewer stages, so 3-4 programs share an SM and a 4096-12288-wide output's 128-768
    # programs run in about one wave (the entries above hold one program per SM).
    C(16, 32, 256, 1, 4, 3), C(16, 32, 256, 1, 2, 3), C(16, 32, 128, 1, 4, 4), C(16, 32, 128, 1, 2, 4),
    C(16, 16, 256, 1, 2, 4), C(16, 16, 256, 1, 4, 3), C(16, 64, 128, 1, 4, 3), C(16, 16, 128, 1, 2, 6),
    # With the rows past M masked (M = 1 pays for no re-read rows): longer k-blocks with
    # few programs' worth of buffers.
    C(16, 16, 512, 1, 2, 4), C(16, 32, 512, 1, 4, 3), C(16, 32, 128, 1, 2, 6), C(16, 64, 256, 1, 4, 3),
    # Narrow outputs (N <= 6144: a 2B-class model's projections give 32-192 programs on
    # 32-wide N tiles): 16- and 8-wide N tiles, one or two warps.
    C(16, 16, 256, 1, 1, 6), C(16, 16, 128, 1, 1, 8), C(16, 16, 512, 1, 1, 4), C(16, 8, 256, 1, 1, 6),
    C(16, 8, 512, 1, 1, 4), C(16, 16, 256, 1, 2, 8), C(16, 16, 128, 1, 2, 8),
]
# --tma-decode: the decode tiles with TMA operand loads (bulk copies into shared memory,
# rows past M zero-filled by the copy engine) beside the table's pointer-load tiles.
_DECODE_TILES = [(16, 32, 256, 4, 5), (16, 64, 256, 4, 4), (16, 32, 128, 2, 4), (16, 16, 256, 2, 6),
                 (16, 32, 256, 4, 3), (16, 64, 128, 4, 4), (16, 128, 128, 4, 3)]
CANDIDATES_TMA_DECODE = [C(bm, bn, bk, 1, w, s) for bm, bn, bk, w, s in _DECODE_TILES[:4]] + [
    C(bm, bn, bk, 1, w, s, tma=True) for bm, bn, bk, w, s in _DECODE_TILES]
# --layout kn: B stored [K, N] row-major (N contiguous; what ``rlkernels.matmul(x, b)``
# documents), where the table's decode tiles were picked for a k-contiguous nn.Linear weight.
_KN_TILES = [(16, 32, 256, 4, 5), (16, 32, 256, 4, 6), (16, 64, 128, 4, 4), (16, 64, 128, 4, 6), (16, 64, 64, 4, 6),
             (16, 128, 64, 4, 4), (16, 128, 64, 4, 6), (16, 128, 128, 4, 3), (16, 128, 64, 8, 4),
             (16, 256, 64, 8, 3), (16, 256, 32, 8, 4), (16, 64, 256, 4, 3), (16, 128, 32, 4, 6),
             (32, 128, 64, 4, 4), (64, 64, 128, 4, 4), (64, 128, 64, 4, 4), (64, 128, 128, 4, 3),
             (64, 256, 64, 8, 3), (64, 32, 256, 4, 4)]
CANDIDATES_KN_DECODE = [C(bm, bn, bk, 1, w, s) for bm, bn, bk, w, s in _KN_TILES]
SHAPES = [(4096, 4096), (4096, 12288), (12288, 4096), (4096, 151936),
          # a 2B-class model (Qwen3-1.7B: q/o, k/v, gate/up, down) and an 8B's k/v
          (2048, 2048), (2048, 1024), (2048, 6144), (6144, 2048), (4096, 1024)]
MS = [1, 4, 16, 64, 128, 1024, 4096, 16384]
MS_DECODE = [1, 4, 16, 24, 32, 48, 64, 96]


def plausible(cfg: GemmConfig, m: int) -> bool:
    if m <= 16 and cfg.block_m == 16:
        return True
    if m <= 16:
        return cfg.block_m <= 32
    if m <= 64:
        return cfg.block_m <= 64
    if m <= 256:
        return cfg.block_m <= 128
    return cfg.block_m >= 64


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--decode", action="store_true", help="small-M candidates and M values only")
    p.add_argument("--tma-decode", action="store_true", help="with --decode: TMA-load decode tiles vs the table's")
    p.add_argument("--ms", default=None, help="comma-separated M values (default: the mode's list)")
    p.add_argument("--shapes", default=None, help="comma-separated indices into SHAPES")
    p.add_argument("--layout", choices=("nk", "kn"), default="nk",
                   help="with --decode: B as an nn.Linear weight [N, K] (nk) or as a [K, N] matrix (kn)")
    args = p.parse_args()
    global CANDIDATES_16, MS
    if args.decode:
        CANDIDATES_16, MS = (CANDIDATES_TMA_DECODE if args.tma_decode else CANDIDATES_DECODE), MS_DECODE
        if args.layout == "kn":
            CANDIDATES_16 = CANDIDATES_KN_DECODE
    if args.ms:
        MS = [int(m) for m in args.ms.split(",")]
    torch.backends.cuda.matmul.allow_tf32 = False
    rows = []
    shapes = SHAPES[:2] if args.quick else SHAPES
    if args.shapes:
        shapes = [SHAPES[int(i)] for i in args.shapes.split(",")]
    for k, n in shapes:
        g = torch.Generator(device="cuda").manual_seed(0)
        w = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).bfloat16()
        xs = torch.randn(max(MS), k, device="cuda", generator=g).bfloat16()
        # --decode times GPU work alone (CUDA-graph replay, as rollout engines run
        # decode) with the weight read from HBM (copies cycled past the L2), as in a
        # decode step where every layer's weight is read once.
        w_cold = l2_cold_copies(w) if args.decode else [w]
        kn = args.layout == "kn"
        if kn:
            # The [K, N] matrix itself (not a view of the weight): b_cold holds [K, N] copies.
            b_cold = l2_cold_copies(w.t().contiguous())

        def timed(fn_of_w):
            if args.decode:
                return graph_median_us(cycling(fn_of_w, b_cold if kn else w_cold), replays=50) / 1e3
            return median_ms(lambda: fn_of_w(w))
        for m in MS:
            x = xs[:m]
            ref = cublaslt.cublaslt_linear(x, w, None)
            if kn:
                row = {"K": k, "N": n, "M": m, "layout": "kn",
                       "stock_ms": timed(lambda bc: x @ bc),
                       "cublaslt_ms": float("nan"),
                       "auto_ms": timed(lambda bc: rlkernels_matmul(x, bc)),
                       "auto_eager_ms": median_ms(lambda: rlkernels_matmul(x, b_cold[0])),
                       "stock_eager_ms": median_ms(lambda: x @ b_cold[0]), "triton": {}}
            else:
                row = {"K": k, "N": n, "M": m,
                       "stock_ms": timed(lambda wc: torch.nn.functional.linear(x, wc)),
                       "cublaslt_ms": timed(lambda wc: cublaslt.cublaslt_linear(x, wc, None)), "triton": {}}
            for cfg in CANDIDATES_16:
                if not plausible(cfg, m):
                    continue
                try:
                    out = triton_gemm(x, b_cold[0] if kn else w.t(), config=cfg)
                    same = bool(torch.equal(out, ref))
                    if kn:
                        t = timed(lambda bc: triton_gemm(x, bc, config=cfg))
                    else:
                        t = timed(lambda wc: triton_gemm(x, wc.t(), config=cfg))
                except Exception as e:  # out of shared memory etc.
                    row["triton"][cfg.short()] = {"error": str(e)[:120]}
                    continue
                row["triton"][cfg.short()] = {"ms": t, "same_bits": same}
            ok = {c: v["ms"] for c, v in row["triton"].items() if v.get("same_bits")}
            best = min(ok, key=ok.get) if ok else None
            row["best"], row["best_ms"] = best, ok.get(best)
            rows.append(row)
            if kn:
                print(f"   kn auto path {row['auto_ms']*1e3:.1f}us graph ({row['auto_ms']/row['stock_ms']:.3f}x), eager "
                      f"{row['auto_eager_ms']*1e3:.1f} vs stock {row['stock_eager_ms']*1e3:.1f}us")
            if args.decode:
                top = sorted((v["ms"], c) for c, v in row["triton"].items() if v.get("same_bits"))[:3]
                print("   top:", [(c, round(t * 1e3, 1)) for t, c in top])
            print(f"K={k:6d} N={n:6d} M={m:6d} stock {row['stock_ms']*1e3:9.1f}us lt {row['cublaslt_ms']*1e3:9.1f}us "
                  f"best {best} {row['best_ms']*1e3 if best else float('nan'):9.1f}us "
                  f"ratio {row['best_ms']/row['stock_ms'] if best else float('nan'):.3f} "
                  f"mismatch {[c for c, v in row['triton'].items() if v.get('same_bits') is False]}", flush=True)
    if args.decode:
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"environment": environment(), "bf16": rows}, f, indent=1)
        return
    # fp32 tiles: benchmarks/explore_fp32.py.
    # dW = dY^T @ X over T tokens, fp32 accumulator (the training kernel)
    dw = []
    T = 8192
    for n, k in [(4096, 4096), (12288, 4096), (4096, 12288)]:
        x = torch.randn(T, k, device="cuda").bfloat16()
        dy = torch.randn(T, n, device="cuda").bfloat16()
        acc = torch.zeros(n, k, device="cuda")
        row = {"T": T, "N": n, "K": k, "torch_ms": median_ms(lambda: dy.t() @ x), "triton": {}}
        for cfg in CANDIDATES_16:
            if cfg.block_m < 64:
                continue
            try:
                row["triton"][cfg.short()] = median_ms(lambda: triton_gemm(dy.t(), x, out=acc, accumulate=True, config=cfg))
            except Exception as e:
                row["triton"][cfg.short()] = str(e)[:100]
        best = min((c for c in row["triton"] if isinstance(row["triton"][c], float)), key=lambda c: row["triton"][c])
        row["best"], row["best_ms"] = best, row["triton"][best]
        dw.append(row)
        print(f"dW N={n} K={k}: torch {row['torch_ms']*1e3:.1f}us best {best} {row['best_ms']*1e3:.1f}us "
              f"ratio {row['best_ms']/row['torch_ms']:.3f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": environment(), "bf16": rows, "dw": dw}, f, indent=1)


if __name__ == "__main__":
    main()
