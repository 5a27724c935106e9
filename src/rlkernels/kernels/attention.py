"""Triton kernels of the batch-invariant attention (host code: ``rlkernels.ops.attention.triton_host``).

The chain every forward kernel computes for a query row (see docs/operators/attention.md):
keys in blocks of BLOCK_N aligned to key 0, ascending; blocks grouped in splits of
S_SPLIT keys aligned to key 0; each split's online-softmax state (m, l, acc) starts
from scratch and the splits' states are merged in ascending order by :func:`merge_states`
starting from the empty state. ``block_step`` and ``merge_states`` are the only places
where the state is updated; both the full (prefill) kernel and the split (decode)
kernel walk a split with :func:`split_walk` and merge with :func:`merge_states`, so their
rows agree bit for bit. ``kernels.attention_ws`` computes the same chain with the same
instructions in a warp-specialized Hopper kernel (Gluon).

Exactness of the no-op steps (why a tile's extra rows/blocks cost no bits): a block
whose keys are all masked for a row leaves (m, l, acc) unchanged exactly (alpha =
exp2(0) = 1, p = exp2(-inf) = 0, fma(l, 1, 0) = l, acc + 0 = acc), and merging the
empty state (-inf, 0, 0) is exact too. Scores are in log2 units (qk_scale includes
log2(e)); the saved LSE is m + log2(l) in the same units.

Loads: blocks whose rows all lie inside the sequence may come through TMA descriptors
(``TMA``; ``tma_row`` says where a head's rows are) and the rest through masked pointer
loads; a block's values, and so every dot, are the same either way.
"""
from __future__ import annotations

from ._triton import DOT_ANY_M, tl, triton

