"""GEMM backends: one primitive, :meth:`gemm`, per registry backend, used for every GEMM of every op.

* ``TritonGemmBackend`` -- the Triton chain (``gemm.triton``) from the checked-in table, and
  cuBLASLt without split-K for larger M where a probe proved the same bits.
* ``TorchGemmBackend`` -- the ascending elementwise chain (``gemm.chain``), any device.

The backends differ in how they produce the canonical bits, never in which bits a row gets.
``RLKERNELS_GEMM_BACKEND`` (:func:`gemm_backend_mode`) picks the route inside ``TritonGemmBackend``
(auto, Triton only, cuBLASLt only); the registry's backend picks the object.
The routing thresholds below are measured choices (docs/design/gemm_dispatch.md).
"""
from __future__ import annotations

import torch

from .._env import env_get
from ..runtime import mode_state as _mode_state
from .chain import chain_matmul, chain_sum
from .cublaslt import cublaslt_available, cublaslt_verified, linear_no_split_k
from .table import LM_HEAD_N, WIDE_N
from .triton import triton_gemm

# cuBLASLt-no-split from this M up (same bits, proven by a probe): measured on H100
# it matches stock cuBLAS within ~3% for M >= 128, while the Triton decode tiles
# beat both at M <= 16 and cuBLASLt's heuristics can pick badly there (M=16,
# K=12288: 263 us vs 49 us). See docs/design/gemm_dispatch.md.
CUBLASLT_MIN_M = 65
# Narrow outputs (N < WIDE_N) from M = 33: there cuBLASLt-no-split beat the Triton tile
# at M = 33-64 (12288 x 4096: 0.91-0.92x stock from HBM vs 0.96-0.97x; 4096^2 M = 33:
# 1.02-1.03x vs 1.06-1.08x, equal at 48-64), while on wide outputs the Triton tiles
# win (lm head 0.93-0.95x vs 1.00x); docs/design/gemm_dispatch.md.
CUBLASLT_MIN_M_NARROW = 33
# lm heads (N >= LM_HEAD_N) keep the Triton 128x128x128 tile up to M = 128, one row of
# tiles that streams the weight once: at M = 128 it takes 0.97x stock's time (455-459 vs
# 470-472 us) where cuBLASLt-no-split takes 1.00x. With two rows of tiles it is far
# slower (M = 192 / 256: 1.38x / 1.33x vs 1.00x; docs/design/gemm_dispatch.md).
CUBLASLT_MIN_M_LM_HEAD = 129


def cublaslt_min_m(n: int) -> int:
    """The smallest M the auto dispatcher sends to cuBLASLt-no-split for N outputs."""
    if n >= LM_HEAD_N:
        return CUBLASLT_MIN_M_LM_HEAD
    return CUBLASLT_MIN_M if n >= WIDE_N else CUBLASLT_MIN_M_NARROW


class TorchGemmBackend:
    name = "torch"

    def gemm(self, a: torch.Tensor, b: torch.Tensor, *, bias: torch.Tensor | None = None,
             out: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
             accumulate: bool = False, rowsum: torch.Tensor | None = None,
             b_transposed: bool = False) -> torch.Tensor:
        if b_transposed:
            b = b.t()
        acc = chain_matmul(a, b, acc=out if accumulate else None)
        if rowsum is not None:
            chain_sum(a, -1, acc=rowsum)
        if accumulate:
            return acc
        if bias is not None:
            acc = acc + bias.to(acc.dtype)
        result = acc.to(out_dtype or a.dtype)
        if out is not None:
            out.copy_(result)
            return out
        return result


def gemm_backend_mode() -> str:
    mode = (env_get("RLKERNELS_GEMM_BACKEND") or "auto").strip().lower() or "auto"
    if mode not in ("auto", "triton", "cublaslt"):
        raise ValueError(f"RLKERNELS_GEMM_BACKEND={mode!r}: expected auto, triton or cublaslt")
    return mode


def aligned_16_bytes(k: int, n: int) -> bool:
    """K and N multiples of 8 elements (16-byte rows for 16-bit types).

    cuBLASLt's bits were proven equal to the chain on such shapes only; with N = 8191
    it gave different bits for a few outputs per row (H100, tests/ops/test_matmul.py), so
    unaligned problems stay on the Triton chain.
    """
    return k % 8 == 0 and n % 8 == 0


