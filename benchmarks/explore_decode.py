"""Experiment: a persistent, flattened decode GEMM against the weight-streaming floor.

    python benchmarks/explore_decode.py [--json PATH]

The table's decode tile on a 100 MB weight is 192 programs of 512 KB on 132 SMs, one
resident per SM, so the second wave runs on fewer than half the SMs. Here a fixed grid
of programs each owns every NUM_PROGS-th N tile and walks (tile, k-block) in one
software-pipelined loop, so loads keep flowing across its tiles and every SM streams
nearly the same number of columns. Each output element is still one ascending fp32
K-chain started from zero (``acc = tl.dot(x, w, acc)``, reset to exact zeros after a
tile's last k-block): the bits are checked against ``rlkernels.linear`` for every
variant. Timing as the GEMM benchmark's cold columns: CUDA-graph replay with the weight
cycled through copies that do not fit in L2, stock F.linear and rlkernels in the same
process, and the read floor of benchmarks/floors.py.

Other decode experiments here: ``--short-m`` (rows past M wrapped vs masked), ``--m1-only``
(Triton's M == 1 specialization) and ``--register`` (the weight loaded through registers,
where an evict-first hint survives; Triton 3.6 drops it from cp.async loads, which is
why the evict-first engine flag of commit 809ea4c changed nothing and was removed,
benchmarks/results/explore_decode_stream_h100_session12.json).
"""
from __future__ import annotations

import argparse
import contextlib
import sys
from typing import Any

import torch
import triton
import triton.language as tl

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from floors import read_floor_us  # noqa: E402

from rlkernels.bench.common import cycling, graph_median_us, l2_cold_copies, print_table, write_json  # noqa: E402
from rlkernels.bench.gemm import SHAPES  # noqa: E402


@triton.jit
def _decode_persistent_kernel(x_ptr, w_ptr, c_ptr, M, N, K, stride_xm, stride_wn, stride_cm,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                              NUM_PROGS: tl.constexpr, STAGES: tl.constexpr):
    pid = tl.program_id(0)
    num_tiles = tl.cdiv(N, BLOCK_N)
    k_tiles = K // BLOCK_K  # the launcher asks K % BLOCK_K == 0
    my_tiles = (num_tiles - pid + NUM_PROGS - 1) // NUM_PROGS
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    rm = (offs_m % M).to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for it in tl.range(0, my_tiles * k_tiles, num_stages=STAGES):
        t = it // k_tiles
        kb = it - t * k_tiles
        offs_n = (pid + t * NUM_PROGS) * BLOCK_N + tl.arange(0, BLOCK_N)
        rn = (offs_n % N).to(tl.int64)
        ks = kb * BLOCK_K + offs_k
        x = tl.load(x_ptr + rm[:, None] * stride_xm + ks[None, :])
        w = tl.load(w_ptr + rn[None, :] * stride_wn + ks[:, None])
        acc = tl.dot(x, w, acc)
        if kb == k_tiles - 1:
            c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
            tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)


@triton.jit
def _decode_register_kernel(x_ptr, w_ptr, c_ptr, M, N, K, stride_xm, stride_wn, stride_cm,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            EVICT_FIRST: tl.constexpr, PREFETCH: tl.constexpr):
    # The weight through registers (ld.global), not cp.async: Triton 3.6 drops eviction
    # hints when its pipeliner turns a load into cp.async. PREFETCH loads k-block k + 1
    # before the dot of k-block k (a register double buffer, since num_stages = 1).
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rn = (offs_n % N).to(tl.int64)
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + rn[None, :] * stride_wn + offs_k[:, None]
    x_mask = offs_m[:, None] < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_tiles = K // BLOCK_K  # the launcher asks K % BLOCK_K == 0
    if PREFETCH:
        if EVICT_FIRST:
            w = tl.load(w_ptrs, eviction_policy="evict_first")
        else:
            w = tl.load(w_ptrs)
    for kb in range(0, k_tiles):
        x = tl.load(x_ptrs, mask=x_mask, other=0.0)
        if PREFETCH:
            # The last iteration re-reads its own block (in bounds) instead of the next.
            nxt = w_ptrs + BLOCK_K * (kb + 1 < k_tiles)
            if EVICT_FIRST:
                w_next = tl.load(nxt, eviction_policy="evict_first")
            else:
                w_next = tl.load(nxt)
            acc = tl.dot(x, w, acc)
            w = w_next
            w_ptrs = nxt
        else:
            if EVICT_FIRST:
                w = tl.load(w_ptrs, eviction_policy="evict_first")
            else:
                w = tl.load(w_ptrs)
            acc = tl.dot(x, w, acc)
            w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def decode_register(x: torch.Tensor, w: torch.Tensor, block_n: int, block_k: int, warps: int, evict_first: bool,
                    prefetch: bool) -> torch.Tensor:
    """x [M, K] @ w[N, K]^T, M <= 16, K % block_k == 0 (an experiment, not a library path)."""
    M, K = x.shape
    N = w.shape[0]
    assert M <= 16 and K % block_k == 0 and x.stride(1) == 1 and w.stride(1) == 1
    out = torch.empty(M, N, device=x.device, dtype=x.dtype)
    _decode_register_kernel[(triton.cdiv(N, block_n),)](
        x, w, out, M, N, K, x.stride(0), w.stride(0), out.stride(0), BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k,
        EVICT_FIRST=evict_first, PREFETCH=prefetch, num_warps=warps, num_stages=1)
    return out


