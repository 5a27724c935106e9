"""Hugging Face causal LMs: ``patch_model``, ``token_logprobs`` and ``generate``.

``patch_model`` swaps every ``nn.Linear`` for :class:`rlkernels.Linear` and every
``*RMSNorm`` module (Llama, Qwen2, Qwen3, Mistral, ... -- anything with ``weight``
and ``variance_epsilon``/``eps`` computing the HF RMSNorm formula) for
:class:`rlkernels.RMSNorm`, sharing the Parameter objects, and selects the
``"rlkernels"`` attention implementation (``integrations.hf_attention``): the fused
attention whose rows do not depend on the batch, the padding side, packing, or
prefill vs decode. SDPA / flash kernels pick their split and tile strategy from the
batch and sequence shape, and eager attention's row sums shift with left padding.

``token_logprobs`` scores the next tokens with :func:`rlkernels.linear_logprob` on
the final hidden states, so the [tokens, vocab] logits are never materialised. A
patched model (:func:`is_patched`) runs as it is: every op of its forward that
reduces is already an invariant one, so it needs no per-call Python override; any
other model's decoder runs under the batch-invariant mode. ``generate`` is the sampler's
side of the same formula: a static-cache decode loop (:mod:`.hf_decode`) whose every
token is drawn by :func:`rlkernels.linear_sample` from the fp32 distribution
``token_logprobs`` scores, with that token's log-prob bitwise the trainer's.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import types
import warnings
from typing import Any

import torch
from torch import nn

from . import fsdp, hf_attention, hf_coverage, hf_decode, hf_mlp, hf_moe, hf_rotary
from .batch_invariant import set_batch_invariant_mode
from .hf_decode import release_decode_graphs  # noqa: F401  (generate's kept decode state; public)
from ..nn import Linear
from ..nn import LMHead
from ..nn import RMSNorm
from ..nn import SiLU
from ..ops._validate import require_temperature
from ..ops.linear_logprob import linear_logprob

IGNORE_INDEX = -100


def _is_rms_norm(module: nn.Module) -> bool:
    return (type(module).__name__.endswith("RMSNorm") and not isinstance(module, RMSNorm)
            and isinstance(getattr(module, "weight", None), torch.Tensor)
            and (hasattr(module, "variance_epsilon") or hasattr(module, "eps"))
            # Gemma-style (1 + weight) norms compute a different formula: leave them alone.
            and "Gemma" not in type(module).__name__)


def _is_silu(module: nn.Module) -> bool:
    """``nn.SiLU`` (not in place) or transformers' ``SiLUActivation``: x * sigmoid(x)."""
    kind = type(module)
    if kind is nn.SiLU:
        return not module.inplace
    return kind.__name__ == "SiLUActivation" and kind.__module__ == "transformers.activations"


