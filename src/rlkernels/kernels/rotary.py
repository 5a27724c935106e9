"""The rotary position embedding of queries and keys in one launch. Host side:
``rlkernels.ops.rotary``.

``rotary_kernel`` computes transformers' formula ``x * cos + rotate_half(x) * sin`` with
``rotate_half(x) = cat(-x2, x1)``, for the query and the key heads of every token, with
the rounding of the eager ops: each product is one fp32 multiply rounded to the tensors'
dtype (exact in fp32 for bf16 and fp16 operands, so rounded once, as ATen's mul), and the
sum one fp32 add of the two rounded products, rounded again. Negation is exact, so
``-x2 * s`` is ``-(x2 * s)``. The launch runs with ``enable_fp_fusion`` off: in fp32 the
multiply and the add must stay two roundings, never one FMA. An element's bits depend on
its own q (or k), cos and sin values alone.
"""
from __future__ import annotations

from ._triton import tl, triton

if triton is not None:

    @triton.jit
    def _rotate_heads(src, s_head, dst, d_head, h0, H, c1, c2, s1, s2, HALF: tl.constexpr,
                      BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr):
        # Heads [h0, h0 + BLOCK_H) of one token; src/dst point at the token's head 0.
        heads = h0 + tl.arange(0, BLOCK_H)
        cols = tl.arange(0, BLOCK_HALF)
        mask = (heads[:, None] < H) & (cols[None, :] < HALF)
        src_off = heads[:, None].to(tl.int64) * s_head + cols[None, :]
        dst_off = heads[:, None].to(tl.int64) * d_head + cols[None, :]
        dt = dst.dtype.element_ty
        x1 = tl.load(src + src_off, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + src_off + HALF, mask=mask, other=0.0).to(tl.float32)
        out1, out2 = rotate_pair(x1, x2, c1, c2, s1, s2, dt)
        tl.store(dst + dst_off, out1, mask=mask)
        tl.store(dst + dst_off + HALF, out2, mask=mask)

    @triton.jit
    def token_rotary(cos_ptr, sin_ptr, L, s_cb, s_cl, s_sb, s_sl, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
        """(b, pos, c1, c2, s1, s2) of the token of grid axis 0 (b * L + pos): its batch row and
        position (int64), and its cos and sin halves in fp32, each [1, BLOCK_HALF]."""
        token = tl.program_id(0)
        b = (token // L).to(tl.int64)
        pos = (token % L).to(tl.int64)
        c_row = cos_ptr + b * s_cb + pos * s_cl
        s_row = sin_ptr + b * s_sb + pos * s_sl
        cols = tl.arange(0, BLOCK_HALF)
        in_half = cols < HALF
        c1 = tl.load(c_row + cols, mask=in_half, other=0.0).to(tl.float32)[None, :]
        c2 = tl.load(c_row + HALF + cols, mask=in_half, other=0.0).to(tl.float32)[None, :]
        s1 = tl.load(s_row + cols, mask=in_half, other=0.0).to(tl.float32)[None, :]
        s2 = tl.load(s_row + HALF + cols, mask=in_half, other=0.0).to(tl.float32)[None, :]
        return b, pos, c1, c2, s1, s2

    @triton.jit
    def rotate_pair(x1, x2, c1, c2, s1, s2, dt: tl.constexpr):
        """(x1 c1 - x2 s1, x2 c2 + x1 s2) in dt, every product and the sum rounded to dt
        as the eager ops round them; x1, x2, c, s in fp32 (values of dt)."""
        out1 = (x1 * c1).to(dt).to(tl.float32) - (x2 * s1).to(dt).to(tl.float32)
        out2 = (x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)
        return out1.to(dt), out2.to(dt)

    @triton.jit
    def rotary_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr, L, HQ, HK,
                      s_qb, s_qh, s_ql, s_kb, s_kh, s_kl, o_qb, o_qh, o_ql, o_kb, o_kh, o_kl,
                      s_cb, s_cl, s_sb, s_sl,
                      HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr):
        """q [B, HQ, L, 2 HALF], k [B, HK, L, 2 HALF], cos/sin [B or 1, L, 2 HALF] (a batch
        stride of 0 broadcasts) -> q_out, k_out of q's and k's shapes; the last dimension
        of every tensor has unit stride. Grid: (B * L, cdiv(HQ, BLOCK_H) + cdiv(HK, BLOCK_H))."""
        block = tl.program_id(1)
        b, pos, c1, c2, s1, s2 = token_rotary(cos_ptr, sin_ptr, L, s_cb, s_cl, s_sb, s_sl, HALF, BLOCK_HALF)
        q_blocks = tl.cdiv(HQ, BLOCK_H)
        if block < q_blocks:
            _rotate_heads(q_ptr + b * s_qb + pos * s_ql, s_qh, q_out_ptr + b * o_qb + pos * o_ql, o_qh,
                          block * BLOCK_H, HQ, c1, c2, s1, s2, HALF, BLOCK_HALF, BLOCK_H)
        else:
            _rotate_heads(k_ptr + b * s_kb + pos * s_kl, s_kh, k_out_ptr + b * o_kb + pos * o_kl, o_kh,
                          (block - q_blocks) * BLOCK_H, HK, c1, c2, s1, s2, HALF, BLOCK_HALF, BLOCK_H)
