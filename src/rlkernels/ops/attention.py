"""Batch-invariant fused attention with FlashAttention's API: prefill == decode bit for bit.

    flash_attn_func(q, k, v, causal=True, softmax_scale=None)            q [B, Lq, Hq, D], k/v [B, Lk, Hkv, D]
    flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, ...)
                                                                          q [Tq, Hq, D], k/v [Tk, Hkv, D]
    flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, ...)
                                                                          q [B, Lq, Hq, D], caches [B, S, Hkv, D]

The chain (one per query row, whatever the entry point, batch, padding or packing):
keys in blocks of ``BLOCK_N`` aligned to the sequence's key 0, ascending; the blocks
grouped into splits of ``S_SPLIT`` keys aligned to key 0; each split's online-softmax
state (m, l, acc) in fp32 starts from scratch and is updated per block with
``m' = max(m, rowmax(s))``, ``alpha = exp2(m - m')``, ``p = exp2(s - m')`` (p rounded
to the input dtype), ``l' = l * alpha + rowsum(p)``, ``acc' = acc * alpha + p @ v``;
the splits are merged in ascending order from the empty state with one formula; out =
acc / l. Causal masking is bottom-right aligned (query i of Lq sits at key position
Lk - Lq + i). Masked and out-of-range keys contribute exact zeros (their K/V loads are
masked to 0 and their scores are -inf), which is why a tile's extra rows or blocks
never change a row's bits. Every index is a function of the sequence alone.

Backends: ``triton`` (kernels in ``rlkernels.kernels.attention``: a full kernel that
keeps the merged and the current split state, and for decode a split-KV kernel plus a
combine kernel that compute the same chain) and ``torch`` (the same chain from
elementwise ops and ``ops.chain``'s ascending chains, in natural-log units with
``exp``; any device, fp64 too). The
two backends each keep the contract; their bits differ from each other (FMA vs
separately rounded steps, tensor-core vs elementwise dots).

Backward (flash_attn_func / varlen): delta = rowsum(dO * O) in fp32; dK/dV per key
block over the GQA group's query heads in order and query blocks ascending; dQ per
query block over key blocks ascending, recomputing P from the saved LSE; no atomics.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Iterator

import torch

from . import _validate as V
from ..registry import OpImpl, register, select_backend
from .._env import switch_on, triton_interpret
from ..kernels._triton import GluonTensorDescriptor, cdiv, gl
from ..kernels.attention import (attn_bwd_delta_kernel, attn_bwd_dkdv_kernel, attn_bwd_dq_kernel, attn_combine_kernel,
                                 attn_fwd_kernel, attn_split_kernel)
from ..kernels.attention_ws import WG_ROWS, attn_fwd_ws_kernel, consumer_registers, launch_registers
from ..gemm.chain import accumulator_dtype, chain_matmul, chain_sum
from ..gemm.tma import TensorDescriptor
from ..runtime.device import can_read_back, capability, sm_count
from ..runtime.launcher import DEFAULT_NUM_STAGES, cached_launcher

OP = "flash_attn"
MAX_HEAD_DIM = 256
LOG2E = 1.4426950408889634
CHECK_ENV = "RLKERNELS_ATTN_CHECK_INDICES"
# Decode-like calls (query rows x GQA group <= this) take the split-KV kernels.
SPLIT_KV_MAX_ROWS = 64


@dataclasses.dataclass(frozen=True)
class Chain:
    """The chain-defining constants: key block and split size, both in keys from key 0.

    Everything else (query tiles, warps, stages, which kernel) is launch detail that
    leaves a row's bits unchanged; these two change them.
    """

    block_n: int = 64
    split: int = 1024

    def __post_init__(self) -> None:
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ValueError(f"rlkernels.attention: block_n must be a power of two >= 16, got {self.block_n}")
        if self.split < self.block_n or self.split % self.block_n:
            raise ValueError(f"rlkernels.attention: split ({self.split}) must be a positive multiple of "
                             f"block_n ({self.block_n})")


DEFAULT_CHAIN = Chain()
_chain = DEFAULT_CHAIN


def current_chain() -> Chain:
    return _chain


@contextlib.contextmanager
def chain_settings(block_n: int, split: int) -> Iterator[Chain]:
    """Use another (block_n, split) chain inside the block: for tests on the slow
    interpreter only. Results under different settings are different chains."""
    global _chain
    saved, _chain = _chain, Chain(block_n, split)
    try:
        yield _chain
    finally:
        _chain = saved


@dataclasses.dataclass(frozen=True)
class FwdLaunch:
    """Launch parameters of the forward kernels (no effect on the bits). ``tma``: the
    full kernel reads whole in-range K/V blocks through TMA descriptors where it can
    (:func:`head_rows_desc`) and the call is large enough to pay for them (:func:`tma_pays`).
    ``ws``: the full forward takes the warp-specialized Hopper kernel where it applies
    (:func:`ws_fwd`)."""

    block_m: int = 128
    num_warps: int = 8
    num_stages: int = 3
    split_block_m: int = 16
    split_warps: int = 4
    split_stages: int = 3
    tma: bool = True
    ws: bool = True


@dataclasses.dataclass(frozen=True)
class BwdLaunch:
    """Launch parameters of the backward kernels: the dK/dV kernel's tile, warps and
    stages, then the dQ kernel's; ``tma`` as in :class:`FwdLaunch` (dQ: K/V blocks,
    dK/dV: q and dO blocks)."""

    dkdv_block_m: int = 64
    dkdv_block_n: int = 64
    dkdv_warps: int = 4
    dkdv_stages: int = 2
    dq_block_m: int = 64
    dq_block_n: int = 64
    dq_warps: int = 4
    dq_stages: int = 2
    tma: bool = True


def default_fwd_launch(head_dim: int, max_q: int = 0) -> FwdLaunch:
    """Measured on an H100 (bf16, causal, B * L = 16384; benchmarks/results/attention_h100.json):
    D = 128: 128 rows / 8 warps / 3 stages beat 2 and 4 stages and 64-row tiles at every L;
    the decode kernel's 8 warps beat 2 and 4 (4 at D = 64). D = 64: 64 rows / 4 warps at
    L <= 2048 (190 vs 167 TFLOP/s for 128 / 8 at L = 1024), 128 rows / 4 warps beyond."""
    if triton_interpret():
        return FwdLaunch(16, 1, 1, 16, 1, 1)
    if head_dim <= 64:
        return FwdLaunch(64, 4, 3) if max_q <= 2048 else FwdLaunch(128, 4, 3)
    if head_dim <= 128:
        return FwdLaunch(128, 8, 3, 16, 8, 3)
    return FwdLaunch(64, 4, 2)


def default_bwd_launch(head_dim: int) -> BwdLaunch:
    """Measured on an H100 (bf16, causal, B * L = 16384): with the query-major dK/dV step,
    64 x 64 tiles / 4 warps / 2 stages for both kernels beat 128-row or 128-key tiles,
    8 warps and 3 stages at D = 128 and D = 64 (larger tiles spill the two accumulators)."""
    if triton_interpret():
        return BwdLaunch(16, 16, 1, 1, 16, 16, 1, 1)
    if head_dim <= 128:
        return BwdLaunch(64, 64, 4, 2, 64, 64, 4, 2)
    return BwdLaunch(32, 64, 4, 1, 64, 32, 4, 1)


# Overrides for the tuning script (benchmarks/attention_gpu.py); None = the defaults.
FWD_LAUNCH_OVERRIDE: FwdLaunch | None = None
BWD_LAUNCH_OVERRIDE: BwdLaunch | None = None


# ---------------------------------------------------------------- validation


_QKV_DTYPES = frozenset(V.FLOAT_DTYPES_WITH_FP64)


def _check_qkv(op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rank: int,
               k_ranks: tuple[int, int] | None = None) -> None:
    """Tensors, float, one dtype and device, q of ``rank`` dims and k/v of ``rank`` (or
    ``k_ranks``: an inclusive range) with one shape, a shared head_dim, Hq % Hkv == 0."""
    lo, hi = k_ranks or (rank, rank)
    # Every condition below in one expression first (a decode step is host-bound: the
    # checks one by one cost 10-15 us); where any fails, the checks below name it.
    if (type(q) is torch.Tensor and type(k) is torch.Tensor and type(v) is torch.Tensor
            and q.dtype in _QKV_DTYPES and k.dtype is q.dtype and v.dtype is q.dtype
            and q.dim() == rank and lo <= k.dim() <= hi and k.shape == v.shape
            and q.device == k.device == v.device
            and q.shape[-1] == k.shape[-1] and 1 <= q.shape[-1] <= MAX_HEAD_DIM
            and k.shape[-2] >= 1 and q.shape[-2] % k.shape[-2] == 0):
        return
    for name, t, r0, r1 in (("q", q, rank, rank), ("k", k, lo, hi), ("v", v, lo, hi)):
        V.require_tensor(op, name, t)
        V.require_float(op, name, t)
        V.require_ndim(op, name, t, r0, r1)
    V.require_same_device(op, q=q, k=k, v=v)
    V.require_same_dtype(op, q=q, k=k, v=v)
    if k.shape != v.shape:
        raise ValueError(f"rlkernels.{op}: k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    hq, d = q.shape[-2], q.shape[-1]
    hkv, dk = k.shape[-2], k.shape[-1]
    if d != dk:
        raise ValueError(f"rlkernels.{op}: q and k must share head_dim, got {d} and {dk}")
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"rlkernels.{op}: unsupported head_dim {d} (supported: 1..{MAX_HEAD_DIM})")
    if hkv < 1 or hq % hkv:
        raise ValueError(f"rlkernels.{op}: query heads ({hq}) must be a multiple of KV heads ({hkv})")


def _check_index(op: str, name: str, t: torch.Tensor, n: int | None, device: torch.device) -> None:
    V.require_tensor(op, name, t)
    if t.dtype != torch.int32:
        raise ValueError(f"rlkernels.{op}: {name} must be int32, got {t.dtype}")
    if t.dim() != 1 or (n is not None and t.shape[0] != n):
        want = f"[{n}]" if n is not None else "1-D"
        raise ValueError(f"rlkernels.{op}: {name} must have shape {want}, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"rlkernels.{op}: all tensors must be on one device, got {name} on {t.device} and q on {device}")


def _read_indices(t: torch.Tensor) -> list[int] | None:
    """The values of a small index tensor for the content checks, or None where reading
    them would sync a device at a bad time (CUDA-graph capture, torch.compile tracing)
    or the checks are switched off with RLKERNELS_ATTN_CHECK_INDICES=0."""
    if t.device.type == "cpu":
        return t.tolist()
    if not switch_on(CHECK_ENV) or not can_read_back(t):
        return None
    return t.tolist()


def _check_cu(op: str, name: str, cu: list[int] | None, total: int, max_len: int, max_name: str) -> None:
    if cu is None:
        return
    if cu[0] != 0:
        raise ValueError(f"rlkernels.{op}: {name} must start at 0, got {cu[0]}")
    for i in range(len(cu) - 1):
        if cu[i + 1] < cu[i]:
            raise ValueError(f"rlkernels.{op}: {name} must be non-decreasing, got {name}[{i}] = {cu[i]} > "
                             f"{name}[{i + 1}] = {cu[i + 1]}")
    if cu[-1] != total:
        raise ValueError(f"rlkernels.{op}: {name} must end at the total length {total}, got {cu[-1]}")
    longest = max((b - a for a, b in zip(cu[:-1], cu[1:])), default=0)  # B = 0: no sequence
    if longest > max_len:
        raise ValueError(f"rlkernels.{op}: a sequence of {longest} tokens exceeds {max_name} = {max_len}")


def _scale(op: str, softmax_scale: float | None, d: int) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(d)
    s = float(softmax_scale)
    # The chain takes the row max of the raw scores times the scale (exact for a positive scale only).
    if not math.isfinite(s) or s <= 0:
        raise ValueError(f"rlkernels.{op}: softmax_scale must be positive and finite, got {softmax_scale}")
    return s


def _check_backend(op: str, backend: str, q: torch.Tensor) -> None:
    if backend == "triton":
        if q.dtype == torch.float64:
            raise ValueError(f"rlkernels.{op}: float64 runs on the torch backend only")
        if q.device.type == "cpu" and q.dtype == torch.bfloat16:
            raise ValueError(f"rlkernels.{op}: the Triton interpreter's tl.dot is wrong on bfloat16; "
                             "use float16/float32 or the torch backend on the CPU")


# ---------------------------------------------------------------- key rows

# The backends take keys and values as [NB, S, Hkv, D] with a unit last stride: NB = 1 is
# one packed run of rows every sequence indexes into (varlen), NB = B gives sequence b
# batch row b in any layout (a padded batch, a KV cache, Hugging Face's [B, Hkv, S, D]
# transposed), read in place. k_start[b] counts rows from the sequence's batch row. The
# Triton kernels take a batch row's offset as a number of token strides (``kv_rows``).


def key_rows(t: torch.Tensor, b: int) -> torch.Tensor:
    """Sequence b's key rows [S, Hkv, D] of keys [NB, S, Hkv, D]: NB = 1 holds every
    sequence's keys in one packed run of rows, else sequence b owns batch row b."""
    return t[b if t.shape[0] > 1 else 0]


