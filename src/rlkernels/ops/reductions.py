"""The fixed-order sums the row reductions share: ``rms_norm``, ``softmax``,
``log_softmax``, the MoE router's softmax and the ATen mode's ``mean``.

Every op built on them is "elementwise work + one sum per row" (or per column).
Elementwise torch ops give each element the same bits wherever it sits in a tensor
(one IEEE rounding per op; ``exp``/``log``/``rsqrt`` measured position-independent on
CPU and CUDA), so invariance only needs the sums to have a fixed order:

* ``torch`` backend (any device): a sequential chain over the row,
  ``fl(...fl(fl(x_0) + x_1)... + x_{R-1})`` in fp64, rounded once to fp32 at the
  end, one elementwise add per step over all rows at once. The order depends on R alone,
  and zeros at *either* end add exactly 0, so left- and right-padded attention
  rows match. Rows longer than :data:`CHAIN_MAX` switch (by R alone) to
  :data:`LANES` lane accumulators stepped tile by tile, then a chain over lanes:
  still R-only and invariant to trailing zeros.
* ``triton`` backend (CUDA, or CPU under ``TRITON_INTERPRET=1``): one program per
  row, a fp32 accumulator vector of fixed width :data:`ROW_BLOCK` stepped over the
  row's tiles in ascending order, then a fixed pairwise tree over lane indices
  (layout-independent, unlike ``tl.sum``). Trailing zeros
  (masked keys, right padding, a longer KV length) land in extra tiles or masked
  lanes and add exactly 0; *leading* zeros shift lanes, so left padding is not
  bit-invariant here (nor in the tensor-core P@V).

Column sums (the RMSNorm weight gradient) reduce over the M rows (tokens) of a call
in an order fixed by M alone -- never by M's size class, the device or tuning:

* ``torch``: ascending over rows, one row per step (a chain of row adds in fp64).
* ``triton``: rows split into fixed blocks of :data:`ROWS_PER_BLOCK` aligned to
  row 0; block p's partial is an fp32 chain over its rows ascending (from 0.0),
  computed in parallel over blocks and column tiles; then each column's fp32
  chain over the partials, p ascending (from 0.0), rounded once to the output's
  dtype. No atomics.
"""
from __future__ import annotations

import torch

from ..gemm.chain import accumulator_dtype
from ..kernels._triton import cdiv
from ..kernels.norms import col_finish_kernel, col_partial_kernel, row_dot_kernel
from ..registry import backend_object
from ..runtime.launcher import cached_launcher

ROW_BLOCK = 1024  # must match pairwise_sum_1024; Triton tile width of the per-row sum (fixed: the order must not depend on R's size class)
COL_BLOCK = 128   # Triton column tile of the column sums (each column is its own chain: any width gives the same bits)
# Triton column sums: rows [p*ROWS_PER_BLOCK, (p+1)*ROWS_PER_BLOCK) form partial p. Fixed, aligned
# to row 0 and independent of M's size class, the GPU and any tuning: the order is a function of M.
ROWS_PER_BLOCK = 128
SUM_UNROLL = 16   # rows (partials) whose loads one step of a column chain issues together; order unchanged
NUM_STAGES = 3    # Triton's CUDA default; the loops' pipelining does not change the order
CHAIN_MAX = 16384  # torch backend: sequential chain up to this row length
LANES = 1024       # torch backend: lane count of the long-row sum