# use_cublaslt's answers by everything it reads (see TritonGemmBackend.cublaslt_route);
# bounded like the launch plans.
_CUBLASLT_ROUTES: dict[tuple, bool] = {}
MAX_CUBLASLT_ROUTES = 4096


class TritonGemmBackend:
    name = "triton"

    def use_cublaslt(self, a: torch.Tensor, n: int, bias: torch.Tensor | None) -> bool:
        mode = gemm_backend_mode()
        # In the mode F.linear is itself overridden (to Triton): no detour through it.
        if mode == "triton" or _mode_state.overrides_installed():
            return False
        ok = cublaslt_available(a.device, a.dtype)
        if mode == "cublaslt":
            if not ok or not cublaslt_verified(a.device, a.dtype, a.shape[-1], bias is not None):
                raise RuntimeError(
                    f"rlkernels.matmul: RLKERNELS_GEMM_BACKEND=cublaslt but cuBLASLt-no-split is not verified "
                    f"to give the canonical bits for {a.dtype} K={a.shape[-1]} on {a.device}")
            return True
        return (ok and a.shape[0] >= cublaslt_min_m(n) and aligned_16_bytes(a.shape[-1], n)
                and cublaslt_verified(a.device, a.dtype, a.shape[-1], bias is not None))

    def cublaslt_route(self, a: torch.Tensor, n: int, bias: torch.Tensor | None) -> bool:
        """:meth:`use_cublaslt`, kept by what it depends on: A's shape, N, the dtype, the
        device, the bias's presence, RLKERNELS_GEMM_BACKEND and the batch-invariant mode
        (a probe's verdict is final for the process). Why: working the answer out cost
        3-6 us per call on the H100 hosts, where a cuBLASLt GEMM at M = 128 takes ~15 us of
        GPU time (docs/design/host_time.md)."""
        key = (a.shape, n, a.dtype, a.get_device(), bias is None, env_get("RLKERNELS_GEMM_BACKEND"),
               _mode_state.overrides_installed())
        route = _CUBLASLT_ROUTES.get(key)
        if route is None:
            route = self.use_cublaslt(a, n, bias)  # (a forced backend that cannot run raises: nothing kept)
            if len(_CUBLASLT_ROUTES) >= MAX_CUBLASLT_ROUTES:
                _CUBLASLT_ROUTES.clear()
            _CUBLASLT_ROUTES[key] = route
        return route

    def gemm(self, a: torch.Tensor, b: torch.Tensor, *, bias: torch.Tensor | None = None,
             out: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
             accumulate: bool = False, rowsum: torch.Tensor | None = None,
             b_transposed: bool = False) -> torch.Tensor:
        """C = A @ B; ``b_transposed``: b is given as B^T [N, K] (an nn.Linear weight),
        so no transposed view is made per call (host time at decode sizes)."""
        # Sizes the auto path keeps on Triton (below cublaslt_min_m) go straight there, before
        # the checks below (host time: a decode-size GEMM takes less on the GPU than its Python).
        if (a.dim() == 2 and a.shape[0] < cublaslt_min_m(b.shape[0] if b_transposed else b.shape[-1])
                and gemm_backend_mode() == "auto"):
            return triton_gemm(a, b, bias=bias, out=out, out_dtype=out_dtype, accumulate=accumulate, rowsum=rowsum,
                               b_transposed=b_transposed)
        # cuBLASLt only for activation-major A. A transposed A is a reduction over
        # tokens (dW): it stays on the Triton chain, whose TOKEN_BLOCK continuation is
        # proven, and needs no cuBLASLt probe per token count.
        plain = (out is None and not accumulate and rowsum is None and a.dim() == 2 and b.dim() == 2
                 and a.stride(-1) == 1 and out_dtype in (None, a.dtype) and a.shape[0] > 0 and a.shape[1] > 0)
        if plain and self.cublaslt_route(a, b.shape[0] if b_transposed else b.shape[1], bias):
            return linear_no_split_k(a, b if b_transposed else b.t(), bias)
        return triton_gemm(a, b, bias=bias, out=out, out_dtype=out_dtype, accumulate=accumulate, rowsum=rowsum,
                           b_transposed=b_transposed)
