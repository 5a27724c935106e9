"""``bmm``: batch-invariant batched GEMM, with a one-launch kernel for tiny matrices.

    C[i] = A[i] @ B[i]        a [B, m, k], b [B, k, n]  (or a shared b [k, n])

Every output element is the fp32 accumulation of its dot product over k in
ascending order, rounded once to the input dtype -- the library's canonical
chain (see ``gemm/triton.py``). Each batch element is computed by code that sees
only that element, so its bits do not depend on B, on its position, or on the
other elements.

Paths (triton backend):
  * tiny -- ``m, n, k <= 64``: one launch, one program per fixed group of G batch
    elements (or, for table entries marked persistent, a fixed number of programs per
    SM walking the groups with the next group's loads in flight), whole operands
    staged in registers. ``tl.dot`` on operands
    zero-padded to powers of two >= 16 (fp32 rows: any power of two on Triton >= 3.5;
    zeros past k extend the chain harmlessly:
    fl(acc + 0) = acc), or, for fp32, an explicit ascending-k FMA loop, which is
    the same sequential FMA chain that fp32 ``tl.dot(input_precision="ieee")``
    lowers to. The config (G, warps, mode) comes from a checked-in table keyed by
    (m, n, k, dtype) only -- never by B, never by timing at run time -- so the
    grid is ``cdiv(B, G)`` and nothing else about the launch depends on B.
    The tiny path serves every B >= 1 with fitting dims (B == 1 included), so an
    element's kernel never changes with the batch size.
  * general -- larger dims, or ``RLKERNELS_DISABLE_TINY_GEMM=1``: ``triton_gemm``
    with its batch axis. Never cuBLAS/torch.bmm, whose algorithm choice depends on B.
    A failed tiny launch raises (``_triton_bmm`` says why it does not fall back).

The torch backend is ``chain_matmul`` (ascending elementwise chain, batch dims).

Backward uses the same entry point: dA = dC @ B^T (per element), dB = A^T @ dC
per element for a 3-D b; for a shared 2-D b, dB = sum_i A_i^T dC_i is one GEMM
over the flattened (batch, m) axis, reduced in ascending order (batch-major).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from . import _validate as V
from .._env import switch_on
from ..registry import OpImpl, register_backends, select_backend
from ..gemm.chain import accumulator_dtype, chain_matmul

from ..kernels._triton import DOT_ANY_M, cdiv, pow2_at_least
from ..kernels.bmm import bmm_tiny_kernel
from ..gemm.triton import triton_gemm
from ..runtime.device import sm_count
from ..runtime.launcher import cached_launcher
from ..runtime.opaque import opaque_to_compile

OP = "bmm"
TINY_MAX_DIM = 64
DISABLE_ENV = "RLKERNELS_DISABLE_TINY_GEMM"

# Tiny batched GEMMs are host-bound: later launches skip Triton's binder (runtime.launcher).
_launch_bmm_tiny = cached_launcher(bmm_tiny_kernel) if bmm_tiny_kernel is not None else None


@dataclasses.dataclass(frozen=True)
class TinyConfig:
    """Launch config of the tiny kernel for one (m, n, k, dtype).

    group: batch elements per program step (power of two); num_warps: warps per
    program; use_dot: ``tl.dot`` on padded operands (required for 16-bit: the
    tensor-core chain is the canonical one), else the explicit fp32 FMA loop
    (fp32 only; no padding of m and n to 16).
    programs_per_sm > 0 makes the kernel persistent: ``programs_per_sm`` x SMs
    programs walk the groups in a fixed stride, software-pipelined ``num_stages``
    deep, so a program's next operands are in flight while it computes and stores
    the current ones (one program per group otherwise). Placement only: every
    group runs the same instructions wherever it lands.
    """

    group: int
    num_warps: int
    use_dot: bool = True
    programs_per_sm: int = 0
    num_stages: int = 1

    @property
    def persistent(self) -> bool:
        return self.programs_per_sm > 0

    def short(self) -> str:
        base = f"G{self.group}/w{self.num_warps}/{'dot' if self.use_dot else 'fma'}"
        return f"{base}/p{self.programs_per_sm}s{self.num_stages}" if self.persistent else base



def _pow2_floor(x: int) -> int:
    """The largest power of two <= x (x >= 1)."""
    return 1 << (x.bit_length() - 1)


def tiny_blocks(m: int, n: int, k: int, cfg: TinyConfig, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) the kernel stages for an m x k @ k x n element."""
    if cfg.use_dot:
        # tl.dot wants >= 16 per dim before Triton 3.5. From 3.5 it takes fewer rows,
        # and fp32's FMA lowering then does no work for rows that do not exist (16-bit
        # tensor-core dots pad them again inside, so they keep 16).
        m_floor = 1 if dtype == torch.float32 and DOT_ANY_M else 16
        return pow2_at_least(m, m_floor), pow2_at_least(n, 16), pow2_at_least(k, 16)
    # The FMA loop is unrolled over exactly k steps: BLOCK_K is k itself (no arange over it).
    return pow2_at_least(m, 1), pow2_at_least(n, 1), k


