"""Measure the worst error vs float64 per (op, dtype) for docs/contract.md and rlkernels.contract.

    python benchmarks/measure_contract.py [--device cuda] [--trials 20]

Random shapes (primes, 1, non-multiples of tiles), random data; prints the worst
``rel`` (or ``abs`` for log-probs) error seen per op and dtype on each backend
that runs here (torch; triton on GPU or under TRITON_INTERPRET=1).
"""
from __future__ import annotations

import argparse
import json

import torch

import rlkernels
from rlkernels import reference
from rlkernels.registry import backend_unavailable_reason
from rlkernels.testing import rel_error


def _abs(out, ref):
    return float((out.double().cpu() - ref.double().cpu()).abs().max())


def cases(g, device, dtype, backend):
    def r(*s, scale=1.0):
        return (torch.randn(*s, generator=g) * scale).to(device=device, dtype=dtype)

    m, k, n = (int(torch.randint(1, 70, (1,), generator=g)) for _ in range(3))
    a, b, bias = r(m, k), r(k, n), r(n)
    yield "matmul", "rel", rlkernels.matmul(a, b, bias, backend=backend), reference.matmul_ref(a, b, bias)
    B = int(torch.randint(2, 9, (1,), generator=g))
    ab, bb = r(B, m % 64 + 1, k % 64 + 1), r(B, k % 64 + 1, n % 64 + 1)
    if hasattr(rlkernels, "bmm"):
        yield "bmm", "rel", rlkernels.get_op("bmm", backend)(ab, bb), reference.bmm_ref(ab, bb)
    if hasattr(rlkernels, "linear_logprob"):
        V = int(torch.randint(2, 300, (1,), generator=g))
        h, w = r(m, k), r(V, k, scale=k ** -0.5)
        tgt = torch.randint(0, V, (m,), generator=g).to(device)
        lp, ent = rlkernels.get_op("linear_logprob", backend)(h, w, tgt, return_entropy=True)
        rlp, rent = reference.linear_logprob_ref(h, w, tgt)
        yield "linear_logprob", "abs", lp, rlp
        yield "linear_logprob_entropy", "abs", ent, rent
    for op, ref in (("rms_norm", None), ("softmax", reference.softmax_ref), ("log_softmax", reference.log_softmax_ref)):
        try:
            impl = rlkernels.get_op(op, backend)
        except Exception:
            continue
        x = r(m, n + 1)
        if op == "rms_norm":
            wt = r(n + 1)
            yield op, "rel", impl(x, wt, 1e-6), reference.rms_norm_ref(x, wt, 1e-6)
        else:
            yield op, "rel", impl(x, -1), ref(x, -1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--json")
    args = p.parse_args()
    device = torch.device(args.device)
    worst: dict[str, float] = {}
    for backend in ("torch", "triton"):
        if backend_unavailable_reason(backend, device):
            continue
        dtypes = [torch.float32, torch.float16, torch.bfloat16] + ([torch.float64] if backend == "torch" else [])
        if backend == "triton" and device.type == "cpu":
            dtypes = [torch.float32, torch.float16]  # interpreter: bf16 dots are not emulated
        for dtype in dtypes:
            g = torch.Generator().manual_seed(0)
            for _ in range(args.trials):
                for op, metric, out, ref in cases(g, device, dtype, backend):
                    err = rel_error(out, ref) if metric == "rel" else _abs(out, ref)
                    key = f"{op}|{str(dtype)[6:]}|{backend}|{device.type}|{metric}"
                    worst[key] = max(worst.get(key, 0.0), err)
    for key in sorted(worst):
        print(f"{key:60s} {worst[key]:.3e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(worst, f, indent=1)


if __name__ == "__main__":
    main()
