"""An attention layer's inputs -- q/k RMSNorm, rotary embedding, KV-cache write -- in one launch.

``attention_inputs(q, k, v, cos, sin, q_norm=..., k_norm=..., cache=...)`` is what a
Qwen3- or Llama-style attention forward does between its projections and its attention
call::

    q = rms_norm(q, *q_norm)            # per head, where the family norms q and k
    k = rms_norm(k, *k_norm)
    q, k = rotary_embedding(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    write_kv_slots(k_cache, v_cache, k, v.transpose(1, 2), start)   # with a cache

That composition is the definition: every path returns its bits. On the Triton backend
without gradients it is one launch (``kernels.attention_inputs``: each op's expression,
so each op's rounding) instead of four at a decode step; elsewhere -- the torch backend,
bf16 under the interpreter, a gradient to carry, a layout or dtype mix the kernel does not
take -- it is the ops themselves.
"""
from __future__ import annotations

import torch

from . import _validate as V
from ..kernels._triton import cdiv
from ..kernels.attention_inputs import attention_inputs_kernel
from ..runtime.launcher import NO_FP_FUSION, cached_launcher
from .kv_cache import write_kv_slots
from .norms import rms_norm
from .reductions import reduction_backend_for
from .rotary import fused_backend_ok, rotary_embedding

OP = "attention_inputs"
HEADS_PER_PROGRAM = 4  # heads one program computes; per-element work, so any value gives the same bits
MAX_HEAD_DIM = 1024  # the RMSNorm kernel's one tile: a head row's sum is its tree
_launch = cached_launcher(attention_inputs_kernel, leading_tensors=11, options=NO_FP_FUSION)

Norm = tuple[torch.Tensor, float]
Cache = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           q_norm: Norm | None, k_norm: Norm | None, cache: Cache | None) -> None:
    for name, t in (("q", q), ("k", k), ("v", v), ("cos", cos), ("sin", sin)):
        V.require_float(OP, name, t)
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"rlkernels.{OP}: q must be [B, L, HQ, D] and k, v [B, L, HK, D], got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    B, L, _, D = q.shape
    if D % 2:
        raise ValueError(f"rlkernels.{OP}: the head dim must be even for the rotary embedding, got {D}")
    if cos.shape != sin.shape or cos.dim() != 3 or cos.shape[1:] != (L, D) or cos.shape[0] not in (1, B):
        raise ValueError(f"rlkernels.{OP}: cos and sin must be [{B} or 1, {L}, {D}], got {tuple(cos.shape)} and "
                         f"{tuple(sin.shape)}")
    V.require_same_device(OP, q=q, k=k, v=v, cos=cos, sin=sin)
    for name, norm in (("q_norm", q_norm), ("k_norm", k_norm)):
        if norm is None:
            continue
        weight, eps = norm
        V.require_float(OP, f"{name}'s weight", weight)
        if weight.shape != (D,):
            raise ValueError(f"rlkernels.{OP}: {name}'s weight must be [{D}] (one head's norm), got "
                             f"{tuple(weight.shape)}")
        if not isinstance(eps, (int, float)) or not eps >= 0:
            raise ValueError(f"rlkernels.{OP}: {name}'s eps must be a number >= 0, got {eps!r}")
    if cache is not None:
        k_cache, v_cache, start = cache
        want = (B, k.shape[2])
        for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
            if c.dim() != 4 or c.shape[:2] != want or c.shape[3] != D or c.dtype != k.dtype:
                raise ValueError(f"rlkernels.{OP}: {name} must be [{B}, {k.shape[2]}, S, {D}] {k.dtype}, got "
                                 f"{tuple(c.shape)} {c.dtype}")
        # write_kv_slots checks the rest (the slot counter, the devices) on its path.


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               q_norm: Norm | None, k_norm: Norm | None, cache: Cache | None,
               backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ops one by one: the definition of every path's bits."""
    if q_norm is not None:
        q = rms_norm(q, q_norm[0], q_norm[1], backend=backend)
    if k_norm is not None:
        k = rms_norm(k, k_norm[0], k_norm[1], backend=backend)
    q, k = rotary_embedding(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    v = v.transpose(1, 2)
    if cache is None:
        return q, k, v
    k_cache, v_cache, start = cache
    write_kv_slots(k_cache, v_cache, k, v, start)
    return q, k_cache, v_cache


def _fused_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              q_norm: Norm | None, k_norm: Norm | None, cache: Cache | None, backend: str | None = None) -> bool:
    """The kernel reproduces the ops for these inputs: one dtype throughout (the norms'
    outputs then keep it), unit stride along D, a head the norm kernel sums in one tile,
    and each op's Triton path (the rotary kernel without gradients, the fused RMSNorm)."""
    D = q.shape[3]
    tensors = [q, k, v, cos, sin] + [n[0] for n in (q_norm, k_norm) if n is not None]
    if cache is not None:
        tensors += list(cache[:2])
        if cache[2].dtype != torch.int64 or cache[2].numel() != 1 or cache[2].device != q.device:
            return False
    if D > MAX_HEAD_DIM or any(t.dtype != q.dtype or t.device != q.device for t in tensors):
        return False
    if any(t.stride(-1) != 1 and t.shape[-1] != 1 for t in tensors):
        return False
    if not fused_backend_ok(q, k, cos, sin) or (torch.is_grad_enabled() and v.requires_grad):
        return False
    norms = [n[0] for n in (q_norm, k_norm) if n is not None]
    if any(torch.is_grad_enabled() and w.requires_grad for w in norms):
        return False
    reductions = reduction_backend_for("rms_norm", q.device, backend)
    return not norms or (reductions.name == "triton" and reductions.fuses_rms_norm(q, norms[0]))


