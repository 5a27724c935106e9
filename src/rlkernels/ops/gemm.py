"""The canonical K-chain GEMM in Triton, and its checked-in dispatch table.

Every output element is the fp32 accumulation of its dot product over K in
ascending order -- ``acc = tl.dot(a_blk, b_blk, acc)`` for k-blocks 0, 1, 2, ... --
with no split over K, rounded once at the end. On Hopper the bits of that chain
do not depend on the tile shape (the tensor cores step through K in fixed 16-wide
pieces whatever BLOCK_K is; measured: 22 configs and cuBLASLt without split-K
give identical bits), so the dispatch table may pick tiles by M without changing
a row's result; ``tests/test_matmul_gpu.py`` proves it for every config here.

The same kernel serves every GEMM in the library:
  * forward / dX:  C = A @ B (+ bias), any strides, optional batch axis;
  * dW:            C += A @ B with A = dY^T, reduction over tokens, the fp32
                   accumulator loaded from C (``weight.main_grad``) so that
                   micro-batches chain exactly like one big batch;
  * dbias:         the row sums of A (= column sums of dY) through the same
                   tensor-core chain (a dot with a ones block), fused in.
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from ..registry import triton_interpret

from ._launch import cached_launcher, current_device, kept_launch_key, launch_with_key
from . import l2_window
from ._tiles import grouped_tile
from ._triton import DOT_ANY_M, cdiv, tl, triton
from .gemm_tma import TmaPlan, tma_gemm_planned, tma_layouts

try:
    from triton.runtime.errors import OutOfResources
except Exception:  # pragma: no cover - no Triton
    OutOfResources = RuntimeError


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    # Large-M tiles: operands by TMA (ops.gemm_tma) where the layouts allow -- else the
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
# Picked offline on H100 by benchmarks/tune_gemm.py (results under
# benchmarks/results/); the canonical K-chain makes every entry produce the same
# bits (measured: 19 candidate configs x 8 M x 4 shapes, 0 mismatches vs
# cuBLASLt-no-split; tests/test_matmul_gpu.py re-proves it for each entry).
WIDE_N = 8192  # wide outputs (MLP up-projections, lm heads) want wider N tiles at decode
LM_HEAD_N = 65536  # vocabulary-sized outputs (lm heads)
GEMM_TABLE_16BIT: tuple[tuple[int, int, GemmConfig], ...] = (
    # M <= 16 (decode). Until session 11, M = 1 had its own row (16x64x256): the tiles'
    # 15 wrapped rows re-read row 0 from the same L2 lines and made the narrower tiles
    # up to 60% slower at M = 1 than at M = 4. With rows past M masked (MASK_SHORT_M) M = 1
    # runs like M = 4, and one tile per width class serves M = 1..16 (graph replay, weight
    # from HBM, benchmarks/results/explore_decode_short_m_h100_session11.json:
    # 4096 x 12288 36.3-36.8 us on 16x32x128/w2 vs 37.0-37.9 on 16x64x256, as in session
    # 10's tune_gemm_decode_occupancy_h100.json; 12288 x 4096 M = 1 37.8 vs 38.5).
    # lm heads: 16x32x256/w4/s6 (was 16x64x256/w4/s4), found by session 14's narrower-tile
    # sweep, eager and from HBM alike: M = 16 419 vs 423 us (0.928x vs 0.937x stock), M = 1-8
    # 0.917-0.922x vs 0.921-0.929x (benchmarks/results/explore_lm_head_narrow_h100_session14.json).
    (16, LM_HEAD_N, GemmConfig(16, 32, 256, group_m=1, num_warps=4, num_stages=6)),
    (16, WIDE_N, GemmConfig(16, 32, 128, group_m=1, num_warps=2, num_stages=4)),
    (16, 0, GemmConfig(16, 32, 256, group_m=1, num_warps=4, num_stages=5)),
    (64, WIDE_N, GemmConfig(64, 128, 128, group_m=8, num_warps=4, num_stages=3)),
    (32, 0, GemmConfig(32, 32, 256, group_m=4, num_warps=4, num_stages=4)),
    # M in (32, 64] on narrower outputs: 64-row tiles, N tiles of 32 keep 128 programs
    # on a 4096-wide output (graph replay, weight from HBM: 15.3 vs 16.9-17.4 us at
    # M = 64 on 4096 x 4096; benchmarks/results/tune_gemm_decode_mid_h100.json).
    (64, 0, GemmConfig(64, 32, 256, group_m=1, num_warps=4, num_stages=4)),
    (256, WIDE_N, GemmConfig(128, 128, 128, group_m=8, num_warps=8, num_stages=3)),
    (256, 0, GemmConfig(64, 64, 128, group_m=8, num_warps=4, num_stages=4)),
    # Large M: TMA operand loads and a persistent schedule, warp-specialized up to
    # M = 2048 (H100 bf16, M >= 1024: 0.96-1.06x stock cuBLAS where the pointer kernel
    # ran 1.18-1.29x, same bits; benchmarks/results/explore_tma_h100.json).
    (2048, 0, GemmConfig(128, 256, 64, group_m=8, num_warps=8, num_stages=3, tma=True, persistent=True,
                         warp_specialize=True)),
    (1 << 62, 0, GemmConfig(128, 256, 64, group_m=8, num_warps=8, num_stages=3, tma=True, persistent=True)),
)
# Decode rows for a B stored [K, N] with N contiguous (``rlkernels.matmul(x, b)`` on a
# row-major matrix), consulted before the table above: the table's 16x32 tiles were
# picked for a k-contiguous nn.Linear weight, and on a [K, N] lm head they read 32-wide
# row pieces (1.28x stock at M = 1-16). 128-wide N tiles read whole 256-byte rows; same
# bits (the K chain does not depend on the tile). See docs/operators/matmul.md.
GEMM_TABLE_16BIT_N_CONTIGUOUS_B: tuple[tuple[int, int, GemmConfig], ...] = (
    (16, WIDE_N, GemmConfig(16, 128, 128, group_m=1, num_warps=4, num_stages=3)),
)
# dW = dY^T @ X (A read transposed, reduction over tokens) and fp32 chained outputs:
# their own tile (the fp32 output goes through pointers, see ops.gemm_tma).
GEMM_ACCUMULATE_16BIT = GemmConfig(128, 256, 64, group_m=8, num_warps=8, num_stages=3, tma=True, persistent=True)
# fp32 (IEEE): tl.dot's FMA lowering chains every output element over ascending k from
# registers, whatever the tile or orientation, so every entry gives the same bits
# (tests/test_matmul_gpu.py). What the tile changes is shared-memory traffic: each lane
# owns output columns and reads B's column k-values; a k-contiguous B (an nn.Linear
# weight read as W^T) puts a lane's column 256 bytes from its neighbour's, 8-way bank
# conflicts that held every forward-orientation tile near 26 TFLOP/s. Swapped, the
# weight is the row operand (read broadcast across a warp) and the activation,
# transposed once into [K, M] (tokens x hidden: small next to the GEMM), the column
# operand with lanes on consecutive addresses. A few rows on a narrow output stay
# unswapped: their dot runs unpadded (Triton >= 3.5), one lane per output column.
# Picked on H100 by benchmarks/explore_fp32.py (benchmarks/results/explore_fp32_v2_h100.json
# and _v3_: every candidate's bits equal): 4096 x 4096 M = 1 48 us (was 108), M = 64
# 93 us (was 297), M = 4096 3.3 ms (was 5.35); lm head M = 4-16 1.0 ms (was 1.7-2.9).
_FP32_M1 = GemmConfig(1, 32, 128, group_m=1, num_warps=1, num_stages=4)
_FP32_SWAP_32X32 = GemmConfig(32, 32, 32, group_m=1, num_warps=2, num_stages=4, swap_ab=True)
GEMM_TABLE_FP32: tuple[tuple[int, int, GemmConfig], ...] = (
    (1, 0, _FP32_M1),
    # Wide outputs: one 16-token tile streams the weight once (lm head M = 4-8: 1.0 ms,
    # stock 1.0-1.3 ms).
    (16, LM_HEAD_N, GemmConfig(32, 16, 64, group_m=1, num_warps=1, num_stages=4, swap_ab=True)),
    (16, WIDE_N, GemmConfig(16, 16, 64, group_m=1, num_warps=1, num_stages=4, swap_ab=True)),
    (4, 0, GemmConfig(2, 64, 64, group_m=1, num_warps=2, num_stages=4)),
    # 16-row weight tiles: 256 programs on a 4096-wide output (4096^2 M = 16: 46 us vs
    # 86 us for 32x32x32 and stock's 62; explore_fp32_v4/_v5_h100.json).
    (16, 0, GemmConfig(16, 16, 128, group_m=1, num_warps=1, num_stages=4, swap_ab=True)),
    (32, LM_HEAD_N, GemmConfig(64, 32, 32, group_m=1, num_warps=2, num_stages=4, swap_ab=True)),
    (32, WIDE_N, _FP32_SWAP_32X32),
    (64, LM_HEAD_N, GemmConfig(128, 64, 16, group_m=8, num_warps=4, num_stages=3, swap_ab=True)),
    (64, WIDE_N, GemmConfig(32, 64, 32, group_m=1, num_warps=4, num_stages=3, swap_ab=True)),
    (64, 0, _FP32_SWAP_32X32),
    # Session 9 (explore_fp32_v6_h100.json, same bits): M = 128 on 32-row weight tiles,
    # 256 two-warp programs instead of 128 four-warp ones (4096^2: 133 vs 137 us), and
    # 8 warps on 128x64 at large M (4096^2 M = 4096: 3.25 vs 3.34 ms).
    # The lm head keeps 64x64 at M = 128 (3.65 ms; the 32-row tile took 3.89 ms,
    # gemm_h100_run10_fp32_session10.json).
    (128, LM_HEAD_N, GemmConfig(64, 64, 32, group_m=1, num_warps=4, num_stages=4, swap_ab=True)),
    (128, 0, GemmConfig(32, 64, 32, group_m=1, num_warps=2, num_stages=4, swap_ab=True)),
    (1 << 62, 0, GemmConfig(128, 64, 32, group_m=1, num_warps=8, num_stages=3, swap_ab=True)),
)
# fp32 operands the swap does not apply to (B not k-contiguous, a batch axis, the fused
# row-sum): the forward orientation (small tiles from the same sweeps; M > 8 from
# session 5's, explore_fp32_h100.json).
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
    V) -- which gets the wide accumulate tile (H100, 8192 x 4096 x 4096 dH chunk:
    18.4 ms vs 20.3 ms with the forward's large-M tile; benchmarks/results/
    logprob_profile_h100.json).
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


if triton is not None:

    @triton.jit
    def _gemm_kernel(
        a_ptr, b_ptr, c_ptr, bias_ptr, rowsum_ptr,
        M, N, K,
        stride_ab, stride_am, stride_ak,
        stride_bb, stride_bk, stride_bn,
        stride_cb, stride_cm, stride_cn,
        HAS_BIAS: tl.constexpr, ACC_FROM_C: tl.constexpr, ROWSUM: tl.constexpr,
        IEEE: tl.constexpr, EVEN_K: tl.constexpr, MASK_M: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
        SWAPPED: tl.constexpr,
    ):
        pid = tl.program_id(0)
        batch = tl.program_id(1).to(tl.int64)
        pid_m, pid_n = grouped_tile(pid, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)

        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        # Rows/cols past the edge re-read valid memory (wrapped) instead of masking;
        # their results are never stored. int64: lm-head outputs exceed 2^31 elements.
        # MASK_M (fewer rows than the tile, i.e. decode): rows past M are not read at
        # all. Wrapped, every program fetched row 0 BLOCK_M times per k-block, all from
        # the same few L2 lines: at M = 1 a 16-row tile ran 5-60% slower than the same
        # tile at M = 4, the narrower tiles worst (H100, benchmarks/results/
        # explore_decode_short_m_h100_session11.json; masked, M = 1 runs like M = 4).
        # Either way a stored row's products are its own row's, so its bits are the same.
        rm = offs_m.to(tl.int64) if MASK_M else (offs_m % M).to(tl.int64)
        if SWAPPED:
            # B = X^T, its columns padded to whole tiles by the launcher: read unwrapped,
            # so the compiler sees contiguous, aligned rows (16-byte copies at any M).
            rn = offs_n.to(tl.int64)
        else:
            rn = (offs_n % N).to(tl.int64)
        a_ptrs = a_ptr + batch * stride_ab + rm[:, None] * stride_am + offs_k[None, :].to(tl.int64) * stride_ak
        b_ptrs = b_ptr + batch * stride_bb + offs_k[:, None].to(tl.int64) * stride_bk + rn[None, :] * stride_bn

        c_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        c_ptrs = c_ptr + batch * stride_cb + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :].to(tl.int64) * stride_cn
        if ACC_FROM_C:
            acc = tl.load(c_ptrs, mask=c_mask, other=0.0).to(tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if ROWSUM:
            # The row-sum chain starts from the current value (bias.main_grad), like acc.
            do_rowsum = pid_n == 0
            rs_ptrs = rowsum_ptr + batch * M + offs_m
            rs_col = tl.arange(0, 16)
            rs_start = tl.load(rs_ptrs, mask=offs_m < M, other=0.0)
            rs_acc = tl.where(rs_col[None, :] == 0, rs_start[:, None], 0.0)
            ones = tl.full((BLOCK_K, 16), 1.0, dtype=a_ptr.dtype.element_ty)

        # The canonical chain: one ascending pass over K, one fp32 accumulator.
        # (No evict-first hint on the once-read decode weight: Triton 3.6's pipeliner
        # drops it from the cp.async these loads become; docs/perf_notes.md, session 12.)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            if EVEN_K:
                if MASK_M:
                    a = tl.load(a_ptrs, mask=offs_m[:, None] < M, other=0.0)
                else:
                    a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
            else:
                k_left = K - k * BLOCK_K
                a_mask = offs_k[None, :] < k_left
                if MASK_M:
                    a_mask = a_mask & (offs_m[:, None] < M)
                a = tl.load(a_ptrs, mask=a_mask, other=0.0)
                b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
            if IEEE:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
            if ROWSUM:
                if do_rowsum:
                    if IEEE:
                        rs_acc = tl.dot(a, ones, rs_acc, input_precision="ieee")
                    else:
                        rs_acc = tl.dot(a, ones, rs_acc)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk

        if HAS_BIAS:
            if SWAPPED:  # C^T's rows are the output features
                bias = tl.load(bias_ptr + offs_m, mask=offs_m < M, other=0.0)
                acc = acc + bias.to(tl.float32)[:, None]
            else:
                bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)
                acc = acc + bias.to(tl.float32)[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)
        if ROWSUM:
            if do_rowsum:
                # Column 0 holds the chain; the others are exact zeros plus the same sums.
                rs = tl.sum(tl.where(rs_col[None, :] == 0, rs_acc, 0.0), axis=1)
                tl.store(rs_ptrs, rs, mask=offs_m < M)


    # Decode calls are host-bound: later launches skip Triton's binder (ops._launch). The
    # five pointers come first in every call (bias and rowsum stand in as ``out`` when absent).
    _launch_gemm = cached_launcher(_gemm_kernel, leading_tensors=5)


MAX_GRID_BATCH = 65535  # CUDA's limit on grid axis 1, where the batch goes
# Problems with fewer rows than the tile mask the rows past M instead of re-reading
# rows 0..M-1 cyclically (see the kernel). The bits are the same either way (tests/test_gemm.py,
# tests/test_matmul_gpu.py); False gives the wrapped loads back, for A/B benchmarks.
MASK_SHORT_M = True
# Where one program reads each B element (one row of tiles, no batch: a decode weight), B's
# bytes are a streaming L2 access-policy window during the launch (ops.l2_window): the
# weight streams through L2 without replacing what other kernels keep there. A cache
# policy, never a value: the bits are the same either way. False (or
# RLKERNELS_L2_STREAMING=0) launches without it, for A/B benchmarks.
STREAM_ONCE_L2_WINDOW = True

# TMA variants that failed to fit in shared memory, by (config, layouts, dtypes): they
# go straight to the pointer kernel afterwards.
_TMA_TOO_BIG: set[tuple] = set()


class LaunchPlan:
    """What :func:`triton_gemm` works out for a 2-D forward call before its launch -- the
    tile, the grid, the integer arguments, the constexprs, B's window span, the launcher's
    key -- kept under :func:`plan_key`, so that later calls with the same shapes, strides,
    dtypes and alignment launch the same kernel with the same arguments (but the tensors)
    without working it out again. Why: decode calls are host-bound; with plans
    ``rlkernels.linear`` takes 15-25% less host time per call (H100 host, plans on and off
    alternating in one process: benchmarks/results/plans_ab_h100_session15.json). The
    kernel and its arguments are those the full path gives, so are the bits
    (tests/test_gemm.py, tests/test_launch.py). ``swap_block``: an fp32 swapped tile
    (C^T = B^T @ A^T), whose A^T copy is padded to whole tiles of this many tokens."""

    __slots__ = ("out_shape", "out_dtype", "b_as_kn", "grid", "ints", "constexprs", "num_warps", "num_stages",
                 "window_span", "launch_key", "swap_block")

    def __init__(self, out_shape: tuple[int, int], out_dtype: torch.dtype, b_as_kn: bool, grid: tuple[int, int],
                 ints: tuple, constexprs: tuple, cfg: GemmConfig, window_span: int | None,
                 launch_key: tuple | None) -> None:
        self.out_shape, self.out_dtype, self.b_as_kn = out_shape, out_dtype, b_as_kn
        self.grid, self.ints, self.constexprs = grid, ints, constexprs
        self.num_warps, self.num_stages = cfg.num_warps, cfg.num_stages
        self.window_span, self.launch_key = window_span, launch_key
        self.swap_block = cfg.block_n if cfg.swap_ab else None

    def __call__(self, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        result = out = a.new_empty(self.out_shape, dtype=self.out_dtype)
        if self.swap_block is not None:
            # The kernel's A is B^T: the weight as given where the full path viewed it as [K, N].
            a, b, out = b if self.b_as_kn else b.t(), transposed_tiles(a, self.swap_block), out.t()
        elif self.b_as_kn:
            b = b.t()
        _launch_pointer(self.grid, (a, b, out, out if bias is None else bias, out, *self.ints), self.constexprs,
                        self.num_warps, self.num_stages, b, self.window_span, self.launch_key)
        return result


def transposed_tiles(a: torch.Tensor, block: int) -> torch.Tensor:
    """A^T [K, M'] contiguous, M' = M rounded up to whole tiles of ``block`` tokens: the
    swapped kernel reads A^T's rows unwrapped, and the zero padding's products land in
    columns that are never stored."""
    M, K = a.shape
    m_pad = -(-M // block) * block
    if m_pad == M:
        return a.t().contiguous()
    a_t = a.new_zeros(K, m_pad)
    a_t[:, :M] = a.t()
    return a_t


# Launch plans by plan_key; bounded like the launcher's keys (one plan per problem shape).
# False works every call out in full (for A/B benchmarks of host time).
LAUNCH_PLANS = True
_PLANS: dict[tuple, LaunchPlan | TmaPlan] = {}
MAX_PLANS = 4096


def plan_key(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype | None,
             b_transposed: bool) -> tuple:
    """Everything a 2-D forward launch is worked out from: shapes and strides (the integer
    arguments, the tile), dtypes, the 16-byte alignment of each pointer (which Triton
    specializes on; a fresh output is always aligned), the current device (the
    launcher's key) and the module's A/B switches."""
    return (a.shape, a.stride(), b.shape, b.stride(), b_transposed, a.dtype, b.dtype, out_dtype,
            None if bias is None else (bias.dtype, bias.data_ptr() & 15 == 0),
            a.data_ptr() & 15 == 0, b.data_ptr() & 15 == 0, current_device() if a.is_cuda else -1,
            MASK_SHORT_M, STREAM_ONCE_L2_WINDOW)


def _launch_pointer(grid: tuple[int, int], args: tuple, constexprs: tuple, num_warps: int, num_stages: int,
                    b: torch.Tensor, window_span: int | None, launch_key: tuple | None = None) -> None:
    """The pointer kernel's launch; ``window_span``: B's bytes, to stream through L2 during
    it (None: no window)."""
    stream = saved = None
    if window_span is not None:
        stream = torch._C._cuda_getCurrentRawStream(current_device())  # the launch's stream
        saved = l2_window.set_streaming(b, stream, span=window_span)
    try:
        launch_with_key(_launch_gemm, launch_key, grid, args, constexprs, num_warps=num_warps, num_stages=num_stages,
                        stream=stream)
    finally:
        if saved is not None:
            l2_window.restore(stream, saved)


def triton_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    accumulate: bool = False,
    rowsum: torch.Tensor | None = None,
    config: GemmConfig | None = None,
    b_transposed: bool = False,
) -> torch.Tensor:
    """C = A @ B (+ bias) by the canonical K-chain; shapes already validated.

    a: [M, K] or [Bt, M, K]; b: [K, N] or [Bt, K, N] (a 2-D b is shared by every
    batch element, stride 0); any strides. With ``accumulate`` the fp32 ``out`` is
    the chain's starting value and is updated in place. ``rowsum`` (fp32 [M] or
    [Bt, M], contiguous) gets the row sums of A added, through the same chain.
    An fp32 config with ``swap_ab`` runs C^T = B^T @ A^T on a contiguous copy of A^T
    (same bits per element; 2-D operands with B k-contiguous only).
    ``b_transposed``: a 2-D b is given as B^T [N, K] (an nn.Linear weight); the pointer
    kernel reads it through swapped strides, other paths through a transposed view.
    """
    plan_id = None
    if (LAUNCH_PLANS and out is None and config is None and not accumulate and rowsum is None and a.dim() == 2
            and b.dim() == 2):
        plan_id = plan_key(a, b, bias, out_dtype, b_transposed)
        plan = _PLANS.get(plan_id)
        if plan is not None:
            return plan(a, b, bias)
    b_given = b
    # Strides read directly (a 2-D operand has batch stride 0): no views are made,
    # since every host microsecond shows at decode sizes.
    if a.dim() == 3:
        Bt, M, K = a.shape
        sab, sam, sak = a.stride()
    else:
        (M, K), Bt = a.shape, 1
        sab, (sam, sak) = 0, a.stride()
    if b_transposed:
        if b.dim() != 2:
            raise ValueError("rlkernels: b_transposed needs a 2-D b")
        N = b.shape[0]
        sbn, sbk = b.stride()
        sbb = 0
    else:
        N = b.shape[-1]
        sbb, sbk, sbn = (0, *b.stride()) if b.dim() == 2 else b.stride()
    if out is None:
        shape = (Bt, M, N) if a.dim() == 3 or b.dim() == 3 else (M, N)
        out = a.new_empty(shape, dtype=out_dtype or a.dtype)  # (no device object to build: host time)
    scb, scm, scn = (0, *out.stride()) if out.dim() == 2 else out.stride()
    if accumulate and out.dtype != torch.float32:
        raise ValueError("rlkernels: accumulation target must be float32")
    if M == 0 or N == 0 or Bt == 0:
        return out
    if K == 0:
        # An empty chain: its start value (0, or out's when accumulating), plus the bias.
        if not accumulate:
            out.zero_()
        if bias is not None:
            out += bias
        return out
    # The fp32 swap, TMA and batch-chunking paths take B as [K, N]: a view there (the
    # strides read above stay those of the view).
    if b_transposed and a.dtype == torch.float32:
        b, b_transposed = b.t(), False
    can_swap = a.dtype == torch.float32 and swappable(a, b, rowsum)
    cfg = config or gemm_config(M, N, a.dtype, token_reduction=accumulate or (sam == 1 and sak != 1),
                                swappable=can_swap, b_n_contiguous=not b_transposed and sbn == 1 and sbk != 1)
    if b_transposed and (cfg.tma or Bt > MAX_GRID_BATCH):
        b, b_transposed = b.t(), False
    b_as_kn = b is not b_given  # (what a launch plan repeats on the B it is given)
    if cfg.swap_ab:
        if not can_swap:
            raise ValueError(f"rlkernels: config {cfg.short()} needs 2-D fp32 operands with B k-contiguous")
        # C^T = B^T @ A^T: the same chain per element (fma(a, b, c) == fma(b, a, c)).
        result, (a, b, out) = out, (b.t(), transposed_tiles(a, cfg.block_n), out.t())
        M, N = N, M
        (sam, sak), (sbk, sbn), (scm, scn) = a.stride(), b.stride(), out.stride()
    layouts = tma_layouts(a, b, out) if cfg.tma and rowsum is None else None
    if layouts is not None:
        # The variant's identity: what decides its shared memory (layouts, epilogue, dtypes).
        key = (cfg, *layouts, accumulate, out.dtype, a.dtype)
        if key not in _TMA_TOO_BIG:
            try:
                out, tma_plan = tma_gemm_planned(a, b, cfg, bias=bias, out=out, accumulate=accumulate,
                                                 layouts=layouts,
                                                 plan_b_as_kn=None if plan_id is None else b_as_kn)
                if tma_plan is not None:
                    _keep_plan(plan_id, tma_plan)
                return out
            except OutOfResources:
                # Raised before launch (nothing written): some layout/epilogue variants need
                # more shared memory than the chip has (e.g. a warp-specialized tile with an
                # fp32 chained output). The pointer kernel with the same tile gives the same
                # bits (tests/test_gemm_tma.py).
                _TMA_TOO_BIG.add(key)
    if Bt > MAX_GRID_BATCH:
        # CUDA caps grid axis 1; batch elements are independent, so chunking the batch
        # changes no element's bits.
        for lo in range(0, Bt, MAX_GRID_BATCH):
            hi = min(Bt, lo + MAX_GRID_BATCH)
            b_part = b if b.dim() == 2 else b[lo:hi]
            rs_part = rowsum[lo:hi] if rowsum is not None and rowsum.dim() == 2 else rowsum
            triton_gemm(a[lo:hi], b_part, bias=bias, out=out[lo:hi], accumulate=accumulate, rowsum=rs_part,
                        config=cfg)
        return out
    grid = (cdiv(M, cfg.block_m) * cdiv(N, cfg.block_n), Bt)
    args = (a, b, out, bias if bias is not None else out, rowsum if rowsum is not None else out,
            M, N, K, sab, sam, sak, sbb, sbk, sbn, scb, scm, scn)
    constexprs = (bias is not None, accumulate, rowsum is not None, a.dtype == torch.float32, K % cfg.block_k == 0,
                  MASK_SHORT_M and M < cfg.block_m, cfg.block_m, cfg.block_n, cfg.block_k, cfg.group_m, cfg.swap_ab)
    # One row of tiles: each B element is read by one program, once (a decode weight).
    # B's span from the strides at hand (2-D here: no batch axis).
    window_span = (((K - 1) * sbk + (N - 1) * sbn + 1) * b.element_size()
                   if STREAM_ONCE_L2_WINDOW and M <= cfg.block_m and Bt == 1 and a.is_cuda else None)
    _launch_pointer(grid, args, constexprs, cfg.num_warps, cfg.num_stages, b, window_span)
    if plan_id is not None:
        launch_key = kept_launch_key(_launch_gemm, args, constexprs, cfg.num_warps, cfg.num_stages)
        _keep_plan(plan_id, LaunchPlan(tuple(result.shape if cfg.swap_ab else out.shape), out.dtype,
                                       b_as_kn, grid, args[5:], constexprs, cfg, window_span, launch_key))
    return result if cfg.swap_ab else out


def _keep_plan(plan_id: tuple, plan: LaunchPlan | TmaPlan) -> None:
    if len(_PLANS) >= MAX_PLANS:
        _PLANS.clear()
    _PLANS[plan_id] = plan


@functools.lru_cache(maxsize=None)
def all_configs(dtype: torch.dtype) -> tuple[GemmConfig, ...]:
    """Every config the table can pick for ``dtype`` (what GPU tests must cover)."""
    if dtype == torch.float32:
        rows = GEMM_TABLE_FP32 + GEMM_TABLE_FP32_UNSWAPPED
    else:
        rows = GEMM_TABLE_16BIT + GEMM_TABLE_16BIT_N_CONTIGUOUS_B + ((0, 0, GEMM_ACCUMULATE_16BIT),)
    return tuple(dict.fromkeys(cfg for _, _, cfg in rows))
