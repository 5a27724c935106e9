"""One forward core, one backward core, the autograd Function over them, the custom ops
torch.compile sees, and the one place a call picks between them (:func:`attend`).

The index form is data, the same for both backends and every route. Sequence b is given
by one of two forms:

* bounds: int32 device tensors ``q_start, q_len, k_start, k_len`` [B] (``dense`` None);
  q is rows [Tq, Hq, D] and sequence b owns rows ``q_start[b] + [0, q_len[b])``, its
  keys rows ``k_start[b] + [0, k_len[b])`` of ``key_rows(k, b)``.
* dense: ``dense = (Lq, k_add)`` for a padded batch q [B, Lq, Hq, D]: sequence b is batch
  row b, its keys the first ``k_len[b] + k_add`` of key batch row b (``k_add`` alone where
  k_len is None); q_start, q_len and k_start are None. No index tensors are built on the
  host (a decode step is launch-bound).

Both forms give a row the same bits; the custom ops' schema takes the bounds form, so a
traced call turns a dense form into index tensors (:func:`padded_bounds`).

The chain and launch choices travel as an argument (:class:`~.launch.AttnTuning`) from
:func:`attend` to the backends; the custom ops take the chain as plain ints and launch
with the defaults.
"""
from __future__ import annotations

import functools

import torch

from .key_blocks import Chain
from .launch import DEFAULT_TUNING, AttnTuning
from .layout import packed
from .torch_ref import lse_dtype, torch_bwd, torch_fwd
from .triton_host import triton_bwd, triton_fwd


