"""Benchmark: fused lm-head log-prob (+ entropy) vs materialized logits and peers.

    python -m rlkernels.bench logprob [--quick] [--json PATH] [--no-peers] [--temperature T]
        [--logit-softcap C] [--shape N,D,V ...] [--config BM,BV,BK,GROUP,WARPS,STAGES]

bf16 inputs, per-token random upstream gradients on logp (and entropy for
rlkernels / naive torch). Columns: forward ms, forward+backward ms (grads of hidden
and weight), extra peak GiB of forward+backward (everything allocated during the
call, dW and dhidden included). Peers, when importable: Liger's fused linear CE and
Apple's Cut Cross-Entropy (both give -logp, no entropy; CCE is not row-invariant).
With ``--logit-softcap``, a row of rlkernels with Gemma's final soft-cap beside the plain
one, and naive torch capping its logits as Gemma's forward does.
"""
from __future__ import annotations

import argparse
import gc
from typing import Any, Callable

import torch

from ..registry import implementation
from .common import median_ms, optional_import, peak_extra_memory_gib, print_table, write_json

FULL_SHAPES = ((1024, 4096, 151936), (8192, 4096, 151936), (32768, 4096, 151936), (8192, 4096, 32000))
QUICK_SHAPES = ((8192, 4096, 151936),)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-peers", action="store_true", help="skip Liger / CCE / naive torch")
    parser.add_argument("--config", default=None,
                        help="try another fused tile config: BM,BV,BK,GROUP_M,WARPS,STAGES[,tma][,pers] (BV: the LSE tile) "
                             "(bits may change)")
    parser.add_argument("--shape", action="append", default=None, help="N,D,V (repeatable)")
    parser.add_argument("--temperature", type=float, default=1.0,
                        help="T != 1 adds a correctly rounded division per logit (rlkernels and naive torch)")
    parser.add_argument("--logit-softcap", type=float, default=0.0,
                        help="C > 0 adds rlkernels with the logits soft-capped at C (Gemma 2's 30), and caps naive "
                             "torch's logits")


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def _measure(name: str, fwd: Callable[[], Any] | None, fwd_bwd: Callable[[], Any] | None) -> dict[str, Any]:
    row: dict[str, Any] = {"impl": name}
    try:
        if fwd is not None:
            row["fwd_ms"] = median_ms(fwd)
        if fwd_bwd is not None:
            row["fwd_bwd_ms"] = median_ms(fwd_bwd)
            _free()
            row["peak_extra_gib"] = peak_extra_memory_gib(fwd_bwd)
    except torch.cuda.OutOfMemoryError:
        row["note"] = "OOM"
    except Exception as exc:  # a peer's API drift must not kill the run
        row["note"] = f"{type(exc).__name__}: {str(exc)[:80]}"
    _free()
    return row


def _rlkernels_case(h, w, t, gl, ge, temperature: float, logprob_backend=None, softcap: float = 0.0):
    """``linear_logprob`` as the public call runs it, or (``logprob_backend``, one with
    another tile config) its autograd Function with that backend passed explicitly."""
    from ..ops.linear_logprob import LinearLogprobFunction, linear_logprob
    from ..ops.matmul import gemm_backend_for

    if logprob_backend is None:
        def call(hh, ww):
            return linear_logprob(hh, ww, t, temperature=temperature, return_entropy=True, logit_softcap=softcap)
    else:
        gemm_backend = gemm_backend_for(h.device, "triton")

        def call(hh, ww):
            return LinearLogprobFunction.apply(hh, ww, None, t, temperature, logprob_backend, gemm_backend)

    def fwd():
        with torch.no_grad():
            return call(h, w)

    def fwd_bwd():
        hh, ww = h.requires_grad_(), w.requires_grad_()
        lp, ent = call(hh, ww)
        return torch.autograd.grad((lp, ent), (hh, ww), (gl, ge))

    return fwd, fwd_bwd


