"""The public entry points (FlashAttention's API) and the op's registry entries.

Each entry point validates its inputs, picks the backend and puts its sequences in one of
the two index forms (``autograd``): a padded batch in the dense form, packed or bounded
sequences in the bounds form. :func:`~.autograd.attend` then takes the route for the
call's context; flash_attn_with_kvcache, forward only, calls the forward core directly.

Each entry point takes a private keyword ``_tuning`` (:class:`~.launch.AttnTuning`), for
tests and tuning scripts only: another chain, or forced launch parameters, for that call
alone. Callers leave it out.
"""
from __future__ import annotations

import torch

from ...registry import OpImpl, register_backends, select_backend
from .. import _validate as V
from .autograd import append_to_cache, attend, forward, kvcache_append_op, traced
from .launch import DEFAULT_TUNING, AttnTuning
from .layout import last_dim_unit, packed
from .validate import (check_backend, check_cache_seqlens, check_cu, check_index, check_qkv, check_scale,
                       check_sinks, check_softcap, check_window, read_indices)

OP = "flash_attn"
# Decode-like calls (query rows x GQA group <= this) take the split-KV kernels.
SPLIT_KV_MAX_ROWS = 64


def _takes_split_kv(backend: str, max_q: int, group: int) -> bool:
    """Decode-like calls (few query rows per KV head) take the split-KV kernels, which
    fill the GPU over long caches; the full kernel computes the same bits."""
    return backend == "triton" and max_q * group <= SPLIT_KV_MAX_ROWS


def flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                    softmax_scale: float | None = None, window_size: tuple[int, int] = (-1, -1), *,
                    sinks: torch.Tensor | None = None, softcap: float = 0.0, backend: str | None = None,
                    _tuning: AttnTuning = DEFAULT_TUNING) -> torch.Tensor:
    """Batch-invariant attention over a padded batch (FlashAttention's ``flash_attn_func``).

    q: [B, Lq, Hq, D]; k, v: [B, Lk, Hkv, D] with Hq a multiple of Hkv (GQA/MQA);
    fp16/bf16/fp32 (fp64 on the torch backend), D <= 256. Causal masking is
    bottom-right aligned when Lq != Lk. softmax_scale defaults to D**-0.5.
    window_size = (left, right): query i (at key position Lk - Lq + i) sees keys no more
    than ``left`` positions before it (-1: unbounded; Mistral's sliding_window W is
    left = W - 1); ``right`` must be -1 without causal masking. The window is a mask on
    the one chain: a row's bits are the unwindowed chain's with the hidden keys masked.
    sinks: None or [Hq] (any float dtype): head h's sink logit (natural-log units, unscaled)
    joins the softmax normalizer of each of its rows, and its value row is dropped
    (GPT-OSS's attention sinks); differentiable.
    softcap > 0: each scaled score s becomes softcap * tanh(s / softcap) before the mask
    and the softmax (Gemma 2's attention logit soft-capping); 0: none.
    Returns [B, Lq, Hq, D] in q's dtype; differentiable wrt q, k, v (and sinks).
    """
    op = "flash_attn_func"
    check_qkv(op, q, k, v, 4)
    window = check_window(op, window_size, causal)
    softcap = check_softcap(op, softcap)
    check_sinks(op, sinks, q.shape[2], q.device)
    b, lq, _, d = q.shape
    if k.shape[0] != b:
        raise ValueError(f"rlkernels.{op}: q and k must share the batch size, got {b} and {k.shape[0]}")
    lk = k.shape[1]
    name, _ = select_backend(OP, q.device, backend)
    check_backend(op, name, q)
    scale = check_scale(op, softmax_scale, d)
    # The dense form: sequence b is batch row b, Lq queries over its Lk keys.
    return attend(q, last_dim_unit(k), last_dim_unit(v), sinks, None, None, None, None, (lq, lk), lq, lk,
                  bool(causal), window, softcap, scale, _tuning, name, False)


