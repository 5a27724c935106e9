"""Key-row layouts and TMA descriptors: how the kernels find a sequence's rows in memory.

The backends take keys and values as [NB, S, Hkv, D] with a unit last stride: NB = 1 is
one packed run of rows every sequence indexes into (varlen), NB = B gives sequence b
batch row b in any layout (a padded batch, a KV cache, Hugging Face's [B, Hkv, S, D]
transposed), read in place. k_start[b] counts rows from the sequence's batch row. The
Triton kernels take a batch row's offset as a number of token strides (``kv_rows``).
"""
from __future__ import annotations

import torch

from ...gemm.tma import TensorDescriptor


def last_dim_unit(t: torch.Tensor) -> torch.Tensor:
    """t itself where its last stride is 1, else a contiguous copy (the same values)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def packed(t: torch.Tensor) -> torch.Tensor:
    """[B, L, H, D] as rows [B*L, H, D] with a unit last stride (a view when it can be)."""
    return last_dim_unit(t.reshape(t.shape[0] * t.shape[1], t.shape[2], t.shape[3]))


def key_rows(t: torch.Tensor, b: int) -> torch.Tensor:
    """Sequence b's key rows [S, Hkv, D] of keys [NB, S, Hkv, D]: NB = 1 holds every
    sequence's keys in one packed run of rows, else sequence b owns batch row b."""
    return t[b if t.shape[0] > 1 else 0]


def rows_per_batch(t: torch.Tensor) -> int | None:
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
    rk, rv = rows_per_batch(k), rows_per_batch(v)
    if rk is None or rk != rv:
        k, v = k.contiguous(), v.contiguous()
        rk = rows_per_batch(k)
    return k, v, rk


# TMA reads 2-byte tiles here: fp32 stays on pointer loads (its pipelined tiles would not fit shared memory).
TMA_DTYPES = (torch.float16, torch.bfloat16)


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
# The default of ``AttnTuning.tma_min_flops``; tests and benchmarks/sanitize_kernels.py pass 0
# there (every call that can reads through TMA).
TMA_MIN_FLOPS = 50e9


def tma_pays(nb: int, heads: int, max_q: int, max_k: int, d: int, causal: bool, factor: float = 1.0,
             min_flops: float = TMA_MIN_FLOPS) -> bool:
    """Whether a call of nb sequences x heads query heads (up to max_q x max_k scores each,
    head_dim d) is large enough for TMA reads (``min_flops``); launch detail only."""
    flops = 4.0 * nb * heads * max_q * max_k * d * (0.5 if causal else 1.0) * factor
    return flops >= min_flops
