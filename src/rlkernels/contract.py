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


@dataclasses.dataclass(frozen=True)
class Tolerance:
    metric: str  # "rel" or "abs"
    tolerance: float
    measured: float


_F64, _F32, _F16, _BF16 = torch.float64, torch.float32, torch.float16, torch.bfloat16

CONTRACT: dict[str, dict[torch.dtype, Tolerance]] = {
    "matmul": {
        _F64: Tolerance("rel", 1e-13, 0.0),
        _F32: Tolerance("rel", 2e-6, 0.0),
        _F16: Tolerance("rel", 1e-3, 0.0),
        _BF16: Tolerance("rel", 8e-3, 0.0),
    },
}


def tolerance(op: str, dtype: torch.dtype) -> Tolerance:
    try:
        return CONTRACT[op][dtype]
    except KeyError:
        raise KeyError(f"rlkernels.contract: no tolerance for {op} in {dtype}") from None


def check(op: str, dtype: torch.dtype, out: torch.Tensor, ref: torch.Tensor) -> float:
    """The error of ``out`` vs ``ref`` under the op's metric; raises AssertionError past tolerance."""
    from .testing import rel_error

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
