"""Kernels of the top-k / top-p threshold: the smallest kept scaled logit of each row.
Host side: ``rlkernels.ops.lm_head.truncation``.

The kernels read the head's raw fp32 logits and score them in registers (``scores``: the
model's transform, then / T), with the bits every kernel of the statistics pass computes.

A row's candidates are found without a sort of the row: each fixed chunk of it yields its
own C largest (a bitonic top-k in registers), so the C largest of the candidates are the
row's C largest. Masses are ``exp(z - top)`` in fp64, ``top`` the row's max, and p is
taken of the total over the distribution top-p truncates (``z >= floor``, the top-k
threshold): every logit's, from each chunk's max and fp64 mass, or the top-k set's.

The nucleus is the smallest prefix of the sorted values whose mass reaches it; its last
value is the threshold, and every logit equal to it is kept too. It is looked for first
in the row's C largest. Where it is wider (or a top-k set reaches past them), all the
candidates are sorted: every logit above the largest of the chunks' C-th values (the
bound) is among them, so their prefix masses are the row's down to it. Where those do
not reach it either, the threshold is searched over the whole row: the largest order key
t whose mass ``F(t)`` (over z with key >= t) still reaches it, by bisection over the fp32
order keys. Every sum runs over one row's values in an order fixed by V and the chunk.
"""
from __future__ import annotations

from ._triton import tl, triton
from .lm_head import scores

