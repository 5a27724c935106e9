"""Host side of the Triton backend: the forward (full kernel, or split-KV + combine) and
the backward (delta, dK/dV, dQ) launches, over either index form (see ``autograd``)."""
from __future__ import annotations

import torch

from ..._env import triton_interpret
from ...gemm.tma import TensorDescriptor
from ...kernels._triton import cdiv
from ...kernels.attention.backward import attn_bwd_delta_kernel, attn_bwd_dkdv_kernel, attn_bwd_dq_kernel
from ...kernels.attention.forward import attn_fwd_kernel
from ...kernels.attention.split import attn_combine_kernel, attn_split_kernel
from ...runtime.device import capability
from ...runtime.launcher import DEFAULT_NUM_STAGES, cached_launcher
from .launch import (COMBINE_BLOCK_D, COMBINE_STAGES, COMBINE_WARPS, DELTA_WARPS, FWD_OPTIONS, AttnTuning,
                     default_bwd_launch, default_fwd_launch)
from .layout import TMA_DTYPES, head_rows_desc, kv_rows, rows_per_batch, tma_pays
from .sinks import sink_grad
from .ws_host import ws_fwd

LOG2E = 1.4426950408889634

# Decode steps are host-bound: later launches skip Triton's binder (runtime.launcher).
_launch_fwd = cached_launcher(attn_fwd_kernel, options=FWD_OPTIONS) if attn_fwd_kernel is not None else None
_launch_split = cached_launcher(attn_split_kernel, options=FWD_OPTIONS) if attn_split_kernel is not None else None
_launch_combine = (cached_launcher(attn_combine_kernel, options=FWD_OPTIONS) if attn_combine_kernel is not None
                   else None)
_launch_bwd_delta = cached_launcher(attn_bwd_delta_kernel) if attn_bwd_delta_kernel is not None else None
_launch_bwd_dkdv = cached_launcher(attn_bwd_dkdv_kernel) if attn_bwd_dkdv_kernel is not None else None
_launch_bwd_dq = cached_launcher(attn_bwd_dq_kernel) if attn_bwd_dq_kernel is not None else None

_NO_DESCS = (None, None, 0, 0, 0, 0, False)


def _tma_descs(use: bool, a: torch.Tensor, b: torch.Tensor, rows: int, block_d: int) -> tuple:
    """(a_desc, b_desc, a_head_rows, a_head_cols, b_head_rows, b_head_cols, TMA) for a
    kernel's two TMA-read operands, or pointer loads for both (``_NO_DESCS``) where either
    can't be described, the dtype is not 2-byte or the device has no TMA (before Hopper)."""
    if not use or TensorDescriptor is None or a.dtype not in TMA_DTYPES:
        return _NO_DESCS
    if not triton_interpret() and (not a.is_cuda or capability(a.device)[0] < 9):
        return _NO_DESCS
    da, db = head_rows_desc(a, rows, block_d), head_rows_desc(b, rows, block_d)
    if da is None or db is None:
        return _NO_DESCS
    return da[0], db[0], da[1], da[2], db[1], db[2], True


def _key_strides(k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int, int]:
    """(token, head) strides of k then v, as the kernels take them."""
    return k.stride(1), k.stride(2), v.stride(1), v.stride(2)


def _pow2(x: int, floor: int = 16) -> int:
    return max(floor, 1 << max(0, (x - 1).bit_length()))


def score_scales(scale: float, softcap: float) -> tuple[float, float]:
    """(qk_scale, softcap) as the kernels read them: scale * log2(e) (and 1, unread) without a
    cap; with one, scale / cap inside the tanh and cap * log2(e) after it (``capped``)."""
    if softcap > 0:
        return scale / softcap, softcap * LOG2E
    return scale * LOG2E, 1.0