def _rows_per_batch(t: torch.Tensor) -> int | None:
    """t's batch stride in token strides (0 where NB = 1), or None where it is not a whole number."""
    if t.shape[0] <= 1:
        return 0
    if t.stride(1) > 0 and t.stride(0) % t.stride(1) == 0:
        return t.stride(0) // t.stride(1)
    return None


def kv_rows(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(k, v, rows): keys [NB, S, Hkv, D] and values whose batch rows start ``rows`` token
    strides apart in both (the kernels' ``KV_ROWS``). Every layout that stacks whole batch
    rows qualifies; any other is read from contiguous copies (the same bits)."""
    rk, rv = _rows_per_batch(k), _rows_per_batch(v)
    if rk is None or rk != rv:
        k, v = k.contiguous(), v.contiguous()
        rk = _rows_per_batch(k)
    return k, v, rk


# TMA reads 2-byte tiles here: fp32 stays on pointer loads (its pipelined tiles would not fit shared memory).
TMA_DTYPES = (torch.float16, torch.bfloat16)
_NO_DESCS = (None, None, 0, 0, 0, 0, False)


def head_rows_desc(t: torch.Tensor, rows: int, block_d: int) -> tuple[object, int, int] | None:
    """A TMA descriptor over t [..., S, H, D] (unit last stride) read in blocks of ``rows``
    rows and ``block_d`` = D columns, as (desc, head_rows, head_cols): row r of head h is
    descriptor row r + h * head_rows at column h * head_cols. Heads side by side in a row
    (t [T, H, D], [B, S, H, D]) are column blocks; heads of token-major planes (Hugging
    Face's [B, H, S, D] seen as [B, S, H, D]) are row blocks. None where TMA can't
    describe t: other layouts, misaligned, D != block_d (a wider block would read the
    next head's columns), or more than 2**31 rows (int32 coordinates)."""
    st, sh, h, d = t.stride(-3), t.stride(-2), t.shape[-2], t.shape[-1]
    if (d != block_d or t.stride(-1) != 1 or t.numel() == 0 or t.data_ptr() % 16 or st < d
            or (st * t.element_size()) % 16):
        return None
    if sh >= st and sh % st == 0:
        head_rows, head_cols, width = sh // st, 0, d
    elif h == 1 or (sh >= d and (h - 1) * sh + d <= st):
        head_rows, head_cols, width = 0, sh, (h - 1) * sh + d
    else:
        return None
    extent = sum((n - 1) * stride for n, stride in zip(t.shape, t.stride())) + 1
    n_rows = (extent - width) // st + 1
    if n_rows >= 1 << 31:
        return None
    return TensorDescriptor(t, [n_rows, width], [st, 1], [rows, block_d]), head_rows, head_cols


# TMA saves 4-10% of a forward's GPU time (H100, D = 128, L >= 1024) and costs 40-80 us of
# host time per launch (descriptor objects and Triton's argument wrapper): below about 200
# us of GPU work the call is host-bound on the hosts measured, and pointer loads (the same
# bits) finish sooner. The estimate is the call's forward FLOPs (x 2.5 for the backward).
TMA_MIN_FLOPS = 50e9


def tma_pays(nb: int, heads: int, max_q: int, max_k: int, d: int, causal: bool, factor: float = 1.0) -> bool:
    """Whether a call of nb sequences x heads query heads (up to max_q x max_k scores each,
    head_dim d) is large enough for TMA reads (``TMA_MIN_FLOPS``); launch detail only."""
    flops = 4.0 * nb * heads * max_q * max_k * d * (0.5 if causal else 1.0) * factor
    return flops >= TMA_MIN_FLOPS


def _tma_descs(use: bool, a: torch.Tensor, b: torch.Tensor, rows: int, block_d: int) -> tuple:
    """(a_desc, b_desc, a_head_rows, a_head_cols, b_head_rows, b_head_cols, TMA) for a
    kernel's two TMA-read operands, or pointer loads for both (``_NO_DESCS``) where either
    can't be described, the dtype is not 2-byte or the device has no TMA (before Hopper)."""
    if not use or TensorDescriptor is None or a.dtype not in TMA_DTYPES:
        return _NO_DESCS
    if not triton_interpret() and (not a.is_cuda or capability(a.device)[0] < 9):
        return _NO_DESCS
    da, db = head_rows_desc(a, rows, block_d), head_rows_desc(b, rows, block_d)
    if da is None or db is None:
        return _NO_DESCS
    return da[0], db[0], da[1], da[2], db[1], db[2], True


def _key_strides(k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int, int]:
    """(token, head) strides of k then v, as the kernels take them."""
    return k.stride(1), k.stride(2), v.stride(1), v.stride(2)


# The warp-specialized Hopper forward (kernels.attention_ws) computes attn_fwd_kernel's
# chain with the same instructions. wgmma makes it sm_90 only; its stages hold key blocks
# of WS_BLOCK_N. WS_CONSUMERS: the head dims it takes, each with its consumer warpgroups
# per CTA. Measured against the Triton kernel (bf16, causal, B * L = 16384): D = 128 with
# two, 1.1-1.2x at L >= 1024 (H100); D = 64 with three, 311 -> 341 TFLOP/s at L = 4096 and
# 354 -> 389 at 16384, level at 1024, where two consumers measured level or slower (H200).
WS_CONSUMERS = {64: 3, 128: 2}
WS_BLOCK_N = 64
WS_STAGES = 3
# ``RLKERNELS_ATTN_WS=0``: every forward stays on the Triton kernel (the same bits).
WS_ENV = "RLKERNELS_ATTN_WS"
# The persistent kernel's tile index (a round's first tile plus the program id) is an int32.
WS_MAX_TILES = 1 << 30
_WS_LAYOUTS: dict[tuple[torch.dtype, tuple[int, ...]], object] = {}


def ws_layout(dtype: torch.dtype, block: tuple[int, ...]) -> object:
    """The shared-memory layout of kernels.attention_ws's tiles of shape ``block``."""
    layout = _WS_LAYOUTS.get((dtype, block))
    if layout is None:
        layout = _WS_LAYOUTS.setdefault((dtype, block), gl.NVMMASharedLayout.get_default_for(
            list(block), gl.bfloat16 if dtype == torch.bfloat16 else gl.float16))
    return layout


def _tma_strides_ok(t: torch.Tensor, strides: list[int]) -> bool:
    unit = 16 // t.element_size()  # TMA: 16-byte aligned base and strides
    return t.data_ptr() % 16 == 0 and all(s > 0 and s % unit == 0 for s in strides[:-1])


def ws_rows_desc(t: torch.Tensor) -> object | None:
    """q or out [T, H, D] (heads side by side in a row) as the 2-D TMA view [T, H * D]
    kernels.attention_ws reads (and writes) 64-row tiles of; None where TMA can't."""
    (n, h, d), (st, sh, sd) = t.shape, t.stride()
    strides = [st, 1]
    if sd != 1 or (sh != d and h > 1) or n < 1 or not _tma_strides_ok(t, strides) or n >= 1 << 31:
        return None
    shape = [n, h * d]
    return GluonTensorDescriptor(t.as_strided(shape, strides), shape, strides, [WG_ROWS, d],
                                 ws_layout(t.dtype, (WG_ROWS, d)))


def ws_keys_desc(t: torch.Tensor) -> tuple[object, int, int, int] | None:
    """Keys or values [NB, S, H, D] (unit last stride) as a 3-D TMA view [planes, S, cols]
    for kernels.attention_ws, as (desc, XB, XH, XC): key j of sequence b, head h is row
    k_start + j of plane b * XB + h * XH at column h * XC, so the row extent is a batch
    row's S slots (TMA zero-fills past them). Heads side by side in a token give (1, 0,
    D), head planes (Hugging Face's [B, H, S, D]) (H, 1, 0); one batch row of packed
    sequences (NB = 1) XB = 0. None where TMA can't describe t."""
    (nb, rows, h, d), (sb, sr, sh, sd) = t.shape, t.stride()
    if sd != 1 or rows < 1 or nb < 1:
        return None
    if sh == d or h == 1:
        shape, strides, xh, xc = [nb, rows, h * d], [sb, sr, 1], 0, d
        xb = 1
    elif sr == d and (nb == 1 or sb == h * sh):
        shape, strides, xh, xc = [nb * h, rows, d], [sh, d, 1], 1, 0
        xb = h
    else:
        return None
    if shape[0] == 1:  # a stride TMA accepts where there is one plane (size-1 dims may carry any)
        strides[0] = rows * strides[1]
    if not _tma_strides_ok(t, strides) or shape[0] >= 1 << 31:
        return None
    desc = GluonTensorDescriptor(t.as_strided(shape, strides), shape, strides, [1, WG_ROWS, d],
                                 ws_layout(t.dtype, (1, WG_ROWS, d)))
    return desc, xb if nb > 1 else 0, xh, xc


def ws_programs(tiles: int, device: torch.device) -> int:
    """Programs of the persistent warp-specialized forward: one per SM (its shared memory
    holds one per SM), at most one per tile. Launch detail: which program computes a
    tile changes no bit."""
    return min(tiles, sm_count(device))


def ws_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
           bounds: tuple, nb: int, max_q: int, max_k: int, dense: tuple[int, int] | None, causal: bool,
           qk_scale: float, chain: Chain) -> bool:
    """The forward through the warp-specialized kernel, where it applies: q/out [Tq, Hq, D]
    rows, k/v [NB, S, Hkv, D]; ``bounds`` (q_start, q_len, k_start, k_len) or ``dense``
    (Lq, Lk: every sequence's Lk keys from slot 0 of its batch row) as :func:`triton_fwd`.
    Returns False (nothing launched) where it does not apply; the Triton kernel then
    computes the same bits."""
    d, hq = q.shape[2], q.shape[1]
    consumers = WS_CONSUMERS.get(d)
    if (not _launch_fwd_ws or consumers is None or chain.block_n != WS_BLOCK_N or not switch_on(WS_ENV)
            or q.dtype not in TMA_DTYPES or not q.is_cuda or capability(q.device) != (9, 0)
            or not tma_pays(nb, hq, max_q, max_k, d, causal)):
        return False
    hkv = k.shape[2]
    qd, od = ws_rows_desc(q), ws_rows_desc(out)
    kx, vx = ws_keys_desc(k), ws_keys_desc(v)
    if qd is None or od is None or kx is None or vx is None:
        return False
    num_m = cdiv(max_q, consumers * WG_ROWS)
    tiles = num_m * nb * hq
    if tiles > WS_MAX_TILES:
        return False
    (kd, *kxs), (vd, *vxs) = kx, vx
    lq, lk = dense if dense is not None else (0, 0)
    _launch_fwd_ws[consumers](
        (ws_programs(tiles, q.device),),
        (qd, kd, vd, od, out, vd.base, lse, *bounds, out.stride(0), vd.strides[0], vd.strides[1], lse.stride(0), hq,
         hq // hkv, lq, lk, k.shape[1], qk_scale, *kxs, *vxs, num_m, tiles),
        dict(CAUSAL=causal, BLOCK_N=chain.block_n, BLOCK_D=d, S_SPLIT=chain.split, STAGES=WS_STAGES, REVERSE_M=causal,
             DENSE=dense is not None, CONSUMERS=consumers, CONSUMER_REGS=consumer_registers(consumers)),
        num_warps=4, num_stages=DEFAULT_NUM_STAGES)
    return True


# ---------------------------------------------------------------- torch backend


def _empty_state(h: int, rows: int, d: int, adt: torch.dtype, device: torch.device):
    return (torch.full((h, rows), float("-inf"), dtype=adt, device=device),
            torch.zeros((h, rows), dtype=adt, device=device),
            torch.zeros((h, rows, d), dtype=adt, device=device))


def _merge(m1, l1, acc1, m2, l2, acc2):
    m = torch.maximum(m1, m2)
    m_safe = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    a1 = torch.exp(m1 - m_safe)
    a2 = torch.exp(m2 - m_safe)
    return m, l1 * a1 + l2 * a2, acc1 * a1[..., None] + acc2 * a2[..., None]


def _torch_seq_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                   chain: Chain) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: q [Lq, Hq, D], k/v [Lk, Hkv, D] -> (out [Lq, Hq, D] fp32/fp64, lse [Hq, Lq]).

    Natural-log units here (the Triton kernels use exp2 with log2(e) folded into the
    scale): on the CPU, torch.exp gives every element the same bits whether it lands in
    a vectorised body or a scalar tail, while torch.exp2 does not (measured, torch 2.13).
    """
    adt = accumulator_dtype(q.dtype)
    lq, hq, d = q.shape
    lk, hkv = k.shape[:2]
    g = hq // hkv
    qh = q.permute(1, 0, 2)
    kh = k.permute(1, 0, 2).repeat_interleave(g, 0)
    vh = v.permute(1, 0, 2).repeat_interleave(g, 0)
    pos = torch.arange(lq, device=q.device) + (lk - lq)
    m, l, acc = _empty_state(hq, lq, d, adt, q.device)
    n_end = lk  # causal or not, the last row sees every key
    for s0 in range(0, max(n_end, 0), chain.split):
        m_s, l_s, acc_s = _empty_state(hq, lq, d, adt, q.device)
        for n0 in range(s0, min(s0 + chain.split, n_end), chain.block_n):
            n1 = min(n0 + chain.block_n, lk)
            # Keys past the sequence would add exact zeros to both chains: leaving them out is the same.
            s = chain_matmul(qh, kh[:, n0:n1].transpose(1, 2)) * scale
            if causal:
                keys = torch.arange(n0, n1, device=q.device)
                s = torch.where(keys[None, :] <= pos[:, None], s, torch.full_like(s, float("-inf")))
            m_new = torch.maximum(m_s, torch.amax(s, -1))
            m_safe = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
            alpha = torch.exp(m_s - m_safe)
            p = torch.exp(s - m_safe[..., None]).to(q.dtype)
            l_s = l_s * alpha + chain_sum(p, -1)
            acc_s = chain_matmul(p, vh[:, n0:n1], acc=acc_s * alpha[..., None])
            m_s = m_new
        m, l, acc = _merge(m, l, acc, m_s, l_s, acc_s)
    seen = l > 0
    l1 = torch.where(seen, l, torch.ones_like(l))
    out = acc / l1[..., None]
    lse = torch.where(seen, m + torch.log(l1), torch.full_like(l, float("-inf")))
    return out.permute(1, 0, 2), lse


def _segments(q_start, q_len, k_start, k_len) -> list[tuple[int, int, int, int]]:
    return list(zip(q_start.tolist(), q_len.tolist(), k_start.tolist(), k_len.tolist()))


def torch_fwd(q, k, v, q_start, q_len, k_start, k_len, causal: bool, scale: float,
              chain: Chain) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed forward on the torch backend: q [Tq, Hq, D], k/v [NB, S, Hkv, D]; sequence b's
    queries are rows q_start[b] + [0, q_len[b]) and its keys rows k_start[b] + [0, k_len[b])
    of ``key_rows(k, b)``."""
    tq, hq, d = q.shape
    out = torch.zeros((tq, hq, d), dtype=q.dtype, device=q.device)
    lse = torch.full((hq, tq), float("-inf"), dtype=accumulator_dtype(q.dtype), device=q.device)
    for b, (qs, ql, ks, kl) in enumerate(_segments(q_start, q_len, k_start, k_len)):
        if ql == 0:
            continue
        kb, vb = key_rows(k, b), key_rows(v, b)
        o, ls = _torch_seq_fwd(q[qs:qs + ql], kb[ks:ks + kl], vb[ks:ks + kl], causal, scale, chain)
        out[qs:qs + ql] = o.to(q.dtype)
        lse[:, qs:qs + ql] = ls
    return out, lse.float() if q.dtype != torch.float64 else lse


def torch_bwd(do, q, k, v, out, lse, q_start, q_len, k_start, k_len, causal: bool, scale: float):
    """(dq, dk, dv) on the torch backend, the Triton kernels' chain orders with elementwise steps."""
    adt = accumulator_dtype(q.dtype)
    dq = torch.zeros_like(q)
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    hq, hkv = q.shape[1], k.shape[2]
    g = hq // hkv
    for b, (qs, ql, ks, kl) in enumerate(_segments(q_start, q_len, k_start, k_len)):
        if ql == 0 or kl == 0:
            continue
        kb, vb, dkb, dvb = key_rows(k, b), key_rows(v, b), key_rows(dk, b), key_rows(dv, b)
        qh = q[qs:qs + ql].permute(1, 0, 2)           # [Hq, Lq, D]
        doh = do[qs:qs + ql].permute(1, 0, 2)
        oh = out[qs:qs + ql].permute(1, 0, 2)
        kh = kb[ks:ks + kl].permute(1, 0, 2).repeat_interleave(g, 0)
        vh = vb[ks:ks + kl].permute(1, 0, 2).repeat_interleave(g, 0)
        ls = lse[:, qs:qs + ql].to(adt)
        ls = torch.where(ls == float("-inf"), torch.full_like(ls, float("inf")), ls)
        delta = chain_sum(doh.to(adt) * oh.to(adt), -1)
        s = chain_matmul(qh, kh.transpose(1, 2)) * scale
        p = torch.exp(s - ls[..., None])
        if causal:
            pos = torch.arange(ql, device=q.device) + (kl - ql)
            keys = torch.arange(kl, device=q.device)
            p = torch.where(keys[None, :] <= pos[:, None], p, torch.zeros_like(p))
        dp = chain_matmul(doh, vh.transpose(1, 2))
        ds = (p * (dp - delta[..., None])).to(q.dtype)
        p = p.to(q.dtype)
        # dK/dV: one chain per key over (head of the group, query) in that order.
        pg = p.reshape(hkv, g * ql, kl)  # head h = kv_head * g + j: rows ordered (j, query)
        dsg = ds.reshape(hkv, g * ql, kl)
        dv_h = chain_matmul(pg.transpose(1, 2), doh.reshape(hkv, g * ql, -1))
        dk_h = chain_matmul(dsg.transpose(1, 2), qh.reshape(hkv, g * ql, -1)) * scale
        dvb[ks:ks + kl] = dv_h.to(v.dtype).permute(1, 0, 2)
        dkb[ks:ks + kl] = dk_h.to(k.dtype).permute(1, 0, 2)
        dq[qs:qs + ql] = (chain_matmul(ds, kh) * scale).to(q.dtype).permute(1, 0, 2)
    return dq, dk, dv


# ---------------------------------------------------------------- triton backend

# The forward kernels compile without mul+add contraction: the chain's FMAs are written out
# (tl.fma) and nothing else is fused, so the masked and unmasked block steps round alike
# (the interpreter has no such option and ignores it).
_FWD_OPTIONS = {} if triton_interpret() else {"enable_fp_fusion": False}
# The split-KV combine: columns per program, warps, stages (launch detail, no effect on the bits).
COMBINE_BLOCK_D = 32
COMBINE_WARPS = 1
COMBINE_STAGES = 4
# Triton's num_warps where a launch names none: the delta kernel is a light row sum that needs no more.
DELTA_WARPS = 4
# Decode steps are host-bound: later launches skip Triton's binder (runtime.launcher).
_launch_fwd = cached_launcher(attn_fwd_kernel, options=_FWD_OPTIONS) if attn_fwd_kernel is not None else None
_launch_split = cached_launcher(attn_split_kernel, options=_FWD_OPTIONS) if attn_split_kernel is not None else None
_launch_combine = (cached_launcher(attn_combine_kernel, options=_FWD_OPTIONS) if attn_combine_kernel is not None
                   else None)
# The warp-specialized forward by consumer count: each count's launch has its own maxnreg.
_launch_fwd_ws = ({c: cached_launcher(attn_fwd_ws_kernel, options={**_FWD_OPTIONS, "maxnreg": launch_registers(c)})
                   for c in sorted(set(WS_CONSUMERS.values()))} if attn_fwd_ws_kernel is not None else {})
_launch_bwd_delta = cached_launcher(attn_bwd_delta_kernel) if attn_bwd_delta_kernel is not None else None
_launch_bwd_dkdv = cached_launcher(attn_bwd_dkdv_kernel) if attn_bwd_dkdv_kernel is not None else None
_launch_bwd_dq = cached_launcher(attn_bwd_dq_kernel) if attn_bwd_dq_kernel is not None else None


def _pow2(x: int, floor: int = 16) -> int:
    return max(floor, 1 << max(0, (x - 1).bit_length()))


def triton_fwd(q, k, v, q_start, q_len, k_start, k_len, max_q: int, max_k: int, causal: bool, scale: float,
               chain: Chain, split_kv: bool, dense: tuple[int, int] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernels (full kernel, or split-KV + combine); no host sync.

    q [Tq, Hq, D]; k, v [NB, S, Hkv, D] (``key_rows``). ``dense = (Lq, k_add)``: a padded
    batch (sequence b's queries at rows b * Lq, its keys from row 0 of batch row b,
    k_len[b] = k_len[b] + k_add, or k_add where k_len is None), the index tensors
    q_start/q_len/k_start are then unused and may be None: a decode step builds no index
    tensors on the host. Same bits either way.
    """

    tq, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    nb = tq // dense[0] if dense is not None else q_start.shape[0]
    out = torch.empty_like(q)
    lse = torch.empty((hq, tq), dtype=torch.float32, device=q.device)
    if tq == 0 or nb == 0 or max_q == 0:
        return out, lse
    if dense is not None:
        lq_d, k_add = dense
        klen_ptr = k_len is not None
        idx = k_len if klen_ptr else lse  # unread pointers (DENSE) just need a tensor
        q_start = q_len = k_start = idx
        k_len = idx
    else:
        lq_d = k_add = 0
        klen_ptr = True
    k, v, rows = kv_rows(k, v)
    k_strides = _key_strides(k, v)
    cfg = FWD_LAUNCH_OVERRIDE or default_fwd_launch(d, max_q)
    bd = _pow2(d)
    ieee = q.dtype == torch.float32
    qk_scale = scale * LOG2E
    even_d = d == bd
    is_dense = dense is not None
    if split_kv:
        bm = cfg.split_block_m
        rows_pad = cdiv(max_q * g, bm) * bm
        n_splits = max(1, cdiv(max_k, chain.split))
        finish_here = n_splits == 1
        ws_rows = nb * hkv * n_splits * rows_pad
        ws = lse if finish_here else torch.empty(ws_rows * (bd + 2), dtype=torch.float32, device=q.device)
        _launch_split(
            (rows_pad // bm, nb * hkv, n_splits),
            (q, k, v, ws, out, lse, q_start, q_len, k_start, k_len,
             q.stride(0), q.stride(1), *k_strides, out.stride(0), out.stride(1), lse.stride(0),
             hkv, g, d, qk_scale, n_splits, rows_pad, ws_rows, lq_d, k_add, rows),
            dict(CAUSAL=causal, BLOCK_M=bm, BLOCK_N=chain.block_n, BLOCK_D=bd, S_SPLIT=chain.split, IEEE=ieee,
                 EVEN_D=even_d, DENSE=is_dense, KLEN_PTR=klen_ptr, FINISH=finish_here),
            num_warps=cfg.split_warps, num_stages=cfg.split_stages)
        if not finish_here:
            # The combine's tile is launch detail (an elementwise merge per row and column):
            # the real rows only (a decode step's G heads), BLOCK_DC columns per program.
            cm = min(bm, _pow2(max_q * g, floor=2))
            dc = min(bd, COMBINE_BLOCK_D)
            _launch_combine(
                (cdiv(rows_pad, cm), nb * hkv, bd // dc),
                (ws, out, lse, q_start, q_len, k_start, k_len,
                 out.stride(0), out.stride(1), lse.stride(0),
                 hkv, g, d, n_splits, rows_pad, ws_rows, lq_d, k_add),
                dict(BLOCK_M=cm, BLOCK_D=bd, BLOCK_DC=dc, EVEN_D=even_d, DENSE=is_dense, KLEN_PTR=klen_ptr),
                num_warps=COMBINE_WARPS, num_stages=COMBINE_STAGES)
        return out, lse
    # Not the dense form with per-sequence key counts (k_len + K_ADD, the KV-cache path's):
    # the warp-specialized kernel reads a padded batch's key count from Lk alone.
    if (cfg.ws and not (is_dense and klen_ptr)
            and ws_fwd(q, k, v, out, lse, (q_start, q_len, k_start, k_len), nb, max_q, max_k,
                       (lq_d, k_add) if is_dense else None, causal, qk_scale, chain)):
        return out, lse
    *descs, tma = _tma_descs(cfg.tma and tma_pays(nb, hq, max_q, max_k, d, causal), k, v, chain.block_n, bd)
    _launch_fwd(
        (cdiv(max_q, cfg.block_m), nb * hq),
        (q, k, v, out, lse, *descs, q_start, q_len, k_start, k_len,
         q.stride(0), q.stride(1), *k_strides, out.stride(0), out.stride(1), lse.stride(0),
         hq, g, d, qk_scale, lq_d, k_add, rows),
        # (max_k bounds every k_len, as the grid's max_q bounds every q_len)
        dict(CAUSAL=causal, BLOCK_M=cfg.block_m, BLOCK_N=chain.block_n, BLOCK_D=bd, S_SPLIT=chain.split, IEEE=ieee,
             EVEN_D=even_d, DENSE=is_dense, KLEN_PTR=klen_ptr, REVERSE_M=causal, TMA=tma,
             ONE_SPLIT=max_k <= chain.split),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out, lse


def triton_bwd(do, q, k, v, out, lse, q_start, q_len, k_start, k_len, max_q: int, max_k: int, causal: bool,
               scale: float, dense: tuple[int, int] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the backward kernels (delta, dK/dV, dQ); no host sync. Shapes and bounds as
    :func:`triton_fwd` (``dense`` with k_len None: every key of a batch row)."""
    tq, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    nb = tq // dense[0] if dense is not None else q_start.shape[0]
    k, v, rows = kv_rows(k, v)
    launch = not (tq == 0 or nb == 0 or max_q == 0 or max_k == 0)
    # Rows outside every sequence get no write and must read zero; a dense batch whose
    # sequences hold every key of their batch row leaves none (one memset less per grad).
    alloc = torch.empty_like if launch and dense is not None and dense[1] == k.shape[1] else torch.zeros_like
    dq = alloc(q)
    # dK, dV in k's and v's layouts (zeros_like/empty_like keep a dense layout), so their
    # batch rows are as many token strides apart; a layout they do not keep is copied first.
    dk, dv = alloc(k), alloc(v)
    if _rows_per_batch(dk) != rows or _rows_per_batch(dv) != rows:
        k, v = k.contiguous(), v.contiguous()
        dk, dv, rows = alloc(k), alloc(v), _rows_per_batch(k)
    if not launch:
        return dq, dk, dv
    if dense is not None:
        lq_d, k_add = dense
        q_start = q_len = k_start = k_len = lse  # unread pointers (DENSE) just need a tensor
    else:
        lq_d = k_add = 0
    cfg = BWD_LAUNCH_OVERRIDE or default_bwd_launch(d)
    bd = _pow2(d)
    ieee = q.dtype == torch.float32
    qk_scale = scale * LOG2E
    do = do if do.stride(-1) == 1 else do.contiguous()
    delta = torch.empty((hq, tq), dtype=torch.float32, device=q.device)
    bm0 = 16 if triton_interpret() else 64
    _launch_bwd_delta(
        (cdiv(max_q, bm0), nb * hq),
        (out, do, delta, q_start, q_len, out.stride(0), out.stride(1), do.stride(0), do.stride(1), delta.stride(0),
         hq, d, lq_d),
        dict(BLOCK_M=bm0, BLOCK_D=bd, EVEN_D=d == bd, DENSE=dense is not None),
        num_warps=DELTA_WARPS, num_stages=DEFAULT_NUM_STAGES)
    lse = lse.contiguous()
    k_strides = _key_strides(k, v)
    use_tma = cfg.tma and tma_pays(nb, hq, max_q, max_k, d, causal, 2.5)
    *q_descs, q_tma = _tma_descs(use_tma, q, do, cfg.dkdv_block_m, bd)
    _launch_bwd_dkdv(
        (cdiv(max_k, cfg.dkdv_block_n), nb * hkv),
        (q, k, v, do, lse, delta, dk, dv, *q_descs, q_start, q_len, k_start, k_len,
         q.stride(0), q.stride(1), *k_strides, do.stride(0), do.stride(1), lse.stride(0),
         dk.stride(1), dk.stride(2), dv.stride(1), dv.stride(2),
         hkv, g, d, qk_scale, scale, lq_d, k_add, rows),
        dict(CAUSAL=causal, BLOCK_M=cfg.dkdv_block_m, BLOCK_N=cfg.dkdv_block_n, BLOCK_D=bd, IEEE=ieee, EVEN_D=d == bd,
             TMA=q_tma, DENSE=dense is not None),
        num_warps=cfg.dkdv_warps, num_stages=cfg.dkdv_stages)
    *k_descs, k_tma = _tma_descs(use_tma, k, v, cfg.dq_block_n, bd)
    _launch_bwd_dq(
        (cdiv(max_q, cfg.dq_block_m), nb * hq),
        (q, k, v, do, lse, delta, dq, *k_descs, q_start, q_len, k_start, k_len,
         q.stride(0), q.stride(1), *k_strides, do.stride(0), do.stride(1), lse.stride(0), dq.stride(0), dq.stride(1),
         hq, g, d, qk_scale, scale, lq_d, k_add, rows),
        dict(CAUSAL=causal, BLOCK_M=cfg.dq_block_m, BLOCK_N=cfg.dq_block_n, BLOCK_D=bd, IEEE=ieee, EVEN_D=d == bd,
             REVERSE_M=causal, TMA=k_tma, DENSE=dense is not None),
        num_warps=cfg.dq_warps, num_stages=cfg.dq_stages)
    return dq, dk, dv


# ---------------------------------------------------------------- dispatch: autograd.Function and custom ops


def _fwd_impl(q, k, v, q_start, q_len, k_start, k_len, max_q, max_k, causal, scale, block_n, split, backend,
              split_kv):
    if q.is_meta:  # shapes only, as the custom op's fake
        lse_dt = torch.float64 if q.dtype == torch.float64 else torch.float32
        return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=lse_dt)
    chain = Chain(block_n, split)
    if backend == "triton":
        return triton_fwd(q, k, v, q_start, q_len, k_start, k_len, max_q, max_k, causal, scale, chain, split_kv)
    return torch_fwd(q, k, v, q_start, q_len, k_start, k_len, causal, scale, chain)


def _bwd_impl(do, q, k, v, out, lse, q_start, q_len, k_start, k_len, max_q, max_k, causal, scale, backend):
    if q.is_meta:
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if backend == "triton":
        return triton_bwd(do, q, k, v, out, lse, q_start, q_len, k_start, k_len, max_q, max_k, causal, scale)
    return torch_bwd(do, q, k, v, out, lse, q_start, q_len, k_start, k_len, causal, scale)


class _AttnFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, q_start, q_len, k_start, k_len, max_q, max_k, causal, scale, block_n, split,  # type: ignore[override]
                backend, split_kv):
        out, lse = _fwd_impl(q, k, v, q_start, q_len, k_start, k_len, max_q, max_k, causal, scale, block_n,
                             split, backend, split_kv)
        ctx.save_for_backward(q, k, v, out, lse, q_start, q_len, k_start, k_len)
        ctx.args = (max_q, max_k, causal, scale, backend)
        ctx.mark_non_differentiable(lse)
        # lse takes no gradient: no zeros tensor for it per backward (a fill launch of host time).
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):  # type: ignore[override]
        if dout is None:
            return (None,) * 15
        q, k, v, out, lse, q_start, q_len, k_start, k_len = ctx.saved_tensors
        max_q, max_k, causal, scale, backend = ctx.args
        dq, dk, dv = _bwd_impl(dout, q, k, v, out, lse, q_start, q_len, k_start, k_len, max_q, max_k, causal,
                               scale, backend)
        return (dq, dk, dv) + (None,) * 12


class _PaddedBatchAttnFunction(torch.autograd.Function):
    """flash_attn_func on the Triton backend: q [B, Lq, Hq, D], k/v [B, Lk, Hkv, D] in,
    [B, Lq, Hq, D] out, through the kernels' dense form (sequence b's bounds from (Lq, Lk):
    no index tensors). The row views are taken inside, so the call adds one autograd node
    and no view nodes (each costs the host time of a small op, forward and backward)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale):  # type: ignore[override]
        b, lq, hq, d = q.shape
        lk = k.shape[1]
        k, v = _last_dim_unit(k), _last_dim_unit(v)
        out, lse = triton_fwd(_packed(q), k, v, None, None, None, None, lq, lk, causal, scale, _chain, False,
                              dense=(lq, lk))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (causal, scale)
        return out.view(b, lq, hq, d)

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        causal, scale = ctx.args
        b, lq, hq, d = q.shape
        lk = k.shape[1]
        dq, dk, dv = triton_bwd(_packed(dout), _packed(q), k, v, out, lse, None, None, None, None, lq, lk, causal,
                                scale, (lq, lk))
        return dq.view(b, lq, hq, d), dk, dv, None, None


@torch.library.custom_op("rlkernels::flash_attn_fwd", mutates_args=())
def flash_attn_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: torch.Tensor,
                      q_len: torch.Tensor, k_start: torch.Tensor, k_len: torch.Tensor, max_q: int, max_k: int,
                      causal: bool, scale: float, block_n: int, split: int, backend: str,
                      split_kv: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward as an opaque op for torch.compile (same backends, same bits)."""
    return _fwd_impl(q, k, v, q_start, q_len, k_start, k_len, max_q, max_k, causal, scale, block_n, split,
                     backend, split_kv)


@flash_attn_fwd_op.register_fake
def _(q, k, v, q_start, q_len, k_start, k_len, max_q, max_k, causal, scale, block_n, split, backend, split_kv):
    lse_dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=lse_dt)