def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool = True,
                           softmax_scale: float | None = None, window_size: tuple[int, int] = (-1, -1), *,
                           sinks: torch.Tensor | None = None, softcap: float = 0.0, backend: str | None = None,
                           _tuning: AttnTuning = DEFAULT_TUNING) -> torch.Tensor:
    """Batch-invariant attention over packed sequences (FlashAttention's ``flash_attn_varlen_func``).

    q: [Tq, Hq, D]; k, v: [Tk, Hkv, D]; cu_seqlens_q/k: int32 [B + 1], starting at 0,
    non-decreasing, ending at Tq/Tk; max_seqlen_q/k: ints >= every sequence's length
    (they size the launch grid, so nothing is read back from the device for it);
    window_size, sinks and softcap as :func:`flash_attn_func`'s, per sequence.
    Returns [Tq, Hq, D]; differentiable wrt q, k, v (and sinks).
    """
    op = "flash_attn_varlen_func"
    check_qkv(op, q, k, v, 3)
    window = check_window(op, window_size, causal)
    softcap = check_softcap(op, softcap)
    check_sinks(op, sinks, q.shape[1], q.device)
    check_index(op, "cu_seqlens_q", cu_seqlens_q, None, q.device)
    check_index(op, "cu_seqlens_k", cu_seqlens_k, cu_seqlens_q.shape[0], q.device)
    if cu_seqlens_q.shape[0] < 1:
        raise ValueError(f"rlkernels.{op}: cu_seqlens_q must hold at least one entry, got shape {tuple(cu_seqlens_q.shape)}")
    max_q, max_k = int(max_seqlen_q), int(max_seqlen_k)
    if max_q < 0 or max_k < 0:
        raise ValueError(f"rlkernels.{op}: max_seqlen_q/k must be >= 0, got {max_q} and {max_k}")
    check_cu(op, "cu_seqlens_q", read_indices(cu_seqlens_q), q.shape[0], max_q, "max_seqlen_q")
    check_cu(op, "cu_seqlens_k", read_indices(cu_seqlens_k), k.shape[0], max_k, "max_seqlen_k")
    name, _ = select_backend(OP, q.device, backend)
    check_backend(op, name, q)
    scale = check_scale(op, softmax_scale, q.shape[-1])
    q_start, k_start = cu_seqlens_q[:-1], cu_seqlens_k[:-1]
    q_len = cu_seqlens_q[1:] - q_start
    k_len = cu_seqlens_k[1:] - k_start
    return attend(last_dim_unit(q), last_dim_unit(k)[None], last_dim_unit(v)[None], sinks, q_start, q_len, k_start,
                  k_len, None, max_q, max_k, bool(causal), window, softcap, scale, _tuning, name, False)


