"""Kernels of the fused LM-head sampler. Host side: ``rlkernels.ops.linear_sample``.

A token is drawn in two levels over the LM head's statistics pass (:mod:`.lm_head`), which
records each vocabulary tile's mass beside the softmax statistics; a first draw picks a
block of 256 ids with probability proportional to its mass (:func:`sample_block_kernel`);
the block's logits are recomputed by the same D-chain (or read from the logits the GEMM
stored, where a truncated call has them) and a Gumbel-max picks the token inside it
(:func:`sample_in_block_kernel`), which also finishes the token's log-prob and entropy
from the forward's per-split statistics. Every random number comes from Philox keyed by
(seed, stream, position): what the row is, never where it sits. The seed is two int32
scalars (a Python int seed) or, with ``SEED_IN_MEMORY``, the int64 at ``seed_ptr`` (a seed
tensor): the same key words either way, and a captured CUDA graph reads the tensor anew
at each replay instead of keeping the scalars it recorded.
"""
from __future__ import annotations

from ._triton import tl, triton
from .lm_head import finish_row, keep_above, logits_tile, merge_splits, scores

if triton is not None:

    @triton.jit
    def exponential_noise(v_lo, seed_lo, seed_hi, stream_lo, stream_hi, position,
                          BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr):
        """-log(E) [BLOCK_M, BLOCK_V] for the vocabulary ids ``v_lo + [0, BLOCK_V)`` (v_lo % 4 == 0).

        Philox4x32-10 with key (seed_lo, seed_hi) and counter (id // 4, position,
        stream_lo, stream_hi) gives four words; id % 4 picks one, x. With y = x (x < 2^31)
        or ~x, w = (y + 1/2) 2^-32 in fp32, and E = -log(w) or -log1p(-w): the exponential
        of the uniform u = (x + 1/2) 2^-32, accurate at both ends (G = -log E spans
        [-3.1, 22.9]). The ops/linear_sample torch backend computes the same definition.
        """
        quad = (v_lo // 4 + tl.arange(0, BLOCK_V // 4)).to(tl.uint32)
        c0 = tl.zeros((BLOCK_M, BLOCK_V // 4), tl.uint32) + quad[None, :]
        c1 = tl.zeros((BLOCK_M, BLOCK_V // 4), tl.uint32) + position[:, None]
        c2 = tl.zeros((BLOCK_M, BLOCK_V // 4), tl.uint32) + stream_lo[:, None]
        c3 = tl.zeros((BLOCK_M, BLOCK_V // 4), tl.uint32) + stream_hi[:, None]
        r0, r1, r2, r3 = tl.philox_impl(c0, c1, c2, c3, seed_lo, seed_hi, 10)
        # Word k of counter q belongs to id 4q + k: interleaving restores id order.
        x = tl.interleave(tl.interleave(r0, r2), tl.interleave(r1, r3))
        upper = (x >> 31) == 1
        y = tl.where(upper, ~x, x)
        w = (y >> 8).to(tl.float32) * 5.9604644775390625e-08 + ((y & 255).to(tl.float32) + 0.5) * 2.3283064365386963e-10
        # log1p(-w) by Kahan's identity (t - 1 is exact for t in [1/2, 1]).
        t = 1.0 - w
        log1p_neg = tl.where(t == 1.0, -w, tl.log(t) * (-w) / (t - 1.0))
        e = tl.where(upper, -log1p_neg, -tl.log(w))
        return -tl.log(e)

    @triton.jit
    def tile_uniform(seed_lo, seed_hi, stream_lo, stream_hi, position):
        """The first level's uniform in (0, 1), fp64 with 53 bits: Philox counter
        (2^32 - 1, position, stream_lo, stream_hi), words 0 and 1."""
        c0 = ~(position ^ position)  # 2^32 - 1: above every id // 4, so apart from the second level's
        r0, r1, r2, r3 = tl.philox_impl(c0, position, stream_lo, stream_hi, seed_lo, seed_hi, 10)
        return ((r0 >> 5).to(tl.float64) * 67108864.0 + (r1 >> 6).to(tl.float64) + 0.5) * 1.1102230246251565e-16

    @triton.jit
    def _seed_words(seed_ptr, seed_lo, seed_hi, SEED_IN_MEMORY: tl.constexpr):
        """The Philox key (seed mod 2^32, seed >> 32) as uint32 words: from the int64 at
        ``seed_ptr`` (a seed tensor, which a CUDA graph reads anew at every replay), or from
        the two int32 scalars holding the same bits (a Python int seed)."""
        if SEED_IN_MEMORY:
            seed = tl.load(seed_ptr)
            key_lo = (seed & 0xFFFFFFFF).to(tl.uint32)
            key_hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
        else:
            key_lo = seed_lo.to(tl.uint32, bitcast=True)
            key_hi = seed_hi.to(tl.uint32, bitcast=True)
        return key_lo, key_hi

    @triton.jit
    def _row_keys(stream_ptr, pos_ptr, rows, ok, POSITIONS: tl.constexpr):
        """The row's stream words and its position (0 without POSITIONS), and whether the
        position lies outside [0, 2^32) (the host refuses such a call)."""
        stream = tl.load(stream_ptr + rows, mask=ok, other=0)
        stream_lo = (stream & 0xFFFFFFFF).to(tl.uint32)
        stream_hi = ((stream >> 32) & 0xFFFFFFFF).to(tl.uint32)
        if POSITIONS:
            pos = tl.load(pos_ptr + rows, mask=ok, other=0)
        else:
            pos = tl.zeros(rows.shape, tl.int64)
        return stream_lo, stream_hi, pos.to(tl.uint32), (pos < 0) | (pos > 0xFFFFFFFF)

    @triton.jit
    def _block_masses(tile_m_ptr, tile_s_ptr, row, blocks, ref, V, n_tiles,
                      TILE_V: tl.constexpr, SAMPLE_BLOCK: tl.constexpr, BLOCK_B: tl.constexpr):
        """(mass fp64, largest running max fp32) [BLOCK_B] of one row's sample blocks: the sum
        of their tiles' e^(m - ref) s, tiles in ascending order."""
        mass = tl.zeros((BLOCK_B,), tl.float64)
        top = tl.full((BLOCK_B,), float("-inf"), tl.float32)
        for r in tl.static_range(SAMPLE_BLOCK // TILE_V):
            tile = blocks * (SAMPLE_BLOCK // TILE_V) + r
            ok = (tile < n_tiles) & (tile.to(tl.int64) * TILE_V < V)  # tiles past V were never written
            tm = tl.load(tile_m_ptr + row * n_tiles + tile, mask=ok, other=float("-inf"))
            ts = tl.load(tile_s_ptr + row * n_tiles + tile, mask=ok, other=0.0)
            mass += tl.where(ok, ts.to(tl.float64) * tl.exp(tm.to(tl.float64) - ref), 0.0)
            top = tl.maximum(top, tm)
        return mass, top

    @triton.jit(do_not_specialize=["seed_lo", "seed_hi"])
    def sample_block_kernel(tile_m_ptr, tile_s_ptr, m_ptr, s_ptr, stream_ptr, pos_ptr, seed_ptr, block_ptr, ok_ptr,
                            N, V, n_tiles, n_split, seed_lo, seed_hi, TILE_V: tl.constexpr, SAMPLE_BLOCK: tl.constexpr,
                            NOISE: tl.constexpr, SEED_IN_MEMORY: tl.constexpr, POSITIONS: tl.constexpr,
                            BLOCK_B: tl.constexpr):
        """One row per program: its sample block, drawn with probability mass / total (the
        first block whose running fp64 sum exceeds u * total), or without NOISE the first
        block holding a tile whose running max is the row's max (the first maximal logit).
        The masses are taken relative to the row's LSE, merged here from the forward's
        per-split (m, s) ([n_split, N]) as linear_logprob's combine merges them.
        The seed: ``seed_ptr``'s int64 with SEED_IN_MEMORY, else (seed_lo, seed_hi).
        Program 0 also sets the call's all-rows-fine flag at ``ok_ptr`` (int32) to 1, which
        :func:`sample_in_block_kernel`, launched next, clears where a row is refused."""
        row = tl.program_id(0).to(tl.int64)
        one = tl.zeros((1,), tl.int64) + row
        tl.store(ok_ptr + tl.arange(0, 1), tl.full((1,), 1, tl.int32), mask=one == 0)
        mx, s_row, _ = merge_splits(m_ptr, s_ptr, s_ptr, one, one >= 0, N, n_split, False)
        ref = (mx + tl.log(s_row)).to(tl.float64)
        n_blocks = tl.cdiv(V, SAMPLE_BLOCK)
        total = tl.zeros((1,), tl.float64)
        best = tl.full((1,), float("-inf"), tl.float32)
        for b0 in range(0, n_blocks, BLOCK_B):
            blocks = b0 + tl.arange(0, BLOCK_B)
            mass, top = _block_masses(tile_m_ptr, tile_s_ptr, row, blocks, ref, V, n_tiles,
                                      TILE_V, SAMPLE_BLOCK, BLOCK_B)
            total += tl.sum(mass, axis=0)
            best = tl.maximum(best, tl.max(top, axis=0))
        if NOISE:
            key_lo, key_hi = _seed_words(seed_ptr, seed_lo, seed_hi, SEED_IN_MEMORY)
            stream_lo, stream_hi, position, _ = _row_keys(stream_ptr, pos_ptr, one, one >= 0, POSITIONS)
            target = tile_uniform(key_lo, key_hi, stream_lo, stream_hi, position) * total
        chosen = tl.full((1,), -1, tl.int32)
        last = tl.zeros((1,), tl.int32)
        offset = tl.zeros((1,), tl.float64)
        for b0 in range(0, n_blocks, BLOCK_B):
            blocks = b0 + tl.arange(0, BLOCK_B)
            mass, top = _block_masses(tile_m_ptr, tile_s_ptr, row, blocks, ref, V, n_tiles,
                                      TILE_V, SAMPLE_BLOCK, BLOCK_B)
            if NOISE:
                hit = (offset + tl.cumsum(mass, axis=0)) > target
                offset += tl.sum(mass, axis=0)
                # Where rounding leaves u * total at the total: the last block with mass.
                last = tl.maximum(last, tl.max(tl.where(mass > 0, blocks, -1), axis=0))
            else:
                hit = top == best
            first = tl.min(tl.where(hit, blocks, 2147483647), axis=0)
            chosen = tl.where((chosen < 0) & (first < 2147483647), first, chosen)
        chosen = tl.where(chosen < 0, last, chosen)
        tl.store(block_ptr + row + tl.arange(0, 1), chosen)

    @triton.jit(do_not_specialize=["seed_lo", "seed_hi"])
    def sample_in_block_kernel(
        h_ptr, w_ptr, b_ptr, z_ptr, block_ptr, stream_ptr, pos_ptr, seed_ptr, m_ptr, s_ptr, u_ptr,
        token_ptr, logp_ptr, ent_ptr, status_ptr, ok_ptr, threshold_ptr,
        N, V, D, n_split, temperature, logit_scale, cap_arg, cap, seed_lo, seed_hi,
        stride_hn, stride_hd, stride_wv, stride_wd, stride_zn,
        HAS_BIAS: tl.constexpr, TEMP: tl.constexpr, SCALE: tl.constexpr, CAP: tl.constexpr,
        IEEE: tl.constexpr, EVEN_D: tl.constexpr,
        NOISE: tl.constexpr, SEED_IN_MEMORY: tl.constexpr, POSITIONS: tl.constexpr, ENTROPY: tl.constexpr,
        THRESHOLD: tl.constexpr, LOGITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """One row per program: its sample block's BLOCK_V logits by the same chain (the row in
        all BLOCK_M lanes of the dot; with LOGITS, read from the raw logits ``z_ptr`` [N, V]
        fp32, row stride ``stride_zn``, that the GEMM computed by that chain, and scored as
        the statistics pass scores them), then the Gumbel-max (or the argmax) inside the block,
        ties to the lowest id. Then the token's log-prob and entropy from the forward's
        per-split (m, s, u) and the token's logit, as linear_logprob's combine finishes a
        target's; and the row's status: 1 where its log-prob is NaN (no distribution to
        draw from), 2 where its position lies outside [0, 2^32), 0 otherwise. A refused
        row clears the flag at ``ok_ptr`` (an atomic AND of 0: order-free, and no value of
        the draw is reduced through it), so the host checks the call with one element.
        THRESHOLD: the draw is from the truncated distribution, the block's logits below
        the row's ``threshold_ptr[row]`` left out (``keep_above``), as the statistics pass
        that recorded the masses and (m, s, u) left them out."""
        row = tl.program_id(0).to(tl.int64)
        lanes = tl.arange(0, BLOCK_M)
        rm = tl.zeros((BLOCK_M,), tl.int64) + row
        v_lo = tl.load(block_ptr + row) * BLOCK_V
        offs_v = v_lo + tl.arange(0, BLOCK_V)
        col_ok = offs_v < V
        if LOGITS:
            z = tl.load(z_ptr + rm[:, None] * stride_zn + offs_v[None, :].to(tl.int64), mask=col_ok[None, :],
                        other=0.0)
            z = scores(z, temperature, logit_scale, cap_arg, cap, TEMP, SCALE, CAP, BLOCK_M, BLOCK_V)
        else:
            z, _ = logits_tile(h_ptr, w_ptr, b_ptr, rm, offs_v, 0, v_lo, V, D, temperature, logit_scale, cap_arg, cap,
                               stride_hn, stride_hd, stride_wv, stride_wd,
                               HAS_BIAS, TEMP, SCALE, CAP, IEEE, EVEN_D, False, BLOCK_M, BLOCK_V, BLOCK_K)
        z = keep_above(z, threshold_ptr, rm, THRESHOLD)
        bad_position = rm < 0  # all False
        if NOISE:
            key_lo, key_hi = _seed_words(seed_ptr, seed_lo, seed_hi, SEED_IN_MEMORY)
            stream_lo, stream_hi, position, bad_position = _row_keys(stream_ptr, pos_ptr, rm, rm >= 0, POSITIONS)
            key = z + exponential_noise(v_lo, key_lo, key_hi, stream_lo, stream_hi, position, BLOCK_M, BLOCK_V)
        else:
            key = z
        # NaN logits never lead (the host refuses a row whose log-prob is NaN).
        key = tl.where(col_ok[None, :] & (key == key), key, float("-inf"))
        best = tl.max(key, axis=1)
        token = tl.min(tl.where(key == best[:, None], offs_v[None, :], 2147483647), axis=1)
        token = tl.where(token == 2147483647, v_lo, token)
        # The chosen logit as linear_logprob picks its target's: a masked sum, exact, plus 0.
        zt = 0.0 + tl.sum(tl.where(offs_v[None, :] == token[:, None], z, 0.0), axis=1)
        mx, s, u = merge_splits(m_ptr, s_ptr, u_ptr, rm, rm >= 0, N, n_split, ENTROPY)
        logp, ent, _ = finish_row(mx, s, u, zt, rm >= 0, ENTROPY)
        status = tl.where(logp != logp, 1, tl.where(bad_position, 2, 0))
        first = lanes == 0
        tl.store(token_ptr + row + lanes, token.to(tl.int64), mask=first)
        tl.store(logp_ptr + row + lanes, logp, mask=first)
        tl.store(ent_ptr + row + lanes, ent, mask=first)
        tl.store(status_ptr + row + lanes, status.to(tl.int32), mask=first)
        tl.atomic_and(ok_ptr + lanes * 0, (status == 0).to(tl.int32), mask=first)
else:  # pragma: no cover - the torch backend still imports without Triton
    exponential_noise = tile_uniform = sample_block_kernel = sample_in_block_kernel = None