@torch.library.custom_op("rlkernels::flash_attn_bwd", mutates_args=())
def flash_attn_bwd_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                      lse: torch.Tensor, q_start: torch.Tensor, q_len: torch.Tensor, k_start: torch.Tensor,
                      k_len: torch.Tensor, max_q: int, max_k: int, causal: bool, scale: float,
                      backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _bwd_impl(do, q, k, v, out, lse, q_start, q_len, k_start, k_len, max_q, max_k, causal, scale, backend)


@flash_attn_bwd_op.register_fake
def _(do, q, k, v, out, lse, q_start, q_len, k_start, k_len, max_q, max_k, causal, scale, backend):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _op_setup(ctx, inputs, output):
    q, k, v, q_start, q_len, k_start, k_len, max_q, max_k, causal, scale = inputs[:11]
    ctx.save_for_backward(q, k, v, output[0], output[1], q_start, q_len, k_start, k_len)
    ctx.args = (max_q, max_k, causal, scale, inputs[13])


def _op_backward(ctx, dout, _dlse):
    q, k, v, out, lse, q_start, q_len, k_start, k_len = ctx.saved_tensors
    max_q, max_k, causal, scale, backend = ctx.args
    dq, dk, dv = flash_attn_bwd_op(dout.contiguous(), q, k, v, out, lse, q_start, q_len, k_start, k_len,
                                   max_q, max_k, causal, scale, backend)
    return (dq, dk, dv) + (None,) * 12


