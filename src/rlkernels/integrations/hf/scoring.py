"""``rlkernels.token_logprobs``: a Hugging Face causal LM's per-token log-probs, and the pieces it is built from.

:func:`token_logprobs` scores the next tokens with :func:`rlkernels.linear_logprob` on
the final hidden states, so the [tokens, vocab] logits are never materialised. A
patched model (:func:`~rlkernels.integrations.hf.coverage.is_patched`) runs as it is:
every op of its forward that reduces is already an invariant one, so it needs no
per-call Python override; any other model's decoder runs under the batch-invariant
mode. The checks of the model and its inputs (:func:`check_head`, :func:`check_ids`) are
``rlkernels.generate``'s too: they take the name of the public function the user called,
which their errors name.
"""
from __future__ import annotations

import numbers

import warnings
from typing import Any

import torch
from torch import nn

from ...ops._validate import require_temperature
from ...ops.linear_logprob import linear_logprob
from ...ops.lm_head.config import LogitTransform
from ...ops.lm_head.validate import validate_threshold
from ..trainers import fsdp
from . import attention, coverage
from .coverage import attention_implementation, cache_kwargs, decoder_of, mode_for
from .tp_layout import layout_of

IGNORE_INDEX = -100


def check_mask(op: str, input_ids: torch.Tensor, attention_mask: object) -> None:
    """TypeError/ValueError naming ``op`` unless ``attention_mask`` is None or a tensor of 0s
    and 1s shaped like ``input_ids`` (one host sync). Positions are counted from the mask,
    so any other value -- a 2, a 0.5, a packed batch's segment ids -- would silently number
    the tokens wrong."""
    if attention_mask is None:
        return
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"rlkernels.{op}: attention_mask must be a tensor of 0s and 1s shaped like input_ids, got "
                        f"{type(attention_mask).__name__}")
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"rlkernels.{op}: attention_mask has shape {tuple(attention_mask.shape)}, "
                         f"input_ids {tuple(input_ids.shape)}")
    if attention_mask.dtype == torch.bool or attention_mask.numel() == 0:
        return
    if attention_mask.is_complex():
        raise TypeError(f"rlkernels.{op}: attention_mask must be bool, integer or float 0s and 1s, got "
                        f"{attention_mask.dtype}")
    bad = (attention_mask != 0) & (attention_mask != 1)
    if bool(bad.any()):
        b, i = (int(v) for v in bad.nonzero()[0])
        raise ValueError(f"rlkernels.{op}: attention_mask must hold only 0 and 1, got "
                         f"{attention_mask[b, i].item()!r} at [{b}, {i}]: positions are counted from the mask "
                         f"(a packed batch's segment ids are not a mask: pass one row per sequence)")


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids that count only real tokens (left padding starts each sequence at 0)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def hidden_states(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                  position_ids: torch.Tensor | None = None, past_key_values: Any = None,
                  use_cache: bool = False) -> torch.Tensor:
    """Final (post-norm) hidden states [B, L, H] of the decoder; no logits."""
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if position_ids is None:
        if past_key_values is not None:
            raise ValueError("rlkernels.integrations.hf.scoring.hidden_states: pass position_ids when continuing "
                             "from a KV cache")
        position_ids = positions_from_mask(attention_mask)
    decoder = decoder_of(model)
    cache = cache_kwargs(decoder, past_key_values) if past_key_values is not None else {}
    out = decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=use_cache,
                  **cache)
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