def _naive_case(h, w, t, gl, ge, temperature: float, softcap: float = 0.0):
    def compute(hh, ww):
        z = (hh @ ww.t()).float()
        if softcap:
            z = torch.tanh(z / softcap) * softcap
        z = z / temperature
        logz = torch.logsumexp(z, dim=-1)
        lp = z.gather(1, t[:, None])[:, 0] - logz
        ent = logz - (torch.softmax(z, dim=-1) * z).sum(-1)
        return lp, ent

    def fwd():
        with torch.no_grad():
            return compute(h, w)

    def fwd_bwd():
        hh, ww = h.requires_grad_(), w.requires_grad_()
        lp, ent = compute(hh, ww)
        return torch.autograd.grad((lp, ent), (hh, ww), (gl, ge))

    return fwd, fwd_bwd


def _liger_case(h, w, t, gl):
    mod = optional_import("liger_kernel.transformers")
    if mod is None:
        return None
    loss_fn = mod.LigerFusedLinearCrossEntropyLoss(reduction="none")

    def fwd():
        with torch.no_grad():
            return -loss_fn(w, h, t)

    def fwd_bwd():
        hh, ww = h.requires_grad_(), w.requires_grad_()
        loss = loss_fn(ww, hh, t)
        return torch.autograd.grad(loss, (hh, ww), -gl)

    return fwd, fwd_bwd


def _cce_case(h, w, t, gl):
    mod = optional_import("cut_cross_entropy")
    if mod is None:
        return None

    def fwd():
        with torch.no_grad():
            return -mod.linear_cross_entropy(h, w, t, reduction="none")

    def fwd_bwd():
        hh, ww = h.requires_grad_(), w.requires_grad_()
        loss = mod.linear_cross_entropy(hh, ww, t, reduction="none")
        return torch.autograd.grad(loss, (hh, ww), -gl)

    return fwd, fwd_bwd