flash_attn_fwd_op.register_autograd(_op_backward, setup_context=_op_setup)


@torch.library.custom_op("rlkernels::flash_attn_kvcache_append", mutates_args=("k_cache", "v_cache"))
def kvcache_append_op(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      cache_seqlens: torch.Tensor) -> None:
    """k_cache[b, cache_seqlens[b] + j] = k[b, j] (and v), in place; no host sync."""
    _append(k_cache, v_cache, k, v, cache_seqlens)


def _append(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            cache_seqlens: torch.Tensor) -> None:
    nb, lnew = k.shape[:2]
    idx = cache_seqlens.long()[:, None] + torch.arange(lnew, device=k.device)[None, :]
    bidx = torch.arange(nb, device=k.device)[:, None].expand(nb, lnew)
    k_cache.index_put_((bidx, idx), k)
    v_cache.index_put_((bidx, idx), v)


@kvcache_append_op.register_fake
def _(k_cache, v_cache, k, v, cache_seqlens):
    return None


def _needs_grad(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)


def _run(q, k, v, q_start, q_len, k_start, k_len, max_q, max_k, causal, scale, backend, split_kv):
    chain = _chain
    args = (q, k, v, q_start, q_len, k_start, k_len, int(max_q), int(max_k), bool(causal), float(scale),
            chain.block_n, chain.split, backend, bool(split_kv))
    if torch.compiler.is_compiling():
        return flash_attn_fwd_op(*args)
    if not _needs_grad(q, k, v):
        # Inference (decode): the same forward without an autograd node's host time.
        return _fwd_impl(*args)
    return _AttnFunction.apply(*args)


