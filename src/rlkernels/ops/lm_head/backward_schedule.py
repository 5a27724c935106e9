"""The backward's walk over the vocabulary: how wide a chunk of g = d loss / d logits is,
and in which order the chunks run (docs/design/linear_logprob_schedule.md).

Every choice here moves memory and time only: g's elements do not depend on the chunk
width, and the dH chain over V is split at multiples of 256 (a multiple of every K step
of the GEMM backends), so a row's gradients are the same bits whatever the schedule.
"""
from __future__ import annotations

import math

import torch

# Backward: the g buffer [N, Cv] (hidden dtype) is sized to this many bytes, with Cv a
# multiple of BWD_CHUNK_ALIGN in [BWD_MIN_CHUNK, BWD_MAX_CHUNK]. Cv may depend on N:
# g's elements do not depend on Cv, and the dH chain over V is split at multiples of
# 256 (a multiple of every K step of the GEMM backends), which leaves its bits unchanged.
BWD_CHUNK_BYTES = 64 << 20
BWD_CHUNK_ALIGN = 256
# Each chunk re-reads and re-writes the fp32 dH accumulator (N*D*8 bytes): keep chunks
# wide even at large N, where that traffic would rival the dH GEMM (estimate, not tuned).
BWD_MIN_CHUNK = 4096
BWD_MAX_CHUNK = 32768


def backward_chunk(n_rows: int, vocab: int, elem_size: int) -> int:
    """Columns per backward V chunk: a multiple of 256 (the caller clamps it to V)."""
    cv = BWD_CHUNK_BYTES // max(1, n_rows * elem_size)
    return max(BWD_MIN_CHUNK, min(BWD_MAX_CHUNK, cv)) // BWD_CHUNK_ALIGN * BWD_CHUNK_ALIGN


# The fp32 dH accumulator can live in the bytes of dW's last rows, which the chunk loop
# writes last: the columns over those rows then compute their dW after dH is final,
# recomputing their g (extra work: those columns' share of one g pass). Used when that
# share is at most this fraction of V and the accumulator (N*D*4 bytes) is at least the
# g buffer it sits beside -- the trade is memory for time, worth it where the
# accumulator is a large part of the peak (H100, N = 8192, D = 4096, V = 151936, bf16:
# 1.35 -> 1.285 GiB, fwd+bwd 65.3 -> 67.4 ms; docs/design/linear_logprob_schedule.md).
ACC_IN_DW_MAX_RECOMPUTE = 0.25


def dw_tail_rows(n_rows: int, dim: int, vocab: int, cv: int, acc_dtype: torch.dtype,
                 dw: torch.Tensor | None) -> int | None:
    """The first row of ``dw`` whose bytes hold the dH accumulator, or None (its own buffer).

    Columns from this row on take their dW after dH is final, from the last chunk's g
    (:func:`last_chunk_start`) or a recomputed one."""
    if dw is None or n_rows == 0 or not dw.is_contiguous():
        return None
    acc_elem, w_elem = torch.finfo(acc_dtype).bits // 8, dw.element_size()
    acc_bytes, row_bytes = n_rows * dim * acc_elem, dim * w_elem
    if acc_elem <= w_elem or acc_bytes < n_rows * min(cv, vocab) * w_elem:
        # fp32/fp64: the accumulator is returned as dhidden itself, nothing to save; or a
        # small accumulator beside a large g buffer: not worth a recompute.
        return None
    step = 16 // math.gcd(row_bytes, 16)  # a 16-byte aligned start
    tail = (vocab - -(-acc_bytes // row_bytes)) // step * step
    if tail < 0 or vocab - tail > ACC_IN_DW_MAX_RECOMPUTE * vocab:
        return None
    return tail


def main_loop_chunk(cv: int, dim: int) -> int:
    """Columns per chunk of the backward's main loop when dH's accumulator is in dW's tail.

    The peak is then reached after the loop, when dhidden ([N, dim]) is allocated beside
    the g buffer of the recomputed columns; until then the loop may hold a g buffer wider
    by ``dim`` columns at no cost in peak memory. Wider chunks chain the fp32 dH
    accumulator through HBM fewer times (each pass reads and writes N*D*4 bytes; H100,
    the benchmark shape: 0.466 ms per 4096-column dH GEMM against 0.379 for the dW GEMM of
    the same size, which writes bf16 once). A multiple of 256, like every split of the dH chain.
    """
    return cv + dim // BWD_CHUNK_ALIGN * BWD_CHUNK_ALIGN


def main_loop_schedule(last: int, main_cv: int, free_end: int | None, n_rows: int, dim: int,
                       elem_size: int) -> list[tuple[int, int, int | None]]:
    """The backward's main-loop chunks over ``[0, last)``: ``(v0, v1, g_offset)``.

    With dH's accumulator in dW's tail (``free_end`` = its first row), dW's rows from the
    chunk's end up to ``free_end`` are unwritten while the chunk runs: a chunk whose g
    ([n_rows, v1 - v0], dW's dtype) fits there puts it at element ``g_offset`` of dW
    (16-byte aligned) instead of in the separate buffer, and may be wider than
    ``main_cv``: early in V the free rows allow several times the width, so the fp32 dH
    accumulator makes fewer round trips through HBM (the benchmark shape: 9 main-loop
    chunks instead of 19). Such a chunk is taken only when wider than ``main_cv``; the others use
    the separate buffer (``g_offset`` None). Widths are multiples of ``BWD_CHUNK_ALIGN``, like
    every split of the dH chain, so the bits are those of any other schedule.
    """
    align, per16 = BWD_CHUNK_ALIGN, max(1, 16 // elem_size)
    out: list[tuple[int, int, int | None]] = []
    v0 = 0
    while v0 < last:
        width = 0
        if free_end is not None and free_end > v0:
            width = min((free_end - v0) * dim // (dim + n_rows) // align * align, last - v0)
            while width > main_cv:
                offset = -(-(v0 + width) * dim // per16) * per16
                if offset + n_rows * width <= free_end * dim:
                    break
                width -= align
        if width > main_cv:
            out.append((v0, v0 + width, offset))
        else:
            width = min(main_cv, last - v0)
            out.append((v0, v0 + width, None))
        v0 += width
    return out


def last_chunk_start(vocab: int, cv: int) -> int:
    """First column of the backward's last chunk when dH's accumulator is in dW's tail.

    A multiple of 256 (a split of the dH chain) below ``vocab``, leaving at most ``cv``
    columns after it (for ``cv >= 256``). That chunk's g has its own buffer, which
    outlives dH: its columns in dW's tail take their dW from it instead of a recompute.
    """
    align = BWD_CHUNK_ALIGN
    return min(-(-max(0, vocab - cv) // align), (vocab - 1) // align) * align