def make_inputs(n: int, d: int, v: int, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    """The benchmark's case on CUDA: hidden [n, d] and weight [v, d] bf16 (logits of std ~3),
    target [n] int64, per-token upstream grads of logp and entropy [n] fp32."""
    h = torch.randn(n, d, device="cuda", dtype=torch.bfloat16, generator=generator)
    w = (torch.randn(v, d, device="cuda", dtype=torch.bfloat16, generator=generator) * (3 * d ** -0.5)).to(torch.bfloat16)
    t = torch.randint(0, v, (n,), device="cuda", generator=generator)
    gl = torch.randn(n, device="cuda", generator=generator)
    ge = torch.randn(n, device="cuda", generator=generator)
    return h, w, t, gl, ge


def four_gemm_passes(h: torch.Tensor, w: torch.Tensor, generator: torch.Generator) -> Callable[[], Any]:
    """The four GEMM-sized passes of a fused fwd+bwd (logits, logits again, dH = g W,
    dW = g^T H) as bare cuBLAS GEMMs back to back, bf16 out, nothing else.

    No fused implementation does less: without an [N, V] buffer the backward must
    recompute the logits, and dH and dW are one GEMM each. It allocates a random g and
    one logits buffer (2 N V bytes each at bf16).
    """
    h, w = h.detach(), w.detach()  # the fused cases leave requires_grad set; out= refuses it
    n, v = h.shape[0], w.shape[0]
    g = torch.randn(n, v, device=h.device, generator=generator).mul_(1e-3).to(h.dtype)
    logits = torch.empty(n, v, device=h.device, dtype=h.dtype)
    dh = torch.empty_like(h)
    dw = torch.empty_like(w)

    def run() -> None:
        torch.mm(h, w.t(), out=logits)
        torch.mm(h, w.t(), out=logits)
        torch.mm(g, w, out=dh)
        torch.mm(g.t(), h, out=dw)

    return run


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    from ..ops import linear_logprob as L
    from ..ops.lm_head.config import FusedConfig

    temperature = float(getattr(args, "temperature", 1.0) or 1.0)
    softcap = float(getattr(args, "logit_softcap", 0.0) or 0.0)
    logprob_backend = None  # None: the public call with its own config
    if getattr(args, "config", None):
        parts = args.config.split(",")
        a = [int(x) for x in parts[:6]]
        logprob_backend = L.TritonLinearLogprobBackend(
            FusedConfig(a[0], a[1], a[2], group_m=a[3], num_warps=a[4], num_stages=a[5],
                        tma="tma" in parts[6:], persistent="pers" in parts[6:]))
    if getattr(args, "shape", None):
        shapes = tuple(tuple(int(x) for x in s.split(",")) for s in args.shape)
    else:
        shapes = QUICK_SHAPES if args.quick else FULL_SHAPES
    cfg = (logprob_backend or implementation("linear_logprob", "triton").backend_impl).config_for(torch.bfloat16)
    rows: list[dict[str, Any]] = []
    for n, d, v in shapes:
        g = torch.Generator(device="cuda").manual_seed(0)
        h, w, t, gl, ge = make_inputs(n, d, v, g)
        cases: list[tuple[str, Any]] = [("rlkernels", _rlkernels_case(h, w, t, gl, ge, temperature, logprob_backend))]
        if softcap:
            cases.append((f"rlkernels softcap {softcap:g}",
                          _rlkernels_case(h, w, t, gl, ge, temperature, logprob_backend, softcap)))
        if not getattr(args, "no_peers", False):
            free, _ = torch.cuda.mem_get_info()
            # fp32 logits, softmax, their grads and the bf16 copy: about 18 bytes per logit.
            if n * v * 18 < 0.8 * free:
                cases.append(("torch (materialized)", _naive_case(h, w, t, gl, ge, temperature, softcap)))
            else:
                rows.append({"N": n, "D": d, "V": v, "impl": "torch (materialized)", "note": "skipped: would OOM"})
            for name, case in (("liger FLCE", _liger_case(h, w, t, gl)), ("cut-cross-entropy", _cce_case(h, w, t, gl))):
                if case is None:
                    rows.append({"N": n, "D": d, "V": v, "impl": name, "note": "not installed"})
                else:
                    cases.append((name, case))
        for name, (fwd, fwd_bwd) in cases:
            h.requires_grad_(False)
            w.requires_grad_(False)
            row = {"N": n, "D": d, "V": v, **_measure(name, fwd, fwd_bwd)}
            if name == "rlkernels":
                row["config"] = cfg.short()
                flops = 2.0 * n * d * v
                if "fwd_ms" in row:
                    row["fwd_tflops"] = flops / row["fwd_ms"] / 1e9
                if "fwd_bwd_ms" in row:
                    row["fwd_bwd_tflops"] = 4 * flops / row["fwd_bwd_ms"] / 1e9
                # The speed of light on this machine: the logits GEMM alone (cuBLAS, bf16 out);
                # machines of one kind differ by a few percent, so ratios travel, ms do not.
                row["logits_gemm_ms"] = median_ms(lambda: torch.mm(h, w.t()))
                if "fwd_ms" in row:
                    row["fwd_vs_gemm"] = row["fwd_ms"] / row["logits_gemm_ms"]
                _free()
                # ... and of fwd+bwd: the four GEMM passes alone, back to back.
                try:
                    row["four_gemms_ms"] = median_ms(four_gemm_passes(h, w, g))
                    if "fwd_bwd_ms" in row:
                        row["fwd_bwd_vs_four_gemms"] = row["fwd_bwd_ms"] / row["four_gemms_ms"]
                except torch.cuda.OutOfMemoryError:
                    row["four_gemms_ms"] = None
                _free()
            rows.append(row)
            print(row, flush=True)
        del h, w, t, gl, ge, cases
        _free()
    print_table("linear_logprob (bf16, per-token upstream grads)", rows,
                ["N", "D", "V", "impl", "fwd_ms", "fwd_bwd_ms", "peak_extra_gib", "fwd_tflops", "fwd_bwd_tflops",
                 "logits_gemm_ms", "fwd_vs_gemm", "four_gemms_ms", "fwd_bwd_vs_four_gemms", "note"])
    write_json(args.json, "logprob", rows, {"fused_config": cfg.short(), "temperature": temperature,
                                             "logit_softcap": softcap})
    return rows