def _takes_split_kv(backend: str, max_q: int, group: int) -> bool:
    """Decode-like calls (few query rows per KV head) take the split-KV kernels, which
    fill the GPU over long caches; the full kernel computes the same bits."""
    return backend == "triton" and max_q * group <= SPLIT_KV_MAX_ROWS


def _last_dim_unit(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _packed(t: torch.Tensor) -> torch.Tensor:
    """[B, L, H, D] as rows [B*L, H, D] with a unit last stride (a view when it can be)."""
    return _last_dim_unit(t.reshape(t.shape[0] * t.shape[1], t.shape[2], t.shape[3]))


# ---------------------------------------------------------------- public functions


def flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                    softmax_scale: float | None = None, *, backend: str | None = None) -> torch.Tensor:
    """Batch-invariant attention over a padded batch (FlashAttention's ``flash_attn_func``).

    q: [B, Lq, Hq, D]; k, v: [B, Lk, Hkv, D] with Hq a multiple of Hkv (GQA/MQA);
    fp16/bf16/fp32 (fp64 on the torch backend), D <= 256. Causal masking is
    bottom-right aligned when Lq != Lk. softmax_scale defaults to D**-0.5.
    Returns [B, Lq, Hq, D] in q's dtype; differentiable wrt q, k, v.
    """
    op = "flash_attn_func"
    _check_qkv(op, q, k, v, 4)
    b, lq, hq, d = q.shape
    if k.shape[0] != b:
        raise ValueError(f"rlkernels.{op}: q and k must share the batch size, got {b} and {k.shape[0]}")
    lk = k.shape[1]
    name, _ = select_backend(OP, q.device, backend)
    _check_backend(op, name, q)
    scale = _scale(op, softmax_scale, d)
    if name == "triton" and not torch.compiler.is_compiling() and b and lq:
        # No index tensors (five small device ops of host time): the kernels take sequence
        # b's bounds from (Lq, Lk), the decode path's dense form; inference builds no
        # autograd node either.
        if _needs_grad(q, k, v):
            return _PaddedBatchAttnFunction.apply(q, k, v, causal, scale)
        out, _ = triton_fwd(_packed(q), _last_dim_unit(k), _last_dim_unit(v), None, None, None, None, lq, lk, causal,
                            scale, _chain, False, dense=(lq, lk))
        return out.view(b, lq, hq, d)
    dev = q.device
    ar = torch.arange(b, dtype=torch.int32, device=dev)
    q_start, k_start = ar * lq, torch.zeros_like(ar)  # sequence b's keys: batch row b of k
    q_len = torch.full((b,), lq, dtype=torch.int32, device=dev)
    k_len = torch.full((b,), lk, dtype=torch.int32, device=dev)
    out, _ = _run(_packed(q), _last_dim_unit(k), _last_dim_unit(v), q_start, q_len, k_start, k_len, lq, lk, causal,
                  scale, name, False)
    return out.view(b, lq, hq, d)