def patch_model(model: nn.Module, *, attn_implementation: str | None = hf_attention.NAME) -> nn.Module:
    """Make an HF causal LM's Linear, RMSNorm and SiLU layers batch-invariant, in place; returns ``model``.

    The LM head becomes an :class:`rlkernels.nn.LMHead`: its logits are fp32, the
    distribution ``token_logprobs`` scores and ``generate`` draws from, so Hugging Face's
    own ``generate`` samples from it too (not from its rounding to the model dtype).

    Only modules whose type is exactly ``nn.Linear`` are swapped (quantized, LoRA or
    tensor-parallel subclasses are left alone and are not covered).

    Parameters are shared, never copied (tied embeddings stay tied; optimizer state
    keeps pointing at the same tensors). ``attn_implementation`` ("rlkernels" by
    default, the invariant one; "eager" is invariant under the mode except to left
    padding; None leaves it unchanged) is set on the model.

    The mixture-of-experts blocks of Qwen3-MoE, Qwen2-MoE and Mixtral become
    :class:`rlkernels.nn.SparseMoeBlock` (:mod:`~rlkernels.integrations.hf_moe`); one whose
    configuration that block would compute differently (a router with a bias, expert
    counts or top-k that do not match the weights, router jitter, another activation) is
    refused with a ValueError naming it, before anything is swapped.

    Inside a patched decoder's forward the attention layers' rotary embedding runs as one
    launch with transformers' bits (:mod:`~rlkernels.integrations.hf_rotary`: the family's
    ``apply_rotary_pos_emb`` becomes a dispatcher that calls the original anywhere else), and
    the gated MLPs' ``silu(gate) * up`` is one launch (:mod:`~rlkernels.integrations.hf_mlp`).

    A model with modules the library does not cover (:mod:`~rlkernels.integrations.hf_coverage`:
    GPT-2's ``Conv1D``, ``LayerNorm``, other mixture-of-experts blocks, families not verified)
    is patched as far as it goes, with a warning naming those modules; :func:`is_patched`
    is then False, so :func:`token_logprobs` and :func:`generate` run it under the mode.
    """
    if attn_implementation == hf_attention.NAME:
        hf_attention.register()
    # MoE blocks first (a refusal raises before anything else is swapped); the loop below
    # then patches their shared experts' Linear and SiLU children like any MLP's.
    hf_moe.patch_moe_blocks(model)
    head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            # Exact type: subclasses (quantized / LoRA / parallel linears) compute something else.
            if type(child) is nn.Linear:
                setattr(parent, name, (LMHead if child is head else Linear).from_torch(child))
            elif _is_rms_norm(child):
                setattr(parent, name, RMSNorm.from_module(child))
            elif _is_silu(child):
                setattr(parent, name, SiLU())
    if attn_implementation is not None:
        _set_attention(model, attn_implementation)
    hf_rotary.install(model)
    hf_mlp.install(model)
    _keep_out_of_compile(model)
    gaps = hf_coverage.describe_gaps(model)
    if gaps is not None:
        warnings.warn(f"rlkernels.patch_model: {type(model).__name__} is only partly covered ({gaps}). "
                      "Their ops may reduce across features or tokens with stock kernels: "
                      "rlkernels.is_patched(model) is False, and token_logprobs / generate run the model under "
                      "the batch-invariant mode", stacklevel=2)
    return model


