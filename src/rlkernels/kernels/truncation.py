"""Kernels of the top-k / top-p threshold: the smallest kept scaled logit of each row.
Host side: ``rlkernels.ops.lm_head.truncation``.

The kernels read the head's raw fp32 logits and score them in registers (``scores``: the
model's transform, then / T), with the bits every kernel of the statistics pass computes.

A row's candidates are found without a sort of the row, in two passes over fixed chunks
of it. The first takes each chunk's max (and second largest, fp64 mass and a histogram of
its logits on a fixed grid), and each LSE tile's max, which later passes use to skip the
tiles a row cannot keep. From those a filter f per row follows, below which no logit
can be kept: for top-p alone the highest grid edge below which the histograms bound the
mass under (1 - p) of the row's (and at least the row's max + ln((1 - p) / V) - 1); for
top-k the k-th largest of the chunks' two largest each; or the top-k threshold itself
where it is given. In the second pass a chunk wholly below f yields nothing and is not
read again, nor is a tile wholly below f; one with at most C logits >= f yields those (a
scan); only the others take a bitonic top-C in registers. Each chunk reports a bound: every logit of it above the bound
is a candidate. So above the largest bound the candidates are the row's values. The
filter decides only how much work the candidates take: the threshold is searched down to
the bound, and past it over the whole row.
Masses are ``exp(z - top)`` in fp64, ``top`` the row's max, and p is taken of the total
over the distribution top-p truncates (``z >= floor``, the top-k threshold): every
logit's, from each chunk's max and fp64 mass, or the top-k set's.

The nucleus is the smallest prefix of the sorted values whose mass reaches it; its last
value is the threshold, and every logit equal to it is kept too. Equivalently, the
threshold is the value whose order key t is the largest with ``F(t) >= p * total``, F(t)
the mass of the logits whose key is >= t. It is looked for first in the FIRST largest
candidates (a bitonic top-k and a prefix sum), where it ends at or above the bound.
Where it is wider (or a top-k set reaches past them), t is found by bisection over the
fp32 order keys, F summed over all the candidates in registers: their masses are the
row's down to the bound. Where F at the bound does not reach it either, the same
bisection runs over the whole row. Every sum runs over one row's values in an order fixed
by V and the chunk.
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
    def chunk_stats_kernel(x_ptr, cmax_ptr, cs_ptr, hist_ptr, tmax_ptr, N, L, stride_x, n_chunks, n_tiles, bin_scale,
                           temperature, logit_scale, cap_arg, cap, TEMP: tl.constexpr, SCALE: tl.constexpr,
                           CAP: tl.constexpr, CHUNK: tl.constexpr, BLOCK_R: tl.constexpr, SECOND: tl.constexpr,
                           MASS: tl.constexpr, BINS: tl.constexpr, TILE: tl.constexpr):
        """Grid (row blocks, chunks): each row's chunk ``x[row, c*CHUNK : (c+1)*CHUNK]`` (raw
        logits, L of them) scored; its max into ``cmax[row, c]`` ([N, 2 * n_chunks]). SECOND:
        its second largest (another position's: ties count) into ``cmax[row, n_chunks + c]``.
        MASS: its fp64 mass exp(z - max) into ``cs[row, c]`` (0 where it holds only -inf).
        BINS (0: none; BLOCK_R 1): into ``hist[row, c, :]`` ([N, n_chunks, BINS] int32) how
        many of its logits lie in each bin of the grid ``floor(z * bin_scale)``, counted down
        from its max's bin; the last bin holds every lower logit (and -inf, NaN).
        TILE (0: none; it divides CHUNK): each TILE-wide tile's largest score, NaN where the
        tile holds a NaN, into ``tmax[row, t]`` ([N, n_tiles], t < n_tiles = ceil(L / TILE))."""
        rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        chunk = tl.program_id(1)
        cols = chunk * CHUNK + tl.arange(0, CHUNK)
        row_ok = rows < N
        ok = row_ok[:, None] & (cols < L)[None, :]
        z = _row_scores(x_ptr, rows, ok, cols, stride_x, float("-inf"), temperature, logit_scale, cap_arg, cap,
                        TEMP, SCALE, CAP, BLOCK_R, CHUNK)
        mx = tl.max(z, axis=1)
        tl.store(cmax_ptr + rows * (2 * n_chunks) + chunk, mx, mask=row_ok)
        if SECOND:
            at = tl.argmax(z, axis=1)
            rest = tl.where(tl.arange(0, CHUNK)[None, :] == at[:, None], float("-inf"), z)
            tl.store(cmax_ptr + rows * (2 * n_chunks) + n_chunks + chunk, tl.max(rest, axis=1), mask=row_ok)
        if MASS:
            ref = tl.where(mx == float("-inf"), 0.0, mx).to(tl.float64)
            mass = tl.sum(tl.exp(z.to(tl.float64) - ref[:, None]), axis=1)
            tl.store(cs_ptr + rows * n_chunks + chunk, mass, mask=row_ok)
        if TILE > 0:
            # Max and NaN flag per tile: a NaN must keep its tile from ever being skipped, and
            # tl.max does not say whether it saw one.
            zt = tl.reshape(z, [BLOCK_R, CHUNK // TILE, TILE])
            tile_max = tl.max(zt, axis=2)
            has_nan = tl.max((zt != zt).to(tl.int32), axis=2) > 0
            t = chunk * (CHUNK // TILE) + tl.arange(0, CHUNK // TILE)
            tl.store(tmax_ptr + rows[:, None] * n_tiles + t[None, :], tl.where(has_nan, float("nan"), tile_max),
                     mask=row_ok[:, None] & (t < n_tiles)[None, :])
        if BINS > 0:
            tl.static_assert(BLOCK_R == 1, "the chunk histogram takes one row per program")
            below_max = tl.floor(mx * bin_scale)[:, None] - tl.floor(z * bin_scale)
            below_max = tl.where(below_max < BINS - 1, below_max, BINS - 1).to(tl.int32)  # NaN: the last
            counts = tl.histogram(tl.reshape(below_max, [CHUNK]), BINS)
            bins = tl.arange(0, BINS)
            # The columns past L scored -inf: the last bin counted them; they are not logits.
            counts = tl.where(bins == BINS - 1, counts - tl.maximum((chunk + 1) * CHUNK - L, 0), counts)
            tl.store(hist_ptr + rows[:, None] * (n_chunks * BINS) + chunk * BINS + bins[None, :],
                     tl.reshape(counts, [BLOCK_R, BINS]), mask=row_ok[:, None])

    @triton.jit
    def _just_below(f):
        """The largest fp32 below f (-inf for -inf): "every logit > it" is "every logit >= f"."""
        key = order_key(f) - 1
        below = tl.where(key >= 0, key, key ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)
        return tl.where(f == float("-inf"), f, below)

    @triton.jit
    def row_filter_kernel(cmax_ptr, cs_ptr, hist_ptr, f_ptr, n_chunks, top_k, bin_scale, tail, log_tail,
                          FILTER: tl.constexpr, CHUNKS: tl.constexpr, KB: tl.constexpr, BINS: tl.constexpr):
        """Grid (N,): each row's filter into ``f[row]``: no logit below it can be kept.

        FILTER 1 (top-p alone; ``chunk_stats_kernel``'s maxima, masses and histograms): the
        highest edge of the histograms' grid below which their counts bound the mass, each
        logit at its bin's upper edge, by at most ``tail`` (< 1 - p) times the row's mass; at
        least the row's max + ``log_tail`` (ln((1 - p) / V) - 1: all the logits below it
        hold less than (1 - p) / e of the mass). Either way the logits >= f hold more than p
        of the mass, so the nucleus ends at or above f. FILTER 2 (top-k <= KB): the k-th
        largest of the chunks' two largest each, at most the row's k-th largest. NaN rows
        filter nothing (-inf)."""
        row = tl.program_id(0).to(tl.int64)
        ch = tl.arange(0, CHUNKS)
        ch_ok = ch < n_chunks
        if FILTER == 1:
            m = tl.load(cmax_ptr + row * (2 * n_chunks) + ch, mask=ch_ok, other=float("-inf"))
            s = tl.load(cs_ptr + row * n_chunks + ch, mask=ch_ok, other=0.0)
            top = tl.max(m, axis=0)
            every = tl.sum(tl.where(ch_ok, s * tl.exp(m.to(tl.float64) - top.to(tl.float64)), 0.0), axis=0)
            budget = (tail * every).to(tl.float32)
            # A chunk's bin b is the row's bin b + (its max's bin's distance below the row's).
            top_bin = tl.floor(top * bin_scale)
            shift = top_bin - tl.floor(m * bin_scale)
            shift = tl.where(shift < BINS - 1, shift, BINS - 1).to(tl.int32)
            b = tl.arange(0, BINS)
            counts = tl.load(hist_ptr + row * (n_chunks * BINS) + ch[:, None] * BINS + b[None, :],
                             mask=ch_ok[:, None], other=0)
            row_bin = tl.minimum(b[None, :] + shift[:, None], BINS - 1)
            # Every logit of the row's bin r lies below its upper edge (top_bin - r + 1) / bin_scale.
            bound = counts.to(tl.float32) * tl.exp((top_bin - row_bin.to(tl.float32) + 1.0) / bin_scale - top)
            # The smallest r whose lower bins' bound fits the budget (the last bin holds every
            # lower logit, so r = BINS - 1 means none fits).
            lo = tl.full([], 0, tl.int32)
            hi = tl.where(tl.sum(tl.where(row_bin > 0, bound, 0.0)) <= budget, 0, BINS - 1)
            while hi - lo > 1:
                mid = (lo + hi) // 2
                fits = tl.sum(tl.where(row_bin > mid, bound, 0.0)) <= budget
                lo = tl.where(fits, lo, mid)
                hi = tl.where(fits, mid, hi)
            f = tl.where(hi < BINS - 1, (top_bin - hi) / bin_scale, float("-inf"))
            f = tl.maximum(f, top + log_tail)
        else:
            both = tl.arange(0, 2 * CHUNKS)
            mk = tl.load(cmax_ptr + row * (2 * n_chunks) + both, mask=both < 2 * n_chunks, other=float("-inf"))
            kth = tl.topk(tl.reshape(mk, [1, 2 * CHUNKS]), KB)
            f = tl.max(tl.where(tl.arange(0, KB)[None, :] == top_k - 1, kth, float("-inf")), axis=1)
            f = tl.max(f, axis=0)
        tl.store(f_ptr + row, tl.where(f == f, f, float("-inf")))

    @triton.jit
    def chunk_top_kernel(x_ptr, cmax_ptr, f_ptr, tmax_ptr, top_ptr, cb_ptr, N, L, stride_x, n_chunks, n_tiles,
                         temperature, logit_scale, cap_arg, cap, TEMP: tl.constexpr, SCALE: tl.constexpr,
                         CAP: tl.constexpr, CHUNK: tl.constexpr, C: tl.constexpr, BLOCK_R: tl.constexpr,
                         FILTERED: tl.constexpr, TILE: tl.constexpr):
        """Grid (row blocks, chunks): each row's candidates from its chunk ``x[row, c*CHUNK :
        (c+1)*CHUNK]`` (raw logits, L of them) into ``top[row, c*C : (c+1)*C]`` (rows of
        n_chunks * C; -inf past them), and into ``cb[row, c]`` a bound such that every logit of
        the chunk above it is among them.

        FILTERED: with the row's filter ``f[row]`` (``row_filter_kernel``, or a given top-k
        threshold; ``cmax`` from ``chunk_stats_kernel``), a chunk whose max is below f yields
        none (no load); one with at most C logits >= f yields those, in index order (a scan,
        no sort); else its C largest, descending (a bitonic top-k), bounded by its C-th.
        TILE (0: none; with FILTERED): ``tmax`` [N, n_tiles] holds each TILE-wide tile's max
        (``chunk_stats_kernel``'s); a tile whose max is below f is not read either: its
        logits could neither be yielded nor displace the C largest, all >= f."""
        rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        chunk = tl.program_id(1)
        row_ok = rows < N
        j = tl.arange(0, C)[None, :]
        out = top_ptr + rows[:, None] * (n_chunks * C) + chunk * C + j
        if FILTERED:
            f = tl.load(f_ptr + rows, mask=row_ok, other=float("-inf"))
            f = tl.where(f == f, f, float("-inf"))  # a NaN row filters nothing
        else:
            f = tl.full([BLOCK_R], float("-inf"), tl.float32)
        below_f = _just_below(f)
        chunk_max = tl.load(cmax_ptr + rows * (2 * n_chunks) + chunk, mask=row_ok, other=float("-inf"))
        if tl.sum((row_ok & (chunk_max >= f)).to(tl.int32), axis=0) == 0:
            tl.store(out, tl.full([BLOCK_R, C], float("-inf"), tl.float32), mask=row_ok[:, None])
            tl.store(cb_ptr + rows * n_chunks + chunk, below_f, mask=row_ok)
        else:
            cols = chunk * CHUNK + tl.arange(0, CHUNK)
            ok = row_ok[:, None] & (cols < L)[None, :]
            if TILE > 0:
                tile_max = tl.load(tmax_ptr + rows[:, None] * n_tiles + (cols // TILE)[None, :], mask=ok,
                                   other=float("-inf"))
                ok = ok & ~(tile_max < f[:, None])  # a NaN max is read
            z = _row_scores(x_ptr, rows, ok, cols, stride_x, float("-inf"), temperature, logit_scale, cap_arg, cap,
                            TEMP, SCALE, CAP, BLOCK_R, CHUNK)
            keep = ok & (z >= f[:, None])
            count = tl.sum(keep.to(tl.int32), axis=1)
            if tl.max(tl.where(row_ok, count, 0), axis=0) <= C:
                at = tl.cumsum(keep.to(tl.int32), axis=1) - 1
                tl.store(top_ptr + rows[:, None] * (n_chunks * C) + chunk * C + at, z, mask=keep)
                tl.store(out, tl.full([BLOCK_R, C], float("-inf"), tl.float32),
                         mask=row_ok[:, None] & (j >= count[:, None]))
                tl.store(cb_ptr + rows * n_chunks + chunk, below_f, mask=row_ok)
            else:
                best = tl.topk(z, C)
                tl.store(out, best, mask=row_ok[:, None])
                tl.store(cb_ptr + rows * n_chunks + chunk, tl.min(best, axis=1), mask=row_ok)

    @triton.jit
    def _first_reaching(vals, cum, target, WIDTH: tl.constexpr):
        """(the index of the first prefix mass ``cum`` [BLOCK_R, WIDTH] that reaches
        ``target``, WIDTH where none does; the value of ``vals`` there, -inf where none)."""
        j = tl.arange(0, WIDTH)[None, :]
        first = tl.min(tl.where(cum >= target[:, None], j, WIDTH), axis=1)
        return first, tl.max(tl.where(j == first[:, None], vals, float("-inf")), axis=1)

    @triton.jit
    def threshold_kernel(top_ptr, cb_ptr, cmax_ptr, cs_ptr, x_ptr, floor_ptr, out_ptr, N, n_chunks, V, stride_x, top_k,
                         p_hi, p_lo, temperature, logit_scale, cap_arg, cap, TEMP: tl.constexpr,
                         SCALE: tl.constexpr, CAP: tl.constexpr, FINAL: tl.constexpr, CHUNKS: tl.constexpr,
                         C: tl.constexpr, FIRST: tl.constexpr, BLOCK_R: tl.constexpr, TOP_P: tl.constexpr,
                         FLOOR_GIVEN: tl.constexpr, BLOCK: tl.constexpr):
        """Grid (row blocks,): each row's threshold into ``out[row]`` (fp32).

        ``top``: [N, n_chunks * C] the chunks' candidates (n_chunks * C <= FINAL) and ``cb``
        [N, n_chunks] their bounds (``chunk_top_kernel``): every logit above the largest
        bound is a candidate. ``cmax``/``cs``: the chunks' maxima and masses (n_chunks <=
        CHUNKS); ``x``: the whole rows' raw logits [N, V] (read only where the candidates
        fall short). ``top_k``: 0, or <= C (its threshold is the k-th largest candidate);
        FLOOR_GIVEN: ``floor`` [N] holds the top-k threshold instead (a k beyond C). p =
        p_hi + p_lo (two fp32 scalars holding a double's leading bits). Without TOP_P the
        threshold is top-k's. FIRST (>= C): how many of the largest candidates the nucleus is
        looked for in first."""
        rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = rows < N
        cols = tl.arange(0, FINAL)
        width = n_chunks * C
        x = tl.load(top_ptr + rows[:, None] * width + cols[None, :], mask=row_ok[:, None] & (cols < width)[None, :],
                    other=float("-inf"))
        # The row's largest candidates: the row's own values down to the bound (above it).
        best = tl.topk(x, FIRST)
        ch = tl.arange(0, CHUNKS)[None, :]
        ch_ok = row_ok[:, None] & (ch < n_chunks)
        bound = tl.max(tl.load(cb_ptr + rows[:, None] * n_chunks + ch, mask=ch_ok, other=float("-inf")), axis=1)
        if FLOOR_GIVEN:
            floor = tl.load(floor_ptr + rows, mask=row_ok, other=float("-inf"))
        elif top_k > 0:
            floor = tl.max(tl.where(tl.arange(0, FIRST)[None, :] == top_k - 1, best, float("-inf")), axis=1)
        else:
            floor = tl.full(rows.shape, float("-inf"), tl.float32)
        if TOP_P:
            top = tl.max(best, axis=1)
            top64 = tl.where(top == float("-inf"), 0.0, top).to(tl.float64)
            p = (tl.zeros(rows.shape, tl.float64) + p_hi) + p_lo
            # Every logit's mass, from the chunks', in one fixed tree.
            mk = tl.load(cmax_ptr + rows[:, None] * (2 * n_chunks) + ch, mask=ch_ok, other=float("-inf"))
            sk = tl.load(cs_ptr + rows[:, None] * n_chunks + ch, mask=ch_ok, other=0.0)
            every = tl.sum(tl.where(ch_ok, sk * tl.exp(mk.to(tl.float64) - top64[:, None]), 0.0), axis=1)
            # The nucleus within the FIRST largest candidates, where it ends at or above the
            # bound. A top-k set lies within them (its threshold's ties too) where its
            # threshold is above the bound and the FIRST-th is below it: its mass is theirs.
            e = tl.where(best >= floor[:, None], tl.exp(best.to(tl.float64) - top64[:, None]), 0.0)
            cum = tl.cumsum(e, axis=1)
            inside = (floor > float("-inf")) & (tl.min(best, axis=1) < floor) & (floor > bound)
            total = tl.where(inside, tl.max(cum, axis=1), every)
            first, tau = _first_reaching(best, cum, p * total, FIRST)
            tau = tl.where(first < FIRST, tau, floor)
            fast = row_ok & (inside | ((floor == float("-inf")) & (first < FIRST) & (tau >= bound)))
            slow = row_ok & ~fast
            if tl.sum(slow.to(tl.int32), axis=0) > 0:
                tau = tl.where(slow, _threshold_over_candidates(x, bound, every, floor, top64, p, x_ptr, rows, slow,
                                                                stride_x, V, temperature, logit_scale, cap_arg, cap,
                                                                TEMP, SCALE, CAP, BLOCK_R, BLOCK), tau)
            tau = tl.maximum(tau, floor)
        else:
            tau = floor
        tl.store(out_ptr + rows, tau, mask=row_ok)

    @triton.jit
    def _candidate_mass_above(keys, e, t):
        """F(t) [BLOCK_R] over the candidates: their masses ``e`` [BLOCK_R, FINAL] whose order
        keys ``keys`` are >= t [BLOCK_R]."""
        return tl.sum(tl.where(keys >= t[:, None], e, 0.0), axis=1)

    @triton.jit
    def _largest_key_reaching(lo, hi, target, keys, e):
        """Bisection over order keys: from F(lo) >= target > F(hi) (F over the candidates), the
        largest key t with F(t) >= target. Rows with hi = lo + 1 take no step."""
        while tl.sum((hi - lo > 1).to(tl.int32), axis=0) > 0:
            mid = (lo + hi) // 2
            reach = _candidate_mass_above(keys, e, mid) >= target
            lo = tl.where(reach, mid, lo)
            hi = tl.where(reach, hi, mid)
        return lo

    @triton.jit
    def _threshold_over_candidates(x, bound, every, floor, top64, p, x_ptr, rows, row_ok, stride_x, V, temperature,
                                   logit_scale, cap_arg, cap, TEMP: tl.constexpr, SCALE: tl.constexpr,
                                   CAP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK: tl.constexpr):
        """The threshold [BLOCK_R] of rows whose nucleus is wider than their FIRST largest, from
        all the candidates ``x`` [BLOCK_R, FINAL] (every logit above ``bound`` among them),
        else by the whole-row search. ``every``: each row's mass over all its logits."""
        e = tl.where(x >= floor[:, None], tl.exp(x.to(tl.float64) - top64[:, None]), 0.0)
        keys = order_key(x).to(tl.int64)
        # The candidates hold the whole top-k set (every logit >= floor) when it lies above
        # the bound; a top-k set whose threshold's ties run past them: its mass over the
        # whole row.
        covers = (floor > float("-inf")) & (floor > bound)
        floor_key = order_key(floor).to(tl.int64)
        total = tl.where(covers, tl.sum(e, axis=1), every)
        ties_beyond = (floor > float("-inf")) & ~covers & row_ok
        if tl.sum(ties_beyond.to(tl.int32), axis=0) > 0:
            total = tl.where(ties_beyond, _mass_above(x_ptr, rows, ties_beyond, stride_x, V, top64, floor_key,
                                                      temperature, logit_scale, cap_arg, cap, TEMP, SCALE, CAP,
                                                      BLOCK_R, BLOCK), total)
        target = p * total
        # Above the bound the candidates' F is the row's; at the bound itself it may miss the
        # bound's ties, which only add mass: reaching p there still places the threshold.
        bound_key = tl.maximum(order_key(bound), order_key(floor)).to(tl.int64)
        found = row_ok & (covers | (_candidate_mass_above(keys, e, bound_key) >= target))
        top_key = order_key(tl.max(x, axis=1)).to(tl.int64) + 1  # F = 0 there: above every candidate
        lo = _largest_key_reaching(bound_key, tl.where(found, tl.maximum(top_key, bound_key + 1), bound_key + 1),
                                   target, keys, e)
        # The smallest candidate whose key is >= lo: the threshold itself.
        tau = tl.min(tl.where(keys >= lo[:, None], x, float("inf")), axis=1)
        tau = tl.where(found, tau, float("-inf"))
        search = ~found & row_ok
        if tl.sum(search.to(tl.int32), axis=0) > 0:
            # The same bisection over the whole row: F(lo) >= target > F(hi) throughout.
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
    order_key = chunk_stats_kernel = row_filter_kernel = chunk_top_kernel = threshold_kernel = None
