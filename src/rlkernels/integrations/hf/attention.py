"""The batch-invariant attention as a Hugging Face attention implementation, ``"rlkernels"``.

Registered with transformers' ``AttentionInterface`` (and a mask function in
``AttentionMaskInterface`` that hands the 2-D padding mask through unchanged, as
FlashAttention's does), so ``model.set_attn_implementation("rlkernels")`` and
``from_pretrained(..., attn_implementation="rlkernels")`` work after
:func:`register` (``patch_model`` calls it).

Each batch row's valid keys are one interval ``[ks, ke)`` of the key axis (left
padding moves ``ks``, right padding ``ke``, a cache's unused slots lie past ``ke``);
its valid queries are the positions inside that interval. The op reads those
bounds per sequence from device tensors (no host sync) and runs the library's fixed
chain over keys counted from ``ks``: a token's output is the same bits alone, left-
or right-padded, in a batch, packed, in prefill or decode (``ops.attention``).
Rows of padding get zeros. Packed sequences (one row, ``position_ids`` restarting
at 0, or FlashAttention-style ``cu_seq_lens_*`` keyword arguments) run as separate
sequences.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..._env import switch_on
from ...runtime.device import can_read_back
from ...ops.attention import CHECK_ENV, attention_by_bounds

NAME = "rlkernels"


def _padding_mask(attention_mask: torch.Tensor | None, batch: int, kv_length: int) -> torch.Tensor | None:
    """The [B, S] key-validity mask from whatever transformers passed (2-D padding mask,
    a 4-D boolean or additive mask), or None where every key is valid."""
    if attention_mask is None:
        return None
    if attention_mask.dim() == 4:  # [B, 1, Lq, S]: the last query row sees every valid key
        row = attention_mask[:, 0, -1, :]
        valid = row if row.dtype == torch.bool else row == 0
    elif attention_mask.dim() == 2:
        valid = attention_mask.bool()
    else:
        raise ValueError(f"rlkernels attention: unsupported attention_mask shape {tuple(attention_mask.shape)}")
    if valid.shape[0] != batch:
        raise ValueError(f"rlkernels attention: attention_mask has {valid.shape[0]} rows for a batch of {batch}")
    s = valid.shape[-1]
    if s < kv_length:  # keys past the mask (a static cache's unused slots) are not valid
        valid = torch.cat([valid, valid.new_zeros(batch, kv_length - s)], dim=1)
    elif s > kv_length:
        valid = valid[:, s - kv_length:]
    return valid


def _interval(valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(first, end) of each row's valid keys, as int32 device tensors (an empty row: 0, 0).

    A row whose valid keys are not one interval (a hole in the padding mask) has no
    invariant meaning here and is refused; the check reads one bool back from the
    device, except during CUDA-graph capture or torch.compile tracing (as the op's own
    index checks, RLKERNELS_ATTN_CHECK_INDICES=0 turns it off)."""
    s = valid.shape[1]
    v = valid.to(torch.int32)
    count = v.sum(dim=1)
    first = torch.where(count > 0, v.argmax(dim=1), 0)
    end = torch.where(count > 0, s - v.flip(1).argmax(dim=1), 0)
    holes = (end - first) != count
    if _may_read(valid) and bool(holes.any()):
        row = int(holes.nonzero()[0, 0])
        raise ValueError(f"rlkernels attention: row {row} of the attention mask has padding between real tokens; "
                         "each row must be one run of real tokens (left or right padding)")
    return first.to(torch.int32), end.to(torch.int32)


def _may_read(t: torch.Tensor) -> bool:
    if t.device.type == "cpu":
        return True
    return switch_on(CHECK_ENV) and can_read_back(t)


# Every layer of one forward gets the same mask object: its bounds are worked out once
# (a dozen small ops per layer otherwise; eager decode is host-bound). One (key, result)
# pair, replaced whole, so concurrent threads never pair one's key with another's result.
_LAST_BOUNDS: list = [None]