def attention_by_bounds(op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: torch.Tensor,
                        q_len: torch.Tensor, k_start: torch.Tensor, k_len: torch.Tensor, max_q: int, max_k: int, *,
                        causal: bool = True, scale: float | None = None, window_size: tuple[int, int] = (-1, -1),
                        sinks: torch.Tensor | None = None, softcap: float = 0.0, backend: str | None = None,
                        shared_keys: tuple[torch.Tensor, torch.Tensor] | None = None,
                        _tuning: AttnTuning = DEFAULT_TUNING) -> torch.Tensor:
    """The op over sequences given by their bounds, for integrations that hold padded rows.

    q: [Tq, Hq, D]; k, v: [Tk, Hkv, D] (one packed run of key rows) or [B, S, Hkv, D] (any
    strides with a unit last one: sequence b's keys in batch row b, so a cache in Hugging
    Face's [B, Hkv, S, D] layout, transposed, is read in place). Sequence b owns query rows
    ``q_start[b] .. q_start[b] + q_len[b] - 1`` and key rows ``k_start[b] .. k_start[b] +
    k_len[b] - 1`` (int32 device tensors, read by the kernels: no host sync), causal
    bottom-right aligned, its keys counted from ``k_start[b]`` -- the same chain as every
    public entry point. max_q / max_k: ints >= every q_len / k_len. Rows outside every
    sequence are not written. Decode-like calls take the split-KV kernels (same bits).
    window_size, sinks and softcap as :func:`flash_attn_func`'s, positions counted from
    ``k_start[b]``. ``shared_keys = (src, length)`` (int32 [B] device tensors, or None):
    the caller vouches that sequence b's first ``length[b]`` keys and values are sequence
    ``src[b]``'s first ``length[b]``, bit for bit (samples of one prompt, each holding its
    copy); the split-KV kernel then reads them from ``src[b]``, so sequences that share a
    prompt read one copy of it. A read placement: the bits are those of each sequence's
    own keys, which every other path reads. Returns [Tq, Hq, D] in q's dtype;
    differentiable wrt q, k, v. ``op`` names the caller in errors.
    """
    check_qkv(op, q, k, v, 3, k_ranks=(3, 4))
    window = check_window(op, window_size, causal)
    softcap = check_softcap(op, softcap)
    check_sinks(op, sinks, q.shape[1], q.device)
    nb = q_start.shape[0]
    for name, t in (("q_start", q_start), ("q_len", q_len), ("k_start", k_start), ("k_len", k_len)):
        check_index(op, name, t, nb, q.device)
    if shared_keys is not None:
        if not isinstance(shared_keys, (tuple, list)) or len(shared_keys) != 2:
            raise TypeError(f"rlkernels.{op}: shared_keys must be a pair (src, length) of int32 tensors, got "
                            f"{type(shared_keys).__name__}")
        for name, t in zip(("shared_keys' src", "shared_keys' length"), shared_keys):
            check_index(op, name, t, nb, q.device)
    if k.dim() == 4 and k.shape[0] not in (1, nb):
        raise ValueError(f"rlkernels.{op}: batched keys [B, S, Hkv, D] need B = 1 or one row per sequence "
                         f"({nb}), got {tuple(k.shape)}")
    name, _ = select_backend(OP, q.device, backend)
    check_backend(op, name, q)
    scale = check_scale(op, scale, q.shape[-1])
    k, v = last_dim_unit(k), last_dim_unit(v)
    if k.dim() == 3:
        k, v = k[None], v[None]
    max_q, max_k = int(max_q), int(max_k)
    split_kv = _takes_split_kv(name, max_q, q.shape[1] // k.shape[-2])
    return attend(last_dim_unit(q), k, v, sinks, q_start, q_len, k_start, k_len, None, max_q, max_k, bool(causal),
                  window, softcap, scale, _tuning, name, split_kv, shared_keys)


def flash_attn_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            k: torch.Tensor | None = None, v: torch.Tensor | None = None,
                            cache_seqlens: torch.Tensor | int | None = None, causal: bool = True,
                            softmax_scale: float | None = None, window_size: tuple[int, int] = (-1, -1), *,
                            sinks: torch.Tensor | None = None, softcap: float = 0.0, backend: str | None = None,
                            _tuning: AttnTuning = DEFAULT_TUNING) -> torch.Tensor:
    """Decode / chunked prefill over a KV cache (FlashAttention's ``flash_attn_with_kvcache``).

    q: [B, Lq, Hq, D]; k_cache, v_cache: [B, S, Hkv, D] with a unit last stride (any batch,
    token and head strides: ``cache.transpose(1, 2)`` of a [B, Hkv, S, D] cache is read and
    written in place); k, v: optional [B, Lnew, Hkv, D], written in place into
    the caches at positions cache_seqlens[b] + [0, Lnew); cache_seqlens: int32 [B], an
    int, or None (the whole cache). Query i of a sequence attends as key position
    cache_seqlens[b] + Lnew - Lq + i (causal, bottom-right). Slots past
    cache_seqlens[b] + Lnew are never read into the result (NaN there is harmless).
    window_size, sinks and softcap as :func:`flash_attn_func`'s: the cache keeps every key,
    the window masks. Forward only (inference). Returns [B, Lq, Hq, D] in q's dtype.
    """
    op = "flash_attn_with_kvcache"
    check_qkv(op, q, k_cache, v_cache, 4)
    window = check_window(op, window_size, causal)
    softcap = check_softcap(op, softcap)
    check_sinks(op, sinks, q.shape[2], q.device)
    b, lq, hq, d = q.shape
    nb, s_cap = k_cache.shape[:2]
    if nb != b:
        raise ValueError(f"rlkernels.{op}: q and k_cache must share the batch size, got {b} and {nb}")
    for name_, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.stride(-1) != 1 and d > 1:  # the kernels read head_dim contiguously; a copy would lose the append
            raise ValueError(f"rlkernels.{op}: {name_} must have a unit last stride, got strides {tuple(c.stride())}")
    if (k is None) != (v is None):
        raise ValueError(f"rlkernels.{op}: pass both k and v to append, or neither")
    lnew = 0
    if k is not None:
        check_qkv(op, q, k, v, 4)
        V.require_same_dtype(op, q=q, k=k, k_cache=k_cache)
        V.require_same_device(op, q=q, k=k, k_cache=k_cache)
        if k.shape[0] != b or k.shape[2:] != k_cache.shape[2:]:
            raise ValueError(f"rlkernels.{op}: k must be [{b}, Lnew, {k_cache.shape[2]}, {k_cache.shape[3]}], "
                             f"got {tuple(k.shape)}")
        # The append writes the caches in place: a slot shared by two rows (an expanded
        # cache) or by k_cache and v_cache would hand one row's new key to another.
        V.require_writable(op, "k_cache", k_cache)
        V.require_writable(op, "v_cache", v_cache)
        if V.may_overlap(k_cache, v_cache):
            raise ValueError(f"rlkernels.{op}: k_cache and v_cache share memory (k_cache strides "
                             f"{tuple(k_cache.stride())}, v_cache strides {tuple(v_cache.stride())}, "
                             f"{v_cache.data_ptr() - k_cache.data_ptr()} bytes apart), so appending v would "
                             "overwrite keys; pass caches that do not overlap")
        lnew = k.shape[1]
    dev = q.device
    seqlen_int: int | None = None
    if cache_seqlens is None:
        if lnew:
            raise ValueError(f"rlkernels.{op}: appending k/v needs cache_seqlens (the cache is full otherwise)")
        seqlen_int = s_cap
    elif isinstance(cache_seqlens, int):
        if cache_seqlens < 0:
            raise ValueError(f"rlkernels.{op}: cache_seqlens must be >= 0, got {cache_seqlens}")
        if cache_seqlens > s_cap - lnew:
            raise ValueError(f"rlkernels.{op}: cache_seqlens {cache_seqlens} + {lnew} new tokens exceeds the "
                             f"cache of {s_cap}")
        seqlen_int = cache_seqlens
    else:
        check_index(op, "cache_seqlens", cache_seqlens, b, dev)
        check_cache_seqlens(op, read_indices(cache_seqlens), lnew, s_cap)
    name, _ = select_backend(OP, dev, backend)
    check_backend(op, name, q)
    scale = check_scale(op, softmax_scale, d)
    split_kv = _takes_split_kv(name, lq, hq // k_cache.shape[2])
    # The dense form: sequence b's keys are the first cache_seqlens[b] + Lnew slots of its batch row.
    k_len, dense = (None, (lq, seqlen_int + lnew)) if seqlen_int is not None else (cache_seqlens, (lq, lnew))
    if torch.compiler.is_compiling():
        if lnew:
            if seqlen_int is not None:
                cache_seqlens = torch.full((b,), seqlen_int, dtype=torch.int32, device=dev)
            kvcache_append_op(k_cache, v_cache, k, v, cache_seqlens)
        with torch.no_grad():
            return traced(q, k_cache, v_cache, sinks, None, None, None, k_len, dense, lq, s_cap, bool(causal), window,
                          softcap, scale, _tuning.chain, name, split_kv)
    if lnew:
        if seqlen_int is not None:
            k_cache[:, seqlen_int:seqlen_int + lnew] = k
            v_cache[:, seqlen_int:seqlen_int + lnew] = v
        else:
            append_to_cache(k_cache, v_cache, k, v, cache_seqlens)
    # Forward only: no autograd route to pick, the core alone (a decode step is launch-bound).
    out, _ = forward(packed(q), k_cache, v_cache, sinks, None, None, None, k_len, dense, lq, s_cap, bool(causal),
                     window, softcap, scale, _tuning, name, split_kv)
    return out.view_as(q)


# ---------------------------------------------------------------- registry entries


class _AttnOp(OpImpl):
    op_class = "attention"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                softmax_scale: float | None = None) -> torch.Tensor:
        return flash_attn_func(q, k, v, causal, softmax_scale, backend=self.backend)

    def forward_fp32(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                     softmax_scale: float | None = None) -> torch.Tensor:
        """The chain on fp32 copies of the inputs (p kept in fp32), fp32 out."""
        return flash_attn_func(q.float(), k.float(), v.float(), causal, softmax_scale, backend=self.backend)

    def invariance_case(self, device, dtype, generator):
        lq, h, d = (37, 2, 16) if device.type == "cpu" else (1031, 8, 128)
        x = torch.randn(6, 3, lq, h, d, generator=generator).to(device=device, dtype=dtype)
        return (lambda rows: self.forward(rows[:, 0], rows[:, 1], rows[:, 2])), x


register_backends(OP, _AttnOp, {"triton": None, "torch": None})