def next_token_targets(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """targets[:, t] = input_ids[:, t+1], or IGNORE_INDEX where t or t+1 is padding."""
    target = input_ids[:, 1:].clone()
    if attention_mask is not None:
        valid = attention_mask[:, 1:].bool() & attention_mask[:, :-1].bool()
        target = target.masked_fill(~valid, IGNORE_INDEX)
    return target


def vocab_parallel(head: object) -> bool:
    """``head`` is a tensor-parallel model's vocabulary-parallel LM head."""
    mods = coverage.parallel_modules()
    return mods is not None and isinstance(head, mods.VocabParallelHead)


def head_vocab(head: nn.Module) -> int:
    """How many token ids ``head`` scores: a vocabulary-parallel head's every rank together."""
    return head.vocab if vocab_parallel(head) else head.weight.shape[0]


def check_head(op: str, model: nn.Module) -> tuple[nn.Module, LogitTransform]:
    """The LM head, where the model's logits are ``transform(hidden @ head.weight.T (+ bias))``,
    and that transform (:func:`~rlkernels.integrations.hf.coverage.logit_transform`: Cohere's
    scale, Gemma's final soft-cap, or none); else ValueError.

    A model that changes its logits after the head in any other way
    (:data:`~rlkernels.integrations.hf.coverage.LOGIT_TRANSFORMS`) would be scored by another
    distribution than its own, so it is refused, naming the field."""
    head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    if not vocab_parallel(head) and not isinstance(head, nn.Linear):
        raise TypeError(f"rlkernels.{op}: {type(model).__name__}'s output embedding is "
                        f"{type(head).__name__ if head is not None else 'missing'}, not a linear LM head")
    transform, refused = coverage.logit_transform(model)
    if refused:
        raise ValueError(f"rlkernels.{op}: {type(model).__name__} changes its logits after the LM head "
                         f"({', '.join(refused)}) in a way the fused head does not apply (it applies Cohere's "
                         "logit_scale and Gemma's final_logit_softcapping), so its log-probs would not be the "
                         "model's. Such heads are not supported")
    if vocab_parallel(head):
        if op not in ("token_logprobs", "generate", "rollout"):
            raise ValueError(f"rlkernels.{op}: the model is tensor-parallel (rlkernels.tensor_parallel), which "
                             "rlkernels.token_logprobs, generate and rollout take; this call does not yet")
    return head, transform


def logprobs_from_hidden(model: nn.Module, hidden: torch.Tensor, target: torch.Tensor, *,
                         temperature: float = 1.0, return_entropy: bool = False, op: str = "token_logprobs",
                         logit_threshold: torch.Tensor | None = None):
    """linear_logprob of ``target`` [B, T] from ``hidden`` [B, T, H] through the LM head
    (``logit_threshold`` [B, T]: each position's truncated distribution)."""
    head, transform = check_head(op, model)
    B, T = target.shape
    h2 = hidden.reshape(B * T, hidden.shape[-1])
    threshold = logit_threshold.reshape(B * T) if logit_threshold is not None else None
    kw = dict(temperature=temperature, ignore_index=IGNORE_INDEX, return_entropy=return_entropy,
              logit_threshold=threshold, logit_scale=transform.scale, logit_softcap=transform.softcap)
    if vocab_parallel(head):
        from ...parallel.vocab_parallel import sharded_linear_logprob, vocab_parallel_linear_logprob

        if head.group is not None:
            out = vocab_parallel_linear_logprob(h2, head.weight, target.reshape(B * T), head.bias,
                                                shards=head.shards, group=head.group, **kw)
        else:
            out = sharded_linear_logprob(h2, head.weight, target.reshape(B * T), head.bias, shards=head.shards, **kw)
    else:
        out = linear_logprob(h2, head.weight, target.reshape(B * T), getattr(head, "bias", None), **kw)
    if return_entropy:
        logp, ent = out
        return logp.reshape(B, T), ent.reshape(B, T)
    return out.reshape(B, T)


def vocab_size(model: nn.Module) -> int | None:
    """How many ids the model's input embedding can index (None where it cannot be read)."""
    emb = model.get_input_embeddings() if callable(getattr(model, "get_input_embeddings", None)) else None
    mods = coverage.parallel_modules()
    if mods is not None and isinstance(emb, mods.VocabParallelEmbedding):
        return emb.num_embeddings  # every rank's rows together
    weight = getattr(emb, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return weight.shape[0]  # the rows the embedding can index (may exceed config.vocab_size)
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    return size if isinstance(size, int) else None


def check_ids(op: str, model: nn.Module, input_ids: torch.Tensor) -> None:
    """ValueError naming ``rlkernels.<op>`` (the public function called), the first id of
    ``input_ids`` [B, L] outside [0, vocab) and its (batch, index); one host sync."""
    vocab = vocab_size(model)
    if vocab is None or input_ids.numel() == 0:
        return
    bad = (input_ids < 0) | (input_ids >= vocab)
    if bool(bad.any()):
        b, i = (int(v) for v in bad.nonzero()[0])
        raise ValueError(f"rlkernels.{op}: input_ids[{b}, {i}] = {int(input_ids[b, i])} is outside "
                         f"the model's vocabulary [0, {vocab}) (first bad id, at batch {b}, index {i})")


def is_int(value: object) -> bool:
    """An integer id or count: any ``numbers.Integral`` (numpy's too) but a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def warn_attention(op: str, model: nn.Module, batch_invariant: bool | None, stacklevel: int) -> None:
    """Warn, naming ``rlkernels.<op>`` and pointing ``stacklevel`` frames above the caller,
    where the model's attention implementation is neither the patched one nor eager (which
    the mode covers), unless the caller left the mode alone (``batch_invariant=False``):
    that attention's sums depend on the batch."""
    impl = attention_implementation(model)
    if batch_invariant is not False and impl not in (None, "eager", attention.NAME):
        warnings.warn(f"rlkernels.{op}: attention implementation {impl!r} is not batch-invariant; "
                      "call rlkernels.patch_model(model) first", stacklevel=stacklevel + 1)


def eos_token_ids(op: str, model: nn.Module, eos_token_id: object) -> list[int]:
    """The EOS ids a decode ends at: ``eos_token_id`` (an int, or a list, tuple or integer
    tensor of them; None: the model's ``generation_config``'s), checked: TypeError naming
    ``rlkernels.<op>`` for anything else."""
    if eos_token_id is None:
        eos_token_id = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos_token_id is None:
        return []
    if isinstance(eos_token_id, torch.Tensor):
        if eos_token_id.dtype.is_floating_point or eos_token_id.dtype.is_complex or eos_token_id.dtype == torch.bool:
            raise TypeError(f"rlkernels.{op}: eos_token_id must be an int or a list of ints, got a "
                            f"{eos_token_id.dtype} tensor")
        values = eos_token_id.reshape(-1).tolist()
    else:
        values = list(eos_token_id) if isinstance(eos_token_id, (list, tuple)) else [eos_token_id]
    for v in values:
        if not is_int(v):
            raise TypeError(f"rlkernels.{op}: eos_token_id must be an int or a list of ints, got {v!r}")
    return [int(v) for v in values]


def token_logprobs(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                   temperature: float = 1.0, return_entropy: bool = False,
                   batch_invariant: bool | None = None, logit_threshold: torch.Tensor | None = None):
    """Per-token log-probs of ``input_ids`` under ``model``: [B, L-1] float32.

    Position t scores ``input_ids[:, t+1]`` given ``input_ids[:, :t+1]``; targets
    that are padding (or follow padding) give 0 (and entropy 0). Positions are
    recomputed from ``attention_mask``, so left and right padding mean the same
    sequences. The LM head and log-softmax are the fused
    :func:`~rlkernels.ops.linear_logprob.linear_logprob`. ``batch_invariant``: None
    (default) runs a patched model (:func:`rlkernels.patch_model`, :func:`rlkernels.is_patched`) as it is
    and any other model's decoder under :func:`rlkernels.set_batch_invariant_mode`; True always
    enters the mode; False leaves the current mode alone. An unpatched model is not
    invariant to left padding even under the mode (its attention's row sums shift);
    see docs/operators/batch_invariant_mode.md for what the mode covers.

    An empty batch (B = 0) gives empty [0, L-1] results. Every id (padding included:
    all of them go through the embedding) must lie in ``[0, vocab)``, the rows of the
    input embedding; the first one outside raises ValueError with its (batch, index),
    before the model runs.

    ``logit_threshold``: [B, L-1] fp32 (fp64 for an fp64 model), the kept sets of a
    truncated sampler (top-k / top-p): position t scores ``input_ids[:, t+1]`` under the
    distribution over the logits ``>= logit_threshold[:, t]`` (-inf: every logit), and the
    gradient flows through the kept logits only (:func:`rlkernels.linear_logprob`). With
    :func:`rlkernels.generate`'s ``return_thresholds`` placed at the new tokens' positions,
    these are the sampler's log-probs bitwise.
    """
    if input_ids.dim() != 2:
        raise ValueError(f"rlkernels.token_logprobs: input_ids must be [B, L], got {tuple(input_ids.shape)}")
    check_mask("token_logprobs", input_ids, attention_mask)
    temperature = require_temperature("token_logprobs", temperature)
    head, _ = check_head("token_logprobs", model)
    layout = layout_of(model)
    if (layout is not None and layout.world > 1 and layout.no_backward is not None and torch.is_grad_enabled()
            and any(p.requires_grad for p in model.parameters())):
        raise ValueError(f"rlkernels.token_logprobs: the model is tensor-parallel over {layout.world} ranks, where "
                         f"its backward is not built ({layout.no_backward}); score under torch.no_grad(), or "
                         "train the group=None layout")
    check_ids("token_logprobs", model, input_ids)
    B, L = input_ids.shape
    if logit_threshold is not None:
        _check_threshold(model, input_ids, logit_threshold)
    if L < 2:
        empty = torch.zeros(B, 0, dtype=torch.float32, device=input_ids.device)
        return (empty, empty.clone()) if return_entropy else empty
    if B == 0:
        # No sequences: the decoder cannot run on an empty batch, but the head can score
        # zero rows (the result's dtype, and its graph to the head's weight, as for B > 0).
        head = model.get_output_embeddings()
        width = head.weight.shape[1] if isinstance(getattr(head, "weight", None), torch.Tensor) else 0
        hidden = torch.zeros(0, L - 1, width, dtype=head.weight.dtype if width else torch.float32,
                             device=input_ids.device)
        return logprobs_from_hidden(model, hidden, input_ids[:, 1:], temperature=temperature,
                                    return_entropy=return_entropy, logit_threshold=logit_threshold)
    warn_attention("token_logprobs", model, batch_invariant, stacklevel=2)
    # An FSDP2 root gathers its own parameters (embedding, final norm, head) around this call.
    return fsdp.run_as_forward(model, _score, model, input_ids, attention_mask, temperature, return_entropy,
                               batch_invariant, logit_threshold)


def _check_threshold(model: nn.Module, input_ids: torch.Tensor, logit_threshold: object) -> None:
    """token_logprobs' ``logit_threshold``: linear_logprob's checks, for the [B, L-1] scored
    positions, before the model runs."""
    B, L = input_ids.shape
    validate_threshold("token_logprobs", logit_threshold, (B, max(L - 1, 0)),
                       model.get_output_embeddings().weight.dtype, input_ids.device)


def _score(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, temperature: float,
           return_entropy: bool, batch_invariant: bool | None, logit_threshold: torch.Tensor | None = None):
    with mode_for(model, batch_invariant):
        hidden = hidden_states(model, input_ids, attention_mask)
        target = next_token_targets(input_ids, attention_mask)
        return logprobs_from_hidden(model, hidden[:, :-1], target, temperature=temperature,
                                    return_entropy=return_entropy, logit_threshold=logit_threshold)