def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool = True,
                           softmax_scale: float | None = None, *, backend: str | None = None) -> torch.Tensor:
    """Batch-invariant attention over packed sequences (FlashAttention's ``flash_attn_varlen_func``).

    q: [Tq, Hq, D]; k, v: [Tk, Hkv, D]; cu_seqlens_q/k: int32 [B + 1], starting at 0,
    non-decreasing, ending at Tq/Tk; max_seqlen_q/k: ints >= every sequence's length
    (they size the launch grid, so nothing is read back from the device for it).
    Returns [Tq, Hq, D]; differentiable wrt q, k, v.
    """
    op = "flash_attn_varlen_func"
    _check_qkv(op, q, k, v, 3)
    _check_index(op, "cu_seqlens_q", cu_seqlens_q, None, q.device)
    _check_index(op, "cu_seqlens_k", cu_seqlens_k, cu_seqlens_q.shape[0], q.device)
    if cu_seqlens_q.shape[0] < 1:
        raise ValueError(f"rlkernels.{op}: cu_seqlens_q must hold at least one entry, got shape {tuple(cu_seqlens_q.shape)}")
    max_q, max_k = int(max_seqlen_q), int(max_seqlen_k)
    if max_q < 0 or max_k < 0:
        raise ValueError(f"rlkernels.{op}: max_seqlen_q/k must be >= 0, got {max_q} and {max_k}")
    _check_cu(op, "cu_seqlens_q", _read_indices(cu_seqlens_q), q.shape[0], max_q, "max_seqlen_q")
    _check_cu(op, "cu_seqlens_k", _read_indices(cu_seqlens_k), k.shape[0], max_k, "max_seqlen_k")
    name, _ = select_backend(OP, q.device, backend)
    _check_backend(op, name, q)
    scale = _scale(op, softmax_scale, q.shape[-1])
    q_start, k_start = cu_seqlens_q[:-1], cu_seqlens_k[:-1]
    q_len = cu_seqlens_q[1:] - q_start
    k_len = cu_seqlens_k[1:] - k_start
    out, _ = _run(_last_dim_unit(q), _last_dim_unit(k)[None], _last_dim_unit(v)[None], q_start, q_len, k_start,
                  k_len, max_q, max_k, causal, scale, name, False)
    return out


