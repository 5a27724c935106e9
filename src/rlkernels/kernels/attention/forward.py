"""The full forward kernel: one program per (query tile, sequence, query head), every
split of the tile's keys in turn (host code: ``rlkernels.ops.attention.triton_host``)."""
from __future__ import annotations

from .._triton import tl, triton

if triton is not None:
    from .prologue import (key_base, key_range, load_rows, query_base, query_rows, store_rows, tile_bounds, tma_row,
                           window_range)
    from .softmax import ROWSUM_COLS, empty_state, finish, merge_states, split_walk

    @triton.jit
    def attn_fwd_kernel(
        q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, sink_ptr,
        k_desc, v_desc, K_HEAD_ROWS, K_HEAD_COLS, V_HEAD_ROWS, V_HEAD_COLS,
        q_start_ptr, q_len_ptr, k_start_ptr, k_len_ptr,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
        stride_ot, stride_oh, stride_lh,
        H, G, D, qk_scale, softcap, LQ, K_ADD, KV_ROWS, WINDOW,
        CAUSAL: tl.constexpr, SLIDING: tl.constexpr, SINK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr, S_SPLIT: tl.constexpr, IEEE: tl.constexpr, EVEN_D: tl.constexpr, DENSE: tl.constexpr,
        KLEN_PTR: tl.constexpr, REVERSE_M: tl.constexpr, TMA: tl.constexpr, ONE_SPLIT: tl.constexpr,
        SOFTCAP: tl.constexpr,
    ):
        """Full forward: one program per (query tile of BLOCK_M rows, sequence, query head).

        Keeps the merged state and the current split's state in registers and merges
        at each split boundary, which is the split kernel + combine's chain exactly.
        Inside a split, the blocks every row of the tile sees in full run without the
        mask (same bits), the rest (causal diagonal, sequence end) with it. REVERSE_M
        starts the longest causal tiles first (launch order only). TMA: the unmasked
        blocks come through k_desc/v_desc (2D views; ``tma_row``, column kvh * *_HEAD_COLS).
        ONE_SPLIT (every sequence's keys fit in one split): the split loop's one iteration
        written out, merging onto the constant empty state, so the merged accumulator is
        not live during the walk (same bits; the D = 64 kernel stops spilling).
        SLIDING: each row sees keys no more than WINDOW positions back; the splits and
        blocks no row of the tile sees are left out (``window_range``). SINK: head h's
        sink logit (``sink_ptr[h]``, log2 units) joins each row's normalizer (``finish``).
        SOFTCAP: the scores are soft-capped (``capped``; qk_scale and softcap as it reads them).
        """
        pid_m, bh, z, h, q_start, q_len, k_start, k_len = tile_bounds(H, q_start_ptr, q_len_ptr, k_start_ptr, k_len_ptr,
                                                                      LQ, K_ADD, KV_ROWS, REVERSE_M, DENSE, KLEN_PTR)
        if pid_m * BLOCK_M >= q_len:
            return
        kvh, offs_m, offs_d, row_ok = query_rows(h, G, pid_m, q_len, BLOCK_M, BLOCK_D)
        q = load_rows(query_base(q_ptr, q_start, h, stride_qt, stride_qh), offs_m, stride_qt, offs_d, q_len, D, EVEN_D,
                      True)
        pos = k_len - q_len + offs_m
        last = tl.minimum((pid_m + 1) * BLOCK_M, q_len)
        n_end, n_full = key_range(k_len, q_len, pid_m * BLOCK_M, last, BLOCK_N, CAUSAL)
        n_lo, n_win = window_range(k_len - q_len + pid_m * BLOCK_M, k_len - q_len + last - 1, WINDOW, BLOCK_N)
        ONES = tl.full((BLOCK_N, ROWSUM_COLS), 1.0, dtype=q_ptr.dtype.element_ty)
        m, l, acc = empty_state(BLOCK_M, BLOCK_D)
        k_base = key_base(k_ptr, k_start, kvh, stride_kt, stride_kh)
        v_base = key_base(v_ptr, k_start, kvh, stride_vt, stride_vh)
        k_row = tma_row(k_start, kvh, K_HEAD_ROWS)
        v_row = tma_row(k_start, kvh, V_HEAD_ROWS)
        if ONE_SPLIT:
            m_s, l_s, acc_s = split_walk(q, k_base, v_base, stride_kt, stride_vt, k_desc, v_desc, k_row,
                                         kvh * K_HEAD_COLS, v_row, kvh * V_HEAD_COLS, offs_d, row_ok, pos, 0, n_end,
                                         n_full, n_lo, n_win, k_len, D, qk_scale, softcap, ONES, WINDOW, k_base,
                                         v_base, 0, CAUSAL, SLIDING, BLOCK_M, BLOCK_N, BLOCK_D, S_SPLIT, IEEE,
                                         EVEN_D, TMA, SOFTCAP, False)
            m, l, acc = merge_states(m, l, acc, m_s, l_s, acc_s)
        else:
            s_first = 0
            if SLIDING:
                s_first = n_lo // S_SPLIT * S_SPLIT
            for s0 in range(s_first, n_end, S_SPLIT):
                m_s, l_s, acc_s = split_walk(q, k_base, v_base, stride_kt, stride_vt, k_desc, v_desc, k_row,
                                             kvh * K_HEAD_COLS, v_row, kvh * V_HEAD_COLS, offs_d, row_ok, pos, s0,
                                             n_end, n_full, n_lo, n_win, k_len, D, qk_scale, softcap, ONES, WINDOW,
                                             k_base, v_base, 0, CAUSAL, SLIDING, BLOCK_M, BLOCK_N, BLOCK_D, S_SPLIT,
                                             IEEE, EVEN_D, TMA, SOFTCAP, False)
                m, l, acc = merge_states(m, l, acc, m_s, l_s, acc_s)
        sink = m
        if SINK:
            sink = tl.zeros((BLOCK_M,), dtype=tl.float32) + tl.load(sink_ptr + h)
        out, lse = finish(m, l, acc, sink, SINK)
        store_rows(query_base(o_ptr, q_start, h, stride_ot, stride_oh), offs_m, stride_ot, offs_d, q_len, D,
                   out.to(o_ptr.dtype.element_ty), EVEN_D)
        tl.store(lse_ptr + h * stride_lh + q_start + offs_m, lse, mask=row_ok)
else:  # pragma: no cover - the torch backend still imports without Triton
    attn_fwd_kernel = None
