"""The grouped GEMM over experts, one launch per projection, no host sync (host side of
``kernels.grouped_gemm``).

The slots (token, rank) come sorted by expert; ``slot_end`` [E] (on the device) says where
each expert's slots end. The kernel works its tiles out from ``slot_end``, so the grid is a
bound known on the host without reading any count (:func:`max_row_tiles` row tiles,
times the column tiles). Programs
past the last real tile return at once.

Bits: each output element is the canonical K-chain of ``gemm.triton`` (one fp32 chain over
K ascending, rounded once), so a slot's row equals ``rlkernels.linear`` of its token row
alone with its expert's weight, whatever tile the table below picks (on Hopper the chain's
bits do not depend on the tile for 16-bit inputs; fp32 runs the IEEE FMA chain, which no
tile changes). Under ``TRITON_INTERPRET=1`` the tile is the interpreter GEMM's (BLOCK_K =
16: the interpreter's dot sums one BLOCK_K block at a time, as ``rlkernels.linear``'s
interpreted kernel does).
"""
from __future__ import annotations

import torch

from .._env import triton_interpret
from ..kernels._triton import cdiv
from ..kernels.grouped_gemm import grouped_gemm_kernel
from ..runtime.launcher import cached_launcher
from .table import GEMM_INTERPRETER_CONFIG, GemmConfig

# The seven pointers first in every call (absent ones stand in as C).
_launch_grouped = cached_launcher(grouped_gemm_kernel, leading_tensors=7) if grouped_gemm_kernel is not None else None

# Fixed per dtype and slot count, never tuned at run time; any entry gives the same bits.
# Few slots (decode): every expert holds a row or two, the launch streams the selected
# experts' weights once, so a 16-row tile wastes the least of the tensor cores.
GROUPED_SMALL_SLOTS = 256
GROUPED_16BIT_SMALL = GemmConfig(16, 64, 128, group_m=1, num_warps=4, num_stages=4)
GROUPED_16BIT = GemmConfig(64, 128, 64, group_m=1, num_warps=4, num_stages=3)
GROUPED_FP32_SMALL = GemmConfig(16, 64, 32, group_m=1, num_warps=4, num_stages=3)
GROUPED_FP32 = GemmConfig(32, 64, 32, group_m=1, num_warps=4, num_stages=3)


def grouped_config(slots: int, dtype: torch.dtype) -> GemmConfig:
    """The tile for ``slots`` sorted slots; both projections of a layer take the same one."""
    if triton_interpret():
        return GEMM_INTERPRETER_CONFIG
    small = slots <= GROUPED_SMALL_SLOTS
    if dtype == torch.float32:
        return GROUPED_FP32_SMALL if small else GROUPED_FP32
    return GROUPED_16BIT_SMALL if small else GROUPED_16BIT


def max_row_tiles(slots: int, experts: int, block_m: int) -> int:
    """An upper bound on sum_e cdiv(count_e, block_m) over counts summing to ``slots``: at
    most min(E, slots) experts hold slots, each adding at most block_m - 1 rows of padding."""
    return (slots + min(experts, slots) * (block_m - 1)) // block_m


def grouped_gemm(a: torch.Tensor, b: torch.Tensor, slot_end: torch.Tensor, slots: int, *,
                 a_rows: torch.Tensor | None = None, c_rows: torch.Tensor | None = None,
                 out_rows: int | None = None, out_dtype: torch.dtype | None = None, silu_up: bool = False,
                 keep_gate_up: bool = False, config: GemmConfig | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """For each sorted slot s of expert e: C[c_rows[s]] = A[a_rows[s]] @ B[e]^T.

    a: [R, K] (any strides); b: [E, N', K] (expert weights in nn.Linear layout, any
    strides: a transposed view ``w.mT`` of [E, K, N] weights gives A @ W[e], which the
    MoE backward runs); slot_end: [E] int32/int64 on a's device, non-decreasing, the last entry
    ``slots``; a_rows / c_rows: [slots] int64 (None: the slot itself); ``out_rows``: C's
    rows (default ``slots``). ``silu_up``: B's rows are [gate; up] (N' = 2N) and C gets
    h = silu(gate) * up, N columns; with ``keep_gate_up`` the gate and up outputs too, as
    a second result [slots, 2N] in sorted slot order. Returns (C, gate_up or None).
    """
    E, n_b, K = b.shape
    N = n_b // 2 if silu_up else n_b
    rows = slots if out_rows is None else out_rows
    out_dtype = out_dtype or a.dtype
    c = a.new_empty((rows, N), dtype=out_dtype)
    gu = a.new_empty((slots, n_b), dtype=out_dtype) if silu_up and keep_gate_up else None
    if slots == 0 or N == 0:
        return c, gu
    if K == 0:
        if silu_up:
            raise ValueError("rlkernels: grouped_gemm with silu_up needs K > 0")
        c.zero_()
        return c, gu
    cfg = config or grouped_config(slots, a.dtype)
    grid = (max_row_tiles(slots, E, cfg.block_m) * cdiv(N, cfg.block_n),)
    # Runtime arguments in the kernel's order:
    #   pointers  a, a_rows, b, c, c_rows, gu, slot_end
    #   integers  E, N, K, stride_am, stride_ak, stride_be, stride_bn, stride_bk,
    #             stride_cm, stride_cn, stride_gm, stride_gn
    g_strides = gu.stride() if gu is not None else (0, 0)
    args = (a, c if a_rows is None else a_rows, b, c, c if c_rows is None else c_rows, c if gu is None else gu,
            slot_end, E, N, K, *a.stride(), *b.stride(), *c.stride(), *g_strides)
    constexprs = dict(GATHER_A=a_rows is not None, SCATTER_C=c_rows is not None, SILU_UP=silu_up,
                      STORE_GU=gu is not None, IEEE=a.dtype == torch.float32, EVEN_K=K % cfg.block_k == 0,
                      BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                      BLOCK_E=max(16, 1 << (E - 1).bit_length()))
    _launch_grouped(grid, args, constexprs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return c, gu