def attention_by_bounds(op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: torch.Tensor,
                        q_len: torch.Tensor, k_start: torch.Tensor, k_len: torch.Tensor, max_q: int, max_k: int, *,
                        causal: bool = True, scale: float | None = None,
                        backend: str | None = None) -> torch.Tensor:
    """The op over sequences given by their bounds, for integrations that hold padded rows.

    q: [Tq, Hq, D]; k, v: [Tk, Hkv, D] (one packed run of key rows) or [B, S, Hkv, D] (any
    strides with a unit last one: sequence b's keys in batch row b, so a cache in Hugging
    Face's [B, Hkv, S, D] layout, transposed, is read in place). Sequence b owns query rows
    ``q_start[b] .. q_start[b] + q_len[b] - 1`` and key rows ``k_start[b] .. k_start[b] +
    k_len[b] - 1`` (int32 device tensors, read by the kernels: no host sync), causal
    bottom-right aligned, its keys counted from ``k_start[b]`` -- the same chain as every
    public entry point. max_q / max_k: ints >= every q_len / k_len. Rows outside every
    sequence are not written. Decode-like calls take the split-KV kernels (same bits).
    Differentiable wrt q, k, v. ``op`` names the caller in errors.
    """
    _check_qkv(op, q, k, v, 3, k_ranks=(3, 4))
    nb = q_start.shape[0]
    for name, t in (("q_start", q_start), ("q_len", q_len), ("k_start", k_start), ("k_len", k_len)):
        _check_index(op, name, t, nb, q.device)
    if k.dim() == 4 and k.shape[0] not in (1, nb):
        raise ValueError(f"rlkernels.{op}: batched keys [B, S, Hkv, D] need B = 1 or one row per sequence "
                         f"({nb}), got {tuple(k.shape)}")
    name, _ = select_backend(OP, q.device, backend)
    _check_backend(op, name, q)
    scale = _scale(op, scale, q.shape[-1])
    rows = (_last_dim_unit(k), _last_dim_unit(v))
    if k.dim() == 3:
        rows = (rows[0][None], rows[1][None])
    split_kv = _takes_split_kv(name, int(max_q), q.shape[1] // k.shape[-2])
    out, _ = _run(_last_dim_unit(q), *rows, q_start, q_len, k_start, k_len, max_q, max_k, causal, scale, name,
                  split_kv)
    return out


def flash_attn_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            k: torch.Tensor | None = None, v: torch.Tensor | None = None,
                            cache_seqlens: torch.Tensor | int | None = None, causal: bool = True,
                            softmax_scale: float | None = None, *, backend: str | None = None) -> torch.Tensor:
    """Decode / chunked prefill over a KV cache (FlashAttention's ``flash_attn_with_kvcache``).

    q: [B, Lq, Hq, D]; k_cache, v_cache: [B, S, Hkv, D] with a unit last stride (any batch,
    token and head strides: ``cache.transpose(1, 2)`` of a [B, Hkv, S, D] cache is read and
    written in place); k, v: optional [B, Lnew, Hkv, D], written in place into
    the caches at positions cache_seqlens[b] + [0, Lnew); cache_seqlens: int32 [B], an
    int, or None (the whole cache). Query i of a sequence attends as key position
    cache_seqlens[b] + Lnew - Lq + i (causal, bottom-right). Slots past
    cache_seqlens[b] + Lnew are never read into the result (NaN there is harmless).
    Forward only (inference). Returns [B, Lq, Hq, D].
    """
    op = "flash_attn_with_kvcache"
    _check_qkv(op, q, k_cache, v_cache, 4)
    b, lq, hq, d = q.shape
    nb, s_cap = k_cache.shape[:2]
    if nb != b:
        raise ValueError(f"rlkernels.{op}: q and k_cache must share the batch size, got {b} and {nb}")
    for name_, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.stride(-1) != 1 and d > 1:  # the kernels read head_dim contiguously; a copy would lose the append
            raise ValueError(f"rlkernels.{op}: {name_} must have a unit last stride, got strides {tuple(c.stride())}")
    if (k is None) != (v is None):
        raise ValueError(f"rlkernels.{op}: pass both k and v to append, or neither")
    lnew = 0
    if k is not None:
        _check_qkv(op, q, k, v, 4)
        V.require_same_dtype(op, q=q, k=k, k_cache=k_cache)
        V.require_same_device(op, q=q, k=k, k_cache=k_cache)
        if k.shape[0] != b or k.shape[2:] != k_cache.shape[2:]:
            raise ValueError(f"rlkernels.{op}: k must be [{b}, Lnew, {k_cache.shape[2]}, {k_cache.shape[3]}], "
                             f"got {tuple(k.shape)}")
        # The append writes the caches in place: a slot shared by two rows (an expanded
        # cache) or by k_cache and v_cache would hand one row's new key to another.
        V.require_writable(op, "k_cache", k_cache)
        V.require_writable(op, "v_cache", v_cache)
        if V.may_overlap(k_cache, v_cache):
            raise ValueError(f"rlkernels.{op}: k_cache and v_cache share memory (k_cache strides "
                             f"{tuple(k_cache.stride())}, v_cache strides {tuple(v_cache.stride())}, "
                             f"{v_cache.data_ptr() - k_cache.data_ptr()} bytes apart), so appending v would "
                             "overwrite keys; pass caches that do not overlap")
        lnew = k.shape[1]
    dev = q.device
    seqlen_int: int | None = None
    if cache_seqlens is None:
        if lnew:
            raise ValueError(f"rlkernels.{op}: appending k/v needs cache_seqlens (the cache is full otherwise)")
        seqlen_int = s_cap
    elif isinstance(cache_seqlens, int):
        if cache_seqlens < 0:
            raise ValueError(f"rlkernels.{op}: cache_seqlens must be >= 0, got {cache_seqlens}")
        if cache_seqlens > s_cap - lnew:
            raise ValueError(f"rlkernels.{op}: cache_seqlens {cache_seqlens} + {lnew} new tokens exceeds the "
                             f"cache of {s_cap}")
        seqlen_int = cache_seqlens
    else:
        _check_index(op, "cache_seqlens", cache_seqlens, b, dev)
        vals = _read_indices(cache_seqlens)
        if vals is not None:
            negative = [(i, x) for i, x in enumerate(vals) if x < 0]
            if negative:
                i, x = negative[0]
                raise ValueError(f"rlkernels.{op}: cache_seqlens must be >= 0, got cache_seqlens[{i}] = {x}")
            bad = [(i, x) for i, x in enumerate(vals) if x > s_cap - lnew]
            if bad:
                i, x = bad[0]
                raise ValueError(f"rlkernels.{op}: cache_seqlens[{i}] = {x} with {lnew} new tokens is beyond the "
                                 f"cache of {s_cap} slots")
    name, _ = select_backend(OP, dev, backend)
    _check_backend(op, name, q)
    scale = _scale(op, softmax_scale, d)
    split_kv = _takes_split_kv(name, lq, hq // k_cache.shape[2])
    if name == "triton" and not torch.compiler.is_compiling() and s_cap and b:
        # Eager fast path (decode steps are launch-bound): no index tensors, no autograd
        # node; the kernels read sequence b's bounds from (Lq, S, cache_seqlens + Lnew).
        if lnew:
            if seqlen_int is not None:
                k_cache[:, seqlen_int:seqlen_int + lnew] = k
                v_cache[:, seqlen_int:seqlen_int + lnew] = v
            else:
                _append(k_cache, v_cache, k, v, cache_seqlens)
        klen = None if seqlen_int is not None else cache_seqlens
        k_add = seqlen_int + lnew if seqlen_int is not None else lnew
        out, _ = triton_fwd(_packed(q), k_cache, v_cache, None, None, None, klen, lq, s_cap, causal, scale, _chain,
                            split_kv, dense=(lq, k_add))
        return out.view(b, lq, hq, d)
    if seqlen_int is not None:
        cache_seqlens = torch.full((b,), seqlen_int, dtype=torch.int32, device=dev)
    if lnew:
        kvcache_append_op(k_cache, v_cache, k, v, cache_seqlens)
    ar = torch.arange(b, dtype=torch.int32, device=dev)
    q_start, k_start = ar * lq, torch.zeros_like(ar)  # sequence b's keys: batch row b of the cache
    q_len = torch.full((b,), lq, dtype=torch.int32, device=dev)
    k_len = cache_seqlens + lnew
    with torch.no_grad():
        out, _ = _run(_packed(q), k_cache, v_cache, q_start, q_len, k_start, k_len, lq, s_cap, causal, scale, name,
                      split_kv)
    return out.view(b, lq, hq, d)


# ---------------------------------------------------------------- registry entries


class _AttnBase(OpImpl):
    op_class = "attention"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                softmax_scale: float | None = None) -> torch.Tensor:
        return flash_attn_func(q, k, v, causal, softmax_scale, backend=self.backend)

    def forward_fp32(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                     softmax_scale: float | None = None) -> torch.Tensor:
        """The chain on fp32 copies of the inputs (p kept in fp32), fp32 out."""
        return flash_attn_func(q.float(), k.float(), v.float(), causal, softmax_scale, backend=self.backend)

    def invariance_case(self, device, dtype, generator):
        lq, h, d = (37, 2, 16) if device.type == "cpu" else (1031, 8, 128)
        x = torch.randn(6, 3, lq, h, d, generator=generator).to(device=device, dtype=dtype)
        return (lambda rows: self.forward(rows[:, 0], rows[:, 1], rows[:, 2])), x


@register(OP, "triton")
class FlashAttnTriton(_AttnBase):
    pass


@register(OP, "torch")
class FlashAttnTorch(_AttnBase):
    pass
