"""One-run GPU check and launch tuning for the batch-invariant attention.

    PYTHONUNBUFFERED=1 python benchmarks/attention_gpu.py [--quick] [--json PATH]

1. Checks (bf16 and fp16, Hq = 16, Hkv = 8, D = 128 and 64): full causal rows == the
   sequence alone == packed with other lengths == decode steps over a NaN-filled cache
   (split-KV kernel) at block/split boundaries == chunked prefill in chunks of 1, 7, 64,
   100; backward run-to-run equal and alone == packed; accuracy vs float64.
2. Tuning: times candidate launch parameters of the Triton forward kernel (BLOCK_M,
   warps, stages; the warp-specialized Hopper kernel, which has its own fixed launch and
   which the default takes where it applies, is turned off for these candidates), the
   split-KV decode kernel (query tile, warps, stages) and the backward (dK/dV and dQ
   tiles, warps, stages). The chain constants (BLOCK_N, S_SPLIT) are the library's for
   every candidate; each candidate's bits are compared with the default's. A candidate's
   launch goes to its own calls only, as their ``_tuning`` argument (``AttnTuning``).

Every step is wrapped in try/except and prints as it goes; a failing candidate is
reported and skipped.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
import traceback

import torch

from rlkernels import contract, reference
from rlkernels.ops import attention as A
from rlkernels.ops.attention.key_blocks import DEFAULT_CHAIN
from rlkernels.ops.attention.launch import DEFAULT_TUNING

HQ, HKV = 16, 8


def say(*a):
    print(*a, flush=True)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    w = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return torch.equal(a.contiguous().view(w), b.contiguous().view(w))


def rand(shape, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, device="cuda", generator=g).to(dtype)


def median_ms(fn) -> float:
    import triton.testing

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def check(name: str, fn, results: dict) -> None:
    t0 = time.time()
    try:
        ok = fn()
        results[name] = bool(ok)
        say(f"[check] {name}: {'PASS' if ok else 'FAIL'} ({time.time() - t0:.1f}s)")
    except Exception as exc:  # noqa: BLE001
        results[name] = f"error: {type(exc).__name__}: {exc}"
        say(f"[check] {name}: ERROR {type(exc).__name__}: {exc}")
        traceback.print_exc()
        sys.stdout.flush()


def forward_checks(dtype, d: int, L: int, results: dict) -> None:
    q = rand((2, L, HQ, d), dtype, 1)
    k = rand((2, L, HKV, d), dtype, 2)
    v = rand((2, L, HKV, d), dtype, 3)
    full = A.flash_attn_func(q, k, v)
    tag = f"{str(dtype)[6:]} D={d} L={L}"
    check(f"accuracy {tag}", lambda: contract.check("attention", dtype, full[:, :1031],
                                                    reference.attention_ref(q[:, :1031], k[:, :1031], v[:, :1031])) >= 0,
          results)
    check(f"alone == batch {tag}", lambda: bits_equal(A.flash_attn_func(q[1:], k[1:], v[1:])[0], full[1]), results)

    def packed():
        lens = [1, 1031, L, 509]
        parts = [tuple(rand((n, h, d), dtype, 10 + n + h) for h in (HQ, HKV, HKV)) for n in lens]
        parts[2] = (q[0], k[0], v[0])
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
        out = A.flash_attn_varlen_func(*(torch.cat([p[i] for p in parts]) for i in range(3)), cu, cu, L, L)
        a = int(cu[2])
        return bits_equal(out[a:a + L], full[0])
    check(f"packed == batch {tag}", packed, results)

    cap = L + 64
    kc = torch.full((1, cap, HKV, d), float("nan"), dtype=dtype, device="cuda")
    vc = kc.clone()

    def decode():
        bad = []
        for p in sorted({0, 1, 63, 64, 1023, 1024, 1025, 2047, 2048, L - 1} | set(range(0, L, 131))):
            if p >= L:
                continue
            kc[:, :p], vc[:, :p] = k[:1, :p], v[:1, :p]
            kc[:, p:], vc[:, p:] = float("nan"), float("nan")
            row = A.flash_attn_with_kvcache(q[:1, p:p + 1], kc, vc, k[:1, p:p + 1], v[:1, p:p + 1], p)
            if not bits_equal(row[0, 0], full[0, p]):
                bad.append(p)
        if bad:
            say(f"   decode rows differing: {bad[:20]}")
        return not bad
    check(f"decode == prefill {tag}", decode, results)

    def chunks(sizes):
        def go():
            kc.fill_(float("nan"))
            vc.fill_(float("nan"))
            outs, pos, i = [], 0, 0
            while pos < L:
                n = min(sizes[i % len(sizes)], L - pos)
                outs.append(A.flash_attn_with_kvcache(q[:1, pos:pos + n], kc, vc, k[:1, pos:pos + n],
                                                      v[:1, pos:pos + n], pos))
                pos, i = pos + n, i + 1
            return bits_equal(torch.cat(outs, 1)[0], full[0])
        return go
    for sizes in ([1, 7, 64, 100], [100], [64], [7]):
        check(f"chunked {sizes} == prefill {tag}", chunks(sizes), results)


def backward_checks(dtype, d: int, results: dict) -> None:
    lens = [1, 1031, 2048, 509]
    seqs = [[rand((n, h, d), dtype, 100 + n + j) for j, h in enumerate((HQ, HKV, HKV, HQ))] for n in lens]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    tag = f"{str(dtype)[6:]} D={d}"

    def grads(q, k, v, do, cu, mx):
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
        o = A.flash_attn_varlen_func(q, k, v, cu, cu, mx, mx)
        return (o,) + torch.autograd.grad(o, (q, k, v), do)

    cat = [torch.cat([s[i] for s in seqs]) for i in range(4)]
    together = grads(*cat, cu, max(lens))
    check(f"backward run-to-run {tag}", lambda: all(bits_equal(a, b) for a, b in zip(together, grads(*cat, cu, max(lens)))),
          results)

    def alone():
        ok = True
        for i, n in enumerate(lens):
            a = int(cu[i])
            one = grads(*seqs[i], torch.tensor([0, n], dtype=torch.int32, device="cuda"), n)
            ok = ok and all(bits_equal(t[a:a + n], u) for t, u in zip(together, one))
        return ok
    check(f"backward alone == packed {tag}", alone, results)

    def accuracy():
        q, k, v, do = (t[None].double().requires_grad_() if j < 3 else t[None].double() for j, t in enumerate(seqs[1]))
        ref = torch.autograd.grad(reference.attention_ref(q, k, v), (q, k, v), do)
        a, n = int(cu[1]), lens[1]
        errs = [contract.check("attention_grad", dtype, t[a:a + n], r[0]) for t, r in zip(together[1:], ref)]
        say(f"   grad rel errors {['%.2e' % e for e in errs]}")
        return True
    check(f"backward accuracy {tag}", accuracy, results)


def tune_forward(d: int, L: int, quick: bool) -> list[dict]:
    b = max(1, 16384 // L)
    q = rand((b, L, HQ, d), torch.bfloat16, 7)
    k = rand((b, L, HKV, d), torch.bfloat16, 8)
    v = rand((b, L, HKV, d), torch.bfloat16, 9)
    want = A.flash_attn_func(q, k, v)
    flops = 2.0 * b * HQ * L * L * d
    rows = []
    cands = list(itertools.product((64, 128), (4, 8), (2, 3, 4)))
    if quick:
        cands = cands[:4]
    for bm, w, s in cands:
        try:
            # ws=False: the settings are the Triton kernel's; the warp-specialized one ignores them.
            tuning = A.AttnTuning(fwd=A.FwdLaunch(A.KernelLaunch(bm, w, s), ws=False))
            same = bits_equal(A.flash_attn_func(q, k, v, _tuning=tuning), want)
            ms = median_ms(lambda: A.flash_attn_func(q, k, v, _tuning=tuning))
            rows.append({"kernel": "fwd", "D": d, "L": L, "block_m": bm, "warps": w, "stages": s,
                         "ms": ms, "tflops": flops / ms / 1e9, "same_bits": same})
        except Exception as exc:  # noqa: BLE001
            rows.append({"kernel": "fwd", "D": d, "L": L, "block_m": bm, "warps": w, "stages": s,
                         "error": f"{type(exc).__name__}: {str(exc)[:80]}"})
        say(rows[-1])
    return rows


def tune_decode(d: int, quick: bool) -> list[dict]:
    rows = []
    shapes = ((16, 4096), (64, 1024), (1, 32768))
    for b, s in shapes[:1] if quick else shapes:
        q = rand((b, 1, HQ, d), torch.bfloat16, 11)
        kc = rand((b, s, HKV, d), torch.bfloat16, 12)
        vc = rand((b, s, HKV, d), torch.bfloat16, 13)
        want = A.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=s)
        base = A.default_fwd_launch(d)
        for bm, w, st in itertools.product((16, 32), (2, 4, 8), (2, 3, 4)):
            try:
                tuning = A.AttnTuning(fwd=A.FwdLaunch(base.full, A.KernelLaunch(bm, w, st)))
                same = bits_equal(A.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=s, _tuning=tuning), want)
                ms = median_ms(lambda: A.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=s, _tuning=tuning))
                rows.append({"kernel": "decode", "D": d, "B": b, "S": s, "block_m": bm, "warps": w, "stages": st,
                             "us": ms * 1e3, "TB/s": 2 * b * s * HKV * d * 2 / ms / 1e9, "same_bits": same})
            except Exception as exc:  # noqa: BLE001
                rows.append({"kernel": "decode", "D": d, "B": b, "S": s, "block_m": bm, "warps": w, "stages": st,
                             "error": f"{type(exc).__name__}: {str(exc)[:80]}"})
            say(rows[-1])
    return rows


def tune_backward(d: int, L: int, quick: bool) -> list[dict]:
    b = max(1, 16384 // L)
    q = rand((b, L, HQ, d), torch.bfloat16, 21).requires_grad_()
    k = rand((b, L, HKV, d), torch.bfloat16, 22).requires_grad_()
    v = rand((b, L, HKV, d), torch.bfloat16, 23).requires_grad_()
    do = rand((b, L, HQ, d), torch.bfloat16, 24)

    def backward_with(tuning: A.AttnTuning):
        """The backward of a forward run with ``tuning`` (its autograd node keeps the
        tuning), repeatable: what each candidate times."""
        out = A.flash_attn_func(q, k, v, _tuning=tuning)
        return lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
    want = backward_with(DEFAULT_TUNING)()
    flops = 2.5 * 2.0 * b * HQ * L * L * d
    rows = []
    # (dK/dV launch, dQ launch) of one warp count and stage count: BwdLaunch's field order.
    cands = [(A.KernelLaunch(bm1, w, s, bn1), A.KernelLaunch(bm2, w, s, bn2))
             for (bm1, bn1) in ((32, 64), (64, 64), (32, 128), (64, 128))
             for (bm2, bn2) in ((64, 64), (128, 32), (128, 64)) for w in (4, 8) for s in (1, 2, 3)]
    if quick:
        cands = cands[:4]
    for dkdv, dq in cands:
        row = {"kernel": "bwd", "D": d, "L": L, "dkdv": f"{dkdv.block_m}x{dkdv.block_n}",
               "dq": f"{dq.block_m}x{dq.block_n}", "warps": dkdv.num_warps, "stages": dkdv.num_stages}
        try:
            bwd = backward_with(A.AttnTuning(bwd=A.BwdLaunch(dkdv, dq)))
            got = bwd()
            row["same_bits"] = all(bits_equal(a, b_) for a, b_ in zip(got, want))
            ms = median_ms(bwd)
            row.update(ms=ms, tflops=flops / ms / 1e9)
        except Exception as exc:  # noqa: BLE001
            row["error"] = f"{type(exc).__name__}: {str(exc)[:80]}"
        rows.append(row)
        say(row)
    return rows


def table(rows: list[dict], title: str) -> None:
    say(f"\n== {title}")
    ok = [r for r in rows if "error" not in r]
    key = "tflops" if any("tflops" in r for r in ok) else "us"
    ok.sort(key=lambda r: -r[key] if key == "tflops" else r[key])
    for r in ok[:8]:
        say("  " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
    bad = [r for r in rows if "error" in r]
    if bad:
        say(f"  {len(bad)} candidates failed, e.g. {bad[0]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", default=None)
    parser.add_argument("--skip-checks", action="store_true")
    parser.add_argument("--skip-tune", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        say("needs a CUDA GPU")
        return 2
    say(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, chain {DEFAULT_CHAIN}")
    results: dict = {}
    if not args.skip_checks:
        for dtype in (torch.bfloat16, torch.float16):
            for d in (128, 64):
                try:
                    forward_checks(dtype, d, 2048 if args.quick else 4096, results)
                    backward_checks(dtype, d, results)
                except Exception as exc:  # noqa: BLE001
                    results[f"setup {dtype} {d}"] = f"error: {exc}"
                    traceback.print_exc()
                torch.cuda.empty_cache()
        failed = [k for k, v in results.items() if v is not True]
        say(f"\nchecks: {len(results) - len(failed)} passed, {len(failed)} failed: {failed}")
    tuned: list[dict] = []
    if not args.skip_tune:
        for d in (128, 64):
            for L in ((4096,) if args.quick else (1024, 4096, 16384)):
                rows = tune_forward(d, L, args.quick)
                table(rows, f"forward D={d} L={L}")
                tuned += rows
            rows = tune_decode(d, args.quick)
            for shape in sorted({(r["B"], r["S"]) for r in rows}):
                table([r for r in rows if (r["B"], r["S"]) == shape], f"decode D={d} B,S={shape}")
            tuned += rows
            rows = tune_backward(d, 4096, args.quick)
            table(rows, f"backward D={d} L=4096")
            tuned += rows
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "checks": results, "tuning": tuned}, f, indent=1,
                      default=str)
    return 0 if all(v is True for v in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