def decode_persistent(x: torch.Tensor, w: torch.Tensor, block_n: int, block_k: int, num_progs: int, stages: int,
                      warps: int = 4) -> torch.Tensor:
    """x [M, K] @ w[N, K]^T, M <= 16, K % block_k == 0 (an experiment, not a library path)."""
    M, K = x.shape
    N = w.shape[0]
    assert M <= 16 and K % block_k == 0 and x.stride(1) == 1 and w.stride(1) == 1
    out = torch.empty(M, N, device=x.device, dtype=x.dtype)
    progs = min(num_progs, triton.cdiv(N, block_n))
    _decode_persistent_kernel[(progs,)](x, w, out, M, N, K, x.stride(0), w.stride(0), out.stride(0),
                                        BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, NUM_PROGS=progs,
                                        STAGES=stages, num_warps=warps, num_stages=stages)
    return out


def variants(sms: int) -> list[tuple[int, int, int, int]]:
    """(block_n, block_k, num_progs, stages) to try."""
    out = []
    for block_n in (16, 32, 64):
        for block_k in (128, 256):
            for per_sm in (1, 2):
                for stages in (4, 6):
                    smem = stages * (16 * block_k + block_k * block_n) * 2
                    if per_sm * smem <= 200 * 1024:
                        out.append((block_n, block_k, per_sm * sms, stages))
    return out


def main(argv: list[str] | None = None) -> int:
    import rlkernels

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--ms", default="1,16")
    parser.add_argument("--short-m", action="store_true", help="only the wrapped-vs-masked short-M experiment")
    parser.add_argument("--m1-only", action="store_true", help="only the M == 1 specialization experiment")
    parser.add_argument("--register", action="store_true", help="only the register-loaded weight experiment")
    args = parser.parse_args(argv)
    if args.register:
        rows_r: list[dict[str, Any]] = []
        register_rows(rows_r, [int(v) for v in args.ms.split(",")])
        write_json(args.json, "explore_decode_register", rows_r)
        return 0
    if args.m1_only:
        rows_m1: list[dict[str, Any]] = []
        m1_specialization(rows_m1)
        write_json(args.json, "explore_decode_m1", rows_m1)
        return 0
    if args.short_m:
        rows_m: list[dict[str, Any]] = []
        short_m_rows(rows_m)
        write_json(args.json, "explore_decode_short_m", rows_m)
        return 0
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows: list[dict[str, Any]] = []
    for k, n in SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(0)
        w = (torch.randn(n, k, device="cuda", generator=gen) / k ** 0.5).bfloat16()
        copies = l2_cold_copies(w)
        floor = min(read_floor_us(copies).values())
        for m in (int(v) for v in args.ms.split(",")):
            x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
            want = rlkernels.linear(x, w)
            stock = graph_median_us(cycling(lambda wc: torch.nn.functional.linear(x, wc), copies), replays=50)
            ours = graph_median_us(cycling(lambda wc: rlkernels.linear(x, wc), copies), replays=50)
            row: dict[str, Any] = {"K": k, "N": n, "M": m, "stock_us": stock, "rlkernels_us": ours, "floor_us": floor}
            best = None
            for v in variants(sms):
                bn, bk, progs, stages = v
                name = f"{bn}x{bk}/p{progs}/s{stages}"
                try:
                    same = torch.equal(decode_persistent(x, w, bn, bk, progs, stages), want)
                    us = graph_median_us(cycling(lambda wc: decode_persistent(x, wc, bn, bk, progs, stages), copies),
                                         replays=50)
                except Exception as exc:  # noqa: BLE001 - a variant that cannot launch is reported
                    row[name] = f"{type(exc).__name__}: {str(exc)[:60]}"
                    continue
                row[name] = {"us": us, "same_bits": same}
                if same and (best is None or us < best[1]):
                    best = (name, us)
            if best is not None:
                row["best"], row["best_us"] = best
                row["best_ratio_vs_stock"] = best[1] / stock
            row["ratio_vs_stock"] = ours / stock
            row["floor_ratio"] = floor / stock
            rows.append(row)
            print({key: val for key, val in row.items() if not isinstance(val, dict)}, flush=True)
        del w, copies
        torch.cuda.empty_cache()
    print_table("decode: persistent flattened kernel (graph replay, weight from HBM)", rows,
                ["K", "N", "M", "stock_us", "rlkernels_us", "floor_us", "best", "best_us", "ratio_vs_stock",
                 "best_ratio_vs_stock", "floor_ratio"])
    write_json(args.json, "explore_decode", rows)
    return 0




