"""Experiment: where the lm head's per-row cost at decode comes from.

    python benchmarks/explore_lm_head_row_cost.py [--json PATH]

On the lm head (K = 4096, N = 151936) the table's decode tile takes ~0.6 us more per
row of M: 409.8 us at M = 1, 419 at M = 16, on every tile tried (16-, 32-, 64-wide N
tiles, the weight-as-rows wgmma tiles), while stock cuBLAS adds ~0.3 us per row.
Two things grow with M: the activation rows every program reads from L2
(16 rows x 8 KB per k-block and program), and the output rows every program stores
(16 separate 64-byte pieces, one per row, 300 KB apart).

A copy of the decode kernel's loop with two diagnostic limits -- rows of A actually
loaded (the rest are zeros) and rows of C actually stored -- separates the two; the
timings of a diagnostic variant are not results (its output is wrong by design).
Candidate remedies beside it, each checked for the table kernel's bits: the output
stored by TMA (one bulk copy per tile), stored with the streaming cache modifier,
and written transposed ([N, M], one contiguous kilobyte per program) then transposed
back. ``--evict-tiles`` and ``--persistent`` run ``explore_decode.py``'s register-loaded
(evict-first) and persistent decode kernels on this shape (sessions 11-12 measured them
there first).
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch
import triton
import triton.language as tl

from rlkernels.bench.common import compare_variants, print_table, write_json
from rlkernels.ops import gemm

sys.path.insert(0, os.path.dirname(__file__))
from explore_decode import decode_persistent, decode_register  # noqa: E402
from explore_lm_head_tiles import parse_tile  # noqa: E402

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except Exception:  # pragma: no cover
    TensorDescriptor = None


@triton.jit
def _tile_acc(a_ptr, w_ptr, pid_n, load_m, N, K,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The decode tile's K-chain for output columns pid_n * BLOCK_N + [0, BLOCK_N), rows past
    ``load_m`` read as zeros."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rn = (offs_n % N).to(tl.int64)
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * K + offs_k[None, :]
    w_ptrs = w_ptr + rn[None, :] * K + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        a = tl.load(a_ptrs, mask=offs_m[:, None] < load_m, other=0.0)
        b = tl.load(w_ptrs)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return acc


@triton.jit
def _row_cost_kernel(a_ptr, w_ptr, c_ptr, M, N, K, stride_cm, stride_cn, load_m, store_m,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     STREAM_STORE: tl.constexpr, STORE_EVICT: tl.constexpr = ""):
    pid_n = tl.program_id(0)
    acc = _tile_acc(a_ptr, w_ptr, pid_n, load_m, N, K, BLOCK_M, BLOCK_N, BLOCK_K)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :].to(tl.int64) * stride_cn
    c_mask = (offs_m[:, None] < store_m) & (offs_n[None, :] < N)
    if STREAM_STORE:
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask, cache_modifier=".cs")
    else:
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask, eviction_policy=STORE_EVICT)


@triton.jit
def _tma_store_kernel(a_ptr, w_ptr, c_desc, M, N, K,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    acc = _tile_acc(a_ptr, w_ptr, pid_n, M, N, K, BLOCK_M, BLOCK_N, BLOCK_K)
    # Rows past M and columns past N fall outside the descriptor's bounds: not written.
    c_desc.store([0, pid_n * BLOCK_N], acc.to(c_desc.dtype))


TILE = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=256)
LAUNCH = dict(num_warps=4, num_stages=6)
HINTED_PTX: dict[str, bool] = {}


def row_cost(x: torch.Tensor, w: torch.Tensor, load_m: int, store_m: int, *, stream_store: bool = False,
             transposed: bool = False, store_evict: str = "", copy_back: bool = True) -> torch.Tensor:
    m, k = x.shape
    n = w.shape[0]
    if transposed:
        out_t = x.new_empty(n, m)
        c, scm, scn = out_t, 1, m
    else:
        c = x.new_empty(m, n)
        scm, scn = c.stride()
    grid = (triton.cdiv(n, TILE["BLOCK_N"]),)
    compiled = _row_cost_kernel[grid](x, w, c, m, n, k, scm, scn, load_m, store_m, **TILE, STREAM_STORE=stream_store,
                                      STORE_EVICT=store_evict, **LAUNCH)
    if compiled is not None and store_evict:
        HINTED_PTX[f"store {store_evict}"] = "L2::cache_hint" in compiled.asm["ptx"]
    if transposed:
        return out_t.t().contiguous() if copy_back else out_t.t()
    return c


def tma_store(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    m, k = x.shape
    n = w.shape[0]
    c = x.new_empty(m, n)
    desc = TensorDescriptor.from_tensor(c, [TILE["BLOCK_M"], TILE["BLOCK_N"]])
    grid = (triton.cdiv(n, TILE["BLOCK_N"]),)
    _tma_store_kernel[grid](x, w, desc, m, n, k, **TILE, **LAUNCH)
    return c


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--shape", default="4096x151936")
    parser.add_argument("--evict-tiles", default="16x32x256/w4/s1,16x64x256/w4/s1,16x32x128/w2/s1,16x64x128/w4/s1",
                        help="tiles for explore_decode's register-loaded weight, evict-first or not (empty: skip)")
    parser.add_argument("--store-evict", default="evict_last,evict_first",
                        help="eviction policies to try on the output store (empty: skip)")
    parser.add_argument("--persistent", default="16x32x256/w4/s6@1,16x32x256/w4/s4@2,16x64x256/w4/s4@1,16x32x128/w4/s8@1",
                        help="explore_decode's persistent kernel, tile@programs per SM (empty: skip)")
    parser.add_argument("--diagnostics", type=int, default=1, help="0: skip the load/store diagnostics")
    args = parser.parse_args(argv)
    k, n = (int(v) for v in args.shape.split("x"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(n, k, device="cuda", generator=gen) / k ** 0.5).bfloat16()
    sms = torch.cuda.get_device_properties(w.device).multi_processor_count
    rows: list[dict[str, Any]] = []
    for m in (1, 16):
        x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
        want = gemm.triton_gemm(x, w, b_transposed=True)
        variants: dict[str, Any] = {
            "stock": lambda: torch.nn.functional.linear(x, w),
            "table": lambda: gemm.triton_gemm(x, w, b_transposed=True),
            "copy": lambda: row_cost(x, w, m, m),
        }
        for tile in filter(None, args.evict_tiles.split(",")):
            cfg = parse_tile(tile)
            for evict in (True, False):
                for prefetch in (False, True):
                    name = f"{tile} {'evict_first' if evict else 'no hint'}{' prefetch' if prefetch else ''}"
                    variants[name] = (lambda cfg=cfg, evict=evict, prefetch=prefetch:
                                      decode_register(x, w, cfg.block_n, cfg.block_k, cfg.num_warps, evict, prefetch))
        for spec in filter(None, args.persistent.split(",")):
            tile, per_sm = spec.rsplit("@", 1)
            cfg = parse_tile(tile)
            variants[f"persistent {spec}"] = (lambda cfg=cfg, progs=int(per_sm) * sms: decode_persistent(
                x, w, cfg.block_n, cfg.block_k, progs, cfg.num_stages, cfg.num_warps))
        for evict in filter(None, args.store_evict.split(",")):
            variants[f"store {evict}"] = lambda evict=evict: row_cost(x, w, m, m, store_evict=evict)
        if m > 1 and args.diagnostics:
            variants.update({
                "diag: load 1 row": lambda: row_cost(x, w, 1, m),
                "diag: store 1 row": lambda: row_cost(x, w, m, 1),
                "diag: load 1, store 1": lambda: row_cost(x, w, 1, 1),
                "stream store (.cs)": lambda: row_cost(x, w, m, m, stream_store=True),
                "transposed out + copy": lambda: row_cost(x, w, m, m, transposed=True),
                "transposed out (kernel only)": lambda: row_cost(x, w, m, m, transposed=True, copy_back=False),
            })
            if TensorDescriptor is not None:
                variants["tma store"] = lambda: tma_store(x, w)
        for row in compare_variants(variants, want, replays=20):
            rows.append({"M": m, **row})
            print(rows[-1], flush=True)
    print_table(f"lm head K={k} N={n}: per-row cost", rows,
                ["M", "variant", "eager_us", "eager_ratio", "graph_us", "graph_ratio", "same_bits"])
    print("L2::cache_hint in the PTX:", HINTED_PTX)
    write_json(args.json, "explore_lm_head_row_cost", rows, {"hinted_ptx": HINTED_PTX})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