def _bounds_of(attention_mask: torch.Tensor | None, offset: int | torch.Tensor, b: int, lq: int, s: int,
               device: torch.device, queries_real: bool = False):
    """(q_start, q_len, k_start, k_len, valid_rows [B, Lq] or None where every row is valid) of
    each row's one interval of real tokens: q_start counts rows of the [B * Lq] queries,
    k_start slots of row b's keys. ``queries_real``: the caller vouches that every query is
    a real token (:data:`QUERIES_REAL`), so no row is padding."""
    key = (attention_mask, offset, b, lq, s, device,
           None if attention_mask is None else attention_mask._version, queries_real)
    cached = _LAST_BOUNDS[0]
    if cached is not None and cached[0][0] is attention_mask and cached[0][2:] == key[2:] and (
            cached[0][1] is offset or (type(offset) is int and type(cached[0][1]) is int and cached[0][1] == offset)):
        return cached[1]
    valid = _padding_mask(attention_mask, b, s)
    if valid is None:
        ks = torch.zeros(b, dtype=torch.int32, device=device)
        ke = torch.full((b,), s, dtype=torch.int32, device=device)
    else:
        ks, ke = _interval(valid)
    first_q = (ks - offset).clamp(min=0, max=lq)
    end_q = (ke - offset).clamp(min=0, max=lq)
    base_q = torch.arange(b, dtype=torch.int32, device=device) * lq
    k_len = (ke - ks).clamp(min=0)
    q_len = torch.minimum((end_q - first_q).clamp(min=0), k_len)
    if queries_real or (valid is None and type(offset) is int and 0 <= offset <= s - lq):
        valid_rows = None  # every query row is a real token: nothing to zero
    else:
        pos = torch.arange(lq, device=device)
        valid_rows = (pos[None, :] >= first_q[:, None]) & (pos[None, :] < (first_q + q_len)[:, None])
    result = (base_q + first_q, q_len, ks, k_len, valid_rows)
    _LAST_BOUNDS[0] = (key, result)
    return result


