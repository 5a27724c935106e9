"""Appending a step's keys and values to a static KV cache in one launch. Host side:
``rlkernels.ops.kv_cache``.

``kv_write_kernel`` copies k_new and v_new [B, H, L, D] into slots ``start .. start + L - 1``
of k_cache and v_cache [B, H, S, D], ``start`` read from a device counter (so a captured
CUDA graph writes where the counter says when it replays). A copy: no arithmetic, so the
bits are the inputs'. Slots at or past S are not written (the caller sizes the cache).
"""
from __future__ import annotations

from ._triton import tl, triton

if triton is not None:

    @triton.jit
    def kv_write_kernel(k_new_ptr, v_new_ptr, k_cache_ptr, v_cache_ptr, start_ptr, H, L, S, D,
                        s_knb, s_knh, s_knl, s_vnb, s_vnh, s_vnl,
                        s_kcb, s_kch, s_kcs, s_vcb, s_vch, s_vcs,
                        BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr):
        """Grid: (B * H, cdiv(L, BLOCK_L)); the last dimension of every tensor has unit stride."""
        bh = tl.program_id(0)
        b = (bh // H).to(tl.int64)
        h = (bh % H).to(tl.int64)
        rows = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
        cols = tl.arange(0, BLOCK_D)
        start = tl.load(start_ptr)
        slots = start + rows
        keep = ((rows < L) & (slots >= 0) & (slots < S))[:, None] & (cols < D)[None, :]
        r64 = rows.to(tl.int64)[:, None]
        s64 = slots.to(tl.int64)[:, None]
        k = tl.load(k_new_ptr + b * s_knb + h * s_knh + r64 * s_knl + cols[None, :], mask=keep)
        tl.store(k_cache_ptr + b * s_kcb + h * s_kch + s64 * s_kcs + cols[None, :], k, mask=keep)
        v = tl.load(v_new_ptr + b * s_vnb + h * s_vnh + r64 * s_vnl + cols[None, :], mask=keep)
        tl.store(v_cache_ptr + b * s_vcb + h * s_vch + s64 * s_vcs + cols[None, :], v, mask=keep)