_F32, _F16, _BF16 = torch.float32, torch.float16, torch.bfloat16

# Per-shape configs: (m, n, k, dtype) -> TinyConfig. Checked in, never tuned at run
# time: the candidate of ``python -m rlkernels.bench bmm --sweep`` fastest on average
# over H100 sweeps in which every candidate gave the same bits. Persistent entries (4th
# and 5th fields), also all with the table's bits, are kept where they won by >= 5% and
# a neighbouring variant agreed (docs/operators/bmm.md,
# benchmarks/results/bmm_sweep_h100.json; what did not pay: docs/design/refuted.md).
TINY_TABLE: dict[tuple[int, int, int, torch.dtype], TinyConfig] = {
    (12, 12, 64, _F32): TinyConfig(1, 1, True),
    (12, 12, 64, _BF16): TinyConfig(1, 1, True),
    (12, 64, 12, _F32): TinyConfig(1, 1, True, 8, 2),  # 3.21 -> 2.96 us
    (12, 64, 12, _BF16): TinyConfig(1, 2, True),
    (16, 16, 16, _F32): TinyConfig(1, 1, True, 16, 2),  # 4.32 -> 3.84 us
    (16, 16, 16, _BF16): TinyConfig(2, 1, True, 8, 2),  # 2.79 -> 2.64 us
    (64, 64, 64, _F32): TinyConfig(1, 8, True),
    (64, 64, 64, _BF16): TinyConfig(1, 8, True),
    (8, 8, 32, _F32): TinyConfig(1, 1, True, 8, 3),  # 7.75 -> 7.26 us
    (8, 8, 32, _BF16): TinyConfig(2, 2, True),
}