if triton is not None:

    @triton.jit
    def order_key(z):
        """An int32 whose order is z's (fp32): the bits, with the negative values' reversed."""
        bits = z.to(tl.int32, bitcast=True)
        return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)

    @triton.jit
    def _row_scores(x_ptr, rows, ok, cols, stride_x, other, temperature, logit_scale, cap_arg, cap,
                    TEMP: tl.constexpr, SCALE: tl.constexpr, CAP: tl.constexpr, BLOCK_R: tl.constexpr,
                    BLOCK: tl.constexpr):
        """The scores z [BLOCK_R, BLOCK] of raw logits ``x[rows, cols]`` (``other`` where not
        ``ok``)."""
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=ok, other=0.0)
        z = scores(x, temperature, logit_scale, cap_arg, cap, TEMP, SCALE, CAP, BLOCK_R, BLOCK)
        return tl.where(ok, z, other)

    @triton.jit
    def _mass_above(x_ptr, rows, row_ok, stride_x, V, top, t, temperature, logit_scale, cap_arg, cap,
                    TEMP: tl.constexpr, SCALE: tl.constexpr, CAP: tl.constexpr, BLOCK_R: tl.constexpr,
                    BLOCK: tl.constexpr):
        """F(t) [BLOCK_R]: each row's fp64 mass exp(z - top) over its logits whose order key
        is >= t, blocks of the row in ascending order."""
        total = tl.zeros(rows.shape, tl.float64)
        for c0 in range(0, V, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            ok = row_ok[:, None] & (cols < V)[None, :]
            z = _row_scores(x_ptr, rows, ok, cols, stride_x, float("-inf"), temperature, logit_scale, cap_arg, cap,
                            TEMP, SCALE, CAP, BLOCK_R, BLOCK)
            keep = ok & (order_key(z).to(tl.int64) >= t[:, None])
            total += tl.sum(tl.where(keep, tl.exp(z.to(tl.float64) - top[:, None]), 0.0), axis=1)
        return total

    @triton.jit
    def chunk_top_kernel(x_ptr, top_ptr, cm_ptr, cs_ptr, N, L, stride_x, n_chunks, temperature, logit_scale,
                         cap_arg, cap, TEMP: tl.constexpr, SCALE: tl.constexpr, CAP: tl.constexpr,
                         CHUNK: tl.constexpr, C: tl.constexpr, BLOCK_R: tl.constexpr, MASS: tl.constexpr):
        """Grid (row blocks, chunks): the C largest scores of each row's chunk ``x[row, c*CHUNK
        : (c+1)*CHUNK]`` (raw logits, L of them; -inf beyond), descending, into ``top[row, c*C :
        (c+1)*C]`` (rows of n_chunks * C). MASS: the chunk's max and fp64 mass exp(z - max)
        into ``cm`` / ``cs`` [N, n_chunks] (mass 0 where the chunk holds only -inf)."""
        rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        chunk = tl.program_id(1)
        cols = chunk * CHUNK + tl.arange(0, CHUNK)
        row_ok = rows < N
        ok = row_ok[:, None] & (cols < L)[None, :]
        z = _row_scores(x_ptr, rows, ok, cols, stride_x, float("-inf"), temperature, logit_scale, cap_arg, cap,
                        TEMP, SCALE, CAP, BLOCK_R, CHUNK)
        best = tl.topk(z, C)
        out = top_ptr + rows[:, None] * (n_chunks * C) + chunk * C + tl.arange(0, C)[None, :]
        tl.store(out, best, mask=row_ok[:, None])
        if MASS:
            mx = tl.max(z, axis=1)
            ref = tl.where(mx == float("-inf"), 0.0, mx).to(tl.float64)
            mass = tl.sum(tl.exp(z.to(tl.float64) - ref[:, None]), axis=1)
            tl.store(cm_ptr + rows * n_chunks + chunk, mx, mask=row_ok)
            tl.store(cs_ptr + rows * n_chunks + chunk, mass, mask=row_ok)

    @triton.jit
    def _first_reaching(vals, cum, target, WIDTH: tl.constexpr):
        """(the index of the first prefix mass ``cum`` [BLOCK_R, WIDTH] that reaches
        ``target``, WIDTH where none does; the value of ``vals`` there, -inf where none)."""
        j = tl.arange(0, WIDTH)[None, :]
        first = tl.min(tl.where(cum >= target[:, None], j, WIDTH), axis=1)
        return first, tl.max(tl.where(j == first[:, None], vals, float("-inf")), axis=1)

    @triton.jit
    def threshold_kernel(top_ptr, cm_ptr, cs_ptr, x_ptr, floor_ptr, out_ptr, N, n_chunks, V, stride_x, top_k,
                         p_hi, p_lo, temperature, logit_scale, cap_arg, cap, TEMP: tl.constexpr,
                         SCALE: tl.constexpr, CAP: tl.constexpr, FINAL: tl.constexpr, CHUNKS: tl.constexpr,
                         C: tl.constexpr, BLOCK_R: tl.constexpr, TOP_P: tl.constexpr, FLOOR_GIVEN: tl.constexpr,
                         BLOCK: tl.constexpr):
        """Grid (row blocks,): each row's threshold into ``out[row]`` (fp32).

        ``top``: [N, n_chunks * C] each chunk's C largest scores, descending (n_chunks * C <=
        FINAL); ``cm``/``cs``: the chunks' maxima and masses (n_chunks <= CHUNKS); ``x``: the
        whole rows' raw logits [N, V] (read only where the candidates fall short). ``top_k``:
        0, or <= C (its threshold is the k-th candidate); FLOOR_GIVEN: ``floor`` [N] holds
        the top-k threshold instead (a k beyond C). p = p_hi + p_lo (two fp32 scalars
        holding a double's leading bits). Without TOP_P the threshold is top-k's."""
        rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = rows < N
        cols = tl.arange(0, FINAL)
        width = n_chunks * C
        x = tl.load(top_ptr + rows[:, None] * width + cols[None, :], mask=row_ok[:, None] & (cols < width)[None, :],
                    other=float("-inf"))
        # The row's C largest: the C largest of the chunks' C largest.
        best = tl.topk(x, C)
        if FLOOR_GIVEN:
            floor = tl.load(floor_ptr + rows, mask=row_ok, other=float("-inf"))
        elif top_k > 0:
            floor = tl.max(tl.where(tl.arange(0, C)[None, :] == top_k - 1, best, float("-inf")), axis=1)
        else:
            floor = tl.full(rows.shape, float("-inf"), tl.float32)
        if TOP_P:
            top = tl.max(best, axis=1)
            top64 = tl.where(top == float("-inf"), 0.0, top).to(tl.float64)
            p = (tl.zeros(rows.shape, tl.float64) + p_hi) + p_lo
            # Every logit's mass, from the chunks', in one fixed tree.
            ch = tl.arange(0, CHUNKS)[None, :]
            ch_ok = row_ok[:, None] & (ch < n_chunks)
            mk = tl.load(cm_ptr + rows[:, None] * n_chunks + ch, mask=ch_ok, other=float("-inf"))
            sk = tl.load(cs_ptr + rows[:, None] * n_chunks + ch, mask=ch_ok, other=0.0)
            every = tl.sum(tl.where(ch_ok, sk * tl.exp(mk.to(tl.float64) - top64[:, None]), 0.0), axis=1)
            # The nucleus within the C largest. A top-k set lies within them (its
            # threshold's ties too) where the C-th is below its threshold: its mass is theirs.
            e = tl.where(best >= floor[:, None], tl.exp(best.to(tl.float64) - top64[:, None]), 0.0)
            cum = tl.cumsum(e, axis=1)
            inside = (floor > float("-inf")) & (tl.min(best, axis=1) < floor)
            total = tl.where(inside, tl.max(cum, axis=1), every)
            first, tau = _first_reaching(best, cum, p * total, C)
            tau = tl.where(first < C, tau, floor)
            fast = row_ok & (inside | ((floor == float("-inf")) & (first < C)))
            slow = row_ok & ~fast
            if tl.sum(slow.to(tl.int32), axis=0) > 0:
                tau = tl.where(slow, _threshold_over_candidates(x, every, floor, top64, p, x_ptr, rows, slow, stride_x,
                                                                V, temperature, logit_scale, cap_arg, cap, TEMP, SCALE,
                                                                CAP, FINAL, C, BLOCK_R, BLOCK), tau)
            tau = tl.maximum(tau, floor)
        else:
            tau = floor
        tl.store(out_ptr + rows, tau, mask=row_ok)

    @triton.jit
    def _threshold_over_candidates(x, every, floor, top64, p, x_ptr, rows, row_ok, stride_x, V, temperature,
                                   logit_scale, cap_arg, cap, TEMP: tl.constexpr, SCALE: tl.constexpr,
                                   CAP: tl.constexpr, FINAL: tl.constexpr, C: tl.constexpr, BLOCK_R: tl.constexpr,
                                   BLOCK: tl.constexpr):
        """The threshold [BLOCK_R] of rows whose nucleus is wider than their C largest, from
        all the candidates ``x`` [BLOCK_R, FINAL] (the chunks' C largest each), else by the
        whole-row search. ``every``: each row's mass over all its logits."""
        bound = tl.max(tl.min(tl.reshape(x, [BLOCK_R, FINAL // C, C]), axis=2), axis=1)
        vals = tl.sort(x, dim=1, descending=True)
        e = tl.where(vals >= floor[:, None], tl.exp(vals.to(tl.float64) - top64[:, None]), 0.0)
        cum = tl.cumsum(e, axis=1)
        # The candidates hold the whole top-k set (every logit >= floor) when it lies above
        # the bound; a top-k set whose threshold's ties run past them: its mass over the
        # whole row.
        covers = (floor > float("-inf")) & (floor > bound)
        floor_key = order_key(floor).to(tl.int64)
        total = tl.where(covers, tl.max(cum, axis=1), every)
        ties_beyond = (floor > float("-inf")) & ~covers & row_ok
        if tl.sum(ties_beyond.to(tl.int32), axis=0) > 0:
            total = tl.where(ties_beyond, _mass_above(x_ptr, rows, ties_beyond, stride_x, V, top64, floor_key,
                                                      temperature, logit_scale, cap_arg, cap, TEMP, SCALE, CAP,
                                                      BLOCK_R, BLOCK), total)
        target = p * total
        first, tau = _first_reaching(vals, cum, target, FINAL)
        # Prefix masses above the bound are the row's; at the bound itself they may miss
        # its ties, which only add mass: reaching p there still makes it the threshold.
        found = (first < FINAL) & (tau >= bound)
        tau = tl.where(found, tau, tl.where(covers, floor, float("-inf")))
        search = ~found & ~covers & row_ok
        if tl.sum(search.to(tl.int32), axis=0) > 0:
            # Bisection over order keys: F(lo) >= target > F(hi) throughout; rows that need
            # no search start with hi = lo + 1.
            lo = floor_key
            hi = tl.where(search, tl.full(rows.shape, 2147483648, tl.int64), lo + 1)
            while tl.sum((hi - lo > 1).to(tl.int32), axis=0) > 0:
                mid = (lo + hi) // 2
                reach = _mass_above(x_ptr, rows, search & (hi - lo > 1), stride_x, V, top64, mid, temperature,
                                    logit_scale, cap_arg, cap, TEMP, SCALE, CAP, BLOCK_R, BLOCK) >= target
                lo = tl.where(reach, mid, lo)
                hi = tl.where(reach, hi, mid)
            # The smallest logit whose key is >= lo: the threshold itself.
            best = tl.full(rows.shape, float("inf"), tl.float32)
            for c0 in range(0, V, BLOCK):
                zc = c0 + tl.arange(0, BLOCK)
                ok = search[:, None] & (zc < V)[None, :]
                z = _row_scores(x_ptr, rows, ok, zc, stride_x, float("inf"), temperature, logit_scale, cap_arg, cap,
                                TEMP, SCALE, CAP, BLOCK_R, BLOCK)
                keep = ok & (order_key(z).to(tl.int64) >= lo[:, None])
                best = tl.minimum(best, tl.min(tl.where(keep, z, float("inf")), axis=1))
            tau = tl.where(search, best, tau)
        return tau
else:  # pragma: no cover - the torch backend still imports without Triton
    order_key = chunk_top_kernel = threshold_kernel = None
