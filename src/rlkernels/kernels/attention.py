"""Triton kernels of the batch-invariant attention (host code: ``rlkernels.ops.attention``).

The chain every forward kernel computes for a query row (see docs/operators/attention.md):
keys in blocks of BLOCK_N aligned to key 0, ascending; blocks grouped in splits of
S_SPLIT keys aligned to key 0; each split's online-softmax state (m, l, acc) starts
from scratch and the splits' states are merged in ascending order by :func:`merge_states`
starting from the empty state. ``block_step`` and ``merge_states`` are the only places
where the state is updated, and both the full (prefill) kernel and the split (decode)
kernel + combine call them with the same expressions, so their rows agree bit for bit.

Exactness of the no-op steps (why a tile's extra rows/blocks cost no bits): a block
whose keys are all masked for a row leaves (m, l, acc) unchanged exactly (alpha =
exp2(0) = 1, p = exp2(-inf) = 0, fma(l, 1, 0) = l, acc + 0 = acc), and merging the
empty state (-inf, 0, 0) is exact too. Scores are in log2 units (qk_scale includes
log2(e)); the saved LSE is m + log2(l) in the same units.
"""
from __future__ import annotations

from ..ops._triton import tl, triton

if triton is not None:

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
    def block_step(q, k, v, valid, m, l, acc, qk_scale, ONES, IEEE: tl.constexpr):
        """One key block of the online softmax: q [BM, BD], k/v [BN, BD], valid [BM, BN].

        The row sum of p goes through the tensor cores (p @ ones, every column equal,
        taken by an exact max) so its order is the dot chain's, which does not depend
        on the tile shape, rather than a tree reduction whose order follows the layout.
        """
        s = _dot(q, tl.trans(k), tl.zeros((q.shape[0], k.shape[0]), dtype=tl.float32), IEEE)
        s = tl.where(valid, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m - m_safe)
        p = tl.math.exp2(s - m_safe[:, None]).to(v.dtype)
        rows = _dot(p, ONES, tl.zeros((q.shape[0], ONES.shape[1]), dtype=tl.float32), IEEE)
        l = tl.fma(l, alpha, tl.max(rows, 1))
        acc = _dot(p, v, acc * alpha[:, None], IEEE)
        return m_new, l, acc

    @triton.jit
    def finish(m, l, acc):
        """(out fp32, lse in log2 units); a row that saw no key gives 0 and -inf."""
        seen = l > 0
        out = acc / tl.where(seen, l, 1.0)[:, None]
        lse = tl.where(seen, m + tl.math.log2(tl.where(seen, l, 1.0)), float("-inf"))
        return out, lse

    @triton.jit
    def attn_fwd_kernel(
        q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr,
        q_start_ptr, q_len_ptr, k_start_ptr, k_len_ptr,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
        stride_ot, stride_oh, stride_lh,
        H, G, D, qk_scale,
        CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        S_SPLIT: tl.constexpr, IEEE: tl.constexpr,
    ):
        """Full forward: one program per (query tile of BLOCK_M rows, sequence, query head).

        Keeps the merged state and the current split's state in registers and merges
        at each split boundary, which is the split kernel + combine's chain exactly.
        """
        pid_m = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // H
        h = bh % H
        q_len = tl.load(q_len_ptr + b)
        if pid_m * BLOCK_M >= q_len:
            return
        q_start = tl.load(q_start_ptr + b).to(tl.int64)
        k_start = tl.load(k_start_ptr + b).to(tl.int64)
        k_len = tl.load(k_len_ptr + b)
        kvh = h // G
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        row_ok = offs_m < q_len
        q = tl.load(q_ptr + (q_start + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        pos = k_len - q_len + offs_m
        if CAUSAL:
            n_end = tl.minimum(k_len, k_len - q_len + tl.minimum((pid_m + 1) * BLOCK_M, q_len))
        else:
            n_end = k_len
        ONES = tl.full((BLOCK_N, 16), 1.0, dtype=q_ptr.dtype.element_ty)
        m = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
        l = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
        k_base = k_ptr + k_start * stride_kt + kvh * stride_kh
        v_base = v_ptr + k_start * stride_vt + kvh * stride_vh
        for s0 in range(0, n_end, S_SPLIT):
            m_s = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
            l_s = tl.zeros((BLOCK_M,), dtype=tl.float32)
            acc_s = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
            s_end = tl.minimum(s0 + S_SPLIT, n_end)
            for n0 in range(s0, s_end, BLOCK_N):
                offs_n = n0 + tl.arange(0, BLOCK_N)
                k_ok = offs_n < k_len
                kv_mask = k_ok[:, None] & d_ok[None, :]
                k = tl.load(k_base + offs_n.to(tl.int64)[:, None] * stride_kt + offs_d[None, :], mask=kv_mask, other=0.0)
                v = tl.load(v_base + offs_n.to(tl.int64)[:, None] * stride_vt + offs_d[None, :], mask=kv_mask, other=0.0)
                valid = k_ok[None, :] & row_ok[:, None]
                if CAUSAL:
                    valid = valid & (offs_n[None, :] <= pos[:, None])
                m_s, l_s, acc_s = block_step(q, k, v, valid, m_s, l_s, acc_s, qk_scale, ONES, IEEE)
            m, l, acc = merge_states(m, l, acc, m_s, l_s, acc_s)
        out, lse = finish(m, l, acc)
        tl.store(o_ptr + (q_start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
        tl.store(lse_ptr + h * stride_lh + q_start + offs_m, lse, mask=row_ok)

    @triton.jit
    def attn_split_kernel(
        q_ptr, k_ptr, v_ptr, pm_ptr, pl_ptr, pacc_ptr,
        q_start_ptr, q_len_ptr, k_start_ptr, k_len_ptr,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
        HKV, G, D, qk_scale, N_SPLITS, ROWS_PAD,
        CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        S_SPLIT: tl.constexpr, IEEE: tl.constexpr,
    ):
        """One split of S_SPLIT keys for a tile of (query, head of the GQA group) rows.

        Rows r = i * G + g pack a KV head's G query heads into the tile (decode: one
        query, G heads, padded to the minimum tile). Writes the split's (m, l, acc) to
        the workspace [B, HKV, N_SPLITS, ROWS_PAD, BLOCK_D]; a split with nothing to do
        writes the empty state, which the combine merges exactly as a no-op.
        """
        pid_m = tl.program_id(0)
        bk = tl.program_id(1)
        sp = tl.program_id(2)
        b = bk // HKV
        kvh = bk % HKV
        q_len = tl.load(q_len_ptr + b)
        if pid_m * BLOCK_M >= q_len * G:
            return
        q_start = tl.load(q_start_ptr + b).to(tl.int64)
        k_start = tl.load(k_start_ptr + b).to(tl.int64)
        k_len = tl.load(k_len_ptr + b)
        r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        i = r // G
        h = kvh * G + r % G
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        row_ok = i < q_len
        q = tl.load(q_ptr + (q_start + i)[:, None] * stride_qt + h[:, None] * stride_qh + offs_d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        pos = k_len - q_len + i
        if CAUSAL:
            last_i = tl.minimum((pid_m * BLOCK_M + BLOCK_M - 1) // G, q_len - 1)
            n_end = tl.minimum(k_len, k_len - q_len + last_i + 1)
        else:
            n_end = k_len
        ONES = tl.full((BLOCK_N, 16), 1.0, dtype=q_ptr.dtype.element_ty)
        m_s = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
        l_s = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc_s = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
        k_base = k_ptr + k_start * stride_kt + kvh * stride_kh
        v_base = v_ptr + k_start * stride_vt + kvh * stride_vh
        s0 = sp * S_SPLIT
        s_end = tl.minimum(s0 + S_SPLIT, n_end)
        for n0 in range(s0, s_end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            k_ok = offs_n < k_len
            kv_mask = k_ok[:, None] & d_ok[None, :]
            k = tl.load(k_base + offs_n.to(tl.int64)[:, None] * stride_kt + offs_d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(v_base + offs_n.to(tl.int64)[:, None] * stride_vt + offs_d[None, :], mask=kv_mask, other=0.0)
            valid = k_ok[None, :] & row_ok[:, None]
            if CAUSAL:
                valid = valid & (offs_n[None, :] <= pos[:, None])
            m_s, l_s, acc_s = block_step(q, k, v, valid, m_s, l_s, acc_s, qk_scale, ONES, IEEE)
        base = (bk.to(tl.int64) * N_SPLITS + sp) * ROWS_PAD + r
        tl.store(pm_ptr + base, m_s)
        tl.store(pl_ptr + base, l_s)
        tl.store(pacc_ptr + base[:, None] * BLOCK_D + offs_d[None, :], acc_s)

    @triton.jit
    def attn_combine_kernel(
        pm_ptr, pl_ptr, pacc_ptr, o_ptr, lse_ptr, q_start_ptr, q_len_ptr,
        stride_ot, stride_oh, stride_lh,
        HKV, G, D, N_SPLITS, ROWS_PAD,
        BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        """Merges a tile's split states in ascending split order from the empty state."""
        pid_m = tl.program_id(0)
        bk = tl.program_id(1)
        b = bk // HKV
        kvh = bk % HKV
        q_len = tl.load(q_len_ptr + b)
        if pid_m * BLOCK_M >= q_len * G:
            return
        q_start = tl.load(q_start_ptr + b).to(tl.int64)
        r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        i = r // G
        h = kvh * G + r % G
        offs_d = tl.arange(0, BLOCK_D)
        row_ok = i < q_len
        m = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
        l = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
        for sp in range(0, N_SPLITS):
            base = (bk.to(tl.int64) * N_SPLITS + sp) * ROWS_PAD + r
            m_s = tl.load(pm_ptr + base)
            l_s = tl.load(pl_ptr + base)
            acc_s = tl.load(pacc_ptr + base[:, None] * BLOCK_D + offs_d[None, :])
            m, l, acc = merge_states(m, l, acc, m_s, l_s, acc_s)
        out, lse = finish(m, l, acc)
        tl.store(o_ptr + (q_start + i)[:, None] * stride_ot + h[:, None] * stride_oh + offs_d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_d[None, :] < D))
        tl.store(lse_ptr + h * stride_lh + q_start + i, lse, mask=row_ok)

    @triton.jit
    def attn_bwd_delta_kernel(
        o_ptr, do_ptr, delta_ptr, q_start_ptr, q_len_ptr,
        stride_ot, stride_oh, stride_dot, stride_doh, stride_dh,
        H, D, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        """delta = rowsum(dO * O) in fp32, tiles aligned to each sequence's first query."""
        pid_m = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // H
        h = bh % H
        q_len = tl.load(q_len_ptr + b)
        if pid_m * BLOCK_M >= q_len:
            return
        q_start = tl.load(q_start_ptr + b).to(tl.int64)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        mask = (offs_m < q_len)[:, None] & (offs_d < D)[None, :]
        rows = (q_start + offs_m)[:, None]
        o = tl.load(o_ptr + rows * stride_ot + h * stride_oh + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
        do = tl.load(do_ptr + rows * stride_dot + h * stride_doh + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(delta_ptr + h * stride_dh + q_start + offs_m, tl.sum(o * do, 1), mask=offs_m < q_len)

    @triton.jit
    def attn_bwd_dkdv_kernel(
        q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
        q_start_ptr, q_len_ptr, k_start_ptr, k_len_ptr,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
        stride_dot, stride_doh, stride_lh, stride_dkt, stride_dkh, stride_dvt, stride_dvh,
        HKV, G, D, qk_scale, sm_scale,
        CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        """dK, dV of one key block: query heads of the GQA group in order, query blocks
        (aligned to the sequence's first query) ascending, fp32 accumulators, no atomics."""
        pid_n = tl.program_id(0)
        bk = tl.program_id(1)
        b = bk // HKV
        kvh = bk % HKV
        k_len = tl.load(k_len_ptr + b)
        if pid_n * BLOCK_N >= k_len:
            return
        q_len = tl.load(q_len_ptr + b)
        q_start = tl.load(q_start_ptr + b).to(tl.int64)
        k_start = tl.load(k_start_ptr + b).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        n_ok = offs_n < k_len
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + (k_start + offs_n)[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + (k_start + offs_n)[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
        dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
        dv = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
        shift = k_len - q_len
        if CAUSAL:
            m_lo = tl.maximum(pid_n * BLOCK_N - shift, 0) // BLOCK_M * BLOCK_M
        else:
            m_lo = 0
        for g in range(0, G):
            h = kvh * G + g
            for m0 in range(m_lo, q_len, BLOCK_M):
                offs_m = m0 + tl.arange(0, BLOCK_M)
                m_ok = offs_m < q_len
                rows = (q_start + offs_m)[:, None]
                qm = m_ok[:, None] & d_ok[None, :]
                q = tl.load(q_ptr + rows * stride_qt + h * stride_qh + offs_d[None, :], mask=qm, other=0.0)
                do = tl.load(do_ptr + rows * stride_dot + h * stride_doh + offs_d[None, :], mask=qm, other=0.0)
                lse = tl.load(lse_ptr + h * stride_lh + q_start + offs_m, mask=m_ok, other=float("inf"))
                lse = tl.where(lse == float("-inf"), float("inf"), lse)
                delta = tl.load(delta_ptr + h * stride_lh + q_start + offs_m, mask=m_ok, other=0.0)
                sT = _dot(k, tl.trans(q), tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32), IEEE)
                valid = n_ok[:, None] & m_ok[None, :]
                if CAUSAL:
                    valid = valid & (offs_n[:, None] <= (shift + offs_m)[None, :])
                pT = tl.where(valid, tl.math.exp2(sT * qk_scale - lse[None, :]), 0.0)
                dv = _dot(pT.to(do.dtype), do, dv, IEEE)
                dpT = _dot(v, tl.trans(do), tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32), IEEE)
                dsT = pT * (dpT - delta[None, :])
                dk = _dot(dsT.to(q.dtype), q, dk, IEEE)
        dk = dk * sm_scale
        tl.store(dk_ptr + (k_start + offs_n)[:, None] * stride_dkt + kvh * stride_dkh + offs_d[None, :],
                 dk.to(dk_ptr.dtype.element_ty), mask=kv_mask)
        tl.store(dv_ptr + (k_start + offs_n)[:, None] * stride_dvt + kvh * stride_dvh + offs_d[None, :],
                 dv.to(dv_ptr.dtype.element_ty), mask=kv_mask)

    @triton.jit
    def attn_bwd_dq_kernel(
        q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr,
        q_start_ptr, q_len_ptr, k_start_ptr, k_len_ptr,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
        stride_dot, stride_doh, stride_lh, stride_dqt, stride_dqh,
        H, G, D, qk_scale, sm_scale,
        CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        """dQ of one query block: key blocks ascending from key 0, recomputing P; no atomics."""
        pid_m = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // H
        h = bh % H
        q_len = tl.load(q_len_ptr + b)
        if pid_m * BLOCK_M >= q_len:
            return
        q_start = tl.load(q_start_ptr + b).to(tl.int64)
        k_start = tl.load(k_start_ptr + b).to(tl.int64)
        k_len = tl.load(k_len_ptr + b)
        kvh = h // G
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        m_ok = offs_m < q_len
        rows = (q_start + offs_m)[:, None]
        qm = m_ok[:, None] & d_ok[None, :]
        q = tl.load(q_ptr + rows * stride_qt + h * stride_qh + offs_d[None, :], mask=qm, other=0.0)
        do = tl.load(do_ptr + rows * stride_dot + h * stride_doh + offs_d[None, :], mask=qm, other=0.0)
        lse = tl.load(lse_ptr + h * stride_lh + q_start + offs_m, mask=m_ok, other=float("inf"))
        lse = tl.where(lse == float("-inf"), float("inf"), lse)
        delta = tl.load(delta_ptr + h * stride_lh + q_start + offs_m, mask=m_ok, other=0.0)
        pos = k_len - q_len + offs_m
        if CAUSAL:
            n_end = tl.minimum(k_len, k_len - q_len + tl.minimum((pid_m + 1) * BLOCK_M, q_len))
        else:
            n_end = k_len
        dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
        for n0 in range(0, n_end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_ok = offs_n < k_len
            kv_mask = n_ok[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + (k_start + offs_n)[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(v_ptr + (k_start + offs_n)[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
            s = _dot(q, tl.trans(k), tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), IEEE)
            valid = m_ok[:, None] & n_ok[None, :]
            if CAUSAL:
                valid = valid & (offs_n[None, :] <= pos[:, None])
            p = tl.where(valid, tl.math.exp2(s * qk_scale - lse[:, None]), 0.0)
            dp = _dot(do, tl.trans(v), tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), IEEE)
            ds = p * (dp - delta[:, None])
            dq = _dot(ds.to(k.dtype), k, dq, IEEE)
        dq = dq * sm_scale
        tl.store(dq_ptr + rows * stride_dqt + h * stride_dqh + offs_d[None, :], dq.to(dq_ptr.dtype.element_ty), mask=qm)
