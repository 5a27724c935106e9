"""A/B of tile schedules in one process: the flattened (tile, k-block) loop against the
tile loop, on linear_logprob's pieces and whole op and on large-M GEMMs.

    python benchmarks/ab_schedules.py [--parts logprob,gemm] [--shape N,D,V] [--json PATH]

Every variant of a piece must give the same bits (the schedule never changes a tile's
K order); the JSON records ``same_bits`` per row. Times are medians of alternating
rounds (``interleaved_median_ms``), so clock drift is shared between the variants.
cuBLAS ``torch.mm`` / ``F.linear`` of the same GEMM shapes is timed in the same rounds.
"""
from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from rlkernels import linear_logprob
from rlkernels.bench.common import interleaved_median_ms, print_table, write_json
from rlkernels.ops import gemm as gemm_mod
from rlkernels.ops import linear_logprob as lp_mod
from rlkernels.ops.gemm import gemm_config, triton_gemm
from rlkernels.ops.gemm_tma import tma_gemm

_R = dataclasses.replace


def same(a: Any, b: Any) -> bool:
    if isinstance(a, (tuple, list)):
        return all(same(x, y) for x, y in zip(a, b))
    return a is None and b is None or torch.equal(a, b)


def ab_row(piece: str, variants: dict[str, Callable[[], Any]], reference: Callable[[], Any] | None,
           rounds: int, **info: Any) -> dict[str, Any]:
    """Times of every variant (and cuBLAS), bits of every variant against the first; a
    variant that fails (e.g. out of shared memory) gives a row with its error."""
    try:
        return _ab_row(piece, variants, reference, rounds, **info)
    except Exception as e:  # noqa: BLE001 - a benchmark reports, it does not stop
        row = {"piece": piece, **info, "error": f"{type(e).__name__}: {str(e)[:200]}"}
        print(row, flush=True)
        return row


def _ab_row(piece: str, variants: dict[str, Callable[[], Any]], reference: Callable[[], Any] | None,
            rounds: int, **info: Any) -> dict[str, Any]:
    outs = {name: fn() for name, fn in variants.items()}
    first = next(iter(outs.values()))
    bits = all(same(first, o) for o in outs.values())
    del outs
    fns = dict(variants)
    if reference is not None:
        fns["cublas"] = reference
    ms = interleaved_median_ms(fns, rounds=rounds, warmup_ms=20, rep_ms=100)
    names = list(variants)
    row = {"piece": piece, **info, **{f"{n}_ms": ms[n] for n in fns}, "same_bits": bits,
           "ratio": ms[names[-1]] / ms[names[0]]}
    if reference is not None:
        row.update({f"{n}_vs_cublas": ms[n] / ms["cublas"] for n in names})
    print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    return row