# Every Triton launch here goes through the cached launcher (runtime.launcher).
_launch_row_dot = cached_launcher(row_dot_kernel)
_launch_col_partial = cached_launcher(col_partial_kernel)
_launch_col_finish = cached_launcher(col_finish_kernel)
FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class TorchReductionBackend:
    """Sequential-chain sums (any device). Accumulates in fp64 and rounds once to the
    op's accumulator dtype (fp32; fp64 for fp64): products of fp32 values are exact in
    fp64 and a long sequential fp32 chain loses accuracy (measured 6.9e-6 rel on a
    16384-wide softmax), while the order -- and so the invariance -- is unchanged."""

    name = "torch"

    def row_dot(self, a: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        """sum_j a[i, j] * b[i, j] (or sum_j a[i, j]) for a 2-D ``a``; fp32 (fp64 for fp64)."""
        out_dt = accumulator_dtype(a.dtype)
        x = a.double() if b is None else a.double() * b.double()
        M, R = x.shape
        acc = torch.zeros(M, dtype=torch.float64, device=x.device)
        if R <= CHAIN_MAX:
            for j in range(R):
                acc.add_(x[:, j])
            return acc.to(out_dt)
        lanes = torch.zeros(M, LANES, dtype=torch.float64, device=x.device)
        for start in range(0, R, LANES):
            tile = x[:, start:start + LANES]
            lanes[:, :tile.shape[1]].add_(tile)
        for j in range(LANES):
            acc.add_(lanes[:, j])
        return acc.to(out_dt)

    def fuses_rms_norm(self, x: torch.Tensor, weight: torch.Tensor | None) -> bool:
        """Never: rms_norm runs torch elementwise ops around :meth:`row_dot` / :meth:`col_sum`."""
        return False

    def col_sum(self, x: torch.Tensor) -> torch.Tensor:
        """sum_i x[i, j] over rows, ascending; fp32 (fp64 for fp64)."""
        acc = torch.zeros(x.shape[1], dtype=torch.float64, device=x.device)
        for i in range(x.shape[0]):
            acc.add_(x[i].double())
        return acc.to(accumulator_dtype(x.dtype))


class TritonReductionBackend:
    """Fixed-tile Triton sums (fp32 accumulation)."""

    name = "triton"

    def row_dot(self, a: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        if a.dtype == torch.float64:
            return TorchReductionBackend().row_dot(a, b)
        a = a.contiguous()
        b = b.contiguous() if b is not None else None
        M, R = a.shape
        out = torch.empty(M, dtype=torch.float32, device=a.device)
        if M == 0:
            return out
        if R == 0:
            return out.zero_()
        bb = b if b is not None else a
        _launch_row_dot((M,), (a, bb, out, R, a.stride(0), bb.stride(0)), dict(HAS_B=b is not None, BLOCK=ROW_BLOCK),
                        num_warps=4, num_stages=NUM_STAGES)
        return out

    def col_sum(self, x: torch.Tensor) -> torch.Tensor:
        """sum_i x[i, j] for a 2-D ``x`` [M, N], fp32 (fp64 for fp64): blocked, see :func:`blocked_col_sum`."""
        if x.dtype == torch.float64:
            return TorchReductionBackend().col_sum(x)
        x = x.contiguous()
        out = torch.zeros(x.shape[1], dtype=torch.float32, device=x.device)
        blocked_col_sum(x, out)
        return out

    def fuses_rms_norm(self, x: torch.Tensor, weight: torch.Tensor | None) -> bool:
        """Whether rms_norm runs the fused row kernels (fp16/bf16/fp32 operands, rows not empty)."""
        return (x.dtype in FUSED_DTYPES and (weight is None or weight.dtype in FUSED_DTYPES)
                and x.shape[-1] > 0)


def blocked_col_sum(a: torch.Tensor, out: torch.Tensor, x: torch.Tensor | None = None,
                    rstd: torch.Tensor | None = None, keep_fp32: bool = False) -> None:
    """``out[j] = sum_i v[i, j]`` on the Triton backend, in a fixed order that depends on M alone.

    a: [M, N] contiguous (fp16/bf16/fp32); out: [N] (fp16/bf16/fp32), written once, the
    fp32 sum rounded to its dtype. ``v = a``, or with ``x`` [M, N] and ``rstd`` [M] (fp32)
    the RMSNorm weight-gradient term ``v = a * h`` with ``h = x * rstd`` rounded to x's
    dtype (not with ``keep_fp32``). Order: partial p = fp32 chain over rows
    p*ROWS_PER_BLOCK.. ascending, from 0.0; then out = fp32 chain over the partials, p
    ascending, from 0.0. No atomics.
    """
    M, N = a.shape
    if N == 0:
        return
    if M == 0:
        out.zero_()
        return
    P = cdiv(M, ROWS_PER_BLOCK)
    part = torch.empty(P, N, dtype=torch.float32, device=a.device)
    norm = x is not None
    xx = x if x is not None else a
    rs = rstd if rstd is not None else a
    _launch_col_partial((P, cdiv(N, COL_BLOCK)), (a, xx, rs, part, M, N, a.stride(0), xx.stride(0)),
                        dict(NORM=norm, KEEP_FP32=keep_fp32, ROWS=ROWS_PER_BLOCK, UNROLL=SUM_UNROLL,
                             BLOCK_N=COL_BLOCK), num_warps=4, num_stages=NUM_STAGES)
    _launch_col_finish((cdiv(N, COL_BLOCK),), (part, out, P, N), dict(UNROLL=SUM_UNROLL, BLOCK_N=COL_BLOCK),
                       num_warps=4, num_stages=NUM_STAGES)


def reduction_backend_for(op: str, device: torch.device,
                          backend: str | None = None) -> TorchReductionBackend | TritonReductionBackend:
    """The reduction backend object the registry picks for ``op`` on ``device``."""
    return backend_object(op, device, backend)
