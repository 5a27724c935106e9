"""transformers' mixture-of-experts blocks, replaced by :class:`rlkernels.nn.SparseMoeBlock`.

The blocks read (transformers 5.x, ``models/<family>/modeling_<family>.py``) compute, per
token, with a ``*TopKRouter`` ``gate`` (``weight`` [E, H], no bias) and a fused
``*Experts`` module (``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I], SiLU):

* Qwen3-MoE (``Qwen3MoeSparseMoeBlock``): ``softmax(logits, dtype=float32)``, ``topk``,
  divided by their sum when ``norm_topk_prob``, cast to the logits' dtype; the experts'
  outputs times the weights, ``index_add_`` into the output.
* Qwen2-MoE (``Qwen2MoeSparseMoeBlock``): the same routed experts, plus a shared expert
  (a gated MLP) times ``sigmoid(shared_expert_gate(x))`` (a [1, H] linear), added.
* OLMoE (``OlmoeSparseMoeBlock``): Qwen3-MoE's router and experts, line for line.
* Mixtral (``MixtralSparseMoeBlock``): ``softmax(logits.float())``, ``topk``, always divided
  by their sum, kept in fp32; in training, a random jitter of the input when
  ``router_jitter_noise`` > 0.
* GPT-OSS (``GptOssMLP``, returning the output and the routing weights): a router with a
  bias, ``topk`` of the logits and a softmax over those k in the logits' dtype (the
  renormalised softmax over all E, rounded to that dtype); experts with [E, H, 2I] and
  [E, I, H] weights (``x @ W[e]``), biases, and a SwiGLU over interleaved gate/up
  columns, clamped at ``limit`` with ``gate * sigmoid(alpha * gate) * (up + 1)``
  (:class:`~rlkernels.ops.moe.GatedActivation`); replaced by
  :class:`rlkernels.nn.RoutedExpertsMlp`.

The replacement computes that math with the fixed orders of :mod:`rlkernels.ops.moe`
(ties to the lowest expert id, combine in fp32 in ascending rank order, the shared expert
added last, rounded once) and shares every Parameter object. Any other MoE block is left
alone: :mod:`.coverage` names it and ``is_patched`` stays False. A block of these
families whose configuration the replacement would compute differently is refused with
a ValueError naming the module.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ...nn import Linear, MoeExperts, MoeRouter, RoutedExpertsMlp, SparseMoeBlock
from ...ops.matmul import gemm_backend_for
from ...ops.moe import GatedActivation
from .coverage import family_of, is_silu, source_lines


@dataclass(frozen=True)
class Family:
    """What distinguishes one family's block: how it routes and whether it has a shared expert."""

    router: str                       # the class name of its ``gate``
    experts: str                      # the class name of its ``experts``
    normalize: str | bool             # the router attribute that says whether to renormalise, or a constant
    round_weights: bool               # the routing weights are cast to the logits' dtype
    shared_expert: bool               # a shared expert with a sigmoid gate
    shared_mlp: str | None = None     # its class name


# (transformers model module family, block class name) -> Family
BLOCKS: dict[tuple[str, str], Family] = {
    ("qwen3_moe", "Qwen3MoeSparseMoeBlock"): Family("Qwen3MoeTopKRouter", "Qwen3MoeExperts", "norm_topk_prob",
                                                    round_weights=True, shared_expert=False),
    ("qwen2_moe", "Qwen2MoeSparseMoeBlock"): Family("Qwen2MoeTopKRouter", "Qwen2MoeExperts", "norm_topk_prob",
                                                    round_weights=True, shared_expert=True,
                                                    shared_mlp="Qwen2MoeMLP"),
    ("mixtral", "MixtralSparseMoeBlock"): Family("MixtralTopKRouter", "MixtralExperts", True,
                                                 round_weights=False, shared_expert=False),
    ("olmoe", "OlmoeSparseMoeBlock"): Family("OlmoeTopKRouter", "OlmoeExperts", "norm_topk_prob",
                                             round_weights=True, shared_expert=False),
}

# The expert layout flags transformers' ``use_experts_implementation`` sets, at the values
# the blocks above use: [gate; up] concatenated, [out, in] weights, no bias, a gate, no
# post-expert norm, not sharded over an expert-parallel group.
_EXPERT_FLAGS = {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True,
                 "has_post_expert_norm": False, "_is_expert_parallel": False}


