"""The backward kernels: delta = rowsum(dO * O), then dK/dV per key block and dQ per query
block, each recomputing P from the saved LSE; no atomics (host code:
``rlkernels.ops.attention.triton_host``)."""
from __future__ import annotations

from .._triton import tl, triton

if triton is not None:
    from .prologue import (key_base, key_range, load_head_rows, load_pair, load_rows, program_tile,
                           query_base, query_bounds, query_rows, store_rows, tile_bounds, tile_offsets, tma_row,
                           window_range)
    from ..cuda_math import tanhf
    from .softmax import dot

    @triton.jit
    def attn_bwd_delta_kernel(
        o_ptr, do_ptr, delta_ptr, q_start_ptr, q_len_ptr,
        stride_ot, stride_oh, stride_dot, stride_doh, stride_dh,
        H, D, LQ, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, DENSE: tl.constexpr,
    ):
        """delta = rowsum(dO * O) in fp32, tiles aligned to each sequence's first query
        (DENSE: ``seq_bounds``' padded batch of LQ queries per sequence)."""
        pid_m, bh, z, b, h = program_tile(H, False)
        q_start, q_len = query_bounds(b, q_start_ptr, q_len_ptr, LQ, DENSE)
        if pid_m * BLOCK_M >= q_len:
            return
        offs_m, offs_d = tile_offsets(pid_m, BLOCK_M, BLOCK_D)
        o, do = load_head_rows(o_ptr, do_ptr, q_start, h, stride_ot, stride_oh, stride_dot, stride_doh, offs_m, offs_d,
                               q_len, D, EVEN_D, False)
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
        tl.store(delta_ptr + h * stride_dh + q_start + offs_m, delta, mask=offs_m < q_len)

    @triton.jit
    def probs(s, lse, qk_scale, softcap, SOFTCAP: tl.constexpr):
        """(p, slope) of raw scores s [BM, BN] from the saved LSE (log2 units): p = exp2(s' -
        lse) with s' the forward's scaled (SOFTCAP: capped) score, and slope = 1 - tanh^2,
        the cap's derivative up to the scale (unused without SOFTCAP)."""
        if SOFTCAP:
            t = tanhf(s * qk_scale)
            return tl.math.exp2(t * softcap - lse[:, None]), 1.0 - t * t
        else:
            return tl.math.exp2(s * qk_scale - lse[:, None]), s

    @triton.jit
    def score_grad(p, dp, delta, slope, SOFTCAP: tl.constexpr):
        """dL/ds up to the scale: p * (dp - delta), times the cap's slope under SOFTCAP."""
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * slope
        return ds

    @triton.jit
    def dkdv_step(q_base, do_base, l_base, d_base, stride_qt, stride_dot, m0, offs_n, offs_d, q_len, k_len, shift, D,
                  k, v, dk, dv, qk_scale, softcap, WINDOW, CAUSAL: tl.constexpr, SLIDING: tl.constexpr,
                  BLOCK_M: tl.constexpr, IEEE: tl.constexpr, EVEN_D: tl.constexpr, MASK: tl.constexpr, q_desc, do_desc,
                  q_row, q_col, do_row, do_col, TMA: tl.constexpr, SOFTCAP: tl.constexpr):
        """One query block's share of a key block's dK, dV (fp32 accumulators). TMA: q and
        dO come through their descriptors (a whole block inside the sequence). SLIDING:
        the mask also hides keys more than WINDOW positions before a query.

        Scores are taken query-major (q @ k^T, k and v as the dots' shared-memory B
        operands) and p, ds are transposed for the dV, dK dots: holding k and v as
        key-major A operands in registers spilled (H100, D = 128: bwd 271 -> 309 TFLOP/s).
        """
        offs_m = m0 + tl.arange(0, BLOCK_M)
        m_ok = offs_m < q_len
        q, do = load_pair(q_desc, do_desc, q_row, q_col, do_row, do_col, q_base, do_base, stride_qt, stride_dot, m0,
                          offs_m, offs_d, q_len, D, EVEN_D, True, TMA)
        lse = tl.load(l_base + offs_m, mask=m_ok, other=float("inf"))
        lse = tl.where(lse == float("-inf"), float("inf"), lse)
        delta = tl.load(d_base + offs_m, mask=m_ok, other=0.0)
        s = dot(q, tl.trans(k), tl.zeros((BLOCK_M, k.shape[0]), dtype=tl.float32), IEEE)
        p, slope = probs(s, lse, qk_scale, softcap, SOFTCAP)
        if MASK:
            valid = m_ok[:, None] & (offs_n < k_len)[None, :]
            if CAUSAL:
                valid = valid & (offs_n[None, :] <= (shift + offs_m)[:, None])
            if SLIDING:
                valid = valid & (offs_n[None, :] >= (shift + offs_m - WINDOW)[:, None])
            p = tl.where(valid, p, 0.0)
        dv = dot(tl.trans(p.to(do.dtype)), do, dv, IEEE)
        dp = dot(do, tl.trans(v), tl.zeros((BLOCK_M, k.shape[0]), dtype=tl.float32), IEEE)
        ds = score_grad(p, dp, delta, slope, SOFTCAP)
        dk = dot(tl.trans(ds.to(q.dtype)), q, dk, IEEE)
        return dk, dv

    @triton.jit
    def attn_bwd_dkdv_kernel(
        q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
        q_desc, do_desc, Q_HEAD_ROWS, Q_HEAD_COLS, DO_HEAD_ROWS, DO_HEAD_COLS,
        q_start_ptr, q_len_ptr, k_start_ptr, k_len_ptr,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
        stride_dot, stride_doh, stride_lh, stride_dkt, stride_dkh, stride_dvt, stride_dvh,
        HKV, G, D, qk_scale, softcap, sm_scale, LQ, K_ADD, KV_ROWS, WINDOW,
        CAUSAL: tl.constexpr, SLIDING: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr, IEEE: tl.constexpr, EVEN_D: tl.constexpr, TMA: tl.constexpr, DENSE: tl.constexpr,
        SOFTCAP: tl.constexpr,
    ):
        """dK, dV of one key block: query heads of the GQA group in order, query blocks
        (aligned to the sequence's first query) ascending, fp32 accumulators, no atomics.
        TMA: the unmasked query blocks that lie wholly inside the sequence read q and dO
        through q_desc/do_desc (``tma_row`` with the query heads' offsets). DENSE: the
        sequence bounds of a padded batch (``seq_bounds``, k_len = K_ADD). SLIDING: queries
        see keys no more than WINDOW positions back; the query blocks that see none of this
        key block are left out (their terms are exact zeros), the ones that see part of it
        take the mask."""
        pid_n, bk, z, kvh, q_start, q_len, k_start, k_len = tile_bounds(
            HKV, q_start_ptr, q_len_ptr, k_start_ptr, k_len_ptr, LQ, K_ADD, KV_ROWS, False, DENSE, False)
        if pid_n * BLOCK_N >= k_len:
            return
        offs_n, offs_d = tile_offsets(pid_n, BLOCK_N, BLOCK_D)
        k, v = load_head_rows(k_ptr, v_ptr, k_start, kvh, stride_kt, stride_kh, stride_vt, stride_vh, offs_n, offs_d,
                              k_len, D, EVEN_D, True)
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
        # Unmasked blocks end at m_mid; past it, up to m_stop, the window hides part of the block.
        m_mid = q_len
        m_stop = q_len
        if SLIDING:
            m_mid = tl.minimum(tl.maximum(tl.maximum(pid_n * BLOCK_N + WINDOW - shift + 1, 0) // BLOCK_M * BLOCK_M,
                                          m_full), q_len)
            m_stop = tl.minimum(q_len, pid_n * BLOCK_N + BLOCK_N + WINDOW - shift)
        # Unmasked blocks below m_tma lie wholly inside the sequence (descriptor loads where TMA).
        m_tma = m_full
        if TMA:
            m_tma = tl.minimum(tl.maximum(q_len // BLOCK_M * BLOCK_M, m_full), m_mid)
        for g in range(0, G):
            h = kvh * G + g
            q_base = query_base(q_ptr, q_start, h, stride_qt, stride_qh)
            do_base = query_base(do_ptr, q_start, h, stride_dot, stride_doh)
            l_base = lse_ptr + h * stride_lh + q_start
            d_base = delta_ptr + h * stride_lh + q_start
            # Masked query blocks (causal diagonal), then the fully visible ones without the
            # select (where(True, x, 0) is x; rows past q_len load q = do = 0, lse = +inf: p = 0).
            for m0 in range(m_lo, m_full, BLOCK_M):
                dk, dv = dkdv_step(q_base, do_base, l_base, d_base, stride_qt, stride_dot, m0, offs_n, offs_d, q_len,
                                   k_len, shift, D, k, v, dk, dv, qk_scale, softcap, WINDOW, CAUSAL, SLIDING, BLOCK_M,
                                   IEEE, EVEN_D, True, None, None, 0, 0, 0, 0, False, SOFTCAP)
            if TMA:
                q_row = tma_row(q_start, h, Q_HEAD_ROWS)
                do_row = tma_row(q_start, h, DO_HEAD_ROWS)
                for m0 in range(m_full, m_tma, BLOCK_M):
                    dk, dv = dkdv_step(q_base, do_base, l_base, d_base, stride_qt, stride_dot, m0, offs_n, offs_d,
                                       q_len, k_len, shift, D, k, v, dk, dv, qk_scale, softcap, WINDOW, CAUSAL, SLIDING,
                                       BLOCK_M, IEEE, EVEN_D, False, q_desc, do_desc, q_row, h * Q_HEAD_COLS, do_row,
                                       h * DO_HEAD_COLS, True, SOFTCAP)
            for m0 in range(m_tma, m_mid, BLOCK_M):
                dk, dv = dkdv_step(q_base, do_base, l_base, d_base, stride_qt, stride_dot, m0, offs_n, offs_d, q_len,
                                   k_len, shift, D, k, v, dk, dv, qk_scale, softcap, WINDOW, CAUSAL, SLIDING, BLOCK_M,
                                   IEEE, EVEN_D, False, None, None, 0, 0, 0, 0, False, SOFTCAP)
            if SLIDING:
                for m0 in range(m_mid, m_stop, BLOCK_M):
                    dk, dv = dkdv_step(q_base, do_base, l_base, d_base, stride_qt, stride_dot, m0, offs_n, offs_d,
                                       q_len, k_len, shift, D, k, v, dk, dv, qk_scale, softcap, WINDOW, CAUSAL, SLIDING,
                                       BLOCK_M, IEEE, EVEN_D, True, None, None, 0, 0, 0, 0, False, SOFTCAP)
        dk = dk * sm_scale
        store_rows(key_base(dk_ptr, k_start, kvh, stride_dkt, stride_dkh), offs_n, stride_dkt, offs_d, k_len, D,
                   dk.to(dk_ptr.dtype.element_ty), EVEN_D)
        store_rows(key_base(dv_ptr, k_start, kvh, stride_dvt, stride_dvh), offs_n, stride_dvt, offs_d, k_len, D,
                   dv.to(dv_ptr.dtype.element_ty), EVEN_D)

    @triton.jit
    def dq_step(q, do, lse, delta, k_base, v_base, stride_kt, stride_vt, offs_d, m_ok, pos, n0, k_len, D, qk_scale,
                softcap, dq, WINDOW, CAUSAL: tl.constexpr, SLIDING: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, IEEE: tl.constexpr, EVEN_D: tl.constexpr, SOFTCAP: tl.constexpr):
        """dQ's share of keys n0 .. n0 + BLOCK_N - 1 through masked loads: the keys of the
        sequence at or before each row's position (CAUSAL) and no more than WINDOW
        positions back (SLIDING)."""
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < k_len
        k = load_rows(k_base, offs_n, stride_kt, offs_d, k_len, D, EVEN_D, True)
        v = load_rows(v_base, offs_n, stride_vt, offs_d, k_len, D, EVEN_D, True)
        s = dot(q, tl.trans(k), tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), IEEE)
        valid = m_ok[:, None] & n_ok[None, :]
        if CAUSAL:
            valid = valid & (offs_n[None, :] <= pos[:, None])
        if SLIDING:
            valid = valid & (offs_n[None, :] >= (pos - WINDOW)[:, None])
        p, slope = probs(s, lse, qk_scale, softcap, SOFTCAP)
        p = tl.where(valid, p, 0.0)
        dp = dot(do, tl.trans(v), tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), IEEE)
        ds = score_grad(p, dp, delta, slope, SOFTCAP)
        return dot(ds.to(k.dtype), k, dq, IEEE)

    @triton.jit
    def attn_bwd_dq_kernel(
        q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr,
        k_desc, v_desc, K_HEAD_ROWS, K_HEAD_COLS, V_HEAD_ROWS, V_HEAD_COLS,
        q_start_ptr, q_len_ptr, k_start_ptr, k_len_ptr,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
        stride_dot, stride_doh, stride_lh, stride_dqt, stride_dqh,
        H, G, D, qk_scale, softcap, sm_scale, LQ, K_ADD, KV_ROWS, WINDOW,
        CAUSAL: tl.constexpr, SLIDING: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr, IEEE: tl.constexpr, EVEN_D: tl.constexpr, REVERSE_M: tl.constexpr, TMA: tl.constexpr,
        DENSE: tl.constexpr, SOFTCAP: tl.constexpr,
    ):
        """dQ of one query block: key blocks ascending from key 0, recomputing P; no atomics.
        Key blocks every row of the tile sees in full skip the select (same bits) and, where
        TMA, come through k_desc/v_desc. REVERSE_M starts the longest causal query blocks
        first (launch order only). DENSE as in the dK/dV kernel. SLIDING: rows see keys no
        more than WINDOW positions back (``window_range``: the blocks no row sees are left
        out, the ones some row sees in part take the mask)."""
        pid_m, bh, z, h, q_start, q_len, k_start, k_len = tile_bounds(H, q_start_ptr, q_len_ptr, k_start_ptr, k_len_ptr,
                                                                      LQ, K_ADD, KV_ROWS, REVERSE_M, DENSE, False)
        if pid_m * BLOCK_M >= q_len:
            return
        kvh, offs_m, offs_d, m_ok = query_rows(h, G, pid_m, q_len, BLOCK_M, BLOCK_D)
        q, do = load_head_rows(q_ptr, do_ptr, q_start, h, stride_qt, stride_qh, stride_dot, stride_doh, offs_m, offs_d,
                               q_len, D, EVEN_D, False)
        lse = tl.load(lse_ptr + h * stride_lh + q_start + offs_m, mask=m_ok, other=float("inf"))
        lse = tl.where(lse == float("-inf"), float("inf"), lse)
        delta = tl.load(delta_ptr + h * stride_lh + q_start + offs_m, mask=m_ok, other=0.0)
        pos = k_len - q_len + offs_m
        last = tl.minimum((pid_m + 1) * BLOCK_M, q_len)
        n_end, n_full = key_range(k_len, q_len, pid_m * BLOCK_M, last, BLOCK_N, CAUSAL)
        k_base = key_base(k_ptr, k_start, kvh, stride_kt, stride_kh)
        v_base = key_base(v_ptr, k_start, kvh, stride_vt, stride_vh)
        k_row = tma_row(k_start, kvh, K_HEAD_ROWS)
        v_row = tma_row(k_start, kvh, V_HEAD_ROWS)
        dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
        n_low = 0
        if SLIDING:
            n_lo, n_win = window_range(k_len - q_len + pid_m * BLOCK_M, k_len - q_len + last - 1, WINDOW, BLOCK_N)
            n_low = tl.minimum(tl.maximum(n_win, n_lo), n_end)
            for n0 in range(n_lo, n_low, BLOCK_N):
                dq = dq_step(q, do, lse, delta, k_base, v_base, stride_kt, stride_vt, offs_d, m_ok, pos, n0, k_len, D,
                             qk_scale, softcap, dq, WINDOW, CAUSAL, SLIDING, BLOCK_M, BLOCK_N, IEEE, EVEN_D, SOFTCAP)
        n_mid = tl.minimum(tl.maximum(n_full, n_low), n_end)
        for n0 in range(n_low, n_mid, BLOCK_N):
            if TMA:
                k = k_desc.load([k_row + n0, kvh * K_HEAD_COLS])
                v = v_desc.load([v_row + n0, kvh * V_HEAD_COLS])
            else:
                offs_n = n0 + tl.arange(0, BLOCK_N)
                k = load_rows(k_base, offs_n, stride_kt, offs_d, k_len, D, EVEN_D, False)
                v = load_rows(v_base, offs_n, stride_vt, offs_d, k_len, D, EVEN_D, False)
            s = dot(q, tl.trans(k), tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), IEEE)
            p, slope = probs(s, lse, qk_scale, softcap, SOFTCAP)
            dp = dot(do, tl.trans(v), tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), IEEE)
            ds = score_grad(p, dp, delta, slope, SOFTCAP)
            dq = dot(ds.to(k.dtype), k, dq, IEEE)
        for n0 in range(n_mid, n_end, BLOCK_N):
            dq = dq_step(q, do, lse, delta, k_base, v_base, stride_kt, stride_vt, offs_d, m_ok, pos, n0, k_len, D,
                         qk_scale, softcap, dq, WINDOW, CAUSAL, SLIDING, BLOCK_M, BLOCK_N, IEEE, EVEN_D, SOFTCAP)
        dq = dq * sm_scale
        store_rows(query_base(dq_ptr, q_start, h, stride_dqt, stride_dqh), offs_m, stride_dqt, offs_d, q_len, D,
                   dq.to(dq_ptr.dtype.element_ty), EVEN_D)
else:  # pragma: no cover - the torch backend still imports without Triton
    attn_bwd_delta_kernel = attn_bwd_dkdv_kernel = attn_bwd_dq_kernel = None