def logprob_rows(n: int, d: int, vocab: int, rounds: int) -> list[dict[str, Any]]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    bf = torch.bfloat16
    h = torch.randn(n, d, device="cuda", generator=gen).to(bf)
    w = (torch.randn(vocab, d, device="cuda", generator=gen) * 3 * d ** -0.5).to(bf)
    t = torch.randint(0, vocab, (n,), device="cuda", generator=gen)
    gl, ge = torch.randn(n, device="cuda", generator=gen), torch.randn(n, device="cuda", generator=gen)
    base, flat = lp_mod.FUSED_16BIT, _R(lp_mod.FUSED_16BIT, flat=True)
    k_base, k_flat = lp_mod.TritonKernels(_R(base, flat=False)), lp_mod.TritonKernels(flat)
    rows = []
    rows.append(ab_row("forward (partials + combine)", {"tiles": lambda: k_base.forward(h, w, None, t, 1.0),
                                                         "flat": lambda: k_flat.forward(h, w, None, t, 1.0)},
                       lambda: h @ w.t(), rounds, n=n, d=d, v=vocab))
    _, ent, lse = k_base.forward(h, w, None, t, 1.0)
    cv = 8192
    g_buf = torch.empty(n, cv, device="cuda", dtype=bf)

    def g_of(kern: lp_mod.TritonKernels) -> Callable[[], torch.Tensor]:
        def fn() -> torch.Tensor:
            kern.grad_logits(h, w, None, t, lse, ent, gl, ge, 1.0, 0, cv, g_buf)
            return g_buf.clone()
        return fn

    rows.append(ab_row(f"g recompute ({cv} columns)", {"tiles": g_of(k_base), "flat": g_of(k_flat)},
                       lambda: h @ w[:cv].t(), rounds, n=n, d=d, v=cv))
    g = g_of(k_base)()
    acc_cfg = gemm_mod.GEMM_ACCUMULATE_16BIT
    acc_flat = _R(acc_cfg, flatten=True)  # dH (a chain from C) keeps the tile loop: dW only
    dw = torch.empty(cv, d, device="cuda", dtype=bf)
    rows.append(ab_row(f"dW = g^T @ H ({cv} columns)",
                       {"tiles": lambda: tma_gemm(g.t(), h, acc_cfg, out=dw).clone(),
                        "flat": lambda: tma_gemm(g.t(), h, acc_flat, out=dw).clone()},
                       lambda: g.t() @ h, rounds, n=n, d=d, v=cv))

    # The whole op, the module's configs patched between variants.
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    schedules = {"tiles": (_R(base, flat=False), acc_cfg), "flat_fused": (flat, acc_cfg), "flat_all": (flat, acc_flat)}

    def whole(name: str, backward: bool) -> Callable[[], Any]:
        fused, acc = schedules[name]

        def fn() -> Any:
            lp_mod.FUSED_16BIT, gemm_mod.GEMM_ACCUMULATE_16BIT = fused, acc
            lp, en = linear_logprob(hh, ww, t, return_entropy=True)
            if not backward:
                return lp, en
            return torch.autograd.grad((lp, en), (hh, ww), (gl, ge))
        return fn

    try:
        rows.append(ab_row("linear_logprob forward", {s: whole(s, False) for s in ("tiles", "flat_fused")}, None,
                           rounds, n=n, d=d, v=vocab))
        rows.append(ab_row("linear_logprob forward+backward", {s: whole(s, True) for s in schedules}, None,
                           rounds, n=n, d=d, v=vocab))
    finally:
        lp_mod.FUSED_16BIT, gemm_mod.GEMM_ACCUMULATE_16BIT = base, acc_cfg
    return rows


def _linear(x: torch.Tensor, w: torch.Tensor, cfg: gemm_mod.GemmConfig | None) -> Callable[[], torch.Tensor]:
    """x @ w^T by the Triton chain with ``cfg``, or by stock cuBLAS (``F.linear``) for None."""
    if cfg is None:
        return lambda: F.linear(x, w)
    return lambda: triton_gemm(x, w.t(), config=cfg)


GEMM_SHAPES = ((4096, 4096), (4096, 12288), (12288, 4096), (4096, 151936))


def gemm_rows(ms: tuple[int, ...], rounds: int) -> list[dict[str, Any]]:
    """The table's large-M tile (Triton path forced) against its flattened walk."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    rows = []
    for k, n in GEMM_SHAPES:
        w = (torch.randn(n, k, device="cuda", generator=gen) * k ** -0.5).to(torch.bfloat16)
        for m in ms:
            x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
            cfg = gemm_config(m, n, torch.bfloat16)
            if not cfg.persistent:
                continue
            flat = _R(cfg, warp_specialize=False, flatten=True)
            rows.append(ab_row(f"gemm {k}x{n}", {c.short(): _linear(x, w, c) for c in (cfg, flat)},
                               _linear(x, w, None), rounds, m=m, k=k, n=n))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="logprob,gemm")
    p.add_argument("--shape", default="8192,4096,151936", help="linear_logprob N,D,V")
    p.add_argument("--gemm-m", default="1024,2048,4096,16384")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    parts = set(args.parts.split(","))
    rows: list[dict[str, Any]] = []
    if "logprob" in parts:
        n, d, v = (int(x) for x in args.shape.split(","))
        rows += logprob_rows(n, d, v, args.rounds)
    if "gemm" in parts:
        rows += gemm_rows(tuple(int(x) for x in args.gemm_m.split(",")), args.rounds)
    cols = sorted({c for r in rows for c in r if c.endswith("_ms")})
    write_json(args.json, "ab_schedules", rows)
    print_table("schedules A/B (ms)", rows, ["piece", "m", *cols, "ratio", "same_bits"])


if __name__ == "__main__":
    main()
