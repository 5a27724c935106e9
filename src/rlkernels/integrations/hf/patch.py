"""``rlkernels.patch_model``: a Hugging Face causal LM made batch-invariant in place.

``patch_model`` swaps every ``nn.Linear`` for :class:`rlkernels.Linear`, every
``*RMSNorm`` module (Llama, Qwen2, Qwen3, Mistral, ... -- anything with ``weight``
and ``variance_epsilon``/``eps`` computing the HF RMSNorm formula, OLMo 2's order or
Gemma's ``1 + weight``) for :class:`rlkernels.RMSNorm`, sharing the Parameter objects,
the SiLU and tanh-GELU activations for the library's, and selects the
``"rlkernels"`` attention implementation (:mod:`.attention`): the fused
attention whose rows do not depend on the batch, the padding side, packing, or
prefill vs decode. SDPA / flash kernels pick their split and tile strategy from the
batch and sequence shape, and eager attention's row sums shift with left padding.
The per-module swaps live beside it: the mixture-of-experts blocks (:mod:`.moe`), the
rotary embedding (:mod:`.rotary`), the gated MLPs (:mod:`.mlp`), the attention's q, k and v
projections (:mod:`.qkv`), their q/k norms, rotary embedding and cache write (:mod:`.attention_layer`) and the
decoder layers' residual adds (:mod:`.decoder_layer`); what the patched
forward then covers is read by :mod:`.coverage`.
"""
from __future__ import annotations

import functools
import textwrap
import types
import warnings
from typing import Any

import torch
from torch import nn

from ...nn import GELUTanh, LayerNorm, Linear, LMHead, RMSNorm, SiLU
from . import attention, attention_layer, coverage, decoder_layer, mlp, moe, own_generate, qkv, rotary
from .coverage import decoder_of, is_gelu_tanh, is_silu, source_lines
from ...runtime.opaque import opaque_to_compile


# The last line of transformers' RMSNorm forwards the library computes, and whether the
# weight multiplies in fp32 (OLMo 2) or after the rounding to the input's dtype (Llama's).
_RMS_NORM_RETURNS = {"return self.weight * hidden_states.to(input_dtype)": False,
                     "return (self.weight * hidden_states).to(input_dtype)": True}
# Gemma's RMSNorm (Gemma 1-3): the fp32 rows normed by ``_norm``, times ``1 + weight`` in fp32,
# rounded once -- the fp32-kept order with the factor offset by 1.
_GEMMA_FORWARD = ("output = self._norm(x.float())", "output = output * (1.0 + self.weight.float())",
                  "return output.type_as(x)")
_GEMMA_NORM = "return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)"


@functools.lru_cache(maxsize=None)
def _rms_norm_formula(module_type: type) -> tuple[bool, float] | None:
    """``(weight_in_fp32, weight_offset)`` of :class:`rlkernels.RMSNorm` for a transformers
    RMSNorm class whose forward is one of the formulas the library computes (its source
    read), else None: another formula -- a gated or otherwise offset norm -- is left alone,
    not replaced by one that computes something else."""
    lines = source_lines(module_type.forward)
    if lines is None:
        return None
    returns = sum(line.startswith("return") for line in lines)
    if "variance = hidden_states.pow(2).mean(-1, keepdim=True)" in lines:
        found = {_RMS_NORM_RETURNS[line] for line in lines if line in _RMS_NORM_RETURNS}
        return (found.pop(), 0.0) if len(found) == 1 and returns == 1 else None
    body = [line for line in lines if line in _GEMMA_FORWARD]
    norm = source_lines(getattr(module_type, "_norm", None))
    if body == list(_GEMMA_FORWARD) and returns == 1 and norm is not None and _GEMMA_NORM in norm:
        return True, 1.0
    return None