def attention_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
                     q_norm: Norm | None = None, k_norm: Norm | None = None,
                     cache: Cache | None = None,
                     backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Normed (optional) and rotated queries and keys, and the keys and values written to a cache.

    q [B, L, HQ, D], k and v [B, L, HK, D] (as the projections give them, before the
    transpose); cos, sin [B or 1, L, D]; ``q_norm``, ``k_norm``: ``(weight [D], eps)`` of a
    per-head RMSNorm (the library's, Llama's order) or None; ``cache``: ``(k_cache, v_cache,
    start)`` with caches [B, HK, S, D] and ``start`` one int64 element on their device, the
    slot of the first token (as :func:`rlkernels.ops.kv_cache.write_kv_slots`: slots past S
    are not written, and the caller sizes the cache).

    Returns ``(q_out [B, HQ, L, D], keys, values)``: without a cache the rotated keys
    [B, HK, L, D] and ``v.transpose(1, 2)``; with one, the caches (written in place).
    ``backend``: the norms' backend, as :func:`rlkernels.ops.norms.rms_norm` takes it (the
    one launch reproduces the Triton RMSNorm, so it runs where that backend is chosen).
    """
    _check(q, k, v, cos, sin, q_norm, k_norm, cache)
    if not _fused_ok(q, k, v, cos, sin, q_norm, k_norm, cache, backend):
        return _reference(q, k, v, cos, sin, q_norm, k_norm, cache, backend)
    B, L, HQ, D = q.shape
    HK = k.shape[2]
    q_out = torch.empty(B, L, HQ, D, dtype=q.dtype, device=q.device)
    if cache is None:
        k_out, v_out, start, rows = torch.empty(B, L, HK, D, dtype=k.dtype, device=k.device), v, q_out, L
        o_k = (k_out.stride(0), k_out.stride(1), k_out.stride(2))
        o_v = (0, 0, 0)
    else:
        k_out, v_out, start = cache
        rows = k_out.shape[2]
        o_k = (k_out.stride(0), k_out.stride(2), k_out.stride(1))
        o_v = (v_out.stride(0), v_out.stride(2), v_out.stride(1))
    if B * L:
        half = D // 2
        q_w, q_eps = q_norm if q_norm is not None else (q, 0.0)
        k_w, k_eps = k_norm if k_norm is not None else (k, 0.0)
        c_b = cos.stride(0) if cos.shape[0] > 1 else 0
        s_b = sin.stride(0) if sin.shape[0] > 1 else 0
        grid = (B * L, cdiv(HQ, HEADS_PER_PROGRAM) + cdiv(HK, HEADS_PER_PROGRAM))
        _launch(grid, (q, k, v, q_w, k_w, cos, sin, q_out, k_out, v_out, start, L, HQ, HK, rows,
                       float(q_eps), float(k_eps),
                       q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                       v.stride(0), v.stride(1), v.stride(2),
                       q_out.stride(0), q_out.stride(1), q_out.stride(2), *o_k, *o_v,
                       c_b, cos.stride(1), s_b, sin.stride(1)),
                dict(Q_NORM=q_norm is not None, K_NORM=k_norm is not None, CACHE=cache is not None, D=D, HALF=half,
                     BLOCK_D=1 << (D - 1).bit_length(), BLOCK_HALF=1 << (half - 1).bit_length(),
                     BLOCK_H=HEADS_PER_PROGRAM),
                num_warps=1 if D * HEADS_PER_PROGRAM <= 512 else 4, num_stages=1)
    if cache is None:
        return q_out.transpose(1, 2), k_out.transpose(1, 2), v.transpose(1, 2)
    return q_out.transpose(1, 2), k_out, v_out
