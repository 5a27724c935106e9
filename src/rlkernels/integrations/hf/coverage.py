"""What a patched Hugging Face model's forward is proven to cover, and how its modules are read.

``is_patched`` is a promise: every op of the forward that reduces across features or
tokens runs an invariant kernel. It is kept by an allowlist, not a guess. A module is
covered when it is

* one of the library's own modules (:class:`rlkernels.Linear`, :class:`rlkernels.RMSNorm`,
  :class:`rlkernels.nn.LayerNorm` (Cohere's),
  :class:`rlkernels.nn.SiLU`, and the mixture-of-experts :class:`~rlkernels.nn.SparseMoeBlock`
  (GPT-OSS's: :class:`~rlkernels.nn.RoutedExpertsMlp`)
  with its :class:`~rlkernels.nn.MoeRouter` and :class:`~rlkernels.nn.MoeExperts`);
* a module that only gathers, copies or holds others (``nn.Embedding``, dropout, identity,
  ``ReLU``, containers). Other activations are not: ATen's CPU ``silu`` rounds the
  elements of its vector tail differently, and the rest were never measured;
* a module of a verified family (:data:`VERIFIED_FAMILIES`) that holds no parameter of
  its own: those forwards were read and compose only the modules above, the attention
  interface, a rotary table from a one-term product, and elementwise ops.

A stock mixture-of-experts block (``*SparseMoeBlock``, its ``*TopKRouter`` and fused
``*Experts``) is never covered, even in a verified family: its experts run over a
batch-dependent token count and are combined with ``index_add_``. ``patch_model`` replaces
those of Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE and GPT-OSS (:mod:`.moe`).

Anything else -- GPT-2's ``Conv1D``, ``nn.LayerNorm``, another family's mixture-of-experts
block, a family nobody has read --
is a gap: ``patch_model`` warns naming it and ``is_patched`` is False, so
``token_logprobs`` runs such a model under the batch-invariant mode.

The LM head is part of the promise too: ``token_logprobs`` and ``generate`` take the
log-probs from ``hidden @ lm_head.weight.T (+ bias)``. Some models scale or cap their
logits after the head (:data:`LOGIT_TRANSFORMS`); the fused head applies Cohere's scale
and Gemma's final soft-cap where the model's forward is read to make them
(:func:`logit_transform`), and a model with any other is refused rather than scored by
another formula.

The readings every other module of the package shares live here too: a model's base
decoder (:func:`decoder_of`), its modeling module and family, its attention
implementation, the keyword its forward takes the KV cache by (:func:`cache_kwargs`), and
which activations are transformers' SiLU (:func:`is_silu`).
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import io
import sys
import textwrap
import tokenize
import types
from typing import Any, Iterator

from torch import nn
from torch.nn.modules import module as _torch_module

from ...nn import (GELUTanh, LayerNorm, Linear, MoeExperts, MoeRouter, RMSNorm, RoutedExpertsMlp, SiLU,
                   SparseMoeBlock)
from ...ops.lm_head.config import NO_TRANSFORM, LogitTransform
from ..aten_mode import set_batch_invariant_mode
from .attention import NAME as ATTENTION

# transformers' modeling modules whose causal-LM forward was read: decoder layers of
# attention (through the attention interface) and a gated MLP or a mixture-of-experts
# block (the MoE families: their attention, decoder layer and model forward are the dense
# family's, Mistral's for Mixtral), RMSNorms, a rotary table, and an LM head whose output is
# returned unchanged. Phi-3's fused qkv_proj and gate_up_proj are Linears whose outputs are
# sliced; its MLP multiplies up by SiLU(gate), its rotary may leave part of a head unrotated
# (a slice and a concatenation), all elementwise; its RMSNorm is Llama's formula. OLMo 2
# norms q and k over all heads and the sublayers' outputs before the residual adds, with
# its own RMSNorm order (weight times the fp32 rows, then rounded: patch.py reads which).
# Gemma 3 (text): embeddings times a constant, four norms per layer (around the attention
# and the MLP, Gemma's 1 + weight in fp32) and q/k norms, a tanh-GELU gated MLP, per-layer
# sliding windows and a rotary table per layer type, each a one-term product of a
# config-fixed frequency; its logits' soft-cap, where set, is applied by the fused head.
# Gemma 2: Gemma 3's layer and norms, its attention scores soft-capped (the op's softcap),
# its final logit soft-cap applied by the fused head (logit_transform).
# OLMoE: Llama's decoder layer and norms, q and k normed over all heads and optionally
# clamped (``clip_qkv``, elementwise), Qwen3-MoE's mixture-of-experts block.
# GPT-OSS: Llama's decoder layer (its MLP returns the output and the routing weights) with
# biased q/k/v/o projections, OLMo 2's RMSNorm order, a rotary table of cos and sin of one
# product (times YaRN's constant scale) applied to the two halves of a head, per-head
# attention sinks handed to the attention (:data:`ATTENTION_PARAMETERS`), sliding windows on
# every other layer, and its MLP replaced by :class:`~rlkernels.nn.RoutedExpertsMlp`.
# Cohere (Command R): one LayerNorm before a parallel block (the residual plus the
# attention's and the MLP's outputs, two adds), optional q/k LayerNorms per head (Cohere's
# formula, :class:`~rlkernels.nn.LayerNorm`), a rotary table repeated per pair and applied
# to interleaved pairs in fp32, Llama's MLP; its logits' scale is applied by the fused head.
# Cohere 2 (Command R7B): Cohere's layer without q/k norms, sliding windows on most layers,
# the rotary embedding on the windowed layers only.
VERIFIED_FAMILIES: frozenset[str] = frozenset({"llama", "mistral", "qwen2", "qwen3", "phi3", "olmo2", "gemma2",
                                               "gemma3", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss",
                                               "cohere", "cohere2"})

# Parameters an attention module of a verified family holds itself and hands to the
# library's attention, with the statement of its forward that hands them: covered where
# that statement is read there (the attention applies them, :mod:`.attention`).
ATTENTION_PARAMETERS: dict[str, tuple[frozenset[str], str]] = {
    "GptOssAttention": (frozenset({"sinks"}), "s_aux=self.sinks,"),  # per-head sink logits
}

# Class-name endings of transformers' MoE modules: uncovered wherever they appear (the
# block itself holds no parameter, so the family rule alone would let it through).
STOCK_MOE_SUFFIXES = ("SparseMoeBlock", "MoeBlock", "Experts", "TopKRouter", "Router")

# Config fields by which transformers' causal LMs change the logits after the LM head
# (or its input); a value other than the neutral one means the model's logits are not
# ``hidden @ W.T``. Read from the model's config and its text_config.
LOGIT_TRANSFORMS: dict[str, tuple[Any, ...]] = {
    "logit_scale": (None, 1, 1.0),             # Cohere, Cohere2: logits * scale
    "logits_scaling": (None, 1, 1.0),          # Granite: logits / scaling; HyperCLOVAX: logits * scaling
    "final_logit_softcapping": (None,),        # Gemma2/3/4, VaultGemma, NanoChat: tanh(logits / cap) * cap
    "logits_soft_cap": (None,),                # RecurrentGemma
    "lm_head_multiplier": (None, 1, 1.0),      # FalconH1: logits * multiplier
    "output_multiplier": (None, 1, 1.0),       # MuseGlimmer, MuseSpark: logits * multiplier, then a cap
    "logits_mup_width_multiplier": (None, 1, 1.0),  # Inkling: the head's input / multiplier
    "unpadded_vocab_size": (None,),            # Inkling: logits cut to a smaller vocabulary
}

# The transforms of LOGIT_TRANSFORMS the fused head applies (ops.lm_head.config.LogitTransform):
# each field with the statements, in order, by which a causal LM's forward makes it from the
# head's output, read from that forward before the field is taken, and where its value is read.
APPLIED_TRANSFORMS: dict[str, tuple[str, ...]] = {
    # Cohere, Cohere2: the model's own attribute, set from the config.
    "logit_scale": ("logits = logits * self.logit_scale",),
    # Gemma 2 and 3: the config's field, read at each forward.
    "final_logit_softcapping": ("logits = logits / self.config.final_logit_softcapping",
                                "logits = torch.tanh(logits)",
                                "logits = logits * self.config.final_logit_softcapping"),
}

# Modules that only gather, copy, take an exact max or hold other modules, whatever family they come from.
_EXACT = (nn.Embedding, nn.Dropout, nn.Identity, nn.ReLU, nn.ModuleList, nn.ModuleDict, nn.Sequential)


def modeling_module(module: nn.Module) -> str | None:
    """``transformers.models.llama.modeling_llama`` for a Llama layer; None outside transformers' models.

    Wrappers that subclass the module's class on the fly (FSDP2's ``fully_shard``) are
    looked through: the first class of the MRO defined outside ``torch`` decides."""
    return class_modeling_module(type(module))


@functools.lru_cache(maxsize=None)
def class_modeling_module(module_type: type) -> str | None:
    """:func:`modeling_module` of the instances of ``module_type``."""
    for cls in module_type.__mro__:
        parts = cls.__module__.split(".")
        if parts[0] == "torch":
            continue
        if len(parts) >= 4 and parts[0] == "transformers" and parts[1] == "models":
            return cls.__module__
        return None
    return None


def family_of(module: nn.Module) -> str | None:
    """``llama`` for a module of ``transformers.models.llama.modeling_llama`` (:func:`modeling_module`)."""
    name = modeling_module(module)
    return name.split(".")[2] if name is not None else None


def decoder_of(model: nn.Module) -> nn.Module:
    """The base decoder (``model.model`` for ``*ForCausalLM``) that returns final hidden states."""
    base = getattr(model, "base_model", None)
    return base if isinstance(base, nn.Module) and base is not model else model


def attention_implementation(model: nn.Module) -> str | None:
    config = getattr(model, "config", None)
    return getattr(config, "_attn_implementation", None)


# The names transformers gives the KV cache argument: ``past_key_values``, and ``cache`` in
# recent 5.x releases.
CACHE_ARGUMENT_NAMES = ("past_key_values", "cache")


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


def is_silu(module: object) -> bool:
    """``nn.SiLU`` (not in place) or transformers' ``SiLUActivation``: x * sigmoid(x).

    Stock modules only, not :class:`rlkernels.nn.SiLU`. ``patch_model`` swaps what this
    accepts, so the library's own SiLU must fail it: patching a patched model again keeps
    its modules (the identities a kept decode graph is keyed by). The mixture-of-experts
    check reads the activation of a stock ``*Experts`` module, which ``patch_model``
    replaces before it swaps any SiLU, so a stock SiLU is all it meets there.
    """
    kind = type(module)
    if kind is nn.SiLU:
        return not module.inplace  # type: ignore[attr-defined]
    return kind.__name__ == "SiLUActivation" and kind.__module__ == "transformers.activations"


def hub_function(fn: Any) -> Any:
    """The plain function behind ``fn``: the one a Hugging Face ``kernels`` hub layer wraps
    where transformers decorates a modeling function with ``use_kernel_forward_from_hub``
    (an ``nn.Module`` instance whose class forward closes over it as ``func``), else ``fn``.

    This reads a layout private to ``kernels``; where it changes, ``fn`` comes back as it
    is, its source cannot be read, and the fused path that needed the formula is not taken."""
    if isinstance(fn, nn.Module):
        forward = type(fn).forward
        code, cells = getattr(forward, "__code__", None), getattr(forward, "__closure__", None)
        if code is not None and cells and "func" in code.co_freevars:
            inner = cells[code.co_freevars.index("func")].cell_contents
            if inspect.isfunction(inner):
                return inner
    return fn


def source_lines(fn: Any) -> list[str] | None:
    """The lines of ``fn``'s source (:func:`hub_function`'s), stripped of white space and
    comments, or None where it has none to read: how this package checks that a
    transformers forward is the formula it computes."""
    try:
        source = textwrap.dedent(inspect.getsource(hub_function(fn)))
    except (OSError, TypeError):
        return None
    lines = source.splitlines()
    try:
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            if token.type == tokenize.COMMENT:
                row, col = token.start
                lines[row - 1] = lines[row - 1][:col]
    except (tokenize.TokenError, SyntaxError):
        return None
    return [line.strip() for line in lines]


def is_gelu_tanh(module: object) -> bool:
    """``nn.GELU(approximate="tanh")`` or transformers' ``GELUTanh`` / ``PytorchGELUTanh``
    computing ``F.gelu(x, approximate="tanh")`` (Gemma's ``gelu_pytorch_tanh``). Stock modules
    only, not :class:`rlkernels.nn.GELUTanh` (as :func:`is_silu`); ``GELUTanh`` built with its
    Python formula computes something else and is left alone."""
    kind = type(module)
    if kind is nn.GELU:
        return module.approximate == "tanh"  # type: ignore[attr-defined]
    if kind.__module__ != "transformers.activations" or kind.__name__ not in ("GELUTanh", "PytorchGELUTanh"):
        return False
    act = getattr(module, "act", None)
    if act is None:  # releases whose forward calls F.gelu itself
        return 'return nn.functional.gelu(input, approximate="tanh")' in (source_lines(kind.forward) or ())
    return (isinstance(act, functools.partial) and act.func is nn.functional.gelu
            and act.keywords == {"approximate": "tanh"} and not act.args)


def batch_dependent_rope(module: nn.Module) -> str | None:
    """The rope type of a rotary embedding whose table depends on the batch, or None.

    transformers recomputes a ``"dynamic"`` (NTK) or ``"longrope"`` table from the largest
    position id of the whole call, so a row's rotary angles -- and every bit after them --
    change with the longest row beside it, and between a decode step and the trainer's
    full sequence."""
    rope = getattr(module, "rope_type", None)
    for kind in (rope.values() if isinstance(rope, dict) else [rope]):
        if isinstance(kind, str) and ("dynamic" in kind or kind == "longrope"):
            return kind
    return None


def parallel_modules() -> types.ModuleType | None:
    """``rlkernels.parallel.modules`` (the tensor-parallel layers) where it is loaded: a
    model can hold its layers only after ``rlkernels.tensor_parallel`` imported it, and
    ``import rlkernels`` leaves ``rlkernels.parallel`` (and torch.distributed) unloaded."""
    return sys.modules.get("rlkernels.parallel.modules")


def _parallel_layers() -> tuple[type, ...]:
    mods = parallel_modules()
    return (mods.TreeRowParallelLinear, mods.VocabParallelEmbedding, mods.VocabParallelHead) if mods else ()


def _hands_its_parameters_to_the_attention(module: nn.Module) -> bool:
    """Whether every parameter ``module`` holds itself is one :data:`ATTENTION_PARAMETERS`
    names for its class, handed on by the statement read in its forward."""
    names, statement = ATTENTION_PARAMETERS.get(type(module).__name__, (frozenset(), ""))
    own = {n for n, _ in module.named_parameters(recurse=False)}
    return bool(names) and own <= names and statement in (source_lines(type(module).forward) or ())


def _covered(module: nn.Module) -> bool:
    if isinstance(module, (Linear, RMSNorm, LayerNorm, SiLU, GELUTanh, SparseMoeBlock, RoutedExpertsMlp, MoeRouter,
                           MoeExperts, *_EXACT, *_parallel_layers())):
        return True
    if type(module).__name__.endswith(STOCK_MOE_SUFFIXES) or batch_dependent_rope(module) is not None:
        return False
    if family_of(module) not in VERIFIED_FAMILIES:
        return False
    return next(module.parameters(recurse=False), None) is None or _hands_its_parameters_to_the_attention(module)


def uncovered_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(qualified name, module) of every module whose forward the library does not cover."""
    for name, module in model.named_modules():
        if not _covered(module):
            yield name or type(module).__name__, module


def is_patched(model: nn.Module) -> bool:
    """True where ``model``'s forward is invariant without the mode: the ``"rlkernels"``
    attention is selected and every module is covered
    (:func:`~rlkernels.integrations.hf.coverage.uncovered_modules` finds none): the
    library's Linear, RMSNorm and MoE blocks, gathers and elementwise modules, and the
    parameter-free modules of the verified families (:data:`VERIFIED_FAMILIES`), whose
    other ops do not reduce across tokens (embedding gathers, rotary tables from a one-term
    product, elementwise activations and residual adds); an attention module whose own
    parameters it hands to the library's attention (:data:`ATTENTION_PARAMETERS`) too.
    """
    if attention_implementation(model) != ATTENTION:
        return False
    return next(uncovered_modules(model), None) is None


def mode_for(model: nn.Module, batch_invariant: bool | None = None) -> contextlib.AbstractContextManager:
    """The guard to run ``model`` under: the batch-invariant mode where asked (True), or
    (None) where the model is not :func:`is_patched`; otherwise nothing."""
    on = not is_patched(model) if batch_invariant is None else batch_invariant
    return set_batch_invariant_mode(True) if on else contextlib.nullcontext()


def describe_gaps(model: nn.Module, limit: int = 6) -> list[str] | None:
    """What :func:`uncovered_modules` finds, one line per kind of gap (one place of each
    module type), or None.

    Rotary embeddings whose table depends on the batch (:func:`batch_dependent_rope`) come
    first, then modules that hold parameters the library does not patch (``Conv1D``,
    ``LayerNorm``, 3-D expert weights), then the parameter-free modules of families whose
    forwards are not verified."""
    unpatched: dict[str, str] = {}
    unread: dict[str, list[str]] = {}
    ropes: dict[str, str] = {}
    for name, module in uncovered_modules(model):
        kind = type(module).__name__
        rope = batch_dependent_rope(module)
        if rope is not None:
            ropes.setdefault(f"{kind} (rope_type {rope!r}, e.g. {name})", name)
        elif next(module.parameters(recurse=False), None) is not None:
            unpatched.setdefault(kind, name)
        else:
            family = unread.setdefault(family_of(module) or type(module).__module__, [])
            if kind not in family:
                family.append(kind)
    if not unpatched and not unread and not ropes:
        return None

    def listed(items: list[str]) -> str:
        return ", ".join(items[:limit]) + (f" and {len(items) - limit} more" if len(items) > limit else "")

    parts = []
    if ropes:
        parts.append("rotary embeddings whose table follows the longest position in the batch, which the mode "
                     "does not fix: "
                     + listed(list(ropes)))
    if unpatched:
        parts.append("modules holding weights the library does not patch: "
                     + listed([f"{kind} (e.g. {where})" for kind, where in unpatched.items()]))
    if unread:
        parts.append("modules of families whose forwards are not verified: "
                     + "; ".join(f"{family!r}: {listed(kinds)}" for family, kinds in unread.items()))
    return parts


def logit_transforms(model: nn.Module) -> list[str]:
    """``field=value`` for every config field by which ``model`` changes its logits after the head."""
    found = []
    config = getattr(model, "config", None)
    configs = [config, getattr(config, "text_config", None)]
    inner = getattr(model, "model", None)
    for source in [*configs, inner]:
        if source is None:
            continue
        for field, neutral in LOGIT_TRANSFORMS.items():
            value = getattr(source, field, None)
            if not _is_neutral(value, neutral) and f"{field}={value!r}" not in found:
                found.append(f"{field}={value!r}")
    return found


def logit_transform(model: nn.Module) -> tuple[LogitTransform, list[str]]:
    """The transform by which ``model`` makes its logits from its head's output, as the fused
    head applies it, and the ``field=value`` of every transform it does not apply (a field
    outside :data:`APPLIED_TRANSFORMS`, one whose statements ``model``'s forward does not
    hold in order, or two at once)."""
    found = logit_transforms(model)
    fields = [item.split("=", 1)[0] for item in found]
    if len(found) != 1 or fields[0] not in APPLIED_TRANSFORMS or not _forward_makes(type(model), fields[0]):
        return NO_TRANSFORM, found
    scale = fields[0] == "logit_scale"  # where each forward reads its value
    value = getattr(model, "logit_scale", None) if scale else model.config.final_logit_softcapping
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        return NO_TRANSFORM, found
    return LogitTransform(scale=float(value)) if scale else LogitTransform(softcap=float(value)), []


@functools.lru_cache(maxsize=None)
def _forward_makes(model_type: type, field: str) -> bool:
    """Whether ``model_type``'s forward holds the statements of ``field``'s transform
    (:data:`APPLIED_TRANSFORMS`) in order; read once per class (scoring and decoding ask per call)."""
    statements = iter(source_lines(model_type.forward) or [])
    return all(statement in statements for statement in APPLIED_TRANSFORMS[field])


def _is_neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    if value is None:
        return True
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value in neutral
    return False  # a tensor or anything else: a transform the fused head does not apply


def has_hooks(module: nn.Module) -> bool:
    """Whether calling ``module`` runs hooks around its forward or backward (its own or global
    ones): a fused path that skips the call must not skip them."""
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks or _torch_module._global_forward_hooks
                or _torch_module._global_forward_pre_hooks or _torch_module._global_backward_hooks
                or _torch_module._global_backward_pre_hooks)
