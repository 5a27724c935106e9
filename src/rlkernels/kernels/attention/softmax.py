"""The online softmax every forward kernel computes a row with (see ``kernels.attention``):
one key block's step (:func:`block_step`), the merge of two states (:func:`merge_states`),
a split's walk over its key blocks (:func:`split_walk`) and the finish. ``block_step`` and
``merge_states`` are the only places where a state is updated.
"""
from __future__ import annotations

from .._triton import DOT_ANY_M, tl, triton

if triton is not None:
    from ..cuda_math import tanhf
    from .prologue import load_pair, load_rows

    # Columns of the ones matrix the row sums of p go through (``block_step``): the
    # narrowest tensor-core MMA (n8; Triton < 3.5 takes no dot narrower than 16). Every
    # column holds the same sum, so the width changes no bits; 16 columns cost D = 64
    # forwards 7-8 % (H200, bf16, L >= 4096).
    ROWSUM_COLS = tl.constexpr(8 if DOT_ANY_M else 16)

    @triton.jit
    def dot(a, b, acc, IEEE: tl.constexpr):
        """acc + a @ b; IEEE (fp32 inputs): full-precision fp32 products, not TF32."""
        if IEEE:
            return tl.dot(a, b, acc, input_precision="ieee")
        else:
            return tl.dot(a, b, acc)

    @triton.jit
    def empty_state(BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
        """The empty state (m, l, acc) = (-inf, 0, 0) of BLOCK_M rows, acc BLOCK_D wide."""
        m = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
        l = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
        return m, l, acc

    @triton.jit
    def merge_states(m1, l1, acc1, m2, l2, acc2):
        """The one merge formula of two partial states (ascending: 1 before 2)."""
        m = tl.maximum(m1, m2)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        a1 = tl.math.exp2(m1 - m_safe)
        a2 = tl.math.exp2(m2 - m_safe)
        l = tl.fma(l1, a1, l2 * a2)
        acc = tl.fma(acc1, a1[:, None], acc2 * a2[:, None])
        return m, l, acc

    @triton.jit
    def capped(s, qk_scale, softcap):
        """Soft-capped scores in log2 units: softcap * tanh(s * qk_scale), with the host's
        qk_scale = scale / cap and softcap = cap * log2(e) (Gemma 2's cap * tanh(s * scale / cap))."""
        return tanhf(s * qk_scale) * softcap

    @triton.jit
    def block_step(q, k, v, valid, m, l, acc, qk_scale, softcap, ONES, IEEE: tl.constexpr, MASK: tl.constexpr,
                   SOFTCAP: tl.constexpr):
        """One key block of the online softmax: q [BM, BD], k/v [BN, BD], valid [BM, BN].

        m is the running max of the scaled scores: rowmax(s) * qk_scale is rowmax(s *
        qk_scale) exactly (rounding is monotone and qk_scale > 0), so the scale multiplies
        one value per row and p = exp2(fma(s, qk_scale, -m)) costs one FMA per score.
        The row sum of p goes through the tensor cores (p @ ones, every column equal,
        taken by an exact max) so its order is the dot chain's, which does not depend
        on the tile shape, rather than a tree reduction whose order follows the layout.
        MASK=False is for blocks whose keys every row of the tile may see: the same
        expressions without the select (``where(True, s, -inf)`` is s), so same bits.
        SOFTCAP: the scores are ``capped`` first (the mask after, so hidden keys stay -inf)
        and the scale that follows is 1 (x * 1 is x).
        """
        s = dot(q, tl.trans(k), tl.zeros((q.shape[0], k.shape[0]), dtype=tl.float32), IEEE)
        if SOFTCAP:
            s = capped(s, qk_scale, softcap)
            k_scale = 1.0
        else:
            k_scale = qk_scale
        if MASK:
            s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1) * k_scale)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m - m_safe)
        p = tl.math.exp2(tl.fma(s, k_scale, -m_safe[:, None])).to(v.dtype)
        rows = dot(p, ONES, tl.zeros((q.shape[0], ONES.shape[1]), dtype=tl.float32), IEEE)
        l = tl.fma(l, alpha, tl.max(rows, 1))
        acc = dot(p, v, acc * alpha[:, None], IEEE)
        return m_new, l, acc

    @triton.jit
    def finish(m, l, acc, sink, SINK: tl.constexpr):
        """(out fp32, lse in log2 units); a row that saw no key gives 0 and -inf. SINK: ``sink``
        [BLOCK_M] (log2 units) is one more logit in each row's normalizer whose value row is
        dropped (an attention sink): the state is merged with (sink, 1, 0) by the one merge
        formula, last, so a row's sink joins its chain after every key."""
        if SINK:
            m, l, acc = merge_states(m, l, acc, sink, tl.full(sink.shape, 1.0, tl.float32), tl.zeros_like(acc))
        seen = l > 0
        out = acc / tl.where(seen, l, 1.0)[:, None]
        lse = tl.where(seen, m + tl.math.log2(tl.where(seen, l, 1.0)), float("-inf"))
        return out, lse

    @triton.jit
    def masked_block(q, k_base, v_base, stride_kt, stride_vt, offs_d, row_ok, pos, n0, k_len, D, qk_scale, softcap,
                     ONES, m, l, acc, WINDOW, CAUSAL: tl.constexpr, SLIDING: tl.constexpr, BLOCK_N: tl.constexpr,
                     IEEE: tl.constexpr, EVEN_D: tl.constexpr, SOFTCAP: tl.constexpr):
        """``block_step`` over keys n0 .. n0 + BLOCK_N - 1 through masked loads, each row
        seeing the keys of the sequence at or before its position (CAUSAL) and no more than
        WINDOW positions back (SLIDING)."""
        offs_n = n0 + tl.arange(0, BLOCK_N)
        k = load_rows(k_base, offs_n, stride_kt, offs_d, k_len, D, EVEN_D, True)
        v = load_rows(v_base, offs_n, stride_vt, offs_d, k_len, D, EVEN_D, True)
        valid = (offs_n < k_len)[None, :] & row_ok[:, None]
        if CAUSAL:
            valid = valid & (offs_n[None, :] <= pos[:, None])
        if SLIDING:
            valid = valid & (offs_n[None, :] >= (pos - WINDOW)[:, None])
        return block_step(q, k, v, valid, m, l, acc, qk_scale, softcap, ONES, IEEE, True, SOFTCAP)

    @triton.jit
    def split_walk(q, k_base, v_base, stride_kt, stride_vt, k_desc, v_desc, k_row, k_col, v_row, v_col, offs_d,
                   row_ok, pos, s0, n_end, n_full, n_lo, n_win, k_len, D, qk_scale, softcap, ONES, WINDOW,
                   ks_base, vs_base, n_shared,
                   CAUSAL: tl.constexpr, SLIDING: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_D: tl.constexpr, S_SPLIT: tl.constexpr, IEEE: tl.constexpr, EVEN_D: tl.constexpr,
                   TMA: tl.constexpr, SOFTCAP: tl.constexpr, SHARED: tl.constexpr):
        """One split's online-softmax state (m, l, acc), from the empty state, over its key
        blocks ascending: keys [s0, min(s0 + S_SPLIT, n_end)) of a tile whose rows have
        query positions ``pos`` (row_ok: the row exists). Blocks below n_full (a multiple of
        BLOCK_N) are seen in full by every row and run without the mask (through the K/V
        descriptors where TMA: (k_row + n, k_col) is key n); the rest with it. SLIDING
        (each row sees keys no more than WINDOW positions back; ``window_range``'s n_lo,
        n_win): the blocks below n_lo are left out, those below n_win take the mask.

        SHARED: the unmasked blocks wholly below key ``n_shared`` are read from ``ks_base`` /
        ``vs_base`` instead, another sequence's copy of the same keys (the same loads and
        steps from another address, so the same bits): sequences that share a prompt read
        one copy of it, which the L2 cache can serve to all of them.

        The full kernel (each split in turn) and the split kernel (one split per program)
        both walk a split here, so the two compute one chain.
        """
        m_s, l_s, acc_s = empty_state(BLOCK_M, BLOCK_D)
        s_end = tl.minimum(s0 + S_SPLIT, n_end)
        s_low = s0
        if SLIDING:
            s_begin = tl.maximum(s0, n_lo)
            s_low = tl.minimum(tl.maximum(n_win, s_begin), s_end)
            for n0 in range(s_begin, s_low, BLOCK_N):
                m_s, l_s, acc_s = masked_block(q, k_base, v_base, stride_kt, stride_vt, offs_d, row_ok, pos, n0, k_len,
                                               D, qk_scale, softcap, ONES, m_s, l_s, acc_s, WINDOW, CAUSAL, SLIDING,
                                               BLOCK_N, IEEE, EVEN_D, SOFTCAP)
        s_mid = tl.minimum(tl.maximum(n_full, s_low), s_end)
        if SHARED:
            s_shared = tl.minimum(tl.maximum(n_shared // BLOCK_N * BLOCK_N, s_low), s_mid)
            for n0 in range(s_low, s_shared, BLOCK_N):
                k, v = load_pair(k_desc, v_desc, k_row, k_col, v_row, v_col, ks_base, vs_base, stride_kt, stride_vt,
                                 n0, n0 + tl.arange(0, BLOCK_N), offs_d, k_len, D, EVEN_D, False, TMA)
                m_s, l_s, acc_s = block_step(q, k, v, None, m_s, l_s, acc_s, qk_scale, softcap, ONES, IEEE, False,
                                             SOFTCAP)
            s_low = s_shared
        for n0 in range(s_low, s_mid, BLOCK_N):
            k, v = load_pair(k_desc, v_desc, k_row, k_col, v_row, v_col, k_base, v_base, stride_kt, stride_vt, n0,
                             n0 + tl.arange(0, BLOCK_N), offs_d, k_len, D, EVEN_D, False, TMA)
            m_s, l_s, acc_s = block_step(q, k, v, None, m_s, l_s, acc_s, qk_scale, softcap, ONES, IEEE, False, SOFTCAP)
        for n0 in range(s_mid, s_end, BLOCK_N):
            m_s, l_s, acc_s = masked_block(q, k_base, v_base, stride_kt, stride_vt, offs_d, row_ok, pos, n0, k_len, D,
                                           qk_scale, softcap, ONES, m_s, l_s, acc_s, WINDOW, CAUSAL, SLIDING, BLOCK_N,
                                           IEEE, EVEN_D, SOFTCAP)
        return m_s, l_s, acc_s