def _tiles_under_variants(tiles: list[Any], variants: dict[str, Any], rows_out: list[dict[str, Any]],
                          floor: bool = False) -> None:
    """Each decode tile under each variant (label -> context manager that switches the
    engine and restores it) at M = 1, 4, 16 on every shape, graph replay with the weight
    cycled past the L2, bits checked against ``rlkernels.linear``; stock and rlkernels
    (and, with ``floor``, the read floor) in the same process."""
    import rlkernels
    import rlkernels.ops.gemm as G

    for k, n in SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(0)
        w = (torch.randn(n, k, device="cuda", generator=gen) / k ** 0.5).bfloat16()
        copies = l2_cold_copies(w)
        extra = {"floor_us": min(read_floor_us(copies).values())} if floor else {}
        for m in (1, 4, 16):
            x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
            want = rlkernels.linear(x, w)
            row: dict[str, Any] = {"K": k, "N": n, "M": m, **extra,
                                   "stock_us": graph_median_us(cycling(lambda wc: torch.nn.functional.linear(x, wc),
                                                                       copies), replays=50),
                                   "rlkernels_us": graph_median_us(cycling(lambda wc: rlkernels.linear(x, wc), copies),
                                                                   replays=50)}
            for label, switch in variants.items():
                with switch():
                    for cfg in tiles:
                        fn = lambda wc, cfg=cfg: G.triton_gemm(x, wc.t(), config=cfg)  # noqa: E731
                        row[f"{label}:{cfg.short()}"] = {
                            "us": graph_median_us(cycling(fn, copies), replays=50), "same_bits": torch.equal(fn(w), want)}
            rows_out.append(row)
            print({key: (round(v["us"], 1), v["same_bits"]) if isinstance(v, dict) else v for key, v in row.items()},
                  flush=True)
        del w, copies
        torch.cuda.empty_cache()


def _patched(module: Any, name: str, value: Any) -> Any:
    """A context manager factory: ``module.name = value`` inside, restored after."""
    @contextlib.contextmanager
    def switch():
        old = getattr(module, name)
        setattr(module, name, value)
        try:
            yield
        finally:
            setattr(module, name, old)
    return switch


def m1_specialization(rows_out: list[dict[str, Any]]) -> None:
    """Does Triton's M == 1 specialization cost the decode tiles time? The same tiles
    through a copy of the engine's kernel with ``do_not_specialize=["M"]``, at M = 1, 4, 16
    (explore_decode_m1_h100_session11.json was measured before the rows past M were
    masked, i.e. as with ``MASK_SHORT_M = False``)."""
    import rlkernels.ops.gemm as G
    from rlkernels.ops._launch import CachedLauncher

    nospec = CachedLauncher(triton.jit(do_not_specialize=["M"])(G._gemm_kernel.fn))
    tiles = [G.GemmConfig(16, 64, 256, group_m=1, num_warps=4, num_stages=4),
             G.GemmConfig(16, 32, 256, group_m=1, num_warps=4, num_stages=5),
             G.GemmConfig(16, 32, 128, group_m=1, num_warps=2, num_stages=4)]
    _tiles_under_variants(tiles, {"spec": contextlib.nullcontext, "nospec": _patched(G, "_launch_gemm", nospec)},
                          rows_out)


def short_m_rows(rows_out: list[dict[str, Any]]) -> None:
    """Why is a decode tile slower at M = 1 than at M = 4? Not Triton's M == 1
    specialization (:func:`m1_specialization`): the wrapped rows. With M < BLOCK_M every
    program re-read rows 0..M-1 BLOCK_M / M times per k-block. Here the decode tiles at
    M = 1, 4, 16 with the rows past M wrapped (``MASK_SHORT_M = False``) and masked (the
    default)."""
    import rlkernels.ops.gemm as G

    tiles = [G.GemmConfig(16, 64, 256, group_m=1, num_warps=4, num_stages=4),
             G.GemmConfig(16, 32, 256, group_m=1, num_warps=4, num_stages=5),
             G.GemmConfig(16, 32, 128, group_m=1, num_warps=2, num_stages=4),
             G.GemmConfig(16, 16, 256, group_m=1, num_warps=2, num_stages=6),
             G.GemmConfig(16, 64, 128, group_m=1, num_warps=4, num_stages=6)]
    _tiles_under_variants(tiles, {"wrapped": _patched(G, "MASK_SHORT_M", False),
                                  "masked": _patched(G, "MASK_SHORT_M", True)}, rows_out, floor=True)
    for row in rows_out:
        masked = {key: v["us"] for key, v in row.items() if key.startswith("masked:") and v["same_bits"]}
        row["best_masked"] = min(masked, key=masked.get)
        row["best_masked_us"] = masked[row["best_masked"]]
        row["best_masked_ratio_vs_stock"] = row["best_masked_us"] / row["stock_us"]
        row["rlkernels_ratio_vs_stock"] = row["rlkernels_us"] / row["stock_us"]
    print_table("decode tiles: rows past M wrapped vs masked (graph replay, weight from HBM)", rows_out,
                ["K", "N", "M", "stock_us", "rlkernels_us", "floor_us", "best_masked", "best_masked_us",
                 "rlkernels_ratio_vs_stock", "best_masked_ratio_vs_stock"])