def default_tiny_config(m: int, n: int, k: int, dtype: torch.dtype) -> TinyConfig:
    """The rule for shapes not in :data:`TINY_TABLE` (a pure function of the shape)."""
    # fp32 with a tiny m or n: the FMA loop avoids padding them to 16 (up to 16x less work).
    use_dot = not (dtype == torch.float32 and min(m, n) <= 8)
    probe = TinyConfig(1, 4, use_dot)
    bm, bn, bk = tiny_blocks(m, n, k, probe, dtype)
    tile = max(bm * bk, bk * bn, bm * bn)
    # About 4K staged elements per operand per program: enough work per program
    # to amortise its start-up, few enough registers to keep occupancy. Rounded down
    # to a power of two: the kernel stages the group with tl.arange(0, GROUP), which
    # takes powers of two only. (The FMA mode's BLOCK_K is k itself, so its tile need
    # not be a power of two: 17 x 5 x 33 fp32 gave 4096 // 1056 = 3, which failed to
    # compile on every Triton and fell back to the general path. Shapes whose quotient
    # was already a power of two keep exactly the group they had.)
    group = _pow2_floor(max(1, min(16, 4096 // tile)))
    return TinyConfig(group, 4, use_dot)


def tiny_config(m: int, n: int, k: int, dtype: torch.dtype) -> TinyConfig:
    """The config for an (m, n, k, dtype) element; depends on nothing else."""
    cfg = TINY_TABLE.get((m, n, k, dtype))
    if cfg is None and dtype == torch.float16:
        cfg = TINY_TABLE.get((m, n, k, torch.bfloat16))  # same tensor-core chain and layout
    return cfg or default_tiny_config(m, n, k, dtype)


def tiny_enabled() -> bool:
    return not switch_on(DISABLE_ENV, default=False)


def uses_tiny_path(m: int, n: int, k: int) -> bool:
    return tiny_enabled() and max(m, n, k) <= TINY_MAX_DIM


def _pow2_divisor(x: int) -> int:
    """The largest power of two <= 16 that divides x (16 for 0)."""
    return min(16, x & -x) if x else 16


def _b_strides(b: torch.Tensor) -> tuple[int, int, int]:
    # A shared 2-D b is every element's b: batch stride 0.
    return (0, b.stride(0), b.stride(1)) if b.dim() == 2 else (b.stride(0), b.stride(1), b.stride(2))


def _launch_tiny(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, cfg: TinyConfig) -> None:
    """Run the tiny kernel: a [B, m, k], b [B, k, n] or [k, n], out [B, m, n] (B, m, n, k >= 1)."""
    Bt, M, K = a.shape
    N = b.shape[-1]
    if not cfg.use_dot and a.dtype != torch.float32:
        raise ValueError("rlkernels.bmm: the FMA mode is fp32 only (16-bit uses the tensor-core chain)")
    bm, bn, bk = tiny_blocks(M, N, K, cfg, a.dtype)
    sbb, sbk, sbn = _b_strides(b)
    groups = cdiv(Bt, cfg.group)
    if cfg.persistent:

        grid = (min(groups, cfg.programs_per_sm * sm_count(a.device)),)
    else:
        grid = (groups,)
    _launch_bmm_tiny(
        grid,
        (a, b, out,
         Bt, M, N, K,
         a.stride(0), a.stride(1), a.stride(2),
         sbb, sbk, sbn,
         out.stride(0), out.stride(1), out.stride(2)),
        dict(M_DIV=_pow2_divisor(M), N_DIV=_pow2_divisor(N), K_DIV=_pow2_divisor(K),
             AM_DIV=_pow2_divisor(a.stride(1)), AK_DIV=_pow2_divisor(a.stride(2)), BK_DIV=_pow2_divisor(sbk),
             BN_DIV=_pow2_divisor(sbn), CM_DIV=_pow2_divisor(out.stride(1)), CN_DIV=_pow2_divisor(out.stride(2)),
             GROUP=cfg.group, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, USE_DOT=cfg.use_dot, IEEE=a.dtype == torch.float32,
             PERSISTENT=cfg.persistent, STAGES=cfg.num_stages),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def _general_triton(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """The batch-invariant general GEMM into ``out`` [B, m, n] (it chunks past CUDA's grid limit)."""

    triton_gemm(a, b, out=out)


def _triton_bmm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, *,
                config: TinyConfig | None = None, force_general: bool = False) -> torch.Tensor:
    """a [B, m, k] @ b [B, k, n] or [k, n] -> [B, m, n] in ``out_dtype`` on the triton backend.

    ``config``: run the tiny kernel with exactly this config; ``force_general``:
    the general path whatever the dims (both for benchmarks and tests).
    """
    Bt, M, K = a.shape
    N = b.shape[-1]
    out = torch.empty((Bt, M, N), dtype=out_dtype, device=a.device)
    if out.numel() == 0:
        return out
    if K == 0:
        return out.zero_()
    if config is not None:
        # An explicit config (benchmark sweeps, tests) must run as asked: no fallback.
        _launch_tiny(a, b, out, config)
        return out
    if not force_general and uses_tiny_path(M, N, K):
        cfg = tiny_config(M, N, K, a.dtype)
        try:
            _launch_tiny(a, b, out, cfg)
        except Exception as exc:  # noqa: BLE001 - compile, resources, driver: all re-raised as they are
            # No fallback to the general kernel. It would keep an element's bits only if
            # the failure were a pure function of (m, n, k, dtype), and it is not: Triton
            # also specializes on B == 1, on strides equal to 1 or divisible by 16 (and
            # the *_DIV classes), on 16-byte pointer alignment, and resources depend on the
            # GPU. One shape's elements could then run on the tiny kernel in one call and
            # the general one in the next, and the two agree bit for bit only as a GPU
            # property we test, not one we rely on (docs/operators/bmm.md). The config
            # rule is checked to give blocks the kernel takes for every shape it serves
            # (tests/ops/test_bmm.py, and an offline sm_90 compile of every config class).
            if hasattr(exc, "add_note"):  # Python >= 3.11; the exception keeps its type
                exc.add_note(f"rlkernels.bmm: the tiny-GEMM kernel failed for m={M} n={N} k={K} {a.dtype} "
                             f"(config {cfg.short()}); there is no fallback, as its bits could differ. "
                             f"{DISABLE_ENV}=1 runs every shape on the general kernel.")
            raise
        return out
    _general_triton(a, b, out)
    return out


def _torch_bmm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    return chain_matmul(a, b).to(out_dtype)


def _compute(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, backend: str) -> torch.Tensor:
    if backend == "triton":
        return _triton_bmm(a, b, out_dtype)
    return _torch_bmm(a, b, out_dtype)


def _reduce_shared_b_grad(a: torch.Tensor, grad: torch.Tensor, backend: str) -> torch.Tensor:
    """sum_i A_i^T dC_i for a shared b: fp32 [k, n], one ascending chain over (batch, m)."""
    Bt, M, K = a.shape
    N = grad.shape[-1]
    a2 = a.reshape(Bt * M, K)
    g2 = grad.reshape(Bt * M, N)
    if backend == "triton":
    
        return triton_gemm(a2.t(), g2, out_dtype=torch.float32)
    return chain_matmul(a2.t(), g2)


class BmmFunction(torch.autograd.Function):
    """C = A @ B per batch element; the backward runs the same kernels."""

    @staticmethod
    def forward(ctx, a, b, out_dtype, backend):  # type: ignore[override]
        ctx.save_for_backward(a, b)
        ctx.backend = backend
        return _compute(a, b, out_dtype, backend)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        a, b = ctx.saved_tensors
        backend = ctx.backend
        dc = grad_out.to(a.dtype)
        grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            # dA_i = dC_i @ B_i^T: another bmm of tiny elements (k x n transposed view).
            grad_a = _compute(dc, b.transpose(-1, -2), a.dtype, backend)
        if ctx.needs_input_grad[1]:
            if b.dim() == 2:
                if a.shape[0] == 0 or a.shape[1] == 0:
                    grad_b = torch.zeros_like(b)
                else:
                    grad_b = _reduce_shared_b_grad(a, dc, backend).to(b.dtype)
            else:
                grad_b = _compute(a.transpose(-1, -2), dc, b.dtype, backend)
        return grad_a, grad_b, None, None


def validate_bmm(a: Any, b: Any) -> None:
    """Raise ValueError/TypeError naming ``bmm`` on anything the kernels can't take."""
    V.require_tensor(OP, "a", a)
    V.require_tensor(OP, "b", b)
    V.require_float(OP, "a", a)
    V.require_float(OP, "b", b)
    V.require_ndim(OP, "a", a, 3, 3)
    V.require_ndim(OP, "b", b, 2, 3)
    V.require_same_device(OP, a=a, b=b)
    V.require_same_dtype(OP, a=a, b=b)
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(f"rlkernels.{OP}: inner dimensions differ: a {tuple(a.shape)} has k={a.shape[-1]}, "
                         f"b {tuple(b.shape)} has k={b.shape[-2]}")
    if b.dim() == 3 and b.shape[0] != a.shape[0]:
        raise ValueError(f"rlkernels.{OP}: batch sizes differ: a {tuple(a.shape)}, b {tuple(b.shape)} "
                         f"(a shared b must be 2-D [k, n])")


def _run(a: Any, b: Any, out_dtype: torch.dtype | None, backend: str | None) -> torch.Tensor:
    V.require_tensor(OP, "a", a)
    V.require_tensor(OP, "b", b)
    if a.is_floating_point() and b.is_floating_point():
        a, b = V.autocast(a, b)
    validate_bmm(a, b)
    name, _ = select_backend(OP, a.device, backend)
    V.refuse_interpreted_bf16(OP, name, a)
    if name == "triton" and a.dtype == torch.float64:
        raise ValueError(f"rlkernels.{OP}: float64 runs on the torch backend only (RLKERNELS_BACKEND=torch)")
    return BmmFunction.apply(a, b, out_dtype or a.dtype, name)


class _BmmOp(OpImpl):
    op_class = "bmm"

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """a [B, m, k] @ b [B, k, n] or [k, n] -> [B, m, n] in a.dtype."""
        return _run(a, b, None, self.backend)

    def forward_fp32(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """The same chain with the fp32 accumulator kept (fp64 for fp64 inputs)."""
        return _run(a, b, accumulator_dtype(a.dtype), self.backend)

    def invariance_case(self, device: torch.device, dtype: torch.dtype,
                        generator: torch.Generator) -> tuple[Callable[[torch.Tensor], Any], torch.Tensor]:
        a = torch.randn(37, 12, 64, generator=generator).to(device=device, dtype=dtype)
        b = (torch.randn(64, 12, generator=generator) / 8.0).to(device=device, dtype=dtype)
        return (lambda rows: self.forward(rows, b)), a


register_backends(OP, _BmmOp, {"triton": None, "torch": None})


@opaque_to_compile
def bmm(a: torch.Tensor, b: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """Batch-invariant batched matmul.

    a: [B, m, k]; b: [B, k, n], or [k, n] shared by every element; bf16/fp16/fp32
    (fp64 on the torch backend), one dtype and device, any strides. Returns
    [B, m, n] in a.dtype: each element's fp32 ascending-k chain rounded once,
    a function of that element's operands alone. Differentiable in a and b.
    """
    return _run(a, b, None, backend)
