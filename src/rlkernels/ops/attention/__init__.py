"""Batch-invariant fused attention with FlashAttention's API: prefill == decode bit for bit.

    flash_attn_func(q, k, v, causal=True, softmax_scale=None)            q [B, Lq, Hq, D], k/v [B, Lk, Hkv, D]
    flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, ...)
                                                                          q [Tq, Hq, D], k/v [Tk, Hkv, D]
    flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, ...)
                                                                          q [B, Lq, Hq, D], caches [B, S, Hkv, D]

The chain (one per query row, whatever the entry point, batch, padding or packing):
keys in blocks of ``BLOCK_N`` aligned to the sequence's key 0, ascending; the blocks
grouped into splits of ``S_SPLIT`` keys aligned to key 0; each split's online-softmax
state (m, l, acc) in fp32 starts from scratch and is updated per block with
``m' = max(m, rowmax(s))``, ``alpha = exp2(m - m')``, ``p = exp2(s - m')`` (p rounded
to the input dtype), ``l' = l * alpha + rowsum(p)``, ``acc' = acc * alpha + p @ v``;
the splits are merged in ascending order from the empty state with one formula; out =
acc / l. Causal masking is bottom-right aligned (query i of Lq sits at key position
Lk - Lq + i). Masked and out-of-range keys contribute exact zeros (their K/V loads are
masked to 0 and their scores are -inf), which is why a tile's extra rows or blocks
never change a row's bits. Every index is a function of the sequence alone.

Backends: ``triton`` (kernels in ``rlkernels.kernels.attention``: a full kernel that
keeps the merged and the current split state, and for decode a split-KV kernel plus a
combine kernel that compute the same chain) and ``torch`` (the same chain from
elementwise ops and ``gemm.chain``'s ascending chains, in natural-log units with
``exp``; any device, fp64 too). The two backends each keep the contract; their bits
differ from each other (FMA vs separately rounded steps, tensor-core vs elementwise dots).

Backward (flash_attn_func / varlen): delta = rowsum(dO * O) in fp32; dK/dV per key
block over the GQA group's query heads in order and query blocks ascending; dQ per
query block over key blocks ascending, recomputing P from the saved LSE; no atomics.

Modules, lowest first: ``key_blocks`` (:class:`Chain`, the two constants that define the
bits), ``layout`` (key rows, TMA descriptors), ``launch`` (launch parameters,
:class:`AttnTuning`), ``ws_host`` (the warp-specialized Hopper forward), ``triton_host``
(the Triton launches), ``torch_ref`` (the torch backend), ``autograd`` (the forward and
backward cores, the autograd Function, the custom ops, the route a call takes),
``validate`` and ``api`` (the entry points, the registry). This package exports the
entry points and what a caller tunes them with; everything else is imported from its
module.

The chain and the launch choices are arguments, not module state: :class:`AttnTuning`
(chain, forward and backward launch, TMA size threshold) travels from each entry point's
private ``_tuning`` keyword through ``autograd.attend``, the forward and backward cores
and ``autograd.AttnFunction`` to ``triton_host.triton_fwd`` / ``triton_bwd`` (the chain
to ``torch_ref.torch_fwd``). Tests and tuning scripts force a variant per call, e.g.
``flash_attn_func(q, k, v, _tuning=AttnTuning(fwd=dataclasses.replace(default_fwd_launch(d), ws=False)))``.
The custom ops take the chain as ints and launch with the defaults. Tests observe a
launch by wrapping the launchers ``triton_host._launch_*`` and ``ws_host._launch_fwd_ws``,
which live in their modules only, where the code reads them.
"""
from __future__ import annotations

from .api import attention_by_bounds, flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from .key_blocks import Chain
from .launch import AttnTuning, BwdLaunch, FwdLaunch, KernelLaunch, default_bwd_launch, default_fwd_launch
from .validate import CHECK_ENV

__all__ = [
    "CHECK_ENV", "AttnTuning", "BwdLaunch", "Chain", "FwdLaunch", "KernelLaunch", "attention_by_bounds",
    "default_bwd_launch", "default_fwd_launch", "flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache",
]
