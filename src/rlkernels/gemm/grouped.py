"""The grouped GEMMs over experts, one launch per projection, no host sync (host side of
``kernels.grouped_gemm``): :func:`grouped_gemm` (a row per sorted slot) and
:func:`grouped_wgrad` (a weight gradient per expert, reduced over its slots).

The slots (token, rank) come sorted by expert; ``slot_end`` [E] (on the device) says where
each expert's slots end. The kernels work their experts' extents out from ``slot_end``, so
each grid is known on the host without reading any count: for :func:`grouped_gemm` a
bound (:func:`max_row_tiles` row tiles, times the column tiles; programs past the last
real tile return at once), for :func:`grouped_wgrad` E times the tiles of one gradient.

Bits: each output element is the canonical K-chain of ``gemm.triton`` (one fp32 chain over
K ascending, rounded once), so a slot's row equals ``rlkernels.linear`` of its token row
alone with its expert's weight, and an expert's weight gradient the per-expert dW call's,
whatever tile the tables below pick (on Hopper the chain's bits do not depend on the tile
for 16-bit inputs; fp32 runs the IEEE FMA chain, which no tile changes). Under
``TRITON_INTERPRET=1`` the tile is the interpreter GEMM's (BLOCK_K = 16: the interpreter's
dot sums one BLOCK_K block at a time, as ``rlkernels.linear``'s interpreted kernel does).
"""
from __future__ import annotations

import torch

from .._env import triton_interpret
from ..kernels._triton import cdiv, pow2_at_least
from ..kernels.grouped_gemm import grouped_gemm_kernel, grouped_wgrad_kernel
from ..runtime.launcher import cached_launcher
from .table import GEMM_INTERPRETER_CONFIG, GemmConfig

# The seven pointers first in every call (absent ones stand in as C).
_launch_grouped = cached_launcher(grouped_gemm_kernel, leading_tensors=7) if grouped_gemm_kernel is not None else None
# The five pointers first in every call (an absent b_rows stands in as C).
_launch_wgrad = cached_launcher(grouped_wgrad_kernel, leading_tensors=5) if grouped_wgrad_kernel is not None else None

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
                      BLOCK_E=pow2_at_least(E, 16))
    _launch_grouped(grid, args, constexprs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return c, gu


# The weight gradient's tiles, fixed per dtype, never tuned at run time. Its K is an
# expert's token count, which every tile chains alike: on Hopper the 16-bit chain steps K
# 16 at a time in any tile, and fp32 runs the IEEE FMA chain. BLOCK_K = 64 for 16-bit is
# also the per-expert dW call's own (GEMM_ACCUMULATE_16BIT), so even the zero padding of an
# expert's last block is the same. Under the interpreter: the interpreter GEMM's tile
# (BLOCK_K = 16, the K blocks of the per-expert call there).
WGRAD_16BIT = GemmConfig(128, 128, 64, group_m=1, num_warps=8, num_stages=3)
WGRAD_FP32 = GemmConfig(64, 64, 32, group_m=1, num_warps=4, num_stages=3)


def wgrad_config(dtype: torch.dtype) -> GemmConfig:
    """The tile of :func:`grouped_wgrad` for operands of ``dtype``."""
    if triton_interpret():
        return GEMM_INTERPRETER_CONFIG
    return WGRAD_FP32 if dtype == torch.float32 else WGRAD_16BIT


def grouped_wgrad(a: torch.Tensor, b: torch.Tensor, slot_end: torch.Tensor, *, b_rows: torch.Tensor | None = None,
                  out: torch.Tensor | None = None, accumulate: bool = False, out_dtype: torch.dtype | None = None,
                  config: GemmConfig | None = None) -> torch.Tensor:
    """For each expert e with sorted slots [s0, s1): C[e] = A[s0:s1]^T @ B[s0:s1] (dW_e = dY_e^T
    @ X_e), or C[e] += that with ``accumulate``; one launch, no count read on the host.

    a: [slots, M] in sorted slot order, any strides (dY); b: [R, N], any strides, whose row
    of sorted slot s is ``b_rows[s]`` ([slots] int64 on the device, read in the kernel: no
    [slots, N] gather) or s itself (``b_rows`` None, R = slots); slot_end: [E] int32/int64 on
    a's device, non-decreasing, the last entry ``slots``; out: [E, M, N], any strides (default
    a new one in ``out_dtype``, else a's dtype). Each element is the canonical chain over the
    expert's slots ascending (its tokens in order), rounded once to out's dtype: the bits of
    ``gemm(a[s0:s1].t(), b[s0:s1], out_dtype=out.dtype)``, the per-expert call. With
    ``accumulate`` out (fp32: ``main_grad``) is the chain's starting value, updated in place,
    as ``gemm(..., out=out[e], accumulate=True)``; an expert with no slot keeps its values.
    Without it an expert with no slot gets zeros. Returns out.
    """
    slots, M = a.shape
    N = b.shape[1]
    E = slot_end.shape[0]
    if b_rows is None and b.shape[0] != slots:
        raise ValueError(f"rlkernels: grouped_wgrad: b has {b.shape[0]} rows for {slots} slots (and no b_rows)")
    if out is None:
        if accumulate:
            raise ValueError("rlkernels: grouped_wgrad: accumulate needs out (the fp32 chain's start)")
        out = a.new_empty((E, M, N), dtype=out_dtype or a.dtype)
    if tuple(out.shape) != (E, M, N):
        raise ValueError(f"rlkernels: grouped_wgrad: out must be {(E, M, N)}, got {tuple(out.shape)}")
    if accumulate and out.dtype != torch.float32:
        raise ValueError("rlkernels: grouped_wgrad: the accumulation target must be float32")
    if E == 0 or M == 0 or N == 0:
        return out
    if slots == 0:
        # Every chain empty: its start value (0, or out's when accumulating).
        if not accumulate:
            out.zero_()
        return out
    cfg = config or wgrad_config(a.dtype)
    grid = (E * cdiv(M, cfg.block_m) * cdiv(N, cfg.block_n),)
    # Runtime arguments in the kernel's order:
    #   pointers  a, b, b_rows, c, slot_end
    #   integers  M, N, stride_as, stride_am, stride_bs, stride_bn, stride_ce, stride_cm, stride_cn
    args = (a, b, out if b_rows is None else b_rows, out, slot_end, M, N, *a.stride(), *b.stride(), *out.stride())
    constexprs = dict(GATHER_B=b_rows is not None, ACC_FROM_C=accumulate, IEEE=a.dtype == torch.float32,
                      BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k)
    _launch_wgrad(grid, args, constexprs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out