def triton_fwd(q, k, v, q_start, q_len, k_start, k_len, max_q: int, max_k: int, causal: bool, scale: float,
               tuning: AttnTuning, split_kv: bool, dense: tuple[int, int] | None = None, window: int = -1,
               sinks: torch.Tensor | None = None, softcap: float = 0.0,
               shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernels (full kernel, or split-KV + combine); no host sync.

    q [Tq, Hq, D]; k, v [NB, S, Hkv, D] (``key_rows``). ``dense = (Lq, k_add)``: a padded
    batch (sequence b's queries at rows b * Lq, its keys from row 0 of batch row b,
    k_len[b] = k_len[b] + k_add, or k_add where k_len is None), the index tensors
    q_start/q_len/k_start are then unused and may be None: a decode step builds no index
    tensors on the host. Same bits either way. ``tuning``: the chain, and the launch
    (``tuning.fwd``, None for :func:`~.launch.default_fwd_launch`). ``window`` >= 0: each
    query sees keys no more than that many positions back (-1: no window). ``sinks`` [Hq]
    (natural-log units) or None: each head's sink logit in its rows' normalizers.
    ``softcap`` > 0: scores become softcap * tanh(score / softcap) (0: none). ``shared``
    (bounds form; int32 [B] each, or None): (src, length), sequence b's first length[b]
    keys being sequence src[b]'s too: the split-KV kernel reads them there (same bits;
    the full kernel reads every sequence's own). Returns
    (out [Tq, Hq, D] in q's dtype, lse [Hq, Tq] fp32); rows outside every sequence are not
    written (with sinks their LSE is +inf, which the backward's sink gradient reads as no row).
    """
    tq, hq, d = q.shape
    out = torch.empty_like(q)
    if sinks is None:
        lse = torch.empty((hq, tq), dtype=torch.float32, device=q.device)
    else:
        lse = torch.full((hq, tq), float("inf"), dtype=torch.float32, device=q.device)
        sinks = (sinks.float() * LOG2E).contiguous()
    if tq == 0 or max_q == 0:  # (before nb: a dense batch of no query rows has Lq = 0)
        return out, lse
    nb = tq // dense[0] if dense is not None else q_start.shape[0]
    if nb == 0:
        return out, lse
    hkv = k.shape[2]
    g = hq // hkv
    if dense is not None:
        lq_d, k_add = dense
        klen_ptr = k_len is not None
        idx = k_len if klen_ptr else lse  # unread pointers (DENSE) just need a tensor
        q_start = q_len = k_start = idx
        k_len = idx
    else:
        lq_d = k_add = 0
        klen_ptr = True
    k, v, rows = kv_rows(k, v)
    k_strides = _key_strides(k, v)
    chain = tuning.chain
    cfg = tuning.fwd or default_fwd_launch(d, max_q)
    bd = _pow2(d)
    ieee = q.dtype == torch.float32
    qk_scale, cap_log2 = score_scales(scale, softcap)
    even_d = d == bd
    is_dense = dense is not None
    sliding = window >= 0
    sink_ptr = lse if sinks is None else sinks  # (an unread pointer without sinks)
    if split_kv:
        bm = cfg.split.block_m
        rows_pad = cdiv(max_q * g, bm) * bm
        n_splits = max(1, cdiv(max_k, chain.split))
        finish_here = n_splits == 1
        ws_rows = nb * hkv * n_splits * rows_pad
        ws = lse if finish_here else torch.empty(ws_rows * (bd + 2), dtype=torch.float32, device=q.device)
        share_src, share_len = shared if shared is not None and not is_dense else (lse, lse)
        _launch_split(
            (rows_pad // bm, nb * hkv, n_splits),
            (q, k, v, ws, out, lse, sink_ptr, q_start, q_len, k_start, k_len, share_src, share_len,
             q.stride(0), q.stride(1), *k_strides, out.stride(0), out.stride(1), lse.stride(0),
             hkv, g, d, qk_scale, cap_log2, n_splits, rows_pad, ws_rows, lq_d, k_add, rows, max(window, 0)),
            dict(CAUSAL=causal, SLIDING=sliding, SINK=sinks is not None, BLOCK_M=bm, BLOCK_N=chain.block_n,
                 BLOCK_D=bd, S_SPLIT=chain.split, IEEE=ieee, EVEN_D=even_d, DENSE=is_dense, KLEN_PTR=klen_ptr,
                 FINISH=finish_here, SOFTCAP=softcap > 0, SHARED=shared is not None and not is_dense),
            num_warps=cfg.split.num_warps, num_stages=cfg.split.num_stages)
        if not finish_here:
            # The combine's tile is launch detail (an elementwise merge per row and column):
            # the real rows only (a decode step's G heads), BLOCK_DC columns per program, and
            # tiles over the rows a sequence can have (max_q * g), not the split tile's
            # padding: a tile past them would return at once, a block scheduled for nothing
            # (seven of eight at a decode step of G = 2, per layer and step).
            cm = min(bm, _pow2(max_q * g, floor=2))
            dc = min(bd, COMBINE_BLOCK_D)
            _launch_combine(
                (cdiv(max_q * g, cm), nb * hkv, bd // dc),
                (ws, out, lse, sink_ptr, q_start, q_len, k_start, k_len,
                 out.stride(0), out.stride(1), lse.stride(0),
                 hkv, g, d, n_splits, rows_pad, ws_rows, lq_d, k_add),
                dict(SINK=sinks is not None, BLOCK_M=cm, BLOCK_D=bd, BLOCK_DC=dc, EVEN_D=even_d, DENSE=is_dense,
                     KLEN_PTR=klen_ptr, S_SPLIT=chain.split),
                num_warps=COMBINE_WARPS, num_stages=COMBINE_STAGES)
        return out, lse
    # Not the dense form with per-sequence key counts (k_len + K_ADD, the KV-cache path's):
    # the warp-specialized kernel reads a padded batch's key count from Lk alone. It has no
    # window, sinks or soft-cap: it takes a windowed call only where the window hides no key
    # (every position is below max_k, so a window of max_k - 1 keys back reaches key 0), the same bits.
    if (cfg.ws and (window < 0 or window >= max_k - 1) and sinks is None and softcap == 0
            and not (is_dense and klen_ptr)
            and ws_fwd(q, k, v, out, lse, (q_start, q_len, k_start, k_len), nb, max_q, max_k,
                       (lq_d, k_add) if is_dense else None, causal, qk_scale, tuning)):
        return out, lse
    use_tma = cfg.tma and tma_pays(nb, hq, max_q, max_k, d, causal, min_flops=tuning.tma_min_flops)
    *descs, tma = _tma_descs(use_tma, k, v, chain.block_n, bd)
    _launch_fwd(
        (cdiv(max_q, cfg.full.block_m), nb * hq),
        (q, k, v, out, lse, sink_ptr, *descs, q_start, q_len, k_start, k_len,
         q.stride(0), q.stride(1), *k_strides, out.stride(0), out.stride(1), lse.stride(0),
         hq, g, d, qk_scale, cap_log2, lq_d, k_add, rows, max(window, 0)),
        # (max_k bounds every k_len, as the grid's max_q bounds every q_len)
        dict(CAUSAL=causal, SLIDING=sliding, SINK=sinks is not None, BLOCK_M=cfg.full.block_m,
             BLOCK_N=chain.block_n, BLOCK_D=bd, S_SPLIT=chain.split, IEEE=ieee, EVEN_D=even_d, DENSE=is_dense,
             KLEN_PTR=klen_ptr, REVERSE_M=causal, TMA=tma, ONE_SPLIT=max_k <= chain.split, SOFTCAP=softcap > 0),
        num_warps=cfg.full.num_warps, num_stages=cfg.full.num_stages)
    return out, lse


def triton_bwd(do, q, k, v, out, lse, q_start, q_len, k_start, k_len, max_q: int, max_k: int, causal: bool,
               scale: float, tuning: AttnTuning, dense: tuple[int, int] | None = None, window: int = -1,
               sinks: torch.Tensor | None = None, softcap: float = 0.0
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Launch the backward kernels (delta, dK/dV, dQ); no host sync. Shapes and bounds as
    :func:`triton_fwd` (``dense`` with k_len None: every key of a batch row); the launch
    is ``tuning.bwd`` (None for :func:`~.launch.default_bwd_launch`), the chain plays no
    part (P is recomputed from the saved LSE, which holds the sinks); ``window`` and
    ``sinks`` and ``softcap`` as the forward's. Returns (dq, dk, dv) in q's, k's and v's shapes (rows
    outside every sequence get zeros) and dsinks [Hq] fp32 (None without sinks)."""
    tq, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    k, v, rows = kv_rows(k, v)
    # (tq before nb: a dense batch of no query rows has Lq = 0)
    launch = not (tq == 0 or max_q == 0 or max_k == 0 or (dense is None and q_start.shape[0] == 0))
    # Rows outside every sequence get no write and must read zero; a dense batch whose
    # sequences hold every key of their batch row leaves none (one memset less per grad).
    alloc = torch.empty_like if launch and dense is not None and dense[1] == k.shape[1] else torch.zeros_like
    dq = alloc(q)
    # dK, dV in k's and v's layouts (zeros_like/empty_like keep a dense layout), so their
    # batch rows are as many token strides apart; a layout they do not keep is copied first.
    dk, dv = alloc(k), alloc(v)
    if rows_per_batch(dk) != rows or rows_per_batch(dv) != rows:
        k, v = k.contiguous(), v.contiguous()
        dk, dv, rows = alloc(k), alloc(v), rows_per_batch(k)
    if not launch:
        return dq, dk, dv, None if sinks is None else torch.zeros(hq, dtype=torch.float32, device=q.device)
    if dense is not None:
        nb = tq // dense[0]
        lq_d, k_add = dense
        q_start = q_len = k_start = k_len = lse  # unread pointers (DENSE) just need a tensor
    else:
        nb = q_start.shape[0]
        lq_d = k_add = 0
    cfg = tuning.bwd or default_bwd_launch(d)
    bd = _pow2(d)
    ieee = q.dtype == torch.float32
    qk_scale, cap_log2 = score_scales(scale, softcap)
    do = do if do.stride(-1) == 1 else do.contiguous()
    delta = torch.empty((hq, tq), dtype=torch.float32, device=q.device)
    bm0 = 16 if triton_interpret() else 64
    _launch_bwd_delta(
        (cdiv(max_q, bm0), nb * hq),
        (out, do, delta, q_start, q_len, out.stride(0), out.stride(1), do.stride(0), do.stride(1), delta.stride(0),
         hq, d, lq_d),
        dict(BLOCK_M=bm0, BLOCK_D=bd, EVEN_D=d == bd, DENSE=dense is not None),
        num_warps=DELTA_WARPS, num_stages=DEFAULT_NUM_STAGES)
    lse = lse.contiguous()
    k_strides = _key_strides(k, v)
    use_tma = cfg.tma and tma_pays(nb, hq, max_q, max_k, d, causal, 2.5, tuning.tma_min_flops)
    *q_descs, q_tma = _tma_descs(use_tma, q, do, cfg.dkdv.block_m, bd)
    _launch_bwd_dkdv(
        (cdiv(max_k, cfg.dkdv.block_n), nb * hkv),
        (q, k, v, do, lse, delta, dk, dv, *q_descs, q_start, q_len, k_start, k_len,
         q.stride(0), q.stride(1), *k_strides, do.stride(0), do.stride(1), lse.stride(0),
         dk.stride(1), dk.stride(2), dv.stride(1), dv.stride(2),
         hkv, g, d, qk_scale, cap_log2, scale, lq_d, k_add, rows, max(window, 0)),
        dict(CAUSAL=causal, SLIDING=window >= 0, SOFTCAP=softcap > 0, BLOCK_M=cfg.dkdv.block_m,
             BLOCK_N=cfg.dkdv.block_n, BLOCK_D=bd,
             IEEE=ieee, EVEN_D=d == bd, TMA=q_tma, DENSE=dense is not None),
        num_warps=cfg.dkdv.num_warps, num_stages=cfg.dkdv.num_stages)
    *k_descs, k_tma = _tma_descs(use_tma, k, v, cfg.dq.block_n, bd)
    _launch_bwd_dq(
        (cdiv(max_q, cfg.dq.block_m), nb * hq),
        (q, k, v, do, lse, delta, dq, *k_descs, q_start, q_len, k_start, k_len,
         q.stride(0), q.stride(1), *k_strides, do.stride(0), do.stride(1), lse.stride(0), dq.stride(0), dq.stride(1),
         hq, g, d, qk_scale, cap_log2, scale, lq_d, k_add, rows, max(window, 0)),
        dict(CAUSAL=causal, SLIDING=window >= 0, SOFTCAP=softcap > 0, BLOCK_M=cfg.dq.block_m,
             BLOCK_N=cfg.dq.block_n, BLOCK_D=bd,
             IEEE=ieee, EVEN_D=d == bd, REVERSE_M=causal, TMA=k_tma, DENSE=dense is not None),
        num_warps=cfg.dq.num_warps, num_stages=cfg.dq.num_stages)
    return dq, dk, dv, None if sinks is None else sink_grad(sinks.float() * LOG2E, lse, delta, torch.exp2)