# One zero scalar per (dtype, device), kept: a fresh one (or a Python scalar, which torch.where
# wraps into a device tensor) is a fill launch per layer and decode step.
_ZEROS: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _zero(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    zero = _ZEROS.get((dtype, device))
    if zero is None:
        zero = torch.zeros((), dtype=dtype, device=device)
        # One made while a CUDA graph records lives in the graph's memory pool: not kept.
        if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            _ZEROS[(dtype, device)] = zero
    return zero


def _packed_bounds(kwargs: dict[str, Any], total: int, device: torch.device):
    """cu_seqlens of a packed row: FlashAttention-style kwargs, or position_ids restarting at 0."""
    cu = kwargs.get("cu_seq_lens_k")
    if cu is None:
        cu = kwargs.get("cu_seq_lens_q")
    if cu is not None:
        return cu.to(device=device, dtype=torch.int32)
    pos = kwargs.get("position_ids")
    if pos is None or pos.dim() != 2 or pos.shape[0] != 1 or pos.shape[1] != total:
        return None
    starts = (pos[0] == 0).nonzero().flatten()  # one host sync per layer call
    if starts.numel() <= 1 and (starts.numel() == 0 or int(starts[0]) == 0):
        return None
    if int(starts[0]) != 0:
        raise ValueError("rlkernels attention: packed position_ids must start a sequence at 0 in the first slot")
    return torch.cat([starts, starts.new_tensor([total])]).to(torch.int32)


def rlkernels_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                attention_mask: torch.Tensor | None, scaling: float | None = None,
                                dropout: float = 0.0, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query [B, Hq, Lq, D], key/value
    [B, Hkv, S, D] (the cache already appended) -> ([B, Lq, Hq, D], None)."""
    if dropout and module.training:
        raise ValueError(f"rlkernels attention: attention dropout ({dropout}) is not supported")
    if getattr(module, "is_causal", True) is False:
        raise ValueError("rlkernels attention: non-causal attention is not supported")
    b, hq, lq, d = query.shape
    s = key.shape[2]
    window = kwargs.get("sliding_window")
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise ValueError(f"rlkernels attention: sliding_window must be a positive int, got {window!r}")
    dev = query.device
    q_rows = query.transpose(1, 2).reshape(b * lq, hq, d)
    # Keys stay where the cache keeps them ([B, Hkv, S, D]): the kernels take batch and head
    # strides, so a decode step reads the cache in place instead of copying it per layer.
    k_rows = key.transpose(1, 2)
    v_rows = value.transpose(1, 2)
    scale = scaling if scaling is not None else d ** -0.5
    cu = _packed_bounds(kwargs, s, dev) if b == 1 and lq == s else None
    if cu is not None:
        # Packed: every sequence is its own interval of the one row (prefill only).
        q_start = k_start = cu[:-1]
        q_len = k_len = cu[1:] - cu[:-1]
        valid_rows = None
        shared = None
    else:
        # Keys before the first query (a cache): the last lq keys are the queries', unless
        # the mask hook said where they start (a static cache's slots).
        offset: int | torch.Tensor = getattr(attention_mask, Q_OFFSET, s - lq)
        if (1 < lq < s and attention_mask is not None and attention_mask.dim() == 4
                and attention_mask.shape[2] == 1 and not hasattr(attention_mask, Q_OFFSET)):
            # The hook's [B, 1, 1, S] mask, copied on the way without the queries' first slot:
            # taking the last lq slots would be a guess.
            raise ValueError("rlkernels attention: a [B, 1, 1, S] mask for several queries on a cache of "
                             f"{s} slots without the queries' first slot (a copy of the mask the rlkernels mask "
                             "hook made lost its attribute); pass the 2-D padding mask instead")
        q_start, q_len, k_start, k_len, valid_rows = _bounds_of(attention_mask, offset, b, lq, s, dev,
                                                                kwargs.get(QUERIES_REAL) is True)
        shared = kwargs.get(SHARED_KEYS)
    # transformers' window: a query sees keys fewer than `window` positions before it.
    out = attention_by_bounds("attention (Hugging Face)", q_rows, k_rows, v_rows, q_start, q_len, k_start, k_len, lq, s,
                              shared_keys=shared,
                              causal=True, scale=scale, window_size=(-1 if window is None else window - 1, -1),
                              sinks=kwargs.get("s_aux"),  # GPT-OSS's per-head attention sinks
                              softcap=kwargs.get("softcap") or 0.0)  # Gemma 2's attention logit soft-cap
    out = out.view(b, lq, hq, d)
    if valid_rows is not None:  # padding rows: zeros (no key of theirs was computed)
        out = torch.where(valid_rows[:, :, None, None], out, _zero(out.dtype, dev))
    return out, None


# The attribute that carries the queries' first key slot on the mask the hook returns.
Q_OFFSET = "rlkernels_q_offset"
# The forward keyword (handed down to every attention call) with which a decode loop vouches
# that every query it feeds is a real token whose slot its mask holds: no padding row to
# zero, so no ``where`` per layer. The library's decode steps pass it; nothing else should.
QUERIES_REAL = "rlkernels_queries_real"
# The forward keyword with which a decode loop names, per batch row, another row holding the
# same prompt's keys and the prompt's length (``attention_by_bounds``' ``shared_keys``): the
# rollout's samples of one prompt read one copy of it. Same bits; the rollout alone passes it.
SHARED_KEYS = "rlkernels_shared_keys"


def _pass_padding_mask(*args: Any, attention_mask: torch.Tensor | None = None, q_offset: Any = None,
                       cache_position: torch.Tensor | None = None, batch_size: int | None = None,
                       kv_length: int | None = None, q_length: int | None = None,
                       **kwargs: Any) -> torch.Tensor | None:
    """transformers' mask-function hook: the padding mask as given (None: no padding),
    and where the queries are not the last keys, their first key slot.

    A ``StaticCache`` hands attention every slot, written or not. transformers gives the
    queries' offset as ``q_offset`` (5.x; a static cache's device write counter, copied
    here before the first layer's cache update advances it) or ``cache_position`` (4.x).
    It rides on the mask, viewed as [B, 1, 1, S] so that transformers hands it on
    unchanged wherever it builds the mask again (an already 4-D mask is kept as is),
    under the attribute :data:`Q_OFFSET`; the attention reads it there.
    """
    if isinstance(kwargs.get("kv_offset"), int) and kwargs["kv_offset"] > 0:
        # transformers' sliding-window cache layers keep the last `window` keys only; the
        # chain counts keys from a sequence's first, which such a cache no longer holds.
        raise ValueError(f"rlkernels attention: the cache has dropped its first {kwargs['kv_offset']} keys (a "
                         "sliding-window cache layer); the invariant chain needs every key of a sequence in its "
                         "cache: use rlkernels.generate / rlkernels.rollout, or a cache whose layers keep every key")
    if q_offset is None and isinstance(cache_position, torch.Tensor) and cache_position.numel():
        q_offset, q_length = cache_position[:1], cache_position.numel()
    if isinstance(q_offset, torch.Tensor):
        q_offset = q_offset.reshape(-1)[:1].to(torch.int32, copy=True)
    elif q_offset is None or q_offset == (kv_length or 0) - (q_length or 0):
        return attention_mask  # the queries are the last keys, which the attention assumes
    if attention_mask is None:
        if None in (batch_size, kv_length, q_length):
            raise ValueError("rlkernels attention: a cache whose queries are not its last keys needs an "
                             "attention_mask")
        device = q_offset.device if isinstance(q_offset, torch.Tensor) else kwargs.get("device")
        attention_mask = (torch.arange(kv_length, device=device) < q_offset + q_length).expand(batch_size, -1)
    # Contiguous, so that transformers' generate, which makes the mask it builds for a
    # static cache contiguous, hands on this very tensor with its attribute.
    carrier = attention_mask.bool()[:, None, None, :].contiguous()
    setattr(carrier, Q_OFFSET, q_offset)
    return carrier


def register() -> None:
    """Register ``"rlkernels"`` with transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, rlkernels_attention_forward)
    try:
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:  # older transformers build the 4-D mask themselves; it is read the same way
        return
    AttentionMaskInterface.register(NAME, _pass_padding_mask)
