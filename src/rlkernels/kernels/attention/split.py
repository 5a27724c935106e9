"""The split-KV decode path: one program per (tile of query x GQA-group rows, sequence x
KV head, split) writes its split's state, and the combine kernel merges a tile's splits
in ascending order; together the full kernel's chain for every row (host code:
``rlkernels.ops.attention.triton_host``)."""
from __future__ import annotations

from .._triton import tl, triton

if triton is not None:
    from .prologue import group_rows, key_base, key_rows, tile_bounds, window_range
    from .softmax import ROWSUM_COLS, empty_state, finish, merge_states, split_walk

    @triton.jit
    def attn_split_kernel(
        q_ptr, k_ptr, v_ptr, ws_ptr, o_ptr, lse_ptr, sink_ptr,
        q_start_ptr, q_len_ptr, k_start_ptr, k_len_ptr, share_src_ptr, share_len_ptr,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
        stride_ot, stride_oh, stride_lh,
        HKV, G, D, qk_scale, softcap, N_SPLITS, ROWS_PAD, WS_ROWS, LQ, K_ADD, KV_ROWS, WINDOW,
        CAUSAL: tl.constexpr, SLIDING: tl.constexpr, SINK: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, S_SPLIT: tl.constexpr, IEEE: tl.constexpr,
        EVEN_D: tl.constexpr, DENSE: tl.constexpr, KLEN_PTR: tl.constexpr, FINISH: tl.constexpr,
        SOFTCAP: tl.constexpr, SHARED: tl.constexpr,
    ):
        """One split of S_SPLIT keys for a tile of (query, head of the GQA group) rows.

        Rows r = i * G + g pack a KV head's G query heads into the tile (decode: one
        query, G heads, padded to the minimum tile). Writes the split's (m, l, acc) to
        the workspace ws = [m | l | acc] over [B, HKV, N_SPLITS, ROWS_PAD] (acc with
        BLOCK_D per row, the real rows only); a split past the sequence's keys returns at
        once and the combine reads none of it, and one with nothing to do inside them (below
        a sliding window) writes the empty state, which the combine merges as a no-op.
        FINISH (N_SPLITS == 1), or a sequence whose keys all lie in split 0: merge the one
        state onto the empty state and finish here, the combine kernel's expressions
        exactly (``finish_split``), so the path a sequence takes is a function of its own
        key count.
        SLIDING: each row sees keys no more than WINDOW positions back (a split below
        every row's window writes the empty state). SINK: each row's head's sink logit
        (``sink_ptr``, log2 units) joins its normalizer where FINISH (``finish``).
        SHARED (bounds form): sequence b's first ``share_len_ptr[b]`` keys are also those of
        sequence ``share_src_ptr[b]``, bit for bit, and its whole key blocks among them are
        read there (``split_walk``'s SHARED): same bits, one copy of a shared prompt read.
        """
        pid_m, bk, sp, kvh, q_start, q_len, k_start, k_len = tile_bounds(
            HKV, q_start_ptr, q_len_ptr, k_start_ptr, k_len_ptr, LQ, K_ADD, KV_ROWS, False, DENSE, KLEN_PTR)
        if pid_m * BLOCK_M >= q_len * G:
            return
        if sp * S_SPLIT >= tl.maximum(k_len, 1):
            return  # a split past the sequence's keys: the combine reads no state of it
        r, i, h = group_rows(pid_m, kvh, G, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        row_ok = i < q_len
        if EVEN_D:
            q_mask = row_ok[:, None]
        else:
            q_mask = row_ok[:, None] & d_ok[None, :]
        q = tl.load(q_ptr + (q_start + i)[:, None] * stride_qt + h[:, None] * stride_qh + offs_d[None, :],
                    mask=q_mask, other=0.0)
        pos = k_len - q_len + i
        first_i = (pid_m * BLOCK_M) // G
        last_i = tl.minimum((pid_m * BLOCK_M + BLOCK_M - 1) // G, q_len - 1)
        if CAUSAL:
            n_end = tl.minimum(k_len, k_len - q_len + last_i + 1)
            n_full = tl.minimum(k_len, k_len - q_len + first_i + 1)
        else:
            n_end = k_len
            n_full = k_len
        n_full = tl.maximum(n_full, 0) // BLOCK_N * BLOCK_N
        n_lo, n_win = window_range(k_len - q_len + first_i, k_len - q_len + last_i, WINDOW, BLOCK_N)
        ONES = tl.full((BLOCK_N, ROWSUM_COLS), 1.0, dtype=q_ptr.dtype.element_ty)
        k_base = key_base(k_ptr, k_start, kvh, stride_kt, stride_kh)
        v_base = key_base(v_ptr, k_start, kvh, stride_vt, stride_vh)
        ks_base, vs_base, n_shared = k_base, v_base, 0
        if SHARED:
            tl.static_assert(not DENSE, "shared keys are given in the bounds form")
            src = tl.load(share_src_ptr + bk // HKV)
            n_shared = tl.load(share_len_ptr + bk // HKV)
            src_start = key_rows(src, tl.load(k_start_ptr + src), KV_ROWS)
            ks_base = key_base(k_ptr, src_start, kvh, stride_kt, stride_kh)
            vs_base = key_base(v_ptr, src_start, kvh, stride_vt, stride_vh)
        # Pointer loads only: TMA reads measured the same GPU time here (a step is bound by
        # its KV bytes, not the loads' address arithmetic) and cost host time per step.
        m_s, l_s, acc_s = split_walk(q, k_base, v_base, stride_kt, stride_vt, None, None, 0, 0, 0, 0, offs_d, row_ok,
                                     pos, sp * S_SPLIT, n_end, n_full, n_lo, n_win, k_len, D, qk_scale, softcap, ONES,
                                     WINDOW, ks_base, vs_base, n_shared, CAUSAL, SLIDING, BLOCK_M, BLOCK_N, BLOCK_D,
                                     S_SPLIT, IEEE, EVEN_D, False, SOFTCAP, SHARED)
        if FINISH:
            finish_split(m_s, l_s, acc_s, o_ptr, lse_ptr, sink_ptr, q_start, i, h, offs_d, d_ok, row_ok, stride_ot,
                         stride_oh, stride_lh, SINK, BLOCK_M, BLOCK_D, EVEN_D)
        elif k_len <= S_SPLIT:
            # Every key in split 0: finished here, as where the call has one split, so a
            # sequence's path follows its own key count, not the call's longest.
            finish_split(m_s, l_s, acc_s, o_ptr, lse_ptr, sink_ptr, q_start, i, h, offs_d, d_ok, row_ok, stride_ot,
                         stride_oh, stride_lh, SINK, BLOCK_M, BLOCK_D, EVEN_D)
        else:
            # The real rows only: a decode tile pads a KV head's G rows to BLOCK_M.
            base = (bk.to(tl.int64) * N_SPLITS + sp) * ROWS_PAD + r
            tl.store(ws_ptr + base, m_s, mask=row_ok)
            tl.store(ws_ptr + WS_ROWS + base, l_s, mask=row_ok)
            tl.store(ws_ptr + 2 * WS_ROWS + base[:, None] * BLOCK_D + offs_d[None, :], acc_s, mask=row_ok[:, None])

    @triton.jit
    def finish_split(m_s, l_s, acc_s, o_ptr, lse_ptr, sink_ptr, q_start, i, h, offs_d, d_ok, row_ok, stride_ot,
                     stride_oh, stride_lh, SINK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                     EVEN_D: tl.constexpr):
        """A sequence's one split state merged onto the empty state, finished and stored: the
        combine kernel's expressions exactly (its rows' out and LSE)."""
        m, l, acc = empty_state(BLOCK_M, BLOCK_D)
        m, l, acc = merge_states(m, l, acc, m_s, l_s, acc_s)
        if EVEN_D:
            o_mask = row_ok[:, None]
        else:
            o_mask = row_ok[:, None] & d_ok[None, :]
        store_finished(m, l, acc, o_ptr, lse_ptr, sink_ptr, q_start, i, h, offs_d, o_mask, row_ok, stride_ot,
                       stride_oh, stride_lh, SINK)

    @triton.jit
    def store_finished(m, l, acc, o_ptr, lse_ptr, sink_ptr, q_start, i, h, offs_d, o_mask, lse_mask, stride_ot,
                       stride_oh, stride_lh, SINK: tl.constexpr):
        """A merged state finished (``finish``; SINK: with each row's head's sink logit) and
        stored: out where ``o_mask``, the LSE where ``lse_mask``."""
        sink = m
        if SINK:
            sink = tl.load(sink_ptr + h)
        out, lse = finish(m, l, acc, sink, SINK)
        tl.store(o_ptr + (q_start + i)[:, None] * stride_ot + h[:, None] * stride_oh + offs_d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=o_mask)
        tl.store(lse_ptr + h * stride_lh + q_start + i, lse, mask=lse_mask)

    @triton.jit
    def attn_combine_kernel(
        ws_ptr, o_ptr, lse_ptr, sink_ptr, q_start_ptr, q_len_ptr, k_start_ptr, k_len_ptr,
        stride_ot, stride_oh, stride_lh,
        HKV, G, D, N_SPLITS, ROWS_PAD, WS_ROWS, LQ, K_ADD, SINK: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DC: tl.constexpr, EVEN_D: tl.constexpr,
        DENSE: tl.constexpr, KLEN_PTR: tl.constexpr, S_SPLIT: tl.constexpr,
    ):
        """Merges a tile's split states in ascending split order from the empty state: the
        splits that hold its sequence's keys, of a sequence with keys past split 0.

        Each program takes BLOCK_M rows and BLOCK_DC of the BLOCK_D columns (the merge
        is elementwise per row and column, so the column chunking leaves the bits alone):
        a decode step has few real rows, and spreading the columns over programs keeps the
        serial walk over the splits short. The chunk-0 program writes the LSE. SINK: as
        the split kernel's, after the last split.
        """
        pid_m, bk, pid_d, kvh, q_start, q_len, k_start, k_len = tile_bounds(
            HKV, q_start_ptr, q_len_ptr, k_start_ptr, k_len_ptr, LQ, K_ADD, 0, False, DENSE, KLEN_PTR)
        if pid_m * BLOCK_M >= q_len * G:
            return
        if k_len <= S_SPLIT:
            return  # keys in split 0 only: the split kernel finished the sequence
        r, i, h = group_rows(pid_m, kvh, G, BLOCK_M)
        offs_d = pid_d * BLOCK_DC + tl.arange(0, BLOCK_DC)
        row_ok = i < q_len
        m, l, acc = empty_state(BLOCK_M, BLOCK_DC)
        # The splits that hold the sequence's keys: a function of its key count alone.
        for sp in range(0, tl.cdiv(k_len, S_SPLIT)):
            base = (bk.to(tl.int64) * N_SPLITS + sp) * ROWS_PAD + r
            m_s = tl.load(ws_ptr + base, mask=row_ok, other=float("-inf"))
            l_s = tl.load(ws_ptr + WS_ROWS + base, mask=row_ok, other=0.0)
            acc_s = tl.load(ws_ptr + 2 * WS_ROWS + base[:, None] * BLOCK_D + offs_d[None, :], mask=row_ok[:, None],
                            other=0.0)
            m, l, acc = merge_states(m, l, acc, m_s, l_s, acc_s)
        if EVEN_D:
            o_mask = row_ok[:, None]
        else:
            o_mask = row_ok[:, None] & (offs_d[None, :] < D)
        # The chunk-0 program writes the LSE (the test as a vector: a mask takes no scalar).
        lse_mask = row_ok & (i * 0 + pid_d == 0)
        store_finished(m, l, acc, o_ptr, lse_ptr, sink_ptr, q_start, i, h, offs_d, o_mask, lse_mask, stride_ot,
                       stride_oh, stride_lh, SINK)
else:  # pragma: no cover - the torch backend still imports without Triton
    attn_split_kernel = attn_combine_kernel = None
