"""An attention layer's inputs in one launch: the q and k heads' RMSNorm, their rotary
embedding, and the keys' and values' write into a static KV cache. Host side:
``rlkernels.ops.attention_inputs``.

``attention_inputs_kernel`` computes, per token and head, what the separate launches
compute, with their expressions: the RMSNorm of a head row is ``rms_norm_fwd_kernel``'s
(the sum of squares in ``pairwise_sum_1024``'s tree, ``rms_rstd``, ``rms_scale``, rounded
to the output's dtype), the rotary embedding of the normed row ``rotary_kernel``'s
(``rotate_pair``), and the cache write a copy to slot ``start + position``, as
``kv_write_kernel``'s. The launch runs with ``enable_fp_fusion`` off, as the rotary
kernel's: every product and sum is rounded alone. An element's bits depend on its own
token's q (or k) head, the norm's weight, and its position's cos and sin.
"""
from __future__ import annotations

from ._triton import tl, triton

if triton is not None:
    from .norms import pairwise_row_sums, rms_rstd, rms_scale
    from .rotary import rotate_pair, token_rotary

    @triton.jit
    def _normed(src, offs, mask, w_ptr, cols, rstd, dt: tl.constexpr, NORM: tl.constexpr):
        # The head rows' values at offs (fp32 of dt): as loaded, or normed and rounded to dt.
        x = tl.load(src + offs, mask=mask, other=0.0)
        if NORM:
            w = tl.load(w_ptr + cols)
            x = rms_scale(x, rstd[:, None], w[None, :], dt, False, True).to(dt)
        return x.to(tl.float32)

    @triton.jit
    def _heads(src, s_head, dst, d_head, h0, H, w_ptr, eps, c1, c2, s1, s2,
               NORM: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr):
        # Heads [h0, h0 + BLOCK_H) of one token (src, dst at its head 0): normed (NORM) and rotated.
        heads = h0 + tl.arange(0, BLOCK_H)
        h_ok = heads < H
        src_rows = src + heads[:, None].to(tl.int64) * s_head
        dt = dst.dtype.element_ty
        rstd = tl.zeros((BLOCK_H,), dtype=tl.float32)
        if NORM:
            # The whole row for the sum, its lanes the row's element indices (the RMSNorm
            # kernel's one tile).
            cols_d = tl.arange(0, BLOCK_D)
            x = tl.load(src_rows + cols_d[None, :], mask=h_ok[:, None] & (cols_d < D)[None, :],
                        other=0.0).to(tl.float32)
            rstd = rms_rstd(pairwise_row_sums(x * x, BLOCK_H, BLOCK_D), D, eps)
        cols = tl.arange(0, BLOCK_HALF)
        mask = h_ok[:, None] & (cols < HALF)[None, :]
        x1 = _normed(src_rows, cols[None, :], mask, w_ptr, cols, rstd, dt, NORM)
        x2 = _normed(src_rows, cols[None, :] + HALF, mask, w_ptr, cols + HALF, rstd, dt, NORM)
        out1, out2 = rotate_pair(x1, x2, c1, c2, s1, s2, dt)
        dst_rows = dst + heads[:, None].to(tl.int64) * d_head + cols[None, :]
        tl.store(dst_rows, out1, mask=mask)
        tl.store(dst_rows + HALF, out2, mask=mask)

    @triton.jit
    def attention_inputs_kernel(
        q_ptr, k_ptr, v_ptr, q_w_ptr, k_w_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr, v_out_ptr, start_ptr,
        L, HQ, HK, S, q_eps, k_eps,
        s_qb, s_ql, s_qh, s_kb, s_kl, s_kh, s_vb, s_vl, s_vh,
        o_qb, o_ql, o_qh, o_kb, o_kl, o_kh, o_vb, o_vl, o_vh,
        s_cb, s_cl, s_sb, s_sl,
        Q_NORM: tl.constexpr, K_NORM: tl.constexpr, CACHE: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
        BLOCK_D: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr,
    ):
        """q [B, L, HQ, D], k and v [B, L, HK, D] (strides s_*: batch, token, head; unit along
        D), cos/sin [B or 1, L, D] (a batch stride of 0 broadcasts). q_out gets q's heads,
        normed with q_w (Q_NORM) and rotated; k_out gets k's, normed with k_w (K_NORM) and
        rotated, at row ``start + l`` with CACHE (a cache of S rows; ``start`` one int64 on
        the device; rows outside [0, S) are not written) and v_out v's heads at the same
        rows, else at row l (v_out unused). Out strides o_*: batch, row, head.
        Grid: (B * L, cdiv(HQ, BLOCK_H) + cdiv(HK, BLOCK_H))."""
        block = tl.program_id(1)
        b, pos, c1, c2, s1, s2 = token_rotary(cos_ptr, sin_ptr, L, s_cb, s_cl, s_sb, s_sl, HALF, BLOCK_HALF)
        q_blocks = tl.cdiv(HQ, BLOCK_H)
        if block < q_blocks:
            _heads(q_ptr + b * s_qb + pos * s_ql, s_qh, q_out_ptr + b * o_qb + pos * o_ql, o_qh, block * BLOCK_H,
                   HQ, q_w_ptr, q_eps, c1, c2, s1, s2, Q_NORM, D, HALF, BLOCK_D, BLOCK_HALF, BLOCK_H)
        else:
            h0 = (block - q_blocks) * BLOCK_H
            row = pos
            n_heads = HK
            if CACHE:
                row = tl.load(start_ptr) + pos
                # A row outside the cache writes nothing: no head is in range.
                n_heads = tl.where((row >= 0) & (row < S), HK, 0)
            _heads(k_ptr + b * s_kb + pos * s_kl, s_kh, k_out_ptr + b * o_kb + row * o_kl, o_kh, h0,
                   n_heads, k_w_ptr, k_eps, c1, c2, s1, s2, K_NORM, D, HALF, BLOCK_D, BLOCK_HALF, BLOCK_H)
            if CACHE:
                heads = h0 + tl.arange(0, BLOCK_H)
                cols_d = tl.arange(0, BLOCK_D)
                mask = (heads < n_heads)[:, None] & (cols_d < D)[None, :]
                v = tl.load(v_ptr + b * s_vb + pos * s_vl + heads[:, None].to(tl.int64) * s_vh + cols_d[None, :],
                            mask=mask)
                tl.store(v_out_ptr + b * o_vb + row * o_vl + heads[:, None].to(tl.int64) * o_vh + cols_d[None, :], v,
                         mask=mask)
else:  # pragma: no cover - the torch backend still imports without Triton
    attention_inputs_kernel = None