def _forward_eagerly(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    # Inside it, the attention layers' rotary embedding is one launch (hf_rotary).
    return hf_rotary.run_inside(type(self).forward, self, *args, **kwargs)


# Bound per decoder as its ``forward``: ``copy.deepcopy`` rebinds a bound method to the
# copy (a closure over the original's method would run the original's weights).
_forward_eagerly.__name__ = "forward"
_EAGER_FORWARD = torch.compiler.disable(_forward_eagerly)


def _keep_out_of_compile(model: nn.Module) -> None:
    """Run the decoder eagerly under ``torch.compile``, and keep Hugging Face from compiling.

    Inductor fuses the decoder's elementwise code (the rotary product, SiLU times the up
    projection, residual adds) into kernels that round differently from the eager ops,
    so a compiled forward would give other bits than ``token_logprobs`` and the eager
    decode. The decoder's forward is made opaque to dynamo (``torch.compiler.disable``):
    compiling a patched model compiles the code around it, and the tokens' bits stay the
    eager ones. ``generation_config.disable_compile`` keeps ``generate`` with a static
    cache from compiling the forward (with ``fullgraph=True`` an opaque decoder would not
    trace)."""
    decoder = decoder_of(model)
    decoder.forward = types.MethodType(_EAGER_FORWARD, decoder)
    config = getattr(model, "generation_config", None)
    if config is not None and hasattr(config, "disable_compile"):
        config.disable_compile = True


def is_patched(model: nn.Module) -> bool:
    """True where ``model``'s forward is invariant without the mode: the ``"rlkernels"``
    attention is selected and every module is covered
    (:func:`~rlkernels.integrations.hf_coverage.uncovered_modules` finds none): the
    library's Linear, RMSNorm and MoE block, gathers and elementwise modules, and the
    parameter-free modules of the verified families (Llama, Mistral, Qwen2, Qwen3 and the
    MoE Qwen3-MoE, Qwen2-MoE, Mixtral), whose other ops do
    not reduce across tokens (embedding gathers, rotary tables from a one-term product,
    elementwise activations and residual adds).
    """
    if attention_implementation(model) != hf_attention.NAME:
        return False
    return next(hf_coverage.uncovered_modules(model), None) is None


def mode_for(model: nn.Module, batch_invariant: bool | None = None) -> contextlib.AbstractContextManager:
    """The guard to run ``model`` under: the batch-invariant mode where asked (True), or
    (None) where the model is not :func:`is_patched`; otherwise nothing."""
    on = not is_patched(model) if batch_invariant is None else batch_invariant
    return set_batch_invariant_mode(True) if on else contextlib.nullcontext()


def _set_attention(model: nn.Module, impl: str) -> None:
    setter = getattr(model, "set_attn_implementation", None)
    if callable(setter):
        setter(impl)
    else:  # older transformers: the config field is what the attention layers read
        for module in model.modules():
            config = getattr(module, "config", None)
            if config is not None and hasattr(config, "_attn_implementation"):
                config._attn_implementation = impl


def attention_implementation(model: nn.Module) -> str | None:
    config = getattr(model, "config", None)
    return getattr(config, "_attn_implementation", None)


def decoder_of(model: nn.Module) -> nn.Module:
    """The base decoder (``model.model`` for ``*ForCausalLM``) that returns final hidden states."""
    base = getattr(model, "base_model", None)
    return base if isinstance(base, nn.Module) and base is not model else model


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids that count only real tokens (left padding starts each sequence at 0)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


@functools.lru_cache(maxsize=None)
def _cache_keyword(module_type: type) -> str:
    params = inspect.signature(module_type.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_kwargs(module: nn.Module, cache: Any) -> dict[str, Any]:
    """The KV cache as the keyword this module's forward takes.

    Recent transformers 5.x releases name it ``cache`` and warn (a FutureWarning per
    call) on ``past_key_values``; earlier releases only know ``past_key_values``. The
    cache is updated in place, so callers never read it back from the output (which
    warns too).
    """
    return {_cache_keyword(type(module)): cache}


def hidden_states(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                  position_ids: torch.Tensor | None = None, past_key_values: Any = None,
                  use_cache: bool = False) -> torch.Tensor:
    """Final (post-norm) hidden states [B, L, H] of the decoder; no logits."""
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if position_ids is None:
        if past_key_values is not None:
            raise ValueError("rlkernels.hidden_states: pass position_ids when continuing from a KV cache")
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


def check_head(op: str, model: nn.Module) -> nn.Module:
    """The LM head, where the model's logits are ``hidden @ head.weight.T (+ bias)``; else ValueError.

    The fused log-prob applies no scale or cap after the head: a model that has one
    (:data:`~rlkernels.integrations.hf_coverage.LOGIT_TRANSFORMS`) would be scored by
    another distribution than its own, so it is refused, naming the field."""
    head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    if not isinstance(head, nn.Linear):
        raise TypeError(f"rlkernels.{op}: {type(model).__name__}'s output embedding is "
                        f"{type(head).__name__ if head is not None else 'missing'}, not a linear LM head")
    transforms = hf_coverage.logit_transforms(model)
    if transforms:
        raise ValueError(f"rlkernels.{op}: {type(model).__name__} changes its logits after the LM head "
                         f"({', '.join(transforms)}); the fused head computes hidden @ W.T only, so its "
                         "log-probs would not be the model's. Such heads are not supported")
    return head


def logprobs_from_hidden(model: nn.Module, hidden: torch.Tensor, target: torch.Tensor, *,
                         temperature: float = 1.0, return_entropy: bool = False, op: str = "token_logprobs"):
    """linear_logprob of ``target`` [B, T] from ``hidden`` [B, T, H] through the LM head."""
    head = check_head(op, model)
    B, T = target.shape
    h2 = hidden.reshape(B * T, hidden.shape[-1])
    out = linear_logprob(h2, head.weight, target.reshape(B * T), getattr(head, "bias", None),
                         temperature=temperature, ignore_index=IGNORE_INDEX, return_entropy=return_entropy)
    if return_entropy:
        logp, ent = out
        return logp.reshape(B, T), ent.reshape(B, T)
    return out.reshape(B, T)


def _vocab_size(model: nn.Module) -> int | None:
    emb = model.get_input_embeddings() if callable(getattr(model, "get_input_embeddings", None)) else None
    weight = getattr(emb, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return weight.shape[0]  # the rows the embedding can index (may exceed config.vocab_size)
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    return size if isinstance(size, int) else None


def _check_ids(model: nn.Module, input_ids: torch.Tensor) -> None:
    """ValueError naming the first id outside [0, vocab) and its (batch, index); one host sync."""
    vocab = _vocab_size(model)
    if vocab is None or input_ids.numel() == 0:
        return
    bad = (input_ids < 0) | (input_ids >= vocab)
    if bool(bad.any()):
        b, i = (int(v) for v in bad.nonzero()[0])
        raise ValueError(f"rlkernels.token_logprobs: input_ids[{b}, {i}] = {int(input_ids[b, i])} is outside "
                         f"the model's vocabulary [0, {vocab}) (first bad id, at batch {b}, index {i})")


def token_logprobs(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                   temperature: float = 1.0, return_entropy: bool = False,
                   batch_invariant: bool | None = None):
    """Per-token log-probs of ``input_ids`` under ``model``: [B, L-1] float32.

    Position t scores ``input_ids[:, t+1]`` given ``input_ids[:, :t+1]``; targets
    that are padding (or follow padding) give 0 (and entropy 0). Positions are
    recomputed from ``attention_mask``, so left and right padding mean the same
    sequences. The LM head and log-softmax are the fused
    :func:`~rlkernels.ops.linear_logprob.linear_logprob`. ``batch_invariant``: None
    (default) runs a patched model (:func:`patch_model`, :func:`is_patched`) as it is
    and any other model's decoder under :func:`set_batch_invariant_mode`; True always
    enters the mode; False leaves the current mode alone. An unpatched model is not
    invariant to left padding even under the mode (its attention's row sums shift);
    see docs/operators/batch_invariant_mode.md for what the mode covers.

    An empty batch (B = 0) gives empty [0, L-1] results. Every id (padding included:
    all of them go through the embedding) must lie in ``[0, vocab)``, the rows of the
    input embedding; the first one outside raises ValueError with its (batch, index),
    before the model runs.
    """
    if input_ids.dim() != 2:
        raise ValueError(f"rlkernels.token_logprobs: input_ids must be [B, L], got {tuple(input_ids.shape)}")
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError("rlkernels.token_logprobs: attention_mask must match input_ids' shape")
    temperature = require_temperature("token_logprobs", temperature)
    check_head("token_logprobs", model)
    _check_ids(model, input_ids)
    B, L = input_ids.shape
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
                                    return_entropy=return_entropy)
    impl = attention_implementation(model)
    if batch_invariant is not False and impl not in (None, "eager", hf_attention.NAME):
        warnings.warn(f"rlkernels.token_logprobs: attention implementation {impl!r} is not batch-invariant; "
                      "call rlkernels.patch_model(model) first", stacklevel=2)
    # An FSDP2 root gathers its own parameters (embedding, final norm, head) around this call.
    return fsdp.run_as_forward(model, _score, model, input_ids, attention_mask, temperature, return_entropy,
                               batch_invariant)


def _score(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, temperature: float,
           return_entropy: bool, batch_invariant: bool | None):
    with mode_for(model, batch_invariant):
        hidden = hidden_states(model, input_ids, attention_mask)
        target = next_token_targets(input_ids, attention_mask)
        return logprobs_from_hidden(model, hidden[:, :-1], target, temperature=temperature,
                                    return_entropy=return_entropy)


def _eos_ids(model: nn.Module, generate_kwargs: dict[str, Any]) -> list[int]:
    eos = generate_kwargs.get("eos_token_id", getattr(getattr(model, "generation_config", None), "eos_token_id", None))
    return [eos] if isinstance(eos, int) else list(eos or [])


# Options that would draw from another distribution than the one whose log-probs are
# returned and trained (softmax of the fp32 logits / T), with why.
_REFUSED_OPTIONS = {
    "top_k": "a top-k filter draws from a truncated distribution whose log-probs the trainer does not score",
    "top_p": "a nucleus filter draws from a truncated distribution whose log-probs the trainer does not score",
    "min_new_tokens": "forbidding EOS draws from a distribution without it, which the trainer does not score",
    "generator": "the draws are keyed by seed=, streams= and each token's position, not a torch.Generator",
}


def _is_neutral(option: str, value: Any) -> bool:
    if value is None:
        return True
    if option == "top_k":
        return value == 0
    if option == "top_p":
        return value == 1.0
    if option == "min_new_tokens":
        return value == 0
    return False


def _check_decode_options(generate_kwargs: dict[str, Any]) -> None:
    for option, value in generate_kwargs.items():
        if option in _REFUSED_OPTIONS and not _is_neutral(option, value):
            raise ValueError(f"rlkernels.generate: {option}={value!r} is not supported: {_REFUSED_OPTIONS[option]}")
    if generate_kwargs.get("num_beams") not in (None, 1):
        raise ValueError(f"rlkernels.generate: num_beams={generate_kwargs['num_beams']!r} is not supported (the "
                         "log-prob of a token is taken from the forward that produced it)")
    unknown = sorted(set(generate_kwargs) - hf_decode.SUPPORTED_OPTIONS - set(_REFUSED_OPTIONS) - {"num_beams"})
    if unknown:
        raise ValueError(f"rlkernels.generate: the options {unknown} are not supported "
                         f"(supported: {sorted(hf_decode.SUPPORTED_OPTIONS)}, plus seed= and streams=)")


def _check_prompt_mask(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
    """ValueError naming the first prompt row that is not left-padded or has no token; one host sync.

    New tokens are appended after the last column, so a right-padded prompt would put
    padding between its tokens and its continuation. A row of padding alone has no
    token to condition on: the trainer's ``token_logprobs`` scores no position there
    and the sampler's first log-prob would have no counterpart."""
    if attention_mask is None or input_ids.numel() == 0:
        return
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"rlkernels.generate: attention_mask has shape {tuple(attention_mask.shape)}, "
                         f"input_ids {tuple(input_ids.shape)}")
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
             temperature: float = 1.0, return_entropy: bool = False, batch_invariant: bool | None = None,
             cuda_graph: bool = False, seed: int | None = None, streams: torch.Tensor | None = None,
             cache_len: int | None = None, **generate_kwargs: Any):
    """Decode left-padded prompts, drawing every token from the distribution the trainer scores.

    Returns ``(sequences, logprobs)`` (and ``entropy`` with ``return_entropy``):
    sequences [B, L + T] (prompts as given, then the new tokens), logprobs / entropy
    [B, T] fp32 with no autograd graph, where ``logprobs[:, t]`` is the log-prob of
    ``sequences[:, L + t]`` at ``temperature``; tokens after a sequence's EOS are
    ``pad_token_id`` and get 0.

    Each token is :func:`rlkernels.linear_sample` of the final hidden state that precedes
    it: drawn from ``softmax(z / T)`` with ``z`` the LM head's fp32 logits by the canonical
    chain (``do_sample=True``), or their argmax, ties to the lowest id (the default). Its
    log-prob is bitwise :func:`token_logprobs`' for that token, on the finished sequences,
    one at a time, batched, left- or right-padded or packed, on a patched model: the
    importance ratio between sampler and trainer is exactly 1, and so is the ratio between
    the policy that drew the tokens and the one being trained.

    A row's tokens depend on its prompt, the model, T, ``seed`` and its stream alone: the
    draw of its token at position p (counted from the row's first real token) is keyed by
    (seed, stream, p). ``seed``: a Python int in [0, 2^63) (None: drawn from torch's
    default generator, so ``torch.manual_seed`` reproduces a rollout); ``streams``: int64
    [B] (None: ``arange(B)``; pass each prompt's own id to reproduce it in any batch).

    Options: ``max_new_tokens``, ``do_sample``, ``pad_token_id``, ``eos_token_id``.
    ``top_k``, ``top_p``, ``min_new_tokens`` (other than their neutral values) and
    ``generator`` are refused, naming why; beam search and any other option are refused
    too. The decode loop keeps a ``StaticCache`` (:mod:`rlkernels.integrations.hf_decode`);
    ``cuda_graph=True`` (a patched model on CUDA) replays each step, the draw included,
    from one captured CUDA graph, with the eager loop's bits. The cache, the step's
    buffers and the graph are kept for the model (one entry per model, for the newest
    batch size, ``L + max_new_tokens``, T, greedy vs sampled and weights' memory), so a
    later call with the same ones -- whatever its prompts, seed and streams -- replays the
    graph from its first decode step, with a fresh call's bits; the entry holds the
    cache's memory until the model goes or :func:`release_decode_graphs` drops it.
    ``cuda_graph=False`` keeps nothing. ``cache_len``: the static cache's length (None:
    ``L + max_new_tokens``, at least that otherwise). The tokens and log-probs do not
    depend on it (the slots past a row's keys are masked out of the attention's fixed
    chain); pinning it lets calls whose prompt lengths differ replay one kept graph.
    ``batch_invariant`` as in :func:`token_logprobs`: a patched model runs without the mode.
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError("rlkernels.generate: input_ids must be a [B, L] tensor")
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
    if cuda_graph and hf_moe.has_moe_blocks(model) and not hf_moe.experts_capture(input_ids.device):
        raise ValueError("rlkernels.generate: cuda_graph=True on a mixture-of-experts model needs the Triton "
                         "backend: the torch backend runs one GEMM per expert that received tokens, sized on the "
                         "host every step (a host sync a graph cannot capture); decode eagerly (cuda_graph=False)")
    check_head("generate", model)
    _check_ids(model, input_ids)
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
    do_sample = bool(generate_kwargs.get("do_sample", getattr(config, "do_sample", False)))
    B = input_ids.shape[0]
    if do_sample:
        if seed is None:
            seed = int(torch.randint(0, 1 << 62, (1,)))
        streams = streams if streams is not None else torch.arange(B, device=input_ids.device)
    mask = attention_mask.long() if attention_mask is not None else torch.ones_like(input_ids)
    if max_new == 0 or B == 0:
        empty = torch.zeros(B, 0, dtype=torch.float32, device=input_ids.device)
        out = (input_ids, empty, empty.clone())
    else:
        pad = generate_kwargs.get("pad_token_id", getattr(config, "pad_token_id", None))
        out = fsdp.run_as_forward(
            model, _decode, model, input_ids, mask, batch_invariant,
            dict(max_new_tokens=max_new, greedy=not do_sample, temperature=temperature, seed=seed or 0,
                 streams=streams, pad_token_id=pad, eos_token_ids=_eos_ids(model, generate_kwargs),
                 cuda_graph=cuda_graph, cache_len=cache_len, cache_kwargs=cache_kwargs))
    sequences, logp, ent = out
    return (sequences, logp, ent) if return_entropy else (sequences, logp)


def _decode(model: nn.Module, input_ids: torch.Tensor, mask: torch.Tensor, batch_invariant: bool | None,
            options: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    with mode_for(model, batch_invariant):
        return hf_decode.static_generate(model, decoder_of(model), input_ids, mask, **options)
