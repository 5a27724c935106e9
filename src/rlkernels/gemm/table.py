"""The checked-in GEMM dispatch table: which tile (and schedule) a problem gets.

Pure and checked in, never tuned at run time (a timing-based pick can differ between
processes). Every entry produces the canonical K-chain's bits -- the chain does not
depend on the tile on Hopper -- so the table may pick by M, N and B's layout without
changing a row's result; ``tests/ops/test_matmul.py`` proves it for every entry.
Measured choices: docs/design/gemm_dispatch.md.
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from .._env import triton_interpret
from ..kernels._triton import DOT_ANY_M


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    # Large-M tiles: operands by TMA (gemm.tma) where the layouts allow -- else the
    # pointer kernel with the same tile, which gives the same bits -- and a persistent,
    # optionally warp-specialized schedule.
    tma: bool = False
    persistent: bool = False
    warp_specialize: bool = False
    # fp32: compute C^T = B^T @ A^T with A^T made contiguous (see swappable); block_m
    # then runs over N and block_n over M.
    swap_ab: bool = False

    def short(self) -> str:
        sched = "/tma" if self.tma else ""
        sched += ("/pers" + ("-ws" if self.warp_specialize else "")) if self.persistent else ""
        sched += "/swap" if self.swap_ab else ""
        return f"{self.block_m}x{self.block_n}x{self.block_k}/w{self.num_warps}/s{self.num_stages}{sched}"


# The dispatch table: (dtype kind) -> rows of (largest M, smallest N, config); the
# first row with m <= largest M and n >= smallest N wins. Pure and checked in --
# never tuned at run time (a timing-based pick can differ between processes).
# Picked offline on H100 by benchmarks/tune_gemm.py; the canonical K-chain makes every
# entry produce the same bits (tests/ops/test_matmul.py proves it for each entry).
# The measurements behind each row: docs/design/gemm_dispatch.md.
WIDE_N = 8192  # wide outputs (MLP up-projections, lm heads) want wider N tiles at decode
LM_HEAD_N = 65536  # vocabulary-sized outputs (lm heads)
GEMM_TABLE_16BIT: tuple[tuple[int, int, GemmConfig], ...] = (
    # M <= 16 (decode): one tile per width class serves M = 1..16. Rows past M are masked,
    # not wrapped (wrapped rows re-read row 0 from the same L2 lines), so M = 1 runs like
    # M = 4. 32-wide N tiles keep more programs in flight while the weight streams from
    # HBM. Same bits on every tile; docs/design/gemm_dispatch.md#decode-tiles.
    (16, LM_HEAD_N, GemmConfig(16, 32, 256, group_m=1, num_warps=4, num_stages=6)),
    (16, WIDE_N, GemmConfig(16, 32, 128, group_m=1, num_warps=2, num_stages=4)),
    (16, 0, GemmConfig(16, 32, 256, group_m=1, num_warps=4, num_stages=5)),
    (64, WIDE_N, GemmConfig(64, 128, 128, group_m=8, num_warps=4, num_stages=3)),
    (32, 0, GemmConfig(32, 32, 256, group_m=4, num_warps=4, num_stages=4)),
    # M in (32, 64] on narrower outputs: 64-row tiles, N tiles of 32 keep 128 programs
    # on a 4096-wide output (docs/design/gemm_dispatch.md#decode-tiles).
    (64, 0, GemmConfig(64, 32, 256, group_m=1, num_warps=4, num_stages=4)),
    (256, WIDE_N, GemmConfig(128, 128, 128, group_m=8, num_warps=8, num_stages=3)),
    (256, 0, GemmConfig(64, 64, 128, group_m=8, num_warps=4, num_stages=4)),
    # Large M: TMA operand loads and a persistent schedule, warp-specialized up to
    # M = 2048: the pointer kernel with the same tile gives the same bits, more slowly
    # (docs/design/gemm_dispatch.md#tma-tiles-large-m).
    (2048, 0, GemmConfig(128, 256, 64, group_m=8, num_warps=8, num_stages=3, tma=True, persistent=True,
                         warp_specialize=True)),
    (1 << 62, 0, GemmConfig(128, 256, 64, group_m=8, num_warps=8, num_stages=3, tma=True, persistent=True)),
)
# Decode rows for a B stored [K, N] with N contiguous (``rlkernels.matmul(x, b)`` on a
# row-major matrix), consulted before the table above: the table's 16x32 tiles were
# picked for a k-contiguous nn.Linear weight, and on a [K, N] lm head they read 32-wide
# row pieces. 128-wide N tiles read whole 256-byte rows; same bits (the K chain does not
# depend on the tile). See docs/design/gemm_dispatch.md#decode-tiles.
GEMM_TABLE_16BIT_N_CONTIGUOUS_B: tuple[tuple[int, int, GemmConfig], ...] = (
    (16, WIDE_N, GemmConfig(16, 128, 128, group_m=1, num_warps=4, num_stages=3)),
)
# dW = dY^T @ X (A read transposed, reduction over tokens) and fp32 chained outputs:
# their own tile (the fp32 output goes through pointers, see gemm.tma).
GEMM_ACCUMULATE_16BIT = GemmConfig(128, 256, 64, group_m=8, num_warps=8, num_stages=3, tma=True, persistent=True)
# fp32 (IEEE): tl.dot's FMA lowering chains every output element over ascending k from
# registers, whatever the tile or orientation, so every entry gives the same bits
# (tests/ops/test_matmul.py). What the tile changes is shared-memory traffic: each lane
# owns output columns and reads B's column k-values; a k-contiguous B (an nn.Linear
# weight read as W^T) puts a lane's column 256 bytes from its neighbour's, 8-way bank
# conflicts that hold every forward-orientation tile far below the FMA peak. Swapped, the
# weight is the row operand (read broadcast across a warp) and the activation,
# transposed once into [K, M] (tokens x hidden: small next to the GEMM), the column
# operand with lanes on consecutive addresses. A few rows on a narrow output stay
# unswapped: their dot runs unpadded (Triton >= 3.5), one lane per output column.
# Picked on H100 (every candidate's bits equal); docs/design/gemm_dispatch.md#fp32-the-swap.
_FP32_M1 = GemmConfig(1, 32, 128, group_m=1, num_warps=1, num_stages=4)
_FP32_SWAP_32X32 = GemmConfig(32, 32, 32, group_m=1, num_warps=2, num_stages=4, swap_ab=True)
GEMM_TABLE_FP32: tuple[tuple[int, int, GemmConfig], ...] = (
    (1, 0, _FP32_M1),
    # Wide outputs: one 16-token tile streams the weight once.
    (16, LM_HEAD_N, GemmConfig(32, 16, 64, group_m=1, num_warps=1, num_stages=4, swap_ab=True)),
    (16, WIDE_N, GemmConfig(16, 16, 64, group_m=1, num_warps=1, num_stages=4, swap_ab=True)),
    (4, 0, GemmConfig(2, 64, 64, group_m=1, num_warps=2, num_stages=4)),
    # 16-row weight tiles: 256 programs on a 4096-wide output instead of 128.
    (16, 0, GemmConfig(16, 16, 128, group_m=1, num_warps=1, num_stages=4, swap_ab=True)),
    (32, LM_HEAD_N, GemmConfig(64, 32, 32, group_m=1, num_warps=2, num_stages=4, swap_ab=True)),
    (32, WIDE_N, _FP32_SWAP_32X32),
    (64, LM_HEAD_N, GemmConfig(128, 64, 16, group_m=8, num_warps=4, num_stages=3, swap_ab=True)),
    (64, WIDE_N, GemmConfig(32, 64, 32, group_m=1, num_warps=4, num_stages=3, swap_ab=True)),
    (64, 0, _FP32_SWAP_32X32),
    # M = 128 on 32-row weight tiles: 256 two-warp programs instead of 128 four-warp ones
    # hide the FMA chain's latency; 8 warps on 128x64 at large M. The lm head keeps 64x64
    # at M = 128: its 151936 columns already give 2374 programs, and the 32-row tile is
    # slower there. Same bits; docs/design/gemm_dispatch.md#fp32-the-swap.
    (128, LM_HEAD_N, GemmConfig(64, 64, 32, group_m=1, num_warps=4, num_stages=4, swap_ab=True)),
    (128, 0, GemmConfig(32, 64, 32, group_m=1, num_warps=2, num_stages=4, swap_ab=True)),
    (1 << 62, 0, GemmConfig(128, 64, 32, group_m=1, num_warps=8, num_stages=3, swap_ab=True)),
)
# fp32 operands the swap does not apply to (B not k-contiguous, a batch axis, the fused
# row-sum): the forward orientation (tiles from the same offline sweeps, every
# candidate's bits equal).
GEMM_TABLE_FP32_UNSWAPPED: tuple[tuple[int, int, GemmConfig], ...] = (
    (1, 0, _FP32_M1),
    (4, LM_HEAD_N, GemmConfig(4, 64, 32, group_m=1, num_warps=2, num_stages=4)),
    (4, 0, GemmConfig(2, 64, 64, group_m=1, num_warps=2, num_stages=4)),
    (8, WIDE_N, GemmConfig(8, 32, 32, group_m=1, num_warps=1, num_stages=4)),
    (8, 0, GemmConfig(2, 32, 128, group_m=1, num_warps=1, num_stages=4)),
    (16, 0, GemmConfig(16, 32, 64, group_m=1, num_warps=2, num_stages=3)),
    (64, WIDE_N, GemmConfig(64, 128, 16, group_m=8, num_warps=4, num_stages=3)),
    (64, 0, GemmConfig(32, 64, 32, group_m=4, num_warps=4, num_stages=3)),
    (256, WIDE_N, GemmConfig(128, 128, 32, group_m=8, num_warps=8, num_stages=3)),
    (256, 0, GemmConfig(64, 64, 32, group_m=8, num_warps=4, num_stages=3)),
    (1 << 62, 0, GemmConfig(256, 128, 16, group_m=8, num_warps=8, num_stages=3)),
)
# The interpreter computes each tl.dot with numpy's BLAS, whose rounding depends
# on a row's position inside the tile (measured: chunked rows changed bits at
# BLOCK_M=16). One row per program keeps every row's numpy call identical, so the
# interpreter checks the kernel's logic and invariance; the tile-shape claim of
# the canonical chain is a GPU property and is tested there. numpy also sums a
# whole BLOCK_K per step, so BLOCK_K = 16 mirrors the tensor cores' 16-wide K step
# (the TOKEN_BLOCK granularity of dW accumulation).
GEMM_INTERPRETER_CONFIG = GemmConfig(1, 64, 16, group_m=1, num_warps=4, num_stages=1)


def gemm_table(dtype: torch.dtype, swappable: bool = True) -> tuple[tuple[int, int, GemmConfig], ...]:
    if dtype == torch.float32:
        return GEMM_TABLE_FP32 if swappable else GEMM_TABLE_FP32_UNSWAPPED
    return GEMM_TABLE_16BIT


def swappable(a: torch.Tensor, b: torch.Tensor, rowsum: torch.Tensor | None = None) -> bool:
    """Whether an fp32 A @ B may run as C^T = B^T @ A^T: 2-D operands, B k-contiguous."""
    return a.dim() == 2 and b.dim() == 2 and b.stride(0) == 1 and rowsum is None


def gemm_config(m: int, n: int, dtype: torch.dtype, token_reduction: bool = False, *,
                swappable: bool = True, b_n_contiguous: bool = False) -> GemmConfig:
    """The tile config the table assigns to an [m, K] x [K, n] problem.

    ``token_reduction``: a backward GEMM -- A read transposed (dW = dY^T @ X) or an fp32
    output chained from its current value (dW into main_grad, linear_logprob's dH over
    V) -- which gets the wide accumulate tile, faster there than the forward's large-M
    tile (docs/design/gemm_dispatch.md#tma-tiles-large-m).
    """
    if triton_interpret():
        return GEMM_INTERPRETER_CONFIG
    if token_reduction and dtype != torch.float32 and m > 256:
        return GEMM_ACCUMULATE_16BIT
    if b_n_contiguous and dtype != torch.float32:
        for m_max, n_min, cfg in GEMM_TABLE_16BIT_N_CONTIGUOUS_B:
            if m <= m_max and n >= n_min:
                return cfg
    for m_max, n_min, cfg in gemm_table(dtype, swappable):
        if m <= m_max and n >= n_min:
            if cfg.block_m < 16 and not DOT_ANY_M:
                # Triton < 3.5 needs 16 rows per dot; any tile gives the fp32 chain's bits.
                return dataclasses.replace(cfg, block_m=16)
            return cfg
    raise AssertionError("unreachable: the last row is unbounded")


# The gated gate/up GEMM (gemm_silu_mul_kernel) serves the decode tiles' rows. Graph replay
# from HBM on the H200 against the two GEMMs and silu_mul: 0.72-0.73x at M = 1-16 on a 2B
# model's MLP (2048 -> 6144), 0.96x on an 8B's (4096 -> 12288); from M = 32 mixed (0.93x on
# the 2B, 1.17x on the 8B) and at M = 256 1.24-1.45x, where cuBLASLt runs the pair.
SILU_MUL_MAX_M = 16


def silu_mul_config(m: int, n: int, dtype: torch.dtype) -> GemmConfig | None:
    """The tile of the gated GEMM over two [N, K] weights for M rows, or None where it does not
    run (M past SILU_MUL_MAX_M, fp32 outside the interpreter).

    The table's tile for the pair's 2N columns, half as wide: each program chains two
    accumulators, a gate and an up tile, so its registers and shared memory hold what the
    2N-wide tile's would. Same bits on every tile (tests/gemm/test_triton.py)."""
    if triton_interpret():
        return GEMM_INTERPRETER_CONFIG
    if m > SILU_MUL_MAX_M or dtype not in (torch.bfloat16, torch.float16):
        return None
    cfg = gemm_config(m, 2 * n, dtype)
    return dataclasses.replace(cfg, block_n=max(16, cfg.block_n // 2))


# The grouped GEMM of one input (gemm_group_kernel: attention's q, k and v projections).
# Graph replay from HBM on the H200 against three launches: 0.35-0.43x at M = 1-64 on a 2B
# model's q, k, v (2048 -> 2048 + 1024 + 1024), 0.47-0.67x on an 8B's (4096 -> 4096 + 2 x
# 1024); at M = 128 0.50x and 0.95x, at M = 256 0.84x and 1.41x (cuBLASLt runs the three).
LINEAR_GROUP_MAX_M = 64

# A projection with the residual add in its epilogue (gemm_group_kernel with one member: a
# decoder layer's down projection) at the decode tiles' rows, where it runs the table's tile
# for its width; past them the GEMM's own route and torch's add.
LINEAR_RESIDUAL_MAX_M = 16

def linear_group_config(m: int, n_total: int, dtype: torch.dtype) -> GemmConfig | None:
    """The tile of the grouped GEMM over weights of ``n_total`` rows in all for M rows, or
    None where it does not run (M past LINEAR_GROUP_MAX_M, fp32 outside the interpreter):
    the table's tile for one GEMM that wide. Same bits on every tile
    (tests/gemm/test_triton.py)."""
    if triton_interpret():
        return GEMM_INTERPRETER_CONFIG
    if m > LINEAR_GROUP_MAX_M or dtype not in (torch.bfloat16, torch.float16):
        return None
    return gemm_config(m, n_total, dtype)


@functools.lru_cache(maxsize=None)
def all_configs(dtype: torch.dtype) -> tuple[GemmConfig, ...]:
    """Every config the table can pick for ``dtype`` (what GPU tests must cover)."""
    if dtype == torch.float32:
        rows = GEMM_TABLE_FP32 + GEMM_TABLE_FP32_UNSWAPPED
    else:
        rows = GEMM_TABLE_16BIT + GEMM_TABLE_16BIT_N_CONTIGUOUS_B + ((0, 0, GEMM_ACCUMULATE_16BIT),)
    return tuple(dict.fromkeys(cfg for _, _, cfg in rows))
