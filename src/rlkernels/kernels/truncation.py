"""Kernel of the top-p threshold: the smallest kept scaled logit of a row's nucleus.
Host side: ``rlkernels.ops.lm_head.truncation``.

A row's candidates are its largest scaled logits, sorted descending (``torch.topk``
values: a function of the row's values alone). Masses are ``exp(z - max)`` in fp64, and p
is taken of the total over the distribution top-p truncates (``z >= floor``, the top-k
threshold). The nucleus is the smallest prefix of the candidates whose mass reaches it;
its last value is the threshold, and every logit equal to it is kept too. Where the
candidates do not reach it, the threshold is searched over the whole row: the largest
order key t whose mass ``F(t)`` (over z with key >= t) still reaches it, by bisection over
the fp32 order keys. Every sum runs over one row's values in an order fixed by its length.
"""
from __future__ import annotations

from ._triton import tl, triton

if triton is not None:

    @triton.jit
    def order_key(z):
        """An int32 whose order is z's (fp32): the bits, with the negative values' reversed."""
        bits = z.to(tl.int32, bitcast=True)
        return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)

    @triton.jit
    def _mass_above(z_row, V, top, t, BLOCK: tl.constexpr):
        """F(t): the fp64 mass exp(z - top) of the row's logits whose order key is >= t,
        blocks in ascending order."""
        total = tl.zeros((1,), tl.float64)
        for c0 in range(0, V, BLOCK):
            offs = c0 + tl.arange(0, BLOCK)
            ok = offs < V
            z = tl.load(z_row + offs, mask=ok, other=float("-inf"))
            keep = ok & (order_key(z).to(tl.int64) >= t)
            total += tl.sum(tl.where(keep, tl.exp(z.to(tl.float64) - top), 0.0), axis=0)
        return total

    @triton.jit
    def top_p_threshold_kernel(vals_ptr, z_ptr, floor_ptr, out_ptr, n_cand, V, stride_vals, stride_z,
                               p_hi, p_lo, COVERS: tl.constexpr, BLOCK: tl.constexpr):
        """One row per program: its top-p threshold into ``out_ptr[row]``.

        ``vals_ptr``: the row's ``n_cand`` largest scaled logits, descending; ``z_ptr``: all V
        of them; ``floor_ptr``: the top-k threshold (-inf without top-k): the distribution
        top-p truncates is the one over ``z >= floor``. p = p_hi + p_lo (two fp32 scalars
        holding a double's leading bits). COVERS: the candidates hold the whole top-k set
        but for ties at its threshold, so a nucleus they do not reach is that set."""
        row = tl.program_id(0).to(tl.int64)
        p = (tl.zeros((1,), tl.float64) + p_hi) + p_lo
        floor = tl.load(floor_ptr + row + tl.arange(0, 1))
        top = tl.load(vals_ptr + row * stride_vals + tl.arange(0, 1)).to(tl.float64)
        z_row = z_ptr + row * stride_z
        floor_key = order_key(floor).to(tl.int64)
        target = p * _mass_above(z_row, V, top, floor_key, BLOCK)
        acc = tl.zeros((1,), tl.float64)
        tau = tl.full((1,), float("-inf"), tl.float32)
        found = tl.zeros((1,), tl.int1)
        for c0 in range(0, n_cand, BLOCK):
            offs = c0 + tl.arange(0, BLOCK)
            ok = offs < n_cand
            v = tl.load(vals_ptr + row * stride_vals + offs, mask=ok, other=float("-inf"))
            e = tl.where(ok, tl.exp(v.to(tl.float64) - top), 0.0)
            cum = acc + tl.cumsum(e, axis=0)
            first = tl.min(tl.where(ok & (cum >= target), offs, 2147483647), axis=0)
            at = tl.max(tl.where(offs == first, v, float("-inf")), axis=0)
            tau = tl.where(~found & (first < 2147483647), at, tau)
            found = found | (first < 2147483647)
            acc = tl.max(cum, axis=0) + tl.zeros((1,), tl.float64)  # cum never decreases
        if COVERS:
            tau = tl.where(found, tau, floor)
        else:
            if tl.sum(found.to(tl.int32), axis=0) == 0:
                # Bisection over order keys: F(lo) >= target > F(hi) throughout.
                lo = floor_key
                hi = tl.full((1,), 2147483648, tl.int64)
                while tl.sum((hi - lo > 1).to(tl.int32), axis=0) > 0:
                    mid = (lo + hi) // 2
                    reach = _mass_above(z_row, V, top, mid, BLOCK) >= target
                    lo = tl.where(reach, mid, lo)
                    hi = tl.where(reach, hi, mid)
                # The smallest logit whose key is >= lo: the threshold itself.
                best = tl.full((1,), float("inf"), tl.float32)
                for c0 in range(0, V, BLOCK):
                    offs = c0 + tl.arange(0, BLOCK)
                    ok = offs < V
                    z = tl.load(z_row + offs, mask=ok, other=float("inf"))
                    keep = ok & (order_key(z).to(tl.int64) >= lo)
                    best = tl.minimum(best, tl.min(tl.where(keep, z, float("inf")), axis=0))
                tau = best
        tl.store(out_ptr + row + tl.arange(0, 1), tl.maximum(tau, floor))
else:  # pragma: no cover - the torch backend still imports without Triton
    order_key = top_p_threshold_kernel = None
