"""Kernels of the top-k / top-p threshold: the smallest kept scaled logit of each row.
Host side: ``rlkernels.ops.lm_head.truncation``.

A row's candidates are found without a sort of the row: each fixed chunk of it yields its
own C largest (a bitonic top-k in registers), and one program sorts the chunks' candidates.
Every logit above the largest of the chunks' C-th values (the bound) is among them, so
their sorted values and prefix masses are the row's down to the bound: a function of the
row's values alone, however the chunks fall. The chunk pass also leaves each chunk's max
and fp64 mass ``exp(z - max)``, merged in ascending chunk order into the row's mass.

Masses are ``exp(z - top)`` in fp64, ``top`` the row's max, and p is taken of the total
over the distribution top-p truncates (``z >= floor``, the top-k threshold). The nucleus
is the smallest prefix of the candidates whose mass reaches it; its last value is the
threshold, and every logit equal to it is kept too. Where the candidates above the bound
do not reach it,
the threshold is searched over the whole row: the largest order key t whose mass ``F(t)``
(over z with key >= t) still reaches it, by bisection over the fp32 order keys. Every sum
runs over one row's values in an order fixed by V and the chunk.
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
    def _mass_above(z_ptr, rows, row_ok, stride_z, V, top, t, BLOCK: tl.constexpr):
        """F(t) [BLOCK_R]: each row's fp64 mass exp(z - top) over its logits whose order key
        is >= t, blocks of the row in ascending order."""
        total = tl.zeros(rows.shape, tl.float64)
        for c0 in range(0, V, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            ok = row_ok[:, None] & (cols < V)[None, :]
            z = tl.load(z_ptr + rows[:, None] * stride_z + cols[None, :], mask=ok, other=float("-inf"))
            keep = ok & (order_key(z).to(tl.int64) >= t[:, None])
            total += tl.sum(tl.where(keep, tl.exp(z.to(tl.float64) - top[:, None]), 0.0), axis=1)
        return total

    @triton.jit
    def chunk_top_kernel(x_ptr, top_ptr, cm_ptr, cs_ptr, N, L, stride_x, n_chunks,
                         CHUNK: tl.constexpr, C: tl.constexpr, BLOCK_R: tl.constexpr, MASS: tl.constexpr):
        """Grid (row blocks, chunks): the C largest of each row's chunk ``x[row, c*CHUNK :
        (c+1)*CHUNK]`` (of L values; -inf beyond), descending, into ``top[row, c*C : (c+1)*C]``
        (rows of n_chunks * C). MASS: the chunk's max and fp64 mass exp(x - max) into
        ``cm`` / ``cs`` [N, n_chunks] (mass 0 where the chunk holds only -inf)."""
        rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        chunk = tl.program_id(1)
        cols = chunk * CHUNK + tl.arange(0, CHUNK)
        row_ok = rows < N
        ok = row_ok[:, None] & (cols < L)[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=ok, other=float("-inf"))
        best = tl.topk(x, C)
        out = top_ptr + rows[:, None] * (n_chunks * C) + chunk * C + tl.arange(0, C)[None, :]
        tl.store(out, best, mask=row_ok[:, None])
        if MASS:
            mx = tl.max(x, axis=1)
            ref = tl.where(mx == float("-inf"), 0.0, mx).to(tl.float64)
            mass = tl.sum(tl.exp(x.to(tl.float64) - ref[:, None]), axis=1)
            tl.store(cm_ptr + rows * n_chunks + chunk, mx, mask=row_ok)
            tl.store(cs_ptr + rows * n_chunks + chunk, mass, mask=row_ok)

    @triton.jit
    def threshold_kernel(top_ptr, cm_ptr, cs_ptr, z_ptr, floor_ptr, out_ptr, N, n_chunks, V, stride_z, top_k,
                         p_hi, p_lo, FINAL: tl.constexpr, C: tl.constexpr, BLOCK_R: tl.constexpr,
                         TOP_P: tl.constexpr, FLOOR_GIVEN: tl.constexpr, BLOCK: tl.constexpr):
        """Grid (row blocks,): each row's threshold into ``out[row]`` (fp32).

        ``top``: [N, n_chunks * C] each chunk's C largest, descending (n_chunks * C <= FINAL);
        ``cm``/``cs``: the chunks' maxima and masses; ``z``: the whole rows [N, V] (read only
        where the candidates fall short). Every logit above ``bound``, the largest of the
        chunks' C-th values, is among the candidates, so their sorted prefix masses are the
        row's down to it. ``top_k``: 0, or <= C (its threshold is the k-th candidate);
        FLOOR_GIVEN: ``floor`` [N] holds the top-k threshold instead (a k beyond C). p = p_hi
        + p_lo (two fp32 scalars holding a double's leading bits). Without TOP_P the
        threshold is top-k's."""
        rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = rows < N
        cols = tl.arange(0, FINAL)
        width = n_chunks * C
        x = tl.load(top_ptr + rows[:, None] * width + cols[None, :], mask=row_ok[:, None] & (cols < width)[None, :],
                    other=float("-inf"))
        j = cols[None, :]
        if FLOOR_GIVEN:
            floor = tl.load(floor_ptr + rows, mask=row_ok, other=float("-inf"))
        elif top_k > 0:
            # The k-th largest (k <= C): among the C largest of the C largest of each chunk.
            floor = tl.max(tl.where(tl.arange(0, C)[None, :] == top_k - 1, tl.topk(x, C), float("-inf")), axis=1)
        else:
            floor = tl.full(rows.shape, float("-inf"), tl.float32)
        if TOP_P:
            bound = tl.max(tl.min(tl.reshape(x, [BLOCK_R, FINAL // C, C]), axis=2), axis=1)
            vals = tl.sort(x, dim=1, descending=True)
            top = tl.max(vals, axis=1)
            top64 = tl.where(top == float("-inf"), 0.0, top).to(tl.float64)
            e = tl.where(vals >= floor[:, None], tl.exp(vals.to(tl.float64) - top64[:, None]), 0.0)
            cum = tl.cumsum(e, axis=1)
            # The candidates hold the whole top-k set (every logit >= floor) when it lies
            # above the bound.
            covers = (floor > float("-inf")) & (floor > bound)
            floor_key = order_key(floor).to(tl.int64)
            # The distribution's total mass: the chunks' (every logit), the candidates' (a
            # top-k set they hold), or the whole row's above the floor.
            total = tl.zeros(rows.shape, tl.float64)
            for c in range(0, n_chunks):
                mk = tl.load(cm_ptr + rows * n_chunks + c, mask=row_ok, other=float("-inf"))
                sk = tl.load(cs_ptr + rows * n_chunks + c, mask=row_ok, other=0.0)
                total += sk * tl.exp(mk.to(tl.float64) - top64)
            total = tl.where(covers, tl.max(cum, axis=1), total)
            ties_beyond = (floor > float("-inf")) & ~covers & row_ok
            if tl.sum(ties_beyond.to(tl.int32), axis=0) > 0:
                # A top-k set whose threshold's ties run past the candidates: its mass
                # over the whole row.
                total = tl.where(ties_beyond, _mass_above(z_ptr, rows, ties_beyond, stride_z, V, top64, floor_key,
                                                          BLOCK), total)
            p = (tl.zeros(rows.shape, tl.float64) + p_hi) + p_lo
            target = p * total
            first = tl.min(tl.where(cum >= target[:, None], j, FINAL), axis=1)
            tau = tl.max(tl.where(j == first[:, None], vals, float("-inf")), axis=1)
            # Prefix masses above the bound are the row's; at the bound itself they may miss
            # its ties, which only add mass: reaching p there still makes it the threshold.
            found = (first < FINAL) & (tau >= bound)
            tau = tl.where(found, tau, tl.where(covers, floor, float("-inf")))
            search = ~found & ~covers & row_ok
            if tl.sum(search.to(tl.int32), axis=0) > 0:
                # Bisection over order keys: F(lo) >= target > F(hi) throughout; rows that
                # need no search start with hi = lo + 1.
                lo = floor_key
                hi = tl.where(search, tl.full(rows.shape, 2147483648, tl.int64), lo + 1)
                while tl.sum((hi - lo > 1).to(tl.int32), axis=0) > 0:
                    mid = (lo + hi) // 2
                    reach = _mass_above(z_ptr, rows, search & (hi - lo > 1), stride_z, V, top64, mid, BLOCK) >= target
                    lo = tl.where(reach, mid, lo)
                    hi = tl.where(reach, hi, mid)
                # The smallest logit whose key is >= lo: the threshold itself.
                best = tl.full(rows.shape, float("inf"), tl.float32)
                for c0 in range(0, V, BLOCK):
                    zc = c0 + tl.arange(0, BLOCK)
                    ok = search[:, None] & (zc < V)[None, :]
                    z = tl.load(z_ptr + rows[:, None] * stride_z + zc[None, :], mask=ok, other=float("inf"))
                    keep = ok & (order_key(z).to(tl.int64) >= lo[:, None])
                    best = tl.minimum(best, tl.min(tl.where(keep, z, float("inf")), axis=1))
                tau = tl.where(search, best, tau)
            tau = tl.maximum(tau, floor)
        else:
            tau = floor
        tl.store(out_ptr + rows, tau, mask=row_ok)
else:  # pragma: no cover - the torch backend still imports without Triton
    order_key = chunk_top_kernel = threshold_kernel = None
