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
back.
"""
from __future__ import annotations

import argparse
from typing import Any

import torch
import triton
import triton.language as tl

from rlkernels.bench.common import graph_median_us, interleaved_median_ms, print_table, write_json
from rlkernels.ops import gemm

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except Exception:  # pragma: no cover
    TensorDescriptor = None


@triton.jit
def _row_cost_kernel(a_ptr, w_ptr, c_ptr, M, N, K, stride_cm, stride_cn, load_m, store_m,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     STREAM_STORE: tl.constexpr, STORE_EVICT: tl.constexpr = ""):
    pid_n = tl.program_id(0)
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
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rn = (offs_n % N).to(tl.int64)
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * K + offs_k[None, :]
    w_ptrs = w_ptr + rn[None, :] * K + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        a = tl.load(a_ptrs, mask=offs_m[:, None] < M, other=0.0)
        b = tl.load(w_ptrs)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    # Rows past M and columns past N fall outside the descriptor's bounds: not written.
    c_desc.store([0, pid_n * BLOCK_N], acc.to(c_desc.dtype))


@triton.jit
def _evict_first_kernel(a_ptr, w_ptr, c_ptr, M, N, K,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        EVICT: tl.constexpr, PREFETCH: tl.constexpr):
    # The weight read by plain loads (no cp.async: num_stages=1), which keep Triton's
    # L2 evict-first hint; PREFETCH holds the next k-block's weight tile in registers.
    pid_n = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rn = (offs_n % N).to(tl.int64)
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * K + offs_k[None, :]
    w_ptrs = w_ptr + rn[None, :] * K + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    n_k = tl.cdiv(K, BLOCK_K)
    if PREFETCH:
        b_next = tl.load(w_ptrs, eviction_policy=EVICT)
        for k in range(0, n_k):
            b = b_next
            w_ptrs += BLOCK_K
            if k + 1 < n_k:
                b_next = tl.load(w_ptrs, eviction_policy=EVICT)
            a = tl.load(a_ptrs, mask=offs_m[:, None] < M, other=0.0)
            acc = tl.dot(a, b, acc)
            a_ptrs += BLOCK_K
    else:
        for k in range(0, n_k):
            a = tl.load(a_ptrs, mask=offs_m[:, None] < M, other=0.0)
            b = tl.load(w_ptrs, eviction_policy=EVICT)
            acc = tl.dot(a, b, acc)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
    c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :].to(tl.int64)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def _persistent_kernel(a_ptr, w_ptr, c_ptr, M, N, K, NUM_PROGRAMS,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # Each program walks output tiles pid, pid + NUM_PROGRAMS, ...: a tile's store is
    # followed by the next tile's loads instead of the program's exit.
    num_tiles = tl.cdiv(N, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    for tile in range(tl.program_id(0), num_tiles, NUM_PROGRAMS):
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        rn = (offs_n % N).to(tl.int64)
        a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * K + offs_k[None, :]
        w_ptrs = w_ptr + rn[None, :] * K + offs_k[:, None]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            a = tl.load(a_ptrs, mask=offs_m[:, None] < M, other=0.0)
            b = tl.load(w_ptrs)
            acc = tl.dot(a, b, acc)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :].to(tl.int64)
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def persistent(x: torch.Tensor, w: torch.Tensor, tile: str, programs_per_sm: int) -> torch.Tensor:
    """x @ w^T by ``programs_per_sm`` x SMs persistent programs; ``tile`` as 16x32x256/w4/s6."""
    dims, warps, stages = tile.split("/")
    bm, bn, bk = (int(v) for v in dims.split("x"))
    m, k = x.shape
    n = w.shape[0]
    c = x.new_empty(m, n)
    programs = programs_per_sm * torch.cuda.get_device_properties(x.device).multi_processor_count
    _persistent_kernel[(programs,)](x, w, c, m, n, k, programs, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                                    num_warps=int(warps[1:]), num_stages=int(stages[1:]))
    return c


HINTED_PTX: dict[str, bool] = {}


def evict_first(x: torch.Tensor, w: torch.Tensor, tile: str, evict: str = "evict_first",
                prefetch: bool = False) -> torch.Tensor:
    """x @ w^T with plain (hinted) weight loads; ``tile`` as 16x32x256/w4 (one stage)."""
    dims, warps = tile.split("/")
    bm, bn, bk = (int(v) for v in dims.split("x"))
    m, k = x.shape
    n = w.shape[0]
    c = x.new_empty(m, n)
    compiled = _evict_first_kernel[(triton.cdiv(n, bn),)](x, w, c, m, n, k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                                                          EVICT=evict, PREFETCH=prefetch,
                                                          num_warps=int(warps[1:]), num_stages=1)
    if compiled is not None:
        HINTED_PTX[f"{tile} {evict} prefetch={prefetch}"] = "L2::cache_hint" in compiled.asm["ptx"]
    return c


TILE = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=256)
LAUNCH = dict(num_warps=4, num_stages=6)


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
    parser.add_argument("--evict-tiles", default="16x32x256/w4,16x64x256/w4,16x32x128/w2,16x64x128/w4",
                        help="one-stage tiles for the evict-first weight loads (empty: skip)")
    parser.add_argument("--store-evict", default="evict_last,evict_first",
                        help="eviction policies to try on the output store (empty: skip)")
    parser.add_argument("--persistent", default="16x32x256/w4/s6@1,16x32x256/w4/s4@2,16x64x256/w4/s4@1,16x32x128/w4/s8@1",
                        help="persistent variants, tile@programs per SM (empty: skip)")
    parser.add_argument("--diagnostics", type=int, default=1, help="0: skip the load/store diagnostics")
    args = parser.parse_args(argv)
    k, n = (int(v) for v in args.shape.split("x"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(n, k, device="cuda", generator=gen) / k ** 0.5).bfloat16()
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
            for evict in ("evict_first", ""):
                for prefetch in (False, True):
                    name = f"{tile}/s1 {evict or 'no hint'}{' prefetch' if prefetch else ''}"
                    variants[name] = (lambda tile=tile, evict=evict, prefetch=prefetch:
                                      evict_first(x, w, tile, evict, prefetch))
        for spec in filter(None, args.persistent.split(",")):
            tile, per_sm = spec.rsplit("@", 1)
            variants[f"persistent {spec}"] = lambda tile=tile, per_sm=int(per_sm): persistent(x, w, tile, per_sm)
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
        same = {}
        for name, fn in variants.items():
            try:
                same[name] = torch.equal(fn(), want) if name != "stock" else None
            except Exception as e:
                print(name, "failed:", type(e).__name__, e, flush=True)
                same[name] = "failed"
        fns = {name: fn for name, fn in variants.items() if same[name] != "failed"}
        eager = interleaved_median_ms(fns, rounds=5, warmup_ms=20, rep_ms=60)
        graph = {name: graph_median_us(fn, replays=20, trials=7) for name, fn in fns.items()}
        for name in fns:
            row = {"M": m, "variant": name, "eager_us": eager[name] * 1e3, "eager_ratio": eager[name] / eager["stock"],
                   "graph_us": graph[name], "graph_ratio": graph[name] / graph["stock"], "same_bits": same[name]}
            rows.append(row)
            print(row, flush=True)
    print_table(f"lm head K={k} N={n}: per-row cost", rows,
                ["M", "variant", "eager_us", "eager_ratio", "graph_us", "graph_ratio", "same_bits"])
    print("L2::cache_hint in the PTX:", HINTED_PTX)
    write_json(args.json, "explore_lm_head_row_cost", rows, {"hinted_ptx": HINTED_PTX})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