# GPT-OSS's MLP: its own router and experts, read separately (:func:`_replace_gpt_oss`).
GPT_OSS_BLOCK = ("gpt_oss", "GptOssMLP")
# Its experts' layout flags: separate weights per projection pair, transposed, with biases.
_GPT_OSS_EXPERT_FLAGS = {"has_gate": True, "has_bias": True, "is_transposed": True, "is_concatenated": False,
                         "has_post_expert_norm": False, "_is_expert_parallel": False}


# The statements of GPT-OSS's forwards the replacement computes (source lines, white space
# and comments stripped): a transformers release that changes one is refused, not guessed.
_GPT_OSS_FORMULAS = {
    "_apply_gate": ["gate, up = gate_up[..., ::2], gate_up[..., 1::2]",
                    "gate = gate.clamp(min=None, max=self.limit)",
                    "up = up.clamp(min=-self.limit, max=self.limit)",
                    "glu = gate * torch.sigmoid(gate * self.alpha)",
                    "gated_output = (up + 1) * glu"],
    "router": ["router_logits = F.linear(hidden_states, self.weight, self.bias)",
               "router_top_value, router_indices = torch.topk(router_logits, self.top_k, dim=-1)",
               "router_scores = torch.nn.functional.softmax(router_top_value, dim=1, dtype=router_top_value.dtype)"],
    "mlp": ["batch_size, sequence_length, hidden_dim = hidden_states.shape",
            "hidden_states = hidden_states.reshape(-1, hidden_dim)",
            "_, router_scores, router_indices = self.router(hidden_states)",
            "hidden_states = self.experts(hidden_states, router_indices, router_scores)",
            "hidden_states = hidden_states.reshape(batch_size, sequence_length, hidden_dim)",
            "return hidden_states, router_scores"],
}


def _reads_as(fn: object, statements: list[str]) -> bool:
    """Whether ``fn``'s source holds ``statements`` as consecutive lines."""
    lines = [line for line in (source_lines(fn) or []) if line]
    n = len(statements)
    return any(lines[i:i + n] == statements for i in range(len(lines) - n + 1))


def known_block(module: nn.Module) -> bool:
    key = (family_of(module) or "", type(module).__name__)
    return key in BLOCKS or key == GPT_OSS_BLOCK


def _refuse(name: str, module: nn.Module, why: str) -> ValueError:
    return ValueError(f"rlkernels.patch_model: the mixture-of-experts block {name} ({type(module).__name__}) "
                      f"cannot be replaced: {why}")


def _children(module: nn.Module) -> set[str]:
    return {n for n, _ in module.named_children()}


def _param_names(module: nn.Module) -> set[str]:
    return {n for n, _ in module.named_parameters()}