if triton is not None:
    # Columns of the ones matrix the row sums of p go through (``block_step``): the
    # narrowest tensor-core MMA (n8; Triton < 3.5 takes no dot narrower than 16). Every
    # column holds the same sum, so the width changes no bits; 16 columns cost D = 64
    # forwards 7-8 % (H200, bf16, L >= 4096).
    ROWSUM_COLS = tl.constexpr(8 if DOT_ANY_M else 16)

    @triton.jit
    def _dot(a, b, acc, IEEE: tl.constexpr):
        if IEEE:
            return tl.dot(a, b, acc, input_precision="ieee")
        else:
            return tl.dot(a, b, acc)

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
    def block_step(q, k, v, valid, m, l, acc, qk_scale, ONES, IEEE: tl.constexpr, MASK: tl.constexpr):
        """One key block of the online softmax: q [BM, BD], k/v [BN, BD], valid [BM, BN].

        m is the running max of the scaled scores: rowmax(s) * qk_scale is rowmax(s *
        qk_scale) exactly (rounding is monotone and qk_scale > 0), so the scale multiplies
        one value per row and p = exp2(fma(s, qk_scale, -m)) costs one FMA per score.
        The row sum of p goes through the tensor cores (p @ ones, every column equal,
        taken by an exact max) so its order is the dot chain's, which does not depend
        on the tile shape, rather than a tree reduction whose order follows the layout.
        MASK=False is for blocks whose keys every row of the tile may see: the same
        expressions without the select (``where(True, s, -inf)`` is s), so same bits.
        """
        s = _dot(q, tl.trans(k), tl.zeros((q.shape[0], k.shape[0]), dtype=tl.float32), IEEE)
        if MASK:
            s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1) * qk_scale)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m - m_safe)
        p = tl.math.exp2(tl.fma(s, qk_scale, -m_safe[:, None])).to(v.dtype)
        rows = _dot(p, ONES, tl.zeros((q.shape[0], ONES.shape[1]), dtype=tl.float32), IEEE)
        l = tl.fma(l, alpha, tl.max(rows, 1))
        acc = _dot(p, v, acc * alpha[:, None], IEEE)
        return m_new, l, acc

    @triton.jit
    def seq_bounds(b, q_start_ptr, q_len_ptr, k_start_ptr, k_len_ptr, LQ, K_ADD, KV_ROWS,
                   DENSE: tl.constexpr, KLEN_PTR: tl.constexpr):
        """(q_start, q_len, k_start, k_len) of sequence b. DENSE: a padded batch of LQ
        queries per sequence whose keys start at its batch row's first key, k_len =
        k_len_ptr[b] + K_ADD (or K_ADD), so a decode step needs no index tensors built on
        the host; else read the tensors. k_start counts key rows (token strides) from the
        tensor's start: sequence b's batch row begins at row b * KV_ROWS (``key_rows``)."""
        q_start, q_len = query_bounds(b, q_start_ptr, q_len_ptr, LQ, DENSE)
        if DENSE:
            k_start = key_rows(b, 0, KV_ROWS)
            if KLEN_PTR:
                k_len = tl.load(k_len_ptr + b) + K_ADD
            else:
                k_len = b * 0 + K_ADD
        else:
            k_start = key_rows(b, tl.load(k_start_ptr + b), KV_ROWS)
            k_len = tl.load(k_len_ptr + b)
        return q_start, q_len, k_start, k_len

    @triton.jit
    def query_bounds(b, q_start_ptr, q_len_ptr, LQ, DENSE: tl.constexpr):
        """(q_start int64, q_len) of sequence b: ``seq_bounds``'s query half."""
        if DENSE:
            return b.to(tl.int64) * LQ, b * 0 + LQ
        else:
            return tl.load(q_start_ptr + b).to(tl.int64), tl.load(q_len_ptr + b)

    @triton.jit
    def key_rows(b, k_start, KV_ROWS):
        """Row index (in token strides, int64) of sequence b's key k_start. Keys are [NB, S,
        Hkv, D]: NB = 1 (KV_ROWS = 0) holds every sequence's keys in one packed run of rows;
        NB = B gives sequence b batch row b, whose batch stride is KV_ROWS token strides (a
        contiguous cache: S; Hugging Face's [B, Hkv, S, D] read in place: Hkv * S). The
        batch offset joins the row index early, so the key loop's addresses are row *
        stride + head offset as for packed rows (a separate batch term in the address cost
        the decode kernel 31 registers and half its occupancy at D = 128)."""
        return b.to(tl.int64) * KV_ROWS + k_start

    @triton.jit
    def key_base(ptr, k_start, kvh, stride_t, stride_h):
        """Address of key row k_start (``key_rows``) of KV head kvh."""
        return ptr + k_start * stride_t + kvh.to(tl.int64) * stride_h

    @triton.jit
    def tma_row(k_start, kvh, HEAD_ROWS):
        """The descriptor row (int32) of key row k_start (``key_rows``) of KV head kvh: a
        head's rows start HEAD_ROWS rows further down where heads are row blocks of the
        2D view (Hugging Face's [B, Hkv, S, D]); 0 where they are column blocks."""
        return (k_start + kvh.to(tl.int64) * HEAD_ROWS).to(tl.int32)

    @triton.jit
    def load_rows(base, offs_n, stride, offs_d, n_lim, D, EVEN_D: tl.constexpr, MASK_N: tl.constexpr):
        """Rows offs_n (< n_lim where MASK_N) of a [*, D] matrix, zeros elsewhere. With
        EVEN_D (D == BLOCK_D) the mask is constant along d, so loads stay 16 bytes wide."""
        ptrs = base + offs_n.to(tl.int64)[:, None] * stride + offs_d[None, :]
        if MASK_N:
            if EVEN_D:
                return tl.load(ptrs, mask=(offs_n < n_lim)[:, None], other=0.0)
            else:
                return tl.load(ptrs, mask=(offs_n < n_lim)[:, None] & (offs_d < D)[None, :], other=0.0)
        else:
            if EVEN_D:
                return tl.load(ptrs)
            else:
                return tl.load(ptrs, mask=(offs_d < D)[None, :], other=0.0)

    @triton.jit
    def store_rows(base, offs_m, stride, offs_d, m_lim, D, x, EVEN_D: tl.constexpr):
        ptrs = base + offs_m.to(tl.int64)[:, None] * stride + offs_d[None, :]
        if EVEN_D:
            tl.store(ptrs, x, mask=(offs_m < m_lim)[:, None])
        else:
            tl.store(ptrs, x, mask=(offs_m < m_lim)[:, None] & (offs_d < D)[None, :])

    @triton.jit
    def finish(m, l, acc):
        """(out fp32, lse in log2 units); a row that saw no key gives 0 and -inf."""
        seen = l > 0
        out = acc / tl.where(seen, l, 1.0)[:, None]
        lse = tl.where(seen, m + tl.math.log2(tl.where(seen, l, 1.0)), float("-inf"))
        return out, lse

    @triton.jit
    def split_walk(q, k_base, v_base, stride_kt, stride_vt, k_desc, v_desc, k_row, k_col, v_row, v_col, offs_d,
                   row_ok, pos, s0, n_end, n_full, k_len, D, qk_scale, ONES, CAUSAL: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, S_SPLIT: tl.constexpr,
                   IEEE: tl.constexpr, EVEN_D: tl.constexpr, TMA: tl.constexpr):
        """One split's online-softmax state (m, l, acc), from the empty state, over its key
        blocks ascending: keys [s0, min(s0 + S_SPLIT, n_end)) of a tile whose rows have
        query positions ``pos`` (row_ok: the row exists). Blocks below n_full (a multiple of
        BLOCK_N) are seen in full by every row and run without the mask (through the K/V
        descriptors where TMA: (k_row + n, k_col) is key n); the rest with it.

        The full kernel (each split in turn) and the split kernel (one split per program)
        both walk a split here, so the two compute one chain.
        """
        m_s = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
        l_s = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc_s = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
        s_end = tl.minimum(s0 + S_SPLIT, n_end)
        s_mid = tl.minimum(tl.maximum(n_full, s0), s_end)
        for n0 in range(s0, s_mid, BLOCK_N):
            if TMA:
                k = k_desc.load([k_row + n0, k_col])
                v = v_desc.load([v_row + n0, v_col])
            else:
                offs_n = n0 + tl.arange(0, BLOCK_N)
                k = load_rows(k_base, offs_n, stride_kt, offs_d, k_len, D, EVEN_D, False)
                v = load_rows(v_base, offs_n, stride_vt, offs_d, k_len, D, EVEN_D, False)
            m_s, l_s, acc_s = block_step(q, k, v, None, m_s, l_s, acc_s, qk_scale, ONES, IEEE, False)
        for n0 in range(s_mid, s_end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            k_ok = offs_n < k_len
            k = load_rows(k_base, offs_n, stride_kt, offs_d, k_len, D, EVEN_D, True)
            v = load_rows(v_base, offs_n, stride_vt, offs_d, k_len, D, EVEN_D, True)
            valid = k_ok[None, :] & row_ok[:, None]
            if CAUSAL:
                valid = valid & (offs_n[None, :] <= pos[:, None])
            m_s, l_s, acc_s = block_step(q, k, v, valid, m_s, l_s, acc_s, qk_scale, ONES, IEEE, True)
        return m_s, l_s, acc_s

    @triton.jit
    def attn_fwd_kernel(
        q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, k_desc, v_desc, K_HEAD_ROWS, K_HEAD_COLS, V_HEAD_ROWS, V_HEAD_COLS,
        q_start_ptr, q_len_ptr, k_start_ptr, k_len_ptr,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
        stride_ot, stride_oh, stride_lh,
        H, G, D, qk_scale, LQ, K_ADD, KV_ROWS,
        CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        S_SPLIT: tl.constexpr, IEEE: tl.constexpr, EVEN_D: tl.constexpr, DENSE: tl.constexpr,
        KLEN_PTR: tl.constexpr, REVERSE_M: tl.constexpr, TMA: tl.constexpr, ONE_SPLIT: tl.constexpr,
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
        """
        pid_m = tl.program_id(0)
        if REVERSE_M:
            pid_m = tl.num_programs(0) - 1 - pid_m
        bh = tl.program_id(1)
        b = bh // H
        h = bh % H
        q_start, q_len, k_start, k_len = seq_bounds(b, q_start_ptr, q_len_ptr, k_start_ptr, k_len_ptr, LQ, K_ADD,
                                                    KV_ROWS, DENSE, KLEN_PTR)
        if pid_m * BLOCK_M >= q_len:
            return
        kvh = h // G
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        row_ok = offs_m < q_len
        q = load_rows(q_ptr + q_start * stride_qt + h * stride_qh, offs_m, stride_qt, offs_d, q_len, D, EVEN_D, True)
        pos = k_len - q_len + offs_m
        if CAUSAL:
            n_end = tl.minimum(k_len, k_len - q_len + tl.minimum((pid_m + 1) * BLOCK_M, q_len))
            n_full = tl.minimum(k_len, k_len - q_len + pid_m * BLOCK_M + 1)
        else:
            n_end = k_len
            n_full = k_len
        # Keys below n_full are visible to every row of the tile (rows past q_len load q = 0 and are not stored).
        n_full = tl.maximum(n_full, 0) // BLOCK_N * BLOCK_N
        ONES = tl.full((BLOCK_N, ROWSUM_COLS), 1.0, dtype=q_ptr.dtype.element_ty)
        m = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
        l = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
        k_base = key_base(k_ptr, k_start, kvh, stride_kt, stride_kh)
        v_base = key_base(v_ptr, k_start, kvh, stride_vt, stride_vh)
        k_row = tma_row(k_start, kvh, K_HEAD_ROWS)
        v_row = tma_row(k_start, kvh, V_HEAD_ROWS)
        if ONE_SPLIT:
            m_s, l_s, acc_s = split_walk(q, k_base, v_base, stride_kt, stride_vt, k_desc, v_desc, k_row,
                                         kvh * K_HEAD_COLS, v_row, kvh * V_HEAD_COLS, offs_d, row_ok, pos, 0, n_end,
                                         n_full, k_len, D, qk_scale, ONES, CAUSAL, BLOCK_M, BLOCK_N, BLOCK_D,
                                         S_SPLIT, IEEE, EVEN_D, TMA)
            m, l, acc = merge_states(m, l, acc, m_s, l_s, acc_s)
        else:
            for s0 in range(0, n_end, S_SPLIT):
                m_s, l_s, acc_s = split_walk(q, k_base, v_base, stride_kt, stride_vt, k_desc, v_desc, k_row,
                                             kvh * K_HEAD_COLS, v_row, kvh * V_HEAD_COLS, offs_d, row_ok, pos, s0,
                                             n_end, n_full, k_len, D, qk_scale, ONES, CAUSAL, BLOCK_M, BLOCK_N,
                                             BLOCK_D, S_SPLIT, IEEE, EVEN_D, TMA)
                m, l, acc = merge_states(m, l, acc, m_s, l_s, acc_s)
        out, lse = finish(m, l, acc)
        store_rows(o_ptr + q_start * stride_ot + h * stride_oh, offs_m, stride_ot, offs_d, q_len, D,
                   out.to(o_ptr.dtype.element_ty), EVEN_D)
        tl.store(lse_ptr + h * stride_lh + q_start + offs_m, lse, mask=row_ok)

    @triton.jit
    def attn_split_kernel(
        q_ptr, k_ptr, v_ptr, ws_ptr, o_ptr, lse_ptr,
        q_start_ptr, q_len_ptr, k_start_ptr, k_len_ptr,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
        stride_ot, stride_oh, stride_lh,
        HKV, G, D, qk_scale, N_SPLITS, ROWS_PAD, WS_ROWS, LQ, K_ADD, KV_ROWS,
        CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        S_SPLIT: tl.constexpr, IEEE: tl.constexpr, EVEN_D: tl.constexpr, DENSE: tl.constexpr,
        KLEN_PTR: tl.constexpr, FINISH: tl.constexpr,
    ):
        """One split of S_SPLIT keys for a tile of (query, head of the GQA group) rows.

        Rows r = i * G + g pack a KV head's G query heads into the tile (decode: one
        query, G heads, padded to the minimum tile). Writes the split's (m, l, acc) to
        the workspace ws = [m | l | acc] over [B, HKV, N_SPLITS, ROWS_PAD] (acc with
        BLOCK_D per row); a split with nothing to do writes the empty state, which the
        combine merges exactly as a no-op. FINISH (N_SPLITS == 1): merge the one state
        onto the empty state and finish here, the combine kernel's expressions exactly.
        """
        pid_m = tl.program_id(0)
        bk = tl.program_id(1)
        sp = tl.program_id(2)
        b = bk // HKV
        kvh = bk % HKV
        q_start, q_len, k_start, k_len = seq_bounds(b, q_start_ptr, q_len_ptr, k_start_ptr, k_len_ptr, LQ, K_ADD,
                                                    KV_ROWS, DENSE, KLEN_PTR)
        if pid_m * BLOCK_M >= q_len * G:
            return
        r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        i = r // G
        h = kvh * G + r % G
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
        if CAUSAL:
            last_i = tl.minimum((pid_m * BLOCK_M + BLOCK_M - 1) // G, q_len - 1)
            n_end = tl.minimum(k_len, k_len - q_len + last_i + 1)
            n_full = tl.minimum(k_len, k_len - q_len + (pid_m * BLOCK_M) // G + 1)
        else:
            n_end = k_len
            n_full = k_len
        n_full = tl.maximum(n_full, 0) // BLOCK_N * BLOCK_N
        ONES = tl.full((BLOCK_N, ROWSUM_COLS), 1.0, dtype=q_ptr.dtype.element_ty)
        k_base = key_base(k_ptr, k_start, kvh, stride_kt, stride_kh)
        v_base = key_base(v_ptr, k_start, kvh, stride_vt, stride_vh)
        # Pointer loads only: TMA reads measured the same GPU time here (a step is bound by
        # its KV bytes, not the loads' address arithmetic) and cost host time per step.
        m_s, l_s, acc_s = split_walk(q, k_base, v_base, stride_kt, stride_vt, None, None, 0, 0, 0, 0, offs_d, row_ok,
                                     pos, sp * S_SPLIT, n_end, n_full, k_len, D, qk_scale, ONES, CAUSAL, BLOCK_M,
                                     BLOCK_N, BLOCK_D, S_SPLIT, IEEE, EVEN_D, False)
        if FINISH:
            m = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
            l = tl.zeros((BLOCK_M,), dtype=tl.float32)
            acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
            m, l, acc = merge_states(m, l, acc, m_s, l_s, acc_s)
            out, lse = finish(m, l, acc)
            if EVEN_D:
                o_mask = row_ok[:, None]
            else:
                o_mask = row_ok[:, None] & d_ok[None, :]
            tl.store(o_ptr + (q_start + i)[:, None] * stride_ot + h[:, None] * stride_oh + offs_d[None, :],
                     out.to(o_ptr.dtype.element_ty), mask=o_mask)
            tl.store(lse_ptr + h * stride_lh + q_start + i, lse, mask=row_ok)
        else:
            base = (bk.to(tl.int64) * N_SPLITS + sp) * ROWS_PAD + r
            tl.store(ws_ptr + base, m_s)
            tl.store(ws_ptr + WS_ROWS + base, l_s)
            tl.store(ws_ptr + 2 * WS_ROWS + base[:, None] * BLOCK_D + offs_d[None, :], acc_s)

    @triton.jit
    def attn_combine_kernel(
        ws_ptr, o_ptr, lse_ptr, q_start_ptr, q_len_ptr, k_start_ptr, k_len_ptr,
        stride_ot, stride_oh, stride_lh,
        HKV, G, D, N_SPLITS, ROWS_PAD, WS_ROWS, LQ, K_ADD,
        BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DC: tl.constexpr, EVEN_D: tl.constexpr,
        DENSE: tl.constexpr, KLEN_PTR: tl.constexpr,
    ):
        """Merges a tile's split states in ascending split order from the empty state.

        Each program takes BLOCK_M rows and BLOCK_DC of the BLOCK_D columns (the merge
        is elementwise per row and column, so the column chunking leaves the bits alone):
        a decode step has few real rows, and spreading the columns over programs keeps the
        serial walk over the splits short. The chunk-0 program writes the LSE.
        """
        pid_m = tl.program_id(0)
        bk = tl.program_id(1)
        pid_d = tl.program_id(2)
        b = bk // HKV
        kvh = bk % HKV
        q_start, q_len, k_start, k_len = seq_bounds(b, q_start_ptr, q_len_ptr, k_start_ptr, k_len_ptr, LQ, K_ADD,
                                                    0, DENSE, KLEN_PTR)
        if pid_m * BLOCK_M >= q_len * G:
            return
        r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        i = r // G
        h = kvh * G + r % G
        offs_d = pid_d * BLOCK_DC + tl.arange(0, BLOCK_DC)
        row_ok = i < q_len
        m = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
        l = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_DC), dtype=tl.float32)
        for sp in range(0, N_SPLITS):
            base = (bk.to(tl.int64) * N_SPLITS + sp) * ROWS_PAD + r
            m_s = tl.load(ws_ptr + base, mask=row_ok, other=float("-inf"))
            l_s = tl.load(ws_ptr + WS_ROWS + base, mask=row_ok, other=0.0)
            acc_s = tl.load(ws_ptr + 2 * WS_ROWS + base[:, None] * BLOCK_D + offs_d[None, :], mask=row_ok[:, None],
                            other=0.0)
            m, l, acc = merge_states(m, l, acc, m_s, l_s, acc_s)
        out, lse = finish(m, l, acc)
        if EVEN_D:
            o_mask = row_ok[:, None]
        else:
            o_mask = row_ok[:, None] & (offs_d[None, :] < D)
        tl.store(o_ptr + (q_start + i)[:, None] * stride_ot + h[:, None] * stride_oh + offs_d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=o_mask)
        if pid_d == 0:
            tl.store(lse_ptr + h * stride_lh + q_start + i, lse, mask=row_ok)

    @triton.jit
    def attn_bwd_delta_kernel(
        o_ptr, do_ptr, delta_ptr, q_start_ptr, q_len_ptr,
        stride_ot, stride_oh, stride_dot, stride_doh, stride_dh,
        H, D, LQ, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, DENSE: tl.constexpr,
    ):
        """delta = rowsum(dO * O) in fp32, tiles aligned to each sequence's first query
        (DENSE: ``seq_bounds``' padded batch of LQ queries per sequence)."""
        pid_m = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // H
        h = bh % H
        q_start, q_len = query_bounds(b, q_start_ptr, q_len_ptr, LQ, DENSE)
        if pid_m * BLOCK_M >= q_len:
            return
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        o = load_rows(o_ptr + q_start * stride_ot + h * stride_oh, offs_m, stride_ot, offs_d, q_len, D, EVEN_D, True)
        do = load_rows(do_ptr + q_start * stride_dot + h * stride_doh, offs_m, stride_dot, offs_d, q_len, D, EVEN_D,
                       True)
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
        tl.store(delta_ptr + h * stride_dh + q_start + offs_m, delta, mask=offs_m < q_len)

    @triton.jit
    def dkdv_step(q_base, do_base, l_base, d_base, stride_qt, stride_dot, m0, offs_n, offs_d, q_len, k_len, shift, D,
                  k, v, dk, dv, qk_scale, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, IEEE: tl.constexpr,
                  EVEN_D: tl.constexpr, MASK: tl.constexpr, q_desc, do_desc, q_row, q_col, do_row, do_col,
                  TMA: tl.constexpr):
        """One query block's share of a key block's dK, dV (fp32 accumulators). TMA: q and
        dO come through their descriptors (a whole block inside the sequence).

        Scores are taken query-major (q @ k^T, k and v as the dots' shared-memory B
        operands) and p, ds are transposed for the dV, dK dots: holding k and v as
        key-major A operands in registers spilled (H100, D = 128: bwd 271 -> 309 TFLOP/s).
        """
        offs_m = m0 + tl.arange(0, BLOCK_M)
        m_ok = offs_m < q_len
        if TMA:
            q = q_desc.load([q_row + m0, q_col])
            do = do_desc.load([do_row + m0, do_col])
        else:
            q = load_rows(q_base, offs_m, stride_qt, offs_d, q_len, D, EVEN_D, True)
            do = load_rows(do_base, offs_m, stride_dot, offs_d, q_len, D, EVEN_D, True)
        lse = tl.load(l_base + offs_m, mask=m_ok, other=float("inf"))
        lse = tl.where(lse == float("-inf"), float("inf"), lse)
        delta = tl.load(d_base + offs_m, mask=m_ok, other=0.0)
        s = _dot(q, tl.trans(k), tl.zeros((BLOCK_M, k.shape[0]), dtype=tl.float32), IEEE)
        p = tl.math.exp2(s * qk_scale - lse[:, None])
        if MASK:
            valid = m_ok[:, None] & (offs_n < k_len)[None, :]
            if CAUSAL:
                valid = valid & (offs_n[None, :] <= (shift + offs_m)[:, None])
            p = tl.where(valid, p, 0.0)
        dv = _dot(tl.trans(p.to(do.dtype)), do, dv, IEEE)
        dp = _dot(do, tl.trans(v), tl.zeros((BLOCK_M, k.shape[0]), dtype=tl.float32), IEEE)
        ds = p * (dp - delta[:, None])
        dk = _dot(tl.trans(ds.to(q.dtype)), q, dk, IEEE)
        return dk, dv

    @triton.jit
    def attn_bwd_dkdv_kernel(
        q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
        q_desc, do_desc, Q_HEAD_ROWS, Q_HEAD_COLS, DO_HEAD_ROWS, DO_HEAD_COLS,
        q_start_ptr, q_len_ptr, k_start_ptr, k_len_ptr,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
        stride_dot, stride_doh, stride_lh, stride_dkt, stride_dkh, stride_dvt, stride_dvh,
        HKV, G, D, qk_scale, sm_scale, LQ, K_ADD, KV_ROWS,
        CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        IEEE: tl.constexpr, EVEN_D: tl.constexpr, TMA: tl.constexpr, DENSE: tl.constexpr,
    ):
        """dK, dV of one key block: query heads of the GQA group in order, query blocks
        (aligned to the sequence's first query) ascending, fp32 accumulators, no atomics.
        TMA: the unmasked query blocks that lie wholly inside the sequence read q and dO
        through q_desc/do_desc (``tma_row`` with the query heads' offsets). DENSE: the
        sequence bounds of a padded batch (``seq_bounds``, k_len = K_ADD)."""
        pid_n = tl.program_id(0)
        bk = tl.program_id(1)
        b = bk // HKV
        kvh = bk % HKV
        q_start, q_len, k_start, k_len = seq_bounds(b, q_start_ptr, q_len_ptr, k_start_ptr, k_len_ptr, LQ, K_ADD,
                                                    KV_ROWS, DENSE, False)
        if pid_n * BLOCK_N >= k_len:
            return
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        k = load_rows(key_base(k_ptr, k_start, kvh, stride_kt, stride_kh), offs_n, stride_kt, offs_d, k_len, D, EVEN_D,
                      True)
        v = load_rows(key_base(v_ptr, k_start, kvh, stride_vt, stride_vh), offs_n, stride_vt, offs_d, k_len, D, EVEN_D,
                      True)
        dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
        dv = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
        shift = k_len - q_len
        if CAUSAL:
            m_lo = tl.maximum(pid_n * BLOCK_N - shift, 0) // BLOCK_M * BLOCK_M
            # From m_full on, every query row of a block sees every key of this block.
            m_full = tl.maximum(pid_n * BLOCK_N + BLOCK_N - 1 - shift, 0)
            m_full = tl.minimum((m_full + BLOCK_M - 1) // BLOCK_M * BLOCK_M, q_len)
            m_full = tl.maximum(m_full, m_lo)
        else:
            m_lo = 0
            m_full = 0
        # Unmasked blocks below m_tma lie wholly inside the sequence (descriptor loads where TMA).
        m_tma = m_full
        if TMA:
            m_tma = tl.maximum(q_len // BLOCK_M * BLOCK_M, m_full)
        for g in range(0, G):
            h = kvh * G + g
            q_base = q_ptr + q_start * stride_qt + h * stride_qh
            do_base = do_ptr + q_start * stride_dot + h * stride_doh
            l_base = lse_ptr + h * stride_lh + q_start
            d_base = delta_ptr + h * stride_lh + q_start
            # Masked query blocks (causal diagonal), then the fully visible ones without the
            # select (where(True, x, 0) is x; rows past q_len load q = do = 0, lse = +inf: p = 0).
            for m0 in range(m_lo, m_full, BLOCK_M):
                dk, dv = dkdv_step(q_base, do_base, l_base, d_base, stride_qt, stride_dot, m0, offs_n, offs_d, q_len,
                                   k_len, shift, D, k, v, dk, dv, qk_scale, CAUSAL, BLOCK_M, IEEE, EVEN_D, True, None,
                                   None, 0, 0, 0, 0, False)
            if TMA:
                q_row = tma_row(q_start, h, Q_HEAD_ROWS)
                do_row = tma_row(q_start, h, DO_HEAD_ROWS)
                for m0 in range(m_full, m_tma, BLOCK_M):
                    dk, dv = dkdv_step(q_base, do_base, l_base, d_base, stride_qt, stride_dot, m0, offs_n, offs_d,
                                       q_len, k_len, shift, D, k, v, dk, dv, qk_scale, CAUSAL, BLOCK_M, IEEE, EVEN_D,
                                       False, q_desc, do_desc, q_row, h * Q_HEAD_COLS, do_row, h * DO_HEAD_COLS, True)
            for m0 in range(m_tma, q_len, BLOCK_M):
                dk, dv = dkdv_step(q_base, do_base, l_base, d_base, stride_qt, stride_dot, m0, offs_n, offs_d, q_len,
                                   k_len, shift, D, k, v, dk, dv, qk_scale, CAUSAL, BLOCK_M, IEEE, EVEN_D, False, None,
                                   None, 0, 0, 0, 0, False)
        dk = dk * sm_scale
        store_rows(key_base(dk_ptr, k_start, kvh, stride_dkt, stride_dkh), offs_n, stride_dkt, offs_d, k_len, D,
                   dk.to(dk_ptr.dtype.element_ty), EVEN_D)
        store_rows(key_base(dv_ptr, k_start, kvh, stride_dvt, stride_dvh), offs_n, stride_dvt, offs_d, k_len, D,
                   dv.to(dv_ptr.dtype.element_ty), EVEN_D)

    @triton.jit
    def attn_bwd_dq_kernel(
        q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr,
        k_desc, v_desc, K_HEAD_ROWS, K_HEAD_COLS, V_HEAD_ROWS, V_HEAD_COLS,
        q_start_ptr, q_len_ptr, k_start_ptr, k_len_ptr,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
        stride_dot, stride_doh, stride_lh, stride_dqt, stride_dqh,
        H, G, D, qk_scale, sm_scale, LQ, K_ADD, KV_ROWS,
        CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        IEEE: tl.constexpr, EVEN_D: tl.constexpr, REVERSE_M: tl.constexpr, TMA: tl.constexpr,
        DENSE: tl.constexpr,
    ):
        """dQ of one query block: key blocks ascending from key 0, recomputing P; no atomics.
        Key blocks every row of the tile sees in full skip the select (same bits) and, where
        TMA, come through k_desc/v_desc. REVERSE_M starts the longest causal query blocks
        first (launch order only). DENSE as in the dK/dV kernel."""
        pid_m = tl.program_id(0)
        if REVERSE_M:
            pid_m = tl.num_programs(0) - 1 - pid_m
        bh = tl.program_id(1)
        b = bh // H
        h = bh % H
        q_start, q_len, k_start, k_len = seq_bounds(b, q_start_ptr, q_len_ptr, k_start_ptr, k_len_ptr, LQ, K_ADD,
                                                    KV_ROWS, DENSE, False)
        if pid_m * BLOCK_M >= q_len:
            return
        kvh = h // G
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        m_ok = offs_m < q_len
        q = load_rows(q_ptr + q_start * stride_qt + h * stride_qh, offs_m, stride_qt, offs_d, q_len, D, EVEN_D, True)
        do = load_rows(do_ptr + q_start * stride_dot + h * stride_doh, offs_m, stride_dot, offs_d, q_len, D, EVEN_D,
                       True)
        lse = tl.load(lse_ptr + h * stride_lh + q_start + offs_m, mask=m_ok, other=float("inf"))
        lse = tl.where(lse == float("-inf"), float("inf"), lse)
        delta = tl.load(delta_ptr + h * stride_lh + q_start + offs_m, mask=m_ok, other=0.0)
        pos = k_len - q_len + offs_m
        if CAUSAL:
            n_end = tl.minimum(k_len, k_len - q_len + tl.minimum((pid_m + 1) * BLOCK_M, q_len))
            n_full = tl.minimum(k_len, k_len - q_len + pid_m * BLOCK_M + 1)
        else:
            n_end = k_len
            n_full = k_len
        n_full = tl.maximum(n_full, 0) // BLOCK_N * BLOCK_N
        k_base = key_base(k_ptr, k_start, kvh, stride_kt, stride_kh)
        v_base = key_base(v_ptr, k_start, kvh, stride_vt, stride_vh)
        k_row = tma_row(k_start, kvh, K_HEAD_ROWS)
        v_row = tma_row(k_start, kvh, V_HEAD_ROWS)
        dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
        for n0 in range(0, n_full, BLOCK_N):
            if TMA:
                k = k_desc.load([k_row + n0, kvh * K_HEAD_COLS])
                v = v_desc.load([v_row + n0, kvh * V_HEAD_COLS])
            else:
                offs_n = n0 + tl.arange(0, BLOCK_N)
                k = load_rows(k_base, offs_n, stride_kt, offs_d, k_len, D, EVEN_D, False)
                v = load_rows(v_base, offs_n, stride_vt, offs_d, k_len, D, EVEN_D, False)
            s = _dot(q, tl.trans(k), tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), IEEE)
            p = tl.math.exp2(s * qk_scale - lse[:, None])
            dp = _dot(do, tl.trans(v), tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), IEEE)
            ds = p * (dp - delta[:, None])
            dq = _dot(ds.to(k.dtype), k, dq, IEEE)
        for n0 in range(n_full, n_end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_ok = offs_n < k_len
            k = load_rows(k_base, offs_n, stride_kt, offs_d, k_len, D, EVEN_D, True)
            v = load_rows(v_base, offs_n, stride_vt, offs_d, k_len, D, EVEN_D, True)
            s = _dot(q, tl.trans(k), tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), IEEE)
            valid = m_ok[:, None] & n_ok[None, :]
            if CAUSAL:
                valid = valid & (offs_n[None, :] <= pos[:, None])
            p = tl.where(valid, tl.math.exp2(s * qk_scale - lse[:, None]), 0.0)
            dp = _dot(do, tl.trans(v), tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), IEEE)
            ds = p * (dp - delta[:, None])
            dq = _dot(ds.to(k.dtype), k, dq, IEEE)
        dq = dq * sm_scale
        store_rows(dq_ptr + q_start * stride_dqt + h * stride_dqh, offs_m, stride_dqt, offs_d, q_len, D,
                   dq.to(dq_ptr.dtype.element_ty), EVEN_D)
else:  # pragma: no cover - the torch backend still imports without Triton
    attn_fwd_kernel = attn_split_kernel = attn_combine_kernel = None
    attn_bwd_delta_kernel = attn_bwd_dkdv_kernel = attn_bwd_dq_kernel = None
