"""``rlkernels.generate``: the host side of the sampler.

``generate`` is the sampler's side of ``token_logprobs``' formula: a static-cache decode
loop (:mod:`.decode`) whose every token is drawn by :func:`rlkernels.linear_sample` from
the fp32 distribution ``token_logprobs`` scores, with that token's log-prob bitwise the
trainer's. Here its options and prompts are checked (errors name ``rlkernels.generate``)
and the decode is run, as the root's forward where the model is sharded by FSDP2
(:mod:`~rlkernels.integrations.trainers.fsdp`).
"""
from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from ...ops._validate import require_temperature
from ...ops.lm_head.truncation import truncates, validate_truncation
from ..trainers import fsdp
from . import decode, moe
from .coverage import is_patched
from .scoring import (check_head, check_ids, check_mask, eos_token_ids, head_vocab, is_int, vocab_parallel,
                      warn_attention)


# Options that would draw from another distribution than the one whose log-probs are
# returned and trained (softmax of the fp32 logits / T), with why.
_REFUSED_OPTIONS = {
    "min_new_tokens": "forbidding EOS draws from a distribution without it, which the trainer does not score",
    "generator": "the draws are keyed by seed=, streams= and each token's position, not a torch.Generator",
    "repetition_penalty": "a penalty draws from reweighted logits whose log-probs the trainer does not score",
}
# What the model's generation_config says about sampling, read when the call does not pass
# do_sample (as Hugging Face's generate reads it): its temperature, top_k and top_p are
# taken, and a filter it sets that the library does not draw with is refused rather than
# left out.
_CONFIG_FILTERS = ("min_new_tokens", "repetition_penalty")


def _is_neutral(option: str, value: Any) -> bool:
    if value is None:
        return True
    if option == "min_new_tokens":
        return value == 0
    if option == "repetition_penalty":
        return value == 1.0
    return False


def _sampling(config: Any, generate_kwargs: dict[str, Any], temperature: float | None, top_k: int | None,
              top_p: float | None) -> tuple[bool, float, int, float, str]:
    """(do_sample, T, top_k, top_p, where the truncation came from): the call's own when it
    passes ``do_sample`` (T: ``temperature``, else 1; top-k and top-p: the call's, else
    none); otherwise the model's generation_config's, its temperature, top_k and top_p
    included where the call passes none, refusing a filter the config sets that the draw
    would leave out. Greedy decoding truncates nothing (the argmax is always kept)."""
    if "do_sample" in generate_kwargs or not getattr(config, "do_sample", False):
        do_sample = bool(generate_kwargs.get("do_sample", False))
        temperature = 1.0 if temperature is None else temperature
        source = "the call"
    else:
        for option in _CONFIG_FILTERS:
            value = getattr(config, option, None)
            if not _is_neutral(option, value):
                raise ValueError(f"rlkernels.generate: the model's generation_config samples with "
                                 f"{option}={value!r}, which is not supported ({_REFUSED_OPTIONS[option]}); pass "
                                 f"do_sample=True to sample without it, or unset generation_config.{option}")
        do_sample = True
        if temperature is None:
            temperature = require_temperature("generate", getattr(config, "temperature", None) or 1.0)
        top_k = getattr(config, "top_k", None) if top_k is None else top_k
        top_p = getattr(config, "top_p", None) if top_p is None else top_p
        source = "the model's generation_config"
    top_k = 0 if top_k is None else top_k
    top_p = 1.0 if top_p is None else top_p
    validate_truncation("generate", top_k, top_p)
    return do_sample, temperature, int(top_k), float(top_p), source


