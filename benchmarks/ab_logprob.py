"""A/B of fused tile configs of ``linear_logprob`` in one process, bits checked.

    python benchmarks/ab_logprob.py [--shape N,D,V] [--rounds 5] [--json PATH]

Compares the checked-in ``FUSED_16BIT`` with the variants in ``VARIANTS`` (one knob
each) on the backward's g kernel over one chunk, the forward, and the whole forward +
backward, in alternating rounds (``interleaved_median_ms``: clock drift is shared
between the variants). Every variant must give the checked-in config's bits; the JSON
records ``same_bits`` per row. cuBLAS of the same GEMM shape is timed beside the pieces.

In one process the whole op's times swung by +-3% between machines for a change that did
not move it (session 8); for the whole op, ``benchmarks/ab_trees.py`` (one process per
variant and round) is the measure to trust.
"""
from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from rlkernels import linear_logprob
from rlkernels.bench.common import interleaved_median_ms, print_table, write_json
from rlkernels.ops import linear_logprob as lp_mod

# One knob at a time against the checked-in config.
VARIANTS: dict[str, lp_mod.FusedConfig] = {
    "g stored by pointers": dataclasses.replace(lp_mod.FUSED_16BIT, tma_store=False),
}


def same(a: Any, b: Any) -> bool:
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return torch.equal(a, b)


def ab_row(piece: str, fns: dict[str, Callable[[], Any]], reference: Callable[[], Any] | None,
           rounds: int) -> dict[str, Any]:
    outs = [fn() for fn in fns.values()]
    bits = all(same(outs[0], o) for o in outs[1:])
    del outs
    timed = dict(fns, **({"cublas": reference} if reference is not None else {}))
    ms = interleaved_median_ms(timed, rounds=rounds, warmup_ms=20, rep_ms=100)
    first = next(iter(fns))
    row = {"piece": piece, **{f"{k} ms": v for k, v in ms.items()}, "same_bits": bits,
           **{f"{k} / {first}": ms[k] / ms[first] for k in fns if k != first}}
    print(row, flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="8192,4096,151936", help="N,D,V")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    n, d, vocab = (int(x) for x in args.shape.split(","))
    gen = torch.Generator(device="cuda").manual_seed(0)
    bf = torch.bfloat16
    h = torch.randn(n, d, device="cuda", generator=gen).to(bf)
    w = (torch.randn(vocab, d, device="cuda", generator=gen) * 3 * d ** -0.5).to(bf)
    t = torch.randint(0, vocab, (n,), device="cuda", generator=gen)
    gl, ge = torch.randn(n, device="cuda", generator=gen), torch.randn(n, device="cuda", generator=gen)
    configs = {"checked-in": lp_mod.FUSED_16BIT, **VARIANTS}
    kernels = {name: lp_mod.TritonKernels(cfg) for name, cfg in configs.items()}
    _, ent, lse = kernels["checked-in"].forward(h, w, None, t, 1.0)
    cv = min(vocab, lp_mod.backward_chunk(n, vocab, h.element_size()))
    g_buf = torch.empty(n, cv, device="cuda", dtype=bf)

    def g_of(k: lp_mod.TritonKernels) -> Callable[[], torch.Tensor]:
        def fn() -> torch.Tensor:
            k.grad_logits(h, w, None, t, lse, ent, gl, ge, 1.0, 0, cv, g_buf)
            return g_buf.clone()
        return fn

    rows = [ab_row(f"g kernel, {cv} columns", {k: g_of(v) for k, v in kernels.items()}, lambda: h @ w[:cv].t(),
                   args.rounds),
            ab_row("forward kernels", {k: (lambda k=v: k.forward(h, w, None, t, 1.0)) for k, v in kernels.items()},
                   lambda: h @ w.t(), args.rounds)]
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()

    def whole(cfg: lp_mod.FusedConfig) -> Callable[[], Any]:
        def fn() -> Any:
            lp_mod.FUSED_16BIT = cfg  # what the registered backend's kernels read per call
            lp, en = linear_logprob(hh, ww, t, return_entropy=True)
            return (lp, en, *torch.autograd.grad((lp, en), (hh, ww), (gl, ge)))
        return fn

    base = lp_mod.FUSED_16BIT
    try:
        rows.append(ab_row("linear_logprob forward+backward", {k: whole(c) for k, c in configs.items()}, None,
                           args.rounds))
    finally:
        lp_mod.FUSED_16BIT = base
    write_json(args.json, "ab_logprob", rows, {"shape": {"N": n, "D": d, "V": vocab},
                                               "configs": {k: c.short() for k, c in configs.items()}})
    print_table(f"linear_logprob A/B, N={n} D={d} V={vocab} (ms)", rows,
                list(dict.fromkeys(k for r in rows for k in r)))


if __name__ == "__main__":
    main()
