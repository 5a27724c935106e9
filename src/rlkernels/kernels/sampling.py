"""Kernels of the fused LM-head sampler. Host side: ``rlkernels.ops.linear_sample``.

A row's token is the Gumbel-max of its logits: ``argmax_j z_j - log(E_j)`` with
``E_j`` an exponential draw, which picks ``j`` with probability ``softmax(z)_j``.
The draw of column ``j`` comes from a counter-based generator keyed by what the
row is, never by where it sits (:func:`exponential_noise`), and the logits and the
softmax statistics are :mod:`.linear_logprob`'s own tiles and chain, so the
token's log-prob is bitwise ``linear_logprob``'s.
"""
from __future__ import annotations

from ._triton import tl, triton
from .linear_logprob import logits_tile, online_stats
from .tiles import grouped_tile

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

    @triton.jit(do_not_specialize=["seed_lo", "seed_hi"])
    def sample_partial_kernel(
        h_ptr, w_ptr, b_ptr, stream_ptr, pos_ptr, m_ptr, s_ptr, u_ptr, key_ptr, id_ptr, zb_ptr,
        N, V, D, temperature, seed_lo, seed_hi,
        stride_hn, stride_hd, stride_wv, stride_wd,
        HAS_BIAS: tl.constexpr, HAS_TEMP: tl.constexpr, IEEE: tl.constexpr, EVEN_D: tl.constexpr,
        TMA: tl.constexpr, NOISE: tl.constexpr, SPLIT_V: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ):
        """One token block over one split: linear_logprob's (m, s, u), and the split's best
        key (z + noise, or z without NOISE), its lowest id and its logit."""
        pid_m, pid_s = grouped_tile(tl.program_id(0), tl.cdiv(N, BLOCK_M), tl.cdiv(V, SPLIT_V), GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = offs_m < N
        rm = (offs_m % N).to(tl.int64)  # rows past N re-read valid rows; never stored
        if NOISE:
            stream = tl.load(stream_ptr + rm)
            stream_lo = (stream & 0xFFFFFFFF).to(tl.uint32)
            stream_hi = ((stream >> 32) & 0xFFFFFFFF).to(tl.uint32)
            position = tl.load(pos_ptr + rm).to(tl.uint32)
            key_lo = seed_lo.to(tl.uint32, bitcast=True)
            key_hi = seed_hi.to(tl.uint32, bitcast=True)
        v_start = pid_s * SPLIT_V
        n_tiles = tl.cdiv(tl.minimum(V - v_start, SPLIT_V), BLOCK_V)

        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        s_i = tl.zeros((BLOCK_M,), tl.float32)
        u_i = tl.zeros((BLOCK_M,), tl.float32)
        best = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        best_id = tl.zeros((BLOCK_M,), tl.int32) + v_start
        best_z = tl.zeros((BLOCK_M,), tl.float32)
        # Tiles in ascending column order: the statistics are linear_logprob's chain, and a
        # later tile takes the lead only with a strictly larger key (ties: the lowest id).
        for j in range(0, n_tiles):
            offs_v = v_start + j * BLOCK_V + tl.arange(0, BLOCK_V)
            z = logits_tile(h_ptr, w_ptr, b_ptr, rm, offs_v, pid_m * BLOCK_M, v_start + j * BLOCK_V, V, D,
                            temperature, stride_hn, stride_hd, stride_wv, stride_wd,
                            HAS_BIAS, HAS_TEMP, IEEE, EVEN_D, TMA, BLOCK_M, BLOCK_V, BLOCK_K)
            col_ok = offs_v < V
            if NOISE:
                key = z + exponential_noise(v_start + j * BLOCK_V, key_lo, key_hi, stream_lo, stream_hi, position,
                                            BLOCK_M, BLOCK_V)
            else:
                key = z
            # NaN logits never lead (the host refuses a row whose log-prob is NaN).
            key = tl.where(col_ok[None, :] & (key == key), key, float("-inf"))
            tile_best = tl.max(key, axis=1)
            tile_id = tl.min(tl.where(key == tile_best[:, None], offs_v[None, :], 2147483647), axis=1)
            # The chosen logit as linear_logprob picks its target's: a masked sum, exact.
            tile_z = tl.sum(tl.where(offs_v[None, :] == tile_id[:, None], z, 0.0), axis=1)
            lead = tile_best > best
            best_id = tl.where(lead, tile_id, best_id)
            best_z = tl.where(lead, tile_z, best_z)
            best = tl.where(lead, tile_best, best)
            z = tl.where(col_ok[None, :], z, float("-inf"))
            m_i, s_i, u_i = online_stats(m_i, s_i, u_i, z, col_ok)
        part = pid_s.to(tl.int64) * N + offs_m
        tl.store(m_ptr + part, m_i, mask=row_ok)
        tl.store(s_ptr + part, s_i, mask=row_ok)
        tl.store(u_ptr + part, u_i, mask=row_ok)
        tl.store(key_ptr + part, best, mask=row_ok)
        tl.store(id_ptr + part, best_id, mask=row_ok)
        tl.store(zb_ptr + part, best_z, mask=row_ok)

    @triton.jit
    def sample_pick_kernel(key_ptr, id_ptr, zb_ptr, token_ptr, zt_ptr, N, n_split, BLOCK: tl.constexpr):
        """Each row's token: the split with the largest key, ascending (ties: the lowest id)."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < N
        rows = offs.to(tl.int64)
        best = tl.full((BLOCK,), float("-inf"), tl.float32)
        token = tl.load(id_ptr + rows, mask=ok, other=0)
        zt = tl.zeros((BLOCK,), tl.float32)
        # Pointers advance by N per split: 64-bit pointer arithmetic, no int32 k * N product.
        k_ptrs = key_ptr + rows
        i_ptrs = id_ptr + rows
        z_ptrs = zb_ptr + rows
        for _ in range(0, n_split):
            key = tl.load(k_ptrs, mask=ok, other=float("-inf"))
            lead = key > best
            best = tl.where(lead, key, best)
            token = tl.where(lead, tl.load(i_ptrs, mask=ok, other=0), token)
            # 0 + z: the same normalization as linear_logprob's running target sum.
            zt = tl.where(lead, 0.0 + tl.load(z_ptrs, mask=ok, other=0.0), zt)
            k_ptrs += N
            i_ptrs += N
            z_ptrs += N
        tl.store(token_ptr + rows, token.to(tl.int64), mask=ok)
        tl.store(zt_ptr + rows, zt, mask=ok)
else:  # pragma: no cover - the torch backend still imports without Triton
    exponential_noise = sample_partial_kernel = sample_pick_kernel = None
