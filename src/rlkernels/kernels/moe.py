"""The per-token kernels of a mixture-of-experts block, one launch each. Host side:
``rlkernels.ops.moe``.

* ``top_k_route_kernel``: a token's k largest routing probabilities, largest first, equal
  ones to the lowest expert id, and their renormalisation -- what a stable descending
  sort, a gather, k - 1 elementwise adds in rank order and a division give -- from the
  probabilities, or from the logits with the softmax of ``ops.softmax`` in the same launch;
* ``rank_sum_kernel``: the combine ``((w_0 y_0 + w_1 y_1) + ...) + w_{k-1} y_{k-1}`` of a
  token's k expert outputs in fp32, rank ascending, rounded once to the output dtype --
  what k multiplies and k - 1 adds as separate elementwise ops give.

One program per token (times a block of H for the combine): nothing a program computes
reads another token, so a token's bits are its own row's. Every step is one IEEE-rounded
fp32 operation in a fixed order (max, compare, add, multiply, ``div_rn``), so the bits
equal the elementwise ops' on any device. The launches run with ``enable_fp_fusion``
off: a multiply followed by an add must stay two roundings, never one FMA.
"""
from __future__ import annotations

from ._triton import tl, triton
from .cuda_math import expf
from .norms import pairwise_sum_1024

if triton is not None:
    @triton.jit
    def top_k_route_kernel(src_ptr, index_ptr, weights_ptr, total_ptr, E, stride_s, stride_i, stride_w,
                           K: tl.constexpr, NORMALIZE: tl.constexpr, SOFTMAX: tl.constexpr, ROUND: tl.constexpr,
                           BLOCK_E: tl.constexpr):
        """src [T, E] -> index [T, K] int64, weights [T, K] fp32 (probs / their sum with
        NORMALIZE, else the probs), total [T] fp32 (the sum, rank ascending).

        src holds the fp32 probabilities, or with SOFTMAX the logits (any float dtype),
        turned into probabilities as ``ops.softmax.softmax_forward`` does: the max (NaN if any
        entry is NaN, 0 for an all -inf row), exp of the shifted row (CUDA's expf), the sum
        over 1024 lanes in ``pairwise_sum_1024``'s tree (``row_dot_kernel``'s order; BLOCK_E
        is then 1024) and an IEEE division. ROUND: 1 / 2 round the weights to bf16 / fp16
        and back (the routers that cast them to the logits' dtype).

        The order is a stable descending sort's: NaN before every number (as torch.sort puts
        it), then the largest; among equal keys the lowest expert id."""
        t = tl.program_id(0).to(tl.int64)
        ids = tl.arange(0, BLOCK_E)
        valid = ids < E
        if SOFTMAX:
            x = tl.load(src_ptr + t * stride_s + ids, mask=valid, other=float("-inf")).to(tl.float32)
            m = tl.max(x, 0)
            m = tl.where(tl.sum((x != x).to(tl.int32), 0) > 0, float("nan"), m)  # torch.amax propagates NaN
            m = tl.where(m == float("-inf"), 0.0, m)
            e = expf(x - m)
            p = tl.math.div_rn(e, pairwise_sum_1024(e))
        else:
            p = tl.load(src_ptr + t * stride_s + ids, mask=valid, other=0.0)
        # Probabilities lie in [0, 1]: 2 ranks NaN first, -1 puts the padding last, -2 marks a
        # taken expert; none of the keys is ever a probability.
        key = tl.where(p != p, 2.0, p)
        key = tl.where(valid, key, -1.0)
        total = 0.0
        for j in tl.static_range(K):
            best = tl.max(key, 0)
            pick = tl.min(tl.where(key == best, ids, BLOCK_E), 0)
            if SOFTMAX:
                chosen = tl.sum(tl.where(ids == pick, p, 0.0), 0)  # p[pick] plus exact zeros
            else:
                chosen = tl.load(src_ptr + t * stride_s + pick)  # a gather: even a NaN keeps its bits
            tl.store(index_ptr + t * stride_i + j, pick.to(tl.int64))
            tl.store(weights_ptr + t * stride_w + j, chosen)
            total = total + chosen  # 0 + p_0 = p_0 exactly: the chain starts at p_0
            key = tl.where(ids == pick, -2.0, key)
        for j in tl.static_range(K):
            w = tl.load(weights_ptr + t * stride_w + j)
            if NORMALIZE:
                w = tl.math.div_rn(w, total)
            if ROUND == 1:
                w = w.to(tl.bfloat16).to(tl.float32)
            elif ROUND == 2:
                w = w.to(tl.float16).to(tl.float32)
            tl.store(weights_ptr + t * stride_w + j, w)
        tl.store(total_ptr + t, total)

    @triton.jit
    def rank_sum_kernel(y_ptr, w_ptr, out_ptr, H, stride_yt, stride_yr, stride_wt, stride_ot,
                        K: tl.constexpr, WEIGHTED: tl.constexpr, BLOCK_H: tl.constexpr):
        """out[t] = sum_r (w[t, r] *) y[t, r], fp32, r ascending, rounded once to out's dtype.
        y [T, K, H] fp32 (H contiguous), w [T, K] any float dtype (used in fp32), out [T, H]."""
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1).to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = cols < H
        row = y_ptr + t * stride_yt + cols
        acc = tl.load(row, mask=mask, other=0.0)
        if WEIGHTED:
            acc = acc * tl.load(w_ptr + t * stride_wt).to(tl.float32)
        for r in tl.static_range(1, K):
            y = tl.load(row + r * stride_yr, mask=mask, other=0.0)
            if WEIGHTED:
                y = y * tl.load(w_ptr + t * stride_wt + r).to(tl.float32)
            acc = acc + y
        tl.store(out_ptr + t * stride_ot + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)

else:  # pragma: no cover - the torch backend still imports without Triton
    top_k_route_kernel = None
    rank_sum_kernel = None