def register_rows(rows_out: list[dict[str, Any]], ms: list[int]) -> None:
    """The weight loaded into registers (``_decode_register_kernel``), evict-first or
    not, with or without a one-block prefetch, against the table's cp.async tile: eager
    (``do_bench``) and graph replay from HBM; bits checked against ``rlkernels.linear``."""
    import rlkernels
    from rlkernels.bench.common import interleaved_median_ms, median_ms

    tiles = [(bn, bk, warps) for bn in (16, 32, 64) for bk in (128, 256) for warps in (2, 4)]
    for k, n in SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(0)
        w = (torch.randn(n, k, device="cuda", generator=gen) / k ** 0.5).bfloat16()
        copies = l2_cold_copies(w)
        for m in ms:
            x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
            want = rlkernels.linear(x, w)
            eager = interleaved_median_ms({"stock": lambda: torch.nn.functional.linear(x, w),
                                           "rlkernels": lambda: rlkernels.linear(x, w)})
            row: dict[str, Any] = {
                "K": k, "N": n, "M": m, "eager_stock_us": eager["stock"] * 1e3,
                "eager_rlkernels_us": eager["rlkernels"] * 1e3,
                "cold_stock_us": graph_median_us(cycling(lambda wc: torch.nn.functional.linear(x, wc), copies),
                                                 replays=50),
                "cold_rlkernels_us": graph_median_us(cycling(lambda wc: rlkernels.linear(x, wc), copies), replays=50)}
            for bn, bk, warps in tiles:
                for evict in (True, False):
                    for prefetch in (True, False):
                        name = f"{bn}x{bk}/w{warps}/{'ef' if evict else 'nl'}/{'pf' if prefetch else 'np'}"
                        fn = lambda wc, a=(bn, bk, warps, evict, prefetch): decode_register(x, wc, *a)  # noqa: E731
                        try:
                            same = torch.equal(fn(w), want)
                            row[name] = {"eager_us": median_ms(lambda: fn(w), warmup_ms=10, rep_ms=30) * 1e3,
                                         "cold_us": graph_median_us(cycling(fn, copies), replays=50),
                                         "same_bits": same}
                        except Exception as exc:  # noqa: BLE001 - a variant that cannot launch is reported
                            row[name] = f"{type(exc).__name__}: {str(exc)[:60]}"
            ok = {key: v for key, v in row.items() if isinstance(v, dict) and v["same_bits"]}
            for regime in ("eager", "cold"):
                best = min(ok, key=lambda key: ok[key][f"{regime}_us"])
                row[f"best_{regime}"], row[f"best_{regime}_us"] = best, ok[best][f"{regime}_us"]
                row[f"best_{regime}_other_us"] = ok[best]["cold_us" if regime == "eager" else "eager_us"]
                row[f"best_{regime}_ratio"] = ok[best][f"{regime}_us"] / row[f"{regime}_stock_us"]
                row[f"rlkernels_{regime}_ratio"] = row[f"{regime}_rlkernels_us"] / row[f"{regime}_stock_us"]
            row["all_same_bits"] = all(v["same_bits"] for v in row.values() if isinstance(v, dict))
            rows_out.append(row)
            print({key: v for key, v in row.items() if not isinstance(v, dict)}, flush=True)
        del w, copies
        torch.cuda.empty_cache()
    print_table("decode: weight through registers (eager = do_bench; cold = graph replay from HBM)", rows_out,
                ["K", "N", "M", "all_same_bits", "eager_stock_us", "eager_rlkernels_us", "best_eager", "best_eager_us",
                 "best_eager_other_us", "cold_stock_us", "cold_rlkernels_us", "best_cold", "best_cold_us",
                 "best_cold_other_us", "rlkernels_eager_ratio", "best_eager_ratio", "rlkernels_cold_ratio",
                 "best_cold_ratio"])


if __name__ == "__main__":
    sys.exit(main())