def _rms_norm_swap(module: nn.Module) -> tuple[bool, float] | None:
    """:func:`_rms_norm_formula` where ``module`` is a stock RMSNorm the library computes, else None."""
    if (not type(module).__name__.endswith("RMSNorm") or isinstance(module, RMSNorm)
            or not isinstance(getattr(module, "weight", None), torch.Tensor)
            or not (hasattr(module, "variance_epsilon") or hasattr(module, "eps"))):
        return None
    return _rms_norm_formula(type(module))


# Cohere's LayerNorm (``CohereLayerNorm``, its q/k norms too), statement by statement.
_COHERE_LAYER_NORM = ("input_dtype = hidden_states.dtype",
                      "hidden_states = hidden_states.to(torch.float32)",
                      "mean = hidden_states.mean(-1, keepdim=True)",
                      "variance = (hidden_states - mean).pow(2).mean(-1, keepdim=True)",
                      "hidden_states = (hidden_states - mean) * torch.rsqrt(variance + self.variance_epsilon)",
                      "hidden_states = self.weight.to(torch.float32) * hidden_states",
                      "return hidden_states.to(input_dtype)")


@functools.lru_cache(maxsize=None)
def _is_cohere_layer_norm(module_type: type) -> bool:
    """Whether ``module_type``'s forward is Cohere's LayerNorm, the formula of
    :class:`rlkernels.nn.LayerNorm` (its source read)."""
    lines = [line for line in source_lines(module_type.forward) or () if line]
    return tuple(lines[-len(_COHERE_LAYER_NORM):]) == _COHERE_LAYER_NORM


def _layer_norm_swap(module: nn.Module) -> bool:
    """Whether ``module`` is a stock LayerNorm the library computes: Cohere's formula, a
    weight and eps, no other parameter."""
    return (type(module).__name__.endswith("LayerNorm") and not isinstance(module, LayerNorm)
            and isinstance(getattr(module, "weight", None), torch.Tensor)
            and isinstance(getattr(module, "variance_epsilon", None), float)
            and {n for n, _ in module.named_parameters(recurse=False)} == {"weight"}
            and _is_cohere_layer_norm(type(module)))


def _refuse_transformers_tensor_parallel(model: nn.Module) -> None:
    """A model transformers sharded (``from_pretrained(..., tp_plan=...)``) is refused: its
    row-parallel layers add the ranks' partial sums by an all-reduce, an order that depends
    on the TP size, and its Linear layers hold DTensor shards."""
    tp_size = getattr(model, "_tp_size", None)
    if tp_size is not None and tp_size > 1:
        raise ValueError(
            f"rlkernels.patch_model: {type(model).__name__} was sharded by transformers' tensor parallelism "
            f"(tp_plan, tp_size={tp_size}): its row-parallel layers add the ranks' partial sums by an all-reduce "
            "whose order depends on the TP size, so no patch keeps one bit pattern. Load the whole model on every "
            "rank (without tp_plan), patch it, then shard it with rlkernels.tensor_parallel(model, group).")