def forward(q, k, v, sinks, q_start, q_len, k_start, k_len, dense, max_q: int, max_k: int, causal: bool,
            window: int, softcap: float, scale: float, tuning: AttnTuning, backend: str,
            split_kv: bool, shared=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward core: q rows [Tq, Hq, D], k/v [NB, S, Hkv, D] (unit last strides), either
    index form -> (out [Tq, Hq, D] in q's dtype, lse [Hq, Tq] fp32, fp64 for fp64).
    ``sinks`` [Hq] or None: each head's sink logit in its rows' normalizers. ``window`` >= 0:
    each query sees keys no more than that many positions back (-1: no window). ``softcap``
    > 0: scores are softcap * tanh(score / softcap) (0: none). ``tuning``: the chain (both
    backends) and the Triton launch. ``shared``: where a sequence may read keys another
    one holds too (:func:`~.triton_host.triton_fwd`; a read placement, no effect on the bits)."""
    if backend == "triton":
        return triton_fwd(q, k, v, q_start, q_len, k_start, k_len, max_q, max_k, causal, scale, tuning, split_kv,
                          dense, window, sinks, softcap, shared)
    return torch_fwd(q, k, v, q_start, q_len, k_start, k_len, causal, scale, tuning.chain, dense, window, sinks,
                     softcap)


def backward(do, q, k, v, sinks, out, lse, q_start, q_len, k_start, k_len, dense, max_q: int, max_k: int,
             causal: bool, window: int, softcap: float, scale: float, tuning: AttnTuning, backend: str
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The backward core: (dq, dk, dv, dsinks) for dO [Tq, Hq, D] and :func:`forward`'s inputs
    and results (dsinks None without sinks); ``tuning``: the Triton launch (the backward
    recomputes P from the saved LSE, so the chain plays no part)."""
    if backend == "triton":
        return triton_bwd(do, q, k, v, out, lse, q_start, q_len, k_start, k_len, max_q, max_k, causal, scale, tuning,
                          dense, window, sinks, softcap)
    return torch_bwd(do, q, k, v, out, lse, q_start, q_len, k_start, k_len, causal, scale, dense, window, sinks,
                     softcap)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """A padded batch [B, L, H, D] as rows [B*L, H, D]; rows as they are."""
    return packed(t) if t.dim() == 4 else t


class AttnFunction(torch.autograd.Function):
    """The op with autograd, for either index form: q rows [Tq, Hq, D] (bounds) or a padded
    batch [B, Lq, Hq, D] (dense), out in q's shape; ``sinks`` [Hq] or None. ``bounds``:
    (q_start, q_len, k_start, k_len), tensors or None; ``call``: the rest of
    :func:`forward`'s arguments. A call adds one autograd node and no view nodes (a padded
    batch's row views are taken inside), and apply takes six arguments: each node, view or
    argument costs host time per call."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, bounds, call):  # type: ignore[override]
        out, lse = forward(_rows(q), k, v, sinks, *bounds, *call)
        ctx.save_for_backward(q, k, v, sinks, out, lse, *bounds)
        ctx.call = call
        return out if q.dim() == 3 else out.view_as(q)

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, k, v, sinks, out, lse, *bounds = ctx.saved_tensors
        dense, max_q, max_k, causal, window, softcap, scale, tuning, backend, _ = ctx.call
        dq, dk, dv, dsinks = backward(_rows(dout), _rows(q), k, v, sinks, out, lse, *bounds, dense, max_q, max_k,
                                      causal, window, softcap, scale, tuning, backend)
        dsinks = dsinks.to(sinks.dtype) if dsinks is not None else None
        return dq if q.dim() == 3 else dq.view_as(q), dk, dv, dsinks, None, None


@functools.cache
def chain_tuning(block_n: int, split: int) -> AttnTuning:
    """The tuning of a custom-op call: the chain its ints name, the default launch (one
    object per chain, so a traced decode step builds none)."""
    chain = Chain(block_n, split)
    return DEFAULT_TUNING if chain == DEFAULT_TUNING.chain else AttnTuning(chain)


@torch.library.custom_op("rlkernels::flash_attn_fwd", mutates_args=())
def flash_attn_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: torch.Tensor,
                      q_len: torch.Tensor, k_start: torch.Tensor, k_len: torch.Tensor, max_q: int, max_k: int,
                      causal: bool, window: int, scale: float, block_n: int, split: int, backend: str,
                      split_kv: bool, sinks: torch.Tensor | None = None, softcap: float = 0.0
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward core as an opaque op for torch.compile (bounds form; same backends, same
    bits): the chain (block_n, split) with the default launch."""
    return forward(q, k, v, sinks, q_start, q_len, k_start, k_len, None, max_q, max_k, causal, window, softcap,
                   scale, chain_tuning(block_n, split), backend, split_kv)


@flash_attn_fwd_op.register_fake
def _(q, k, v, q_start, q_len, k_start, k_len, max_q, max_k, causal, window, scale, block_n, split, backend,
      split_kv, sinks=None, softcap=0.0):
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=lse_dtype(q.dtype))


@torch.library.custom_op("rlkernels::flash_attn_bwd", mutates_args=())
def flash_attn_bwd_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                      lse: torch.Tensor, q_start: torch.Tensor, q_len: torch.Tensor, k_start: torch.Tensor,
                      k_len: torch.Tensor, max_q: int, max_k: int, causal: bool, window: int, scale: float,
                      backend: str, sinks: torch.Tensor | None = None, softcap: float = 0.0
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward core as an opaque op for torch.compile (bounds form, the default launch):
    (dq, dk, dv, dsinks), dsinks empty without sinks (an op returns tensors only)."""
    dq, dk, dv, dsinks = backward(do, q, k, v, sinks, out, lse, q_start, q_len, k_start, k_len, None, max_q, max_k,
                                  causal, window, softcap, scale, DEFAULT_TUNING, backend)
    return dq, dk, dv, dsinks.to(sinks.dtype) if sinks is not None else q.new_empty((0,))


@flash_attn_bwd_op.register_fake
def _(do, q, k, v, out, lse, q_start, q_len, k_start, k_len, max_q, max_k, causal, window, scale, backend,
      sinks=None, softcap=0.0):
    dsinks = torch.empty_like(sinks) if sinks is not None else q.new_empty((0,))
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dsinks


# The traced route's autograd: a custom op takes its gradient from torch.library, not from
# an autograd.Function, and its backward must be an opaque op too (AOTAutograd traces it).
# Both call the one backward core.
def _op_setup(ctx, inputs, output):
    q, k, v, q_start, q_len, k_start, k_len, max_q, max_k, causal, window, scale = inputs[:12]
    sinks, softcap = inputs[16], inputs[17]
    ctx.save_for_backward(q, k, v, output[0], output[1], q_start, q_len, k_start, k_len, sinks)
    ctx.args = (max_q, max_k, causal, window, scale, inputs[14], softcap)


def _op_backward(ctx, dout, _dlse):
    q, k, v, out, lse, q_start, q_len, k_start, k_len, sinks = ctx.saved_tensors
    max_q, max_k, causal, window, scale, backend, softcap = ctx.args
    dq, dk, dv, dsinks = flash_attn_bwd_op(dout.contiguous(), q, k, v, out, lse, q_start, q_len, k_start, k_len,
                                           max_q, max_k, causal, window, scale, backend, sinks, softcap)
    return (dq, dk, dv) + (None,) * 13 + (dsinks if sinks is not None else None, None)


flash_attn_fwd_op.register_autograd(_op_backward, setup_context=_op_setup)


def append_to_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    cache_seqlens: torch.Tensor) -> None:
    """k_cache[b, cache_seqlens[b] + j] = k[b, j] (and v), in place; no host sync. Caches
    [B, S, Hkv, D], k/v [B, Lnew, Hkv, D], cache_seqlens int32 [B]."""
    nb, lnew = k.shape[:2]
    idx = cache_seqlens.long()[:, None] + torch.arange(lnew, device=k.device)[None, :]
    bidx = torch.arange(nb, device=k.device)[:, None].expand(nb, lnew)
    k_cache.index_put_((bidx, idx), k)
    v_cache.index_put_((bidx, idx), v)


@torch.library.custom_op("rlkernels::flash_attn_kvcache_append", mutates_args=("k_cache", "v_cache"))
def kvcache_append_op(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      cache_seqlens: torch.Tensor) -> None:
    """:func:`append_to_cache` as an opaque op for torch.compile."""
    append_to_cache(k_cache, v_cache, k, v, cache_seqlens)


@kvcache_append_op.register_fake
def _(k_cache, v_cache, k, v, cache_seqlens):
    return None


def padded_bounds(nb: int, dense: tuple[int, int], k_len: torch.Tensor | None, device: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The bounds form (q_start, q_len, k_start, k_len) of the dense form of nb sequences."""
    lq, k_add = dense
    ar = torch.arange(nb, dtype=torch.int32, device=device)
    q_start, k_start = ar * lq, torch.zeros_like(ar)  # sequence b's keys: batch row b of k
    q_len = torch.full((nb,), lq, dtype=torch.int32, device=device)
    k_len = torch.full((nb,), k_add, dtype=torch.int32, device=device) if k_len is None else k_len + k_add
    return q_start, q_len, k_start, k_len


def traced(q, k, v, sinks, q_start, q_len, k_start, k_len, dense, max_q: int, max_k: int, causal: bool, window: int,
           softcap: float, scale: float, chain: Chain, backend: str, split_kv: bool) -> torch.Tensor:
    """The op under torch.compile: the forward custom op (its autograd registered above) on
    the bounds form with ``chain`` and the default launch; out in q's shape. The launch
    sizes are specialized to ints (shapes may be symbolic here): they pick the kernels'
    grids and constexprs."""
    if dense is not None:
        q_start, q_len, k_start, k_len = padded_bounds(q.shape[0], dense, k_len, q.device)
    out, _ = flash_attn_fwd_op(_rows(q), k, v, q_start, q_len, k_start, k_len, int(max_q), int(max_k), bool(causal),
                               int(window), float(scale), chain.block_n, chain.split, backend, bool(split_kv), sinks,
                               float(softcap))
    return out if q.dim() == 3 else out.view_as(q)


def attend(q, k, v, sinks, q_start, q_len, k_start, k_len, dense, max_q: int, max_k: int, causal: bool, window: int,
           softcap: float, scale: float, tuning: AttnTuning, backend: str, split_kv: bool,
           shared=None) -> torch.Tensor:
    """The op on validated inputs, by the one route for the call's context: traced by
    torch.compile (:func:`traced`: ``tuning``'s chain, the default launch), with autograd
    (:class:`AttnFunction`, which keeps ``tuning`` for the backward), or without (the
    forward core alone: no autograd node's host time). q rows [Tq, Hq, D] (bounds form) or a
    padded batch [B, Lq, Hq, D] (dense form); k, v [NB, S, Hkv, D] with unit last strides;
    out in q's shape and dtype. ``shared`` (:func:`forward`) is a read placement the forward
    core alone takes; the other routes read every sequence's own keys, the same bits."""
    if torch.compiler.is_compiling():
        return traced(q, k, v, sinks, q_start, q_len, k_start, k_len, dense, max_q, max_k, causal, window, softcap,
                      scale, tuning.chain, backend, split_kv)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                    or (sinks is not None and sinks.requires_grad)):
        return AttnFunction.apply(q, k, v, sinks, (q_start, q_len, k_start, k_len),
                                  (dense, max_q, max_k, causal, window, softcap, scale, tuning, backend, split_kv))
    out, _ = forward(_rows(q), k, v, sinks, q_start, q_len, k_start, k_len, dense, max_q, max_k, causal, window,
                     softcap, scale, tuning, backend, split_kv, shared)
    return out if q.dim() == 3 else out.view_as(q)