def _check_router(name: str, block: nn.Module, gate: nn.Module, *, bias: bool) -> tuple[int, int, int]:
    """(E, H, top_k) of a router holding ``weight`` [E, H] (and ``bias`` [E] where ``bias``)."""
    weight = getattr(gate, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise _refuse(name, block, "its router has no 2-D weight")
    E, H = weight.shape
    want = {"weight", "bias"} if bias else {"weight"}
    b = getattr(gate, "bias", None)
    if _param_names(gate) != want or (bias and (not isinstance(b, torch.Tensor) or tuple(b.shape) != (E,))):
        read = f"a router with weight [{E}, {H}] and bias [{E}]" if bias else "a router without a bias"
        raise _refuse(name, block, f"its router holds {sorted(_param_names(gate))}; the formula read is {read} "
                                   "(a router with other parameters is not)")
    top_k = getattr(gate, "top_k", None)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= E:
        raise _refuse(name, block, f"top_k = {top_k!r} is not an int in [1, {E}] (the router's experts)")
    if getattr(gate, "num_experts", E) != E:
        raise _refuse(name, block, f"the router says num_experts = {gate.num_experts} but its weight scores {E}")
    return E, H, top_k


def _check_flags(name: str, block: nn.Module, experts: nn.Module, flags: dict[str, object]) -> None:
    for flag, value in flags.items():
        if getattr(experts, flag, value) != value:
            raise _refuse(name, block, f"its experts have {flag} = {getattr(experts, flag)!r} (the replacement "
                                       f"computes the {flag} = {value!r} layout)")


def _refuse_router_logits(name: str, block: nn.Module, config: object) -> None:
    if getattr(config, "output_router_logits", False):
        raise _refuse(name, block, "the config sets output_router_logits=True: transformers records the router "
                                   "logits (for the load-balancing loss) from its own router class, which the "
                                   "replacement does not use, so that loss would silently be 0")


def _replace_gpt_oss(name: str, block: nn.Module, config: object) -> RoutedExpertsMlp:
    """GPT-OSS's ``GptOssMLP`` as :class:`RoutedExpertsMlp`, sharing its Parameters."""
    if _children(block) != {"router", "experts"} or next(block.parameters(recurse=False), None) is not None:
        raise _refuse(name, block, f"it holds {sorted(_children(block))} and "
                                   f"{sorted(n for n, _ in block.named_parameters(recurse=False))} of its own; "
                                   "the GptOssMLP read holds router and experts only")
    gate, experts = block.router, block.experts
    if type(gate).__name__ != "GptOssTopKRouter" or type(experts).__name__ != "GptOssExperts":
        raise _refuse(name, block, f"its router / experts are {type(gate).__name__} / {type(experts).__name__}, "
                                   "expected GptOssTopKRouter / GptOssExperts")
    E, H, top_k = _check_router(name, block, gate, bias=True)
    want = {"gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"}
    if _param_names(experts) != want:
        raise _refuse(name, block, f"its experts hold {sorted(_param_names(experts))}, expected {sorted(want)}")
    gate_up, down = experts.gate_up_proj, experts.down_proj
    gate_up_bias, down_bias = experts.gate_up_proj_bias, experts.down_proj_bias
    two_i = gate_up.shape[-1] if gate_up.dim() == 3 else -1
    shapes = {"gate_up_proj": (E, H, two_i), "down_proj": (E, two_i // 2, H), "gate_up_proj_bias": (E, two_i),
              "down_proj_bias": (E, H)}
    got = {n: tuple(getattr(experts, n).shape) for n in shapes}
    if two_i < 2 or two_i % 2 or got != shapes or getattr(experts, "num_experts", E) != E:
        raise _refuse(name, block, f"its experts' parameters are {got}, not {shapes} for the router's E = {E}, "
                                   f"H = {H}")
    _check_flags(name, block, experts, _GPT_OSS_EXPERT_FLAGS)
    for part, fn in (("_apply_gate", getattr(type(experts), "_apply_gate", None)),
                     ("router", type(gate).forward), ("mlp", type(block).forward)):
        if not _reads_as(fn, _GPT_OSS_FORMULAS[part]):
            raise _refuse(name, block, f"the {part} forward of this transformers release is not the formula "
                                       "read (rlkernels.integrations.hf.moe._GPT_OSS_FORMULAS)")
    alpha, limit = getattr(experts, "alpha", None), getattr(experts, "limit", None)
    for what, value in (("alpha", alpha), ("limit", limit)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise _refuse(name, block, f"its experts' {what} is {value!r}, not a finite positive number")
    _refuse_router_logits(name, block, config)
    router = MoeRouter(gate.weight, top_k, normalize=True, round_weights=True, bias=gate.bias)
    activation = GatedActivation(interleaved=True, limit=float(limit), alpha=float(alpha))
    new = RoutedExpertsMlp(router, MoeExperts(gate_up, down, gate_up_proj_bias=gate_up_bias,
                                              down_proj_bias=down_bias, activation=activation, transposed=True))
    new.train(block.training)
    return new


def replace_block(name: str, block: nn.Module, config: object = None) -> SparseMoeBlock | RoutedExpertsMlp:
    """The invariant block computing ``block``'s forward, sharing its Parameters; ValueError
    (naming ``name``) where the block holds something the replacement would not compute."""
    if (family_of(block), type(block).__name__) == GPT_OSS_BLOCK:
        return _replace_gpt_oss(name, block, config)
    family = BLOCKS.get((family_of(block) or "", type(block).__name__))
    if family is None:
        raise _refuse(name, block, "not a block rlkernels reads (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, GPT-OSS)")
    want = {"gate", "experts"} | ({"shared_expert", "shared_expert_gate"} if family.shared_expert else set())
    if _children(block) != want or next(block.parameters(recurse=False), None) is not None:
        raise _refuse(name, block, f"it holds {sorted(_children(block))} and "
                                   f"{sorted(n for n, _ in block.named_parameters(recurse=False))} of its own; "
                                   f"the {type(block).__name__} read holds {sorted(want)} only")
    gate, experts = block.gate, block.experts
    if type(gate).__name__ != family.router or type(experts).__name__ != family.experts:
        raise _refuse(name, block, f"its gate / experts are {type(gate).__name__} / {type(experts).__name__}, "
                                   f"expected {family.router} / {family.experts}")
    if float(getattr(block, "jitter_noise", 0.0) or 0.0) > 0:
        raise _refuse(name, block, f"router_jitter_noise={block.jitter_noise} scales the input by random noise "
                                   "in training, a draw that depends on the batch's shape")
    E, H, top_k = _check_router(name, block, gate, bias=False)
    normalize = family.normalize if isinstance(family.normalize, bool) else getattr(gate, family.normalize, None)
    if not isinstance(normalize, bool):
        raise _refuse(name, block, f"its router's {family.normalize} is {normalize!r}, not a bool")
    # The experts: [E, 2I, H] and [E, H, I], SiLU, the stock layout.
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor) or gate_up.dim() != 3 \
            or down.dim() != 3:
        raise _refuse(name, block, "its experts do not hold 3-D gate_up_proj and down_proj parameters")
    if {n for n, _ in experts.named_parameters()} != {"gate_up_proj", "down_proj"}:
        raise _refuse(name, block, f"its experts hold {sorted(n for n, _ in experts.named_parameters())}, "
                                   "expected gate_up_proj and down_proj only")
    inter = gate_up.shape[1] // 2
    if gate_up.shape[0] != E or getattr(experts, "num_experts", E) != E or down.shape[0] != E:
        raise _refuse(name, block, f"the router scores {E} experts but the experts hold "
                                   f"{gate_up.shape[0]} (gate_up_proj) / {down.shape[0]} (down_proj) "
                                   f"(num_experts = {getattr(experts, 'num_experts', None)})")
    if gate_up.shape[1] % 2 or gate_up.shape[2] != H or tuple(down.shape) != (E, H, inter):
        raise _refuse(name, block, f"gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} are "
                                   f"not [E, 2I, H] and [E, H, I] with E = {E}, H = {H}")
    _check_flags(name, block, experts, _EXPERT_FLAGS)
    if not is_silu(getattr(experts, "act_fn", None)):
        raise _refuse(name, block, f"its experts' activation is {type(getattr(experts, 'act_fn', None)).__name__}, "
                                   "not SiLU")
    _refuse_router_logits(name, block, config)
    router = MoeRouter(gate.weight, top_k, normalize=normalize, round_weights=family.round_weights)
    shared = shared_gate = None
    if family.shared_expert:
        shared = block.shared_expert
        sg = block.shared_expert_gate
        if type(shared).__name__ != family.shared_mlp:
            raise _refuse(name, block, f"its shared expert is {type(shared).__name__}, expected {family.shared_mlp}")
        if type(sg) not in (nn.Linear, Linear) or tuple(sg.weight.shape) != (1, H):
            raise _refuse(name, block, f"its shared_expert_gate is {type(sg).__name__} "
                                       f"{tuple(getattr(sg, 'weight', torch.empty(0)).shape)}, expected a [1, {H}] "
                                       "nn.Linear")
        shared_gate = sg if isinstance(sg, Linear) else Linear.from_torch(sg)
    new = SparseMoeBlock(router, MoeExperts(gate_up, down), shared, shared_gate)
    new.train(block.training)
    return new


def patch_moe_blocks(model: nn.Module) -> int:
    """Replace every known MoE block of ``model`` in place; returns how many. Refusals raise
    before any block is replaced."""
    config = getattr(model, "config", None)
    plan = []
    for parent_name, parent in model.named_modules():
        for child_name, child in parent.named_children():
            if known_block(child):
                name = f"{parent_name}.{child_name}" if parent_name else child_name
                plan.append((parent, child_name, replace_block(name, child, config)))
    for parent, child_name, new in plan:
        setattr(parent, child_name, new)
    return len(plan)


def has_moe_blocks(model: nn.Module) -> bool:
    return any(isinstance(m, (SparseMoeBlock, RoutedExpertsMlp)) for m in model.modules())


def experts_capture(device: torch.device) -> bool:
    """Whether the MoE blocks' forward on ``device`` captures into a CUDA graph: the Triton
    backend's grouped launches read no expert count on the host; the torch backend's
    per-expert GEMMs are sized from counts read back every step."""
    return gemm_backend_for(device).name == "triton"