def patch_model(model: nn.Module, *, attn_implementation: str | None = attention.NAME) -> nn.Module:
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

    A LayerNorm whose forward is Cohere's becomes :class:`rlkernels.nn.LayerNorm`.

    The mixture-of-experts blocks of Qwen3-MoE, Qwen2-MoE, Mixtral and OLMoE become
    :class:`rlkernels.nn.SparseMoeBlock`, GPT-OSS's MLP :class:`rlkernels.nn.RoutedExpertsMlp`
    (:mod:`~rlkernels.integrations.hf.moe`); one whose
    configuration that block would compute differently (a router with a bias, expert
    counts or top-k that do not match the weights, router jitter, another activation) is
    refused with a ValueError naming it, before anything is swapped.

    Inside a patched decoder's forward the attention layers' rotary embedding runs as one
    launch with transformers' bits (:mod:`~rlkernels.integrations.hf.rotary`: the family's
    ``apply_rotary_pos_emb`` becomes a dispatcher that calls the original anywhere else), and
    the gated MLPs' ``silu(gate) * up`` is one launch (:mod:`~rlkernels.integrations.hf.mlp`),
    at decode sizes the attention layers' q, k and v projections are one launch
    (:mod:`~rlkernels.integrations.hf.qkv`), their q/k norms, rotary embedding and KV-cache write are one
    launch (:mod:`~rlkernels.integrations.hf.attention_layer`), and the decoder layers' residual adds run inside
    the post-attention norm and the down projection
    (:mod:`~rlkernels.integrations.hf.decoder_layer`), each with the separate ops' bits.

    A model sharded by transformers' own tensor parallelism (``tp_plan``) is refused with a
    ValueError that points to :func:`rlkernels.tensor_parallel`.

    A model with modules the library does not cover (:mod:`~rlkernels.integrations.hf.coverage`:
    GPT-2's ``Conv1D``, ``nn.LayerNorm``, other mixture-of-experts blocks, families not verified)
    is patched as far as it goes, with a warning naming those modules; :func:`rlkernels.is_patched`
    is then False, so :func:`rlkernels.token_logprobs` and :func:`rlkernels.generate` run it under the mode.
    """
    _refuse_transformers_tensor_parallel(model)
    if attn_implementation == attention.NAME:
        attention.register()
    # MoE blocks first (a refusal raises before anything else is swapped); the loop below
    # then patches their shared experts' Linear and SiLU children like any MLP's.
    moe.patch_moe_blocks(model)
    head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            # Exact type: subclasses (quantized / LoRA / parallel linears) compute something else.
            if type(child) is nn.Linear:
                setattr(parent, name, (LMHead if child is head else Linear).from_torch(child))
            elif (formula := _rms_norm_swap(child)) is not None:
                setattr(parent, name, RMSNorm.from_module(child, weight_in_fp32=formula[0], weight_offset=formula[1]))
            elif _layer_norm_swap(child):
                setattr(parent, name, LayerNorm.from_module(child))
            elif is_silu(child):
                setattr(parent, name, SiLU())
            elif is_gelu_tanh(child):
                setattr(parent, name, GELUTanh())
    if attn_implementation is not None:
        _set_attention(model, attn_implementation)
    rotary.install(model)
    mlp.install(model)
    qkv.install(model)
    attention_layer.install(model)
    decoder_layer.install(model)
    own_generate.install(model)
    _keep_out_of_compile(model)
    gaps = coverage.describe_gaps(model)
    if gaps is not None:
        # One item per kind of gap, wrapped: a warning line stays readable in a terminal.
        lines = "".join("\n  - " + textwrap.fill(gap, width=180, subsequent_indent="    ", break_long_words=False,
                                                  break_on_hyphens=False) for gap in gaps)
        warnings.warn(f"rlkernels.patch_model: {type(model).__name__} is only partly covered, so "
                      f"rlkernels.is_patched(model) is False:{lines}\n"
                      "Their ops may reduce across features or tokens with stock kernels; token_logprobs and "
                      "generate run the model under the batch-invariant mode.", stacklevel=2)
    return model


def _forward_eagerly(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    # Inside it, the attention layers' rotary embedding is one launch (rotary.py).
    return rotary.run_inside(type(self).forward, self, *args, **kwargs)


# Bound per decoder as its ``forward``: ``copy.deepcopy`` rebinds a bound method to the
# copy (a closure over the original's method would run the original's weights).
_forward_eagerly.__name__ = "forward"
_EAGER_FORWARD = opaque_to_compile(_forward_eagerly)


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


def _set_attention(model: nn.Module, impl: str) -> None:
    setter = getattr(model, "set_attn_implementation", None)
    if callable(setter):
        setter(impl)
    else:  # older transformers: the config field is what the attention layers read
        for module in model.modules():
            config = getattr(module, "config", None)
            if config is not None and hasattr(config, "_attn_implementation"):
                config._attn_implementation = impl
