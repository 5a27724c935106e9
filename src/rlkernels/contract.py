"""The numerical contract: how far each op may be from its float64 reference.

``rel``: ||out - ref|| / ||ref|| (see :func:`rlkernels.testing.rel_error`);
``abs``: max |out - ref|. ``measured`` is the worst value seen by
``benchmarks/measure_contract.py`` over random shapes (CPU torch backend, the
Triton interpreter and the H100), ``tolerance`` is what tests enforce. Output
rounding dominates 16-bit results: bf16 keeps 8 significant bits (unit roundoff
2^-9 = 2.0e-3), fp16 11 (4.9e-4), fp32 24 (6.0e-8).
"""
from __future__ import annotations

import dataclasses

import torch

from .testing import rel_error


@dataclasses.dataclass(frozen=True)
class Tolerance:
    metric: str  # "rel" or "abs"
    tolerance: float
    measured: float


_F64, _F32, _F16, _BF16 = torch.float64, torch.float32, torch.float16, torch.bfloat16

def _row(metric: str, **by_dtype: tuple[float, float]) -> dict[torch.dtype, Tolerance]:
    names = {"fp64": _F64, "fp32": _F32, "fp16": _F16, "bf16": _BF16}
    return {names[k]: Tolerance(metric, tol, measured) for k, (tol, measured) in by_dtype.items()}


# (tolerance, measured worst). Measured: benchmarks/measure_contract.py (CPU: torch
# backend and interpreter; GPU: H100) plus the ops' tests at real sizes; see
# docs/contract.md for where each worst case came from.
CONTRACT: dict[str, dict[torch.dtype, Tolerance]] = {
    # output rounded to the input dtype
    "matmul": _row("rel", fp64=(1e-13, 2.7e-17), fp32=(2e-6, 1.6e-7), fp16=(1e-3, 2.4e-4), bf16=(8e-3, 1.9e-3)),
    # the fp32 accumulator itself (forward_fp32, dW into main_grad), by input dtype;
    # worst: a 4096-token dW reduction on H100
    "matmul_fp32_out": _row("rel", fp32=(2e-5, 4.9e-6), fp16=(2e-5, 4.9e-6), bf16=(2e-5, 4.9e-6)),
    "bmm": _row("rel", fp64=(1e-13, 2.7e-17), fp32=(2e-6, 1.6e-7), fp16=(1e-3, 2.4e-4), bf16=(8e-3, 1.9e-3)),
    # gradients (dA, dB; a shared b reduces over the whole batch): worst fp32 on H100, B=8192
    "bmm_grad": _row("rel", fp64=(1e-13, 1e-16), fp32=(2e-5, 4.7e-6), fp16=(2e-3, 4.6e-4), bf16=(1.6e-2, 4.4e-3)),
    # log-probs and entropies are fp32 outputs: absolute error in nats
    "linear_logprob": _row("abs", fp64=(1e-10, 4.4e-14), fp32=(1e-4, 5.5e-6), fp16=(1e-4, 9.1e-6), bf16=(1e-4, 3.7e-6)),
    # gradients wrt hidden/weight/bias: dominated by rounding dL/dlogits once to 16 bits
    "linear_logprob_grad": _row("rel", fp64=(1e-10, 1.6e-14), fp32=(1e-5, 1.3e-6), fp16=(2e-3, 4.6e-4), bf16=(1.6e-2, 4.4e-3)),
    "rms_norm": _row("rel", fp64=(1e-12, 8.6e-15), fp32=(1e-6, 9.0e-8), fp16=(1e-3, 3.6e-4), bf16=(8e-3, 2.6e-3)),
    # Cohere's LayerNorm (no bias); measured: per-row worst on the CPU torch backend, rows of
    # 1..4096 with mean 3 and std 2
    "layer_norm": _row("rel", fp64=(1e-12, 1.8e-15), fp32=(1e-6, 1.4e-7), fp16=(1e-3, 3.6e-4), bf16=(8e-3, 2.9e-3)),
    "softmax": _row("rel", fp64=(1e-12, 3.8e-15), fp32=(1e-6, 9.3e-8), fp16=(1e-3, 2.6e-4), bf16=(8e-3, 1.9e-3)),
    "log_softmax": _row("rel", fp64=(1e-12, 2.9e-16), fp32=(1e-6, 4.2e-8), fp16=(1e-3, 2.4e-4), bf16=(8e-3, 1.8e-3)),
    # fused attention output; 16-bit: p is rounded to the input dtype before P @ V (as in
    # FlashAttention). Measured on the CPU (torch backend and interpreter, L <= 150, D = 32);
    # the GPU rows are checked by tests/ops/attention/test_api.py at L = 1031.
    "attention": _row("rel", fp64=(1e-12, 4.3e-16), fp32=(2e-6, 3.0e-7), fp16=(2e-3, 2.4e-4), bf16=(1.6e-2, 1.8e-3)),
    # the routed experts of one MoE layer (gate/up GEMM, SiLU x up, down GEMM, fp32 combine),
    # against reference.moe_experts_ref; measured on the CPU torch backend (T = 67, H = 48)
    "moe": _row("rel", fp64=(1e-13, 3.9e-16), fp32=(2e-6, 2.6e-7), fp16=(3e-3, 5.1e-4), bf16=(1.6e-2, 4.0e-3)),
    # dQ, dK, dV (P and dS rounded to the input dtype before their dots)
    "attention_grad": _row("rel", fp64=(1e-10, 9.3e-16), fp32=(1e-5, 5.1e-7), fp16=(3e-3, 5.8e-4), bf16=(2.4e-2, 6.0e-3)),
    # elementwise activations (tanh-GELU) and their gradients, rounded once to the dtype
    "activation": _row("rel", fp64=(1e-13, 7.8e-18), fp32=(1e-6, 2.2e-8), fp16=(1e-3, 8.1e-5), bf16=(8e-3, 5.8e-4)),
    "activation_grad": _row("rel", fp64=(1e-13, 5.4e-16), fp32=(2e-6, 1.7e-7), fp16=(2e-3, 1.8e-4),
                            bf16=(1.6e-2, 1.4e-3)),
}


def tolerance(op: str, dtype: torch.dtype) -> Tolerance:
    try:
        return CONTRACT[op][dtype]
    except KeyError:
        raise KeyError(f"rlkernels.contract: no tolerance for {op} in {dtype}") from None


def check(op: str, dtype: torch.dtype, out: torch.Tensor, ref: torch.Tensor) -> float:
    """The error of ``out`` vs ``ref`` under the op's metric; raises AssertionError past tolerance."""
    tol = tolerance(op, dtype)
    if tol.metric == "rel":
        err = rel_error(out, ref)
    else:
        diff = (out.detach().double().cpu() - ref.detach().double().cpu()).abs()
        err = float(diff.max()) if diff.numel() else 0.0
        if torch.isnan(diff).any():
            err = float("inf")
    if not err <= tol.tolerance:
        raise AssertionError(f"rlkernels.{op} {dtype}: {tol.metric} error {err:.3e} exceeds the contract "
                             f"tolerance {tol.tolerance:.1e}")
    return err