def _check_decode_options(generate_kwargs: dict[str, Any]) -> None:
    for option, value in generate_kwargs.items():
        if option in _REFUSED_OPTIONS and not _is_neutral(option, value):
            raise ValueError(f"rlkernels.generate: {option}={value!r} is not supported: {_REFUSED_OPTIONS[option]}")
    if generate_kwargs.get("num_beams") not in (None, 1):
        raise ValueError(f"rlkernels.generate: num_beams={generate_kwargs['num_beams']!r} is not supported (the "
                         "log-prob of a token is taken from the forward that produced it)")
    unknown = sorted(set(generate_kwargs) - decode.SUPPORTED_OPTIONS - set(_REFUSED_OPTIONS) - {"num_beams"})
    if unknown:
        raise ValueError(f"rlkernels.generate: the options {unknown} are not supported "
                         f"(supported: {sorted(decode.SUPPORTED_OPTIONS)}, plus seed= and streams=)")


def _check_prompt_mask(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
    """ValueError naming the first prompt row that is not left-padded or has no token; one host sync.

    New tokens are appended after the last column, so a right-padded prompt would put
    padding between its tokens and its continuation. A row of padding alone has no
    token to condition on: the trainer's ``token_logprobs`` scores no position there
    and the sampler's first log-prob would have no counterpart."""
    check_mask("generate", input_ids, attention_mask)
    if attention_mask is None or input_ids.numel() == 0:
        return
    mask = attention_mask.bool()
    empty = ~mask.any(dim=1)
    not_left = (mask[:, :-1] & ~mask[:, 1:]).any(dim=1)
    bad = torch.stack([empty, not_left]).cpu()
    if bool(bad[0].any()):
        row = int(bad[0].nonzero()[0])
        raise ValueError(f"rlkernels.generate: prompt row {row} is all padding (attention_mask[{row}] has no 1); "
                         "every prompt needs at least one token")
    if bool(bad[1].any()):
        row = int(bad[1].nonzero()[0])
        raise ValueError(f"rlkernels.generate: prompt row {row} is not left-padded (a 0 follows a 1 in "
                         f"attention_mask[{row}]); prompts must be left-padded (tokenizer.padding_side = 'left')")


def generate(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
             temperature: float | None = None, return_entropy: bool = False, batch_invariant: bool | None = None,
             cuda_graph: bool = False, seed: int | None = None, streams: torch.Tensor | None = None,
             cache_len: int | None = None, top_k: int | None = None, top_p: float | None = None,
             return_thresholds: bool = False, **generate_kwargs: Any):
    """Decode left-padded prompts, drawing every token from the distribution the trainer scores.

    Returns ``(sequences, logprobs)`` (and ``entropy`` with ``return_entropy``):
    sequences [B, L + T] (prompts as given, then the new tokens), logprobs / entropy
    [B, T] fp32 with no autograd graph, where ``logprobs[:, t]`` is the log-prob of
    ``sequences[:, L + t]`` at ``temperature``; tokens after a sequence's EOS are
    ``pad_token_id`` (without one: the first EOS id) and get 0.

    Each token is :func:`rlkernels.linear_sample` of the final hidden state that precedes
    it: drawn from ``softmax(z / T)`` with ``z`` the LM head's fp32 logits by the canonical
    chain (``do_sample=True``), or their argmax, ties to the lowest id (the default). Its
    log-prob is bitwise :func:`rlkernels.token_logprobs`' for that token, on the finished sequences,
    one at a time, batched, left- or right-padded or packed, on a patched model: the
    importance ratio between sampler and trainer is exactly 1, and so is the ratio between
    the policy that drew the tokens and the one being trained.

    A row's tokens depend on its prompt, the model, T, ``seed`` and its stream alone: the
    draw of its token at position p (counted from the row's first real token) is keyed by
    (seed, stream, p). ``seed``: a Python int in [0, 2^63) (None: drawn from torch's
    default generator, so ``torch.manual_seed`` reproduces a rollout); ``streams``: int64
    [B] (None: ``arange(B)``; pass each prompt's own id to reproduce it in any batch).

    Sampling settings: a call that passes ``do_sample`` samples (or not) at ``temperature``
    (None: 1) with its own ``top_k``/``top_p`` (None: none). A call that does not takes
    the model's ``generation_config`` as Hugging Face's generate does: its ``do_sample``
    and, where the call passes none, its temperature, ``top_k`` and ``top_p``; a filter the
    config sets that the draw would leave out (``min_new_tokens``, ``repetition_penalty``
    other than neutral) is refused, naming it. Greedy decoding reports log-probs at
    ``temperature`` too, and truncates nothing.

    Truncated sampling: ``top_k`` (0: off) and ``top_p`` (1: off) draw each token exactly
    from the truncated fp32 distribution, in Hugging Face's order (:func:`rlkernels.linear_sample`),
    and its log-prob is that distribution's. The trainer scores the same distribution from
    the kept sets: ``return_thresholds=True`` returns each draw's threshold tau last,
    [B, T] fp32 (-inf after a row's EOS), and :func:`rlkernels.token_logprobs` with
    ``logit_threshold`` (tau at the new tokens' positions, -inf elsewhere) gives these
    log-probs bitwise. A call that truncates without ``return_thresholds`` is refused:
    its log-probs could not be scored again.

    Options: ``max_new_tokens``, ``do_sample``, ``pad_token_id``, ``eos_token_id``.
    ``min_new_tokens``, ``repetition_penalty`` (other than their neutral values) and
    ``generator`` are refused, naming why; beam search and any other option are refused
    too. The decode loop keeps a ``StaticCache`` (:mod:`rlkernels.integrations.hf.decode`);
    ``cuda_graph=True`` (a patched model on CUDA) replays each step, the draw included,
    from one captured CUDA graph, with the eager loop's bits. The cache, the step's
    buffers and the graph are kept for the model (one entry per model, for the newest
    batch size, ``L + max_new_tokens``, T, greedy vs sampled and weights' memory), so a
    later call with the same ones -- whatever its prompts, seed and streams -- replays the
    graph from its first decode step, with a fresh call's bits; the entry holds the
    cache's memory until the model goes or :func:`rlkernels.release_decode_graphs` drops it.
    ``cuda_graph=False`` keeps nothing. ``cache_len``: the static cache's length (None:
    ``L + max_new_tokens``, at least that otherwise). The tokens and log-probs do not
    depend on it (the slots past a row's keys are masked out of the attention's fixed
    chain); pinning it lets calls whose prompt lengths differ replay one kept graph.
    ``batch_invariant`` as in :func:`rlkernels.token_logprobs`: a patched model runs without the mode.
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError("rlkernels.generate: input_ids must be a [B, L] tensor")
    if temperature is not None:
        temperature = require_temperature("generate", temperature)
    if generate_kwargs.get("return_dict_in_generate"):
        raise ValueError("rlkernels.generate: return_dict_in_generate is not supported; it returns the sequences")
    generate_kwargs.pop("temperature", None)  # given once, above
    _check_decode_options(generate_kwargs)
    if cuda_graph and fsdp.is_fsdp(model):
        raise ValueError("rlkernels.generate: cuda_graph=True is not supported on an FSDP2 (fully_shard) model: "
                         "its layers gather their parameters in every step's forward; decode eagerly, or from an "
                         "unsharded copy")
    if cuda_graph and input_ids.device.type != "cuda":
        raise ValueError(f"rlkernels.generate: cuda_graph=True needs a model and inputs on a CUDA device, "
                         f"got {input_ids.device}")
    if cuda_graph and not is_patched(model):
        raise ValueError("rlkernels.generate: cuda_graph=True runs a patched model's decode step as a graph; "
                         "call rlkernels.patch_model(model) first")
    if cuda_graph and moe.has_moe_blocks(model) and not moe.experts_capture(input_ids.device):
        raise ValueError("rlkernels.generate: cuda_graph=True on a mixture-of-experts model needs the Triton "
                         "backend: the torch backend runs one GEMM per expert that received tokens, sized on the "
                         "host every step (a host sync a graph cannot capture); decode eagerly (cuda_graph=False)")
    check_head("generate", model)
    if input_ids.shape[1] == 0:
        raise ValueError("rlkernels.generate: input_ids has no tokens ([B, 0]); every prompt needs at least one")
    check_ids("generate", model, input_ids)
    _check_prompt_mask(input_ids, attention_mask)
    config = getattr(model, "generation_config", None)
    max_new = generate_kwargs.get("max_new_tokens", getattr(config, "max_new_tokens", None))
    if max_new is None and isinstance(getattr(config, "max_length", None), int):
        max_new = max(0, config.max_length - input_ids.shape[1])  # Hugging Face's reading of max_length
    if max_new is None:
        raise ValueError("rlkernels.generate: pass max_new_tokens (the model's generation_config sets neither "
                         "max_new_tokens nor max_length)")
    if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 0:
        raise ValueError(f"rlkernels.generate: max_new_tokens must be an int >= 0, got {max_new!r}")
    if cache_len is not None and (isinstance(cache_len, bool) or not isinstance(cache_len, int)
                                  or cache_len < input_ids.shape[1] + max_new):
        raise ValueError(f"rlkernels.generate: cache_len must be an int >= the prompt length plus max_new_tokens "
                         f"({input_ids.shape[1]} + {max_new}), got {cache_len!r}")
    do_sample, temperature, top_k, top_p, source = _sampling(config, generate_kwargs, temperature, top_k, top_p)
    truncating = do_sample and truncates(top_k, top_p, head_vocab(model.get_output_embeddings()))
    if truncating and not return_thresholds:
        raise ValueError(f"rlkernels.generate: {source} samples with top_k={top_k}, top_p={top_p}: the tokens are "
                         "drawn from the truncated distribution, whose log-probs the trainer scores only with each "
                         "draw's kept set; pass return_thresholds=True (and hand them to token_logprobs as "
                         "logit_threshold), or do_sample=True without top_k/top_p to sample the full distribution")
    if not truncating:
        top_k, top_p = 0, 1.0
    if vocab_parallel(model.get_output_embeddings()) and cuda_graph:
        raise ValueError("rlkernels.generate: on a tensor-parallel model (rlkernels.tensor_parallel) the draw is "
                         "the vocabulary-parallel sampler's, whose collectives run eagerly: got cuda_graph=True")
    warn_attention("generate", model, batch_invariant, stacklevel=2)
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(limit, int) and input_ids.shape[1] + max_new > limit:
        # Hugging Face's generate warns too: positions past the limit were never trained.
        warnings.warn(f"rlkernels.generate: the prompt ({input_ids.shape[1]} tokens) plus max_new_tokens "
                      f"({max_new}) exceeds the model's max_position_embeddings ({limit})", stacklevel=2)
    eos = eos_token_ids("generate", model, generate_kwargs.get("eos_token_id"))
    pad = generate_kwargs.get("pad_token_id", getattr(config, "pad_token_id", None))
    if pad is not None and not is_int(pad):
        raise TypeError(f"rlkernels.generate: pad_token_id must be an int (or None), got {pad!r}")
    B = input_ids.shape[0]
    if do_sample:
        if seed is None:
            seed = int(torch.randint(0, 1 << 62, (1,)))
        streams = streams if streams is not None else torch.arange(B, device=input_ids.device)
    mask = attention_mask.long() if attention_mask is not None else torch.ones_like(input_ids)
    if max_new == 0 or B == 0:
        empty = torch.zeros(B, 0, dtype=torch.float32, device=input_ids.device)
        out = (input_ids, empty, empty.clone(), empty.clone())
    else:
        out = fsdp.run_as_forward(
            model, decode.decode_under_mode, model, input_ids, mask, batch_invariant,
            dict(max_new_tokens=max_new, greedy=not do_sample, temperature=temperature, seed=seed or 0,
                 streams=streams, pad_token_id=pad, eos_token_ids=eos,
                 cuda_graph=cuda_graph, cache_len=cache_len, top_k=top_k, top_p=top_p, return_thresholds=True))
    sequences, logp, ent, thresholds = out
    result = (sequences, logp, ent) if return_entropy else (sequences, logp)
    return result + (thresholds,) if return_thresholds else result
