"""Drive every Triton kernel the library launches at odd shapes, for compute-sanitizer.

    compute-sanitizer --tool memcheck --error-exitcode 3 python benchmarks/sanitize_kernels.py [--big]
    compute-sanitizer --tool racecheck python benchmarks/sanitize_kernels.py --only gemm_tma,attention

Shapes: M = 1, primes, sizes that are no multiple of any tile, K no multiple of
BLOCK_K, empty batches, an output past 2^31 elements (``--big``: 4 GiB of bf16, slow
under memcheck), a KV cache whose unused slots hold NaN. Each case runs the forward
and, where the op has one, the backward; a case prints one line. The sanitizer
reports any out-of-bounds or misaligned access; this script only checks that the
results are finite where they must be (a cheap guard that the case really ran).
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable

import torch

import rlkernels
from rlkernels.ops.attention import AttnTuning, attention_by_bounds, ws_host
from rlkernels.ops.attention.launch import DEFAULT_TUNING

CASES: dict[str, Callable[[torch.dtype], None]] = {}


def case(name: str):
    def deco(fn):
        CASES[name] = fn
        return fn
    return deco


def _r(*shape, dtype, grad=False):
    t = (torch.randn(*shape, device="cuda") / max(shape[-1], 1) ** 0.5).to(dtype)
    return t.requires_grad_(grad)


def _finite(*ts: torch.Tensor) -> None:
    for t in ts:
        if t is not None and t.numel() and not torch.isfinite(t.float()).all():
            raise AssertionError("non-finite output")


@case("gemm")
def _gemm(dtype):
    # Decode tiles, mid-M tiles, large-M TMA tiles, fp32 swapped tiles, K not a multiple of BLOCK_K.
    for m, k, n in [(1, 4096, 4096), (1, 131, 257), (7, 1000, 1031), (13, 4096, 12289), (16, 127, 151936 // 16),
                    (33, 520, 4097), (97, 4096, 8191), (127, 384, 640), (257, 4096, 4096), (1031, 1024, 3001),
                    (2053, 4096, 4096), (0, 64, 64), (5, 0, 7)]:
        x, w = _r(m, k, dtype=dtype, grad=True), _r(n, k, dtype=dtype, grad=True)
        b = _r(n, dtype=dtype, grad=True)
        y = rlkernels.linear(x, w, b)
        y.float().square().sum().backward()
        _finite(y, x.grad, w.grad, b.grad)
        z = rlkernels.matmul(x.detach(), w.detach().t().contiguous())  # B as a [K, N] matrix
        _finite(z)


@case("gemm_tma")
def _gemm_tma(dtype):
    for m, k, n in [(1024, 4096, 4096), (2049, 1024, 1032), (4099, 264, 520)]:
        x, w = _r(m, k, dtype=dtype), _r(n, k, dtype=dtype)
        _finite(rlkernels.linear(x, w))


@case("gemm_main_grad")
def _gemm_main_grad(dtype):
    # dW accumulated into an fp32 main_grad over micro-batches (token-block chain).
    w = _r(1031, 520, dtype=dtype, grad=True)
    w.main_grad = torch.zeros(1031, 520, device="cuda")
    for m in (16, 48, 17):
        rlkernels.linear(_r(m, 520, dtype=dtype), w).float().sum().backward()
    _finite(w.main_grad)


@case("bmm")
def _bmm(dtype):
    for bt, m, k, n in [(1024, 12, 64, 12), (3, 1, 1, 1), (7, 17, 33, 5), (5, 64, 64, 64), (2, 129, 257, 65),
                        (0, 4, 4, 4)]:
        a, b = _r(bt, m, k, dtype=dtype, grad=True), _r(bt, k, n, dtype=dtype, grad=True)
        y = rlkernels.bmm(a, b)
        y.float().sum().backward()
        _finite(y, a.grad, b.grad)


@case("linear_logprob")
def _logprob(dtype):
    for n, d, v in [(1, 64, 151936), (7, 130, 1031), (33, 1024, 32003), (129, 4096, 151936), (0, 64, 100)]:
        h, w = _r(n, d, dtype=dtype, grad=True), _r(v, d, dtype=dtype, grad=True)
        t = torch.randint(0, v, (n,), device="cuda")
        if n:
            t[::3] = -100
        lp, ent = rlkernels.linear_logprob(h, w, t, temperature=0.7, return_entropy=True)
        (lp.sum() + ent.sum()).backward()
        _finite(lp, ent, h.grad, w.grad)


@case("norms")
def _norms(dtype):
    for rows, r in [(1, 1), (7, 1000), (33, 1025), (5, 16385), (0, 8)]:
        x, w = _r(rows, r, dtype=dtype, grad=True), _r(r, dtype=dtype, grad=True)
        y = rlkernels.rms_norm(x, w)
        s = rlkernels.softmax(x, -1)
        ls = rlkernels.log_softmax(x, -1)
        (y.float().sum() + s.float().square().sum() + ls.float().sum()).backward()
        _finite(y, s, ls, x.grad, w.grad)


@case("mode")
def _mode(dtype):
    with rlkernels.set_batch_invariant_mode():
        x, w = _r(13, 1000, dtype=dtype, grad=True), _r(1000, 257, dtype=dtype, grad=True)
        y = torch.softmax(x @ w, -1).mean(-1)
        y.float().sum().backward()
        _finite(y, x.grad, w.grad)


@case("attention")
def _attention(dtype):
    if not hasattr(rlkernels, "flash_attn_func"):
        print("  (no attention op)")
        return
    # Small calls keep pointer loads (layout.tma_pays): once as the library runs them, once with
    # every unmasked block read through TMA (tma_min_flops 0, passed to each call).
    # The second pass also sends every head_dim-64 and -128 forward through the warp-specialized
    # kernel (its launches counted below, so the run shows it was exercised).
    launch = ws_host._launch_fwd_ws
    launched = []

    def counting(f):
        def launch_and_count(*args, **kwargs):
            launched.append(1)
            return f(*args, **kwargs)
        return launch_and_count

    for tuning in (DEFAULT_TUNING, AttnTuning(tma_min_flops=0)):
        ws_host._launch_fwd_ws = {c: counting(f) for c, f in launch.items()}
        try:
            _attention_cases(dtype, tuning)
        finally:
            ws_host._launch_fwd_ws = launch
        print(f"  tma_min_flops={tuning.tma_min_flops:g}: {len(launched)} warp-specialized forward launches")
        launched.clear()


def _attention_cases(dtype, tuning: AttnTuning):
    for b, lq, hq, hk, d in [(1, 1, 2, 1, 64), (2, 131, 4, 2, 128), (3, 1031, 16, 8, 128), (1, 257, 8, 8, 64),
                             (2, 67, 4, 2, 80)]:
        q, k, v = (_r(b, lq, h, d, dtype=dtype, grad=True) for h in (hq, hk, hk))
        o = rlkernels.flash_attn_func(q, k, v, causal=True, _tuning=tuning)
        o.float().sum().backward()
        _finite(o, q.grad, k.grad, v.grad)
        with torch.no_grad():  # inference: the dense form (no index tensors)
            _finite(rlkernels.flash_attn_func(q.detach(), k.detach(), v.detach(), causal=True, _tuning=tuning))
    # Packed sequences of odd lengths (one-split and several-split rows, TMA and masked blocks).
    lens_p = [1, 131, 1031, 2053]
    cu = torch.tensor([0] + [sum(lens_p[:i + 1]) for i in range(len(lens_p))], device="cuda", dtype=torch.int32)
    for d in (64, 128):
        q, k, v = (_r(cu[-1].item(), h, d, dtype=dtype, grad=True) for h in (16, 8, 8))
        o = rlkernels.flash_attn_varlen_func(q, k, v, cu, cu, max(lens_p), max(lens_p), causal=True, _tuning=tuning)
        o.float().sum().backward()
        _finite(o, q.grad, k.grad, v.grad)
    # Decode over a cache whose unused slots hold NaN.
    s_max, b, hq, hk, d = 4099, 3, 16, 8, 128
    kc = torch.full((b, s_max, hk, d), float("nan"), device="cuda", dtype=dtype)
    vc = torch.full_like(kc, float("nan"))
    lens = torch.tensor([1, 1030, 4097], device="cuda", dtype=torch.int32)
    for i, n in enumerate(lens.tolist()):
        kc[i, :n] = _r(n, hk, d, dtype=dtype)
        vc[i, :n] = _r(n, hk, d, dtype=dtype)
    q = _r(b, 1, hq, d, dtype=dtype)
    _finite(rlkernels.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=True, _tuning=tuning))
    kn, vn = _r(b, 1, hk, d, dtype=dtype), _r(b, 1, hk, d, dtype=dtype)
    _finite(rlkernels.flash_attn_with_kvcache(q, kc, vc, k=kn, v=vn, cache_seqlens=lens, causal=True,
                                              _tuning=tuning))
    # Keys read in place from Hugging Face's [B, Hkv, S, D] layout, left-padded (NaN before
    # each sequence) and right-padded (NaN after it: the last value block runs into free
    # slots), through the op's bounds entry: prefill with its backward, then a decode-like
    # step (the split-KV kernels over several splits).
    for starts in ([4098, 3069, 2], [0, 0, 0]):
        _hf_layout_case(torch.tensor(starts, device="cuda", dtype=torch.int32), lens, q, s_max, dtype, tuning)


def _hf_layout_case(starts, lens, q, s_max, dtype, tuning: AttnTuning):
    b, hq, hk, d = q.shape[0], q.shape[2], 8, q.shape[3]
    kh = torch.full((b, hk, s_max, d), float("nan"), device="cuda", dtype=dtype)
    vh = torch.full_like(kh, float("nan"))
    for i, (s0, n) in enumerate(zip(starts.tolist(), lens.tolist())):
        kh[i, :, s0:s0 + n] = _r(hk, n, d, dtype=dtype)
        vh[i, :, s0:s0 + n] = _r(hk, n, d, dtype=dtype)
    lq = 131
    q_len = torch.clamp(lens, max=lq)
    q_rows = _r(b * lq, hq, d, dtype=dtype, grad=True)
    q_start = torch.arange(b, device="cuda", dtype=torch.int32) * lq
    kg, vg = kh.transpose(1, 2).detach().requires_grad_(), vh.transpose(1, 2).detach().requires_grad_()
    # Each sequence's last q_len keys are its queries' (bottom-right causal).
    o = attention_by_bounds("sanitize", q_rows, kg, vg, q_start, q_len, starts, lens, lq, s_max, _tuning=tuning)
    rows = torch.cat([o[i * lq:i * lq + n] for i, n in enumerate(q_len.tolist())])
    rows.float().sum().backward()
    _finite(rows)
    step = attention_by_bounds("sanitize", q[:, 0], kg.detach(), vg.detach(), torch.arange(b, device="cuda",
                               dtype=torch.int32), torch.ones(b, device="cuda", dtype=torch.int32), starts, lens, 1,
                               s_max, _tuning=tuning)
    _finite(step)


def _big(dtype):
    # An output past 2^31 elements (int64 offsets): 16 x 134217857 bf16, K = 16.
    m, n, k = 16, (1 << 31) // 16 + 129, 16
    x, w = _r(m, k, dtype=dtype), _r(n, k, dtype=dtype)
    y = rlkernels.linear(x, w)
    if not torch.isfinite(y[:, -5:].float()).all():
        raise AssertionError("non-finite tail")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--only", default=None, help="comma-separated case names")
    p.add_argument("--dtypes", default="bfloat16,float16,float32")
    p.add_argument("--big", action="store_true", help="also an output past 2^31 elements (bf16)")
    args = p.parse_args()
    names = args.only.split(",") if args.only else list(CASES)
    failed = 0
    for dt_name in args.dtypes.split(","):
        dtype = getattr(torch, dt_name)
        for name in names:
            if name == "attention" and dtype == torch.float32:
                continue  # bf16/fp16 only on CUDA
            try:
                CASES[name](dtype)
                torch.cuda.synchronize()
                print(f"ok   {name} {dt_name}", flush=True)
            except Exception as e:  # report every case, then fail
                failed += 1
                print(f"FAIL {name} {dt_name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
    if args.big:
        _big(torch.bfloat16)
        torch.cuda.synchronize()
        print("ok   gemm output past 2^31 elements bfloat16", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
