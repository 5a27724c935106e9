"""``rlkernels.tensor_parallel``: a patched dense Hugging Face causal LM sharded in place
over a ``torch.distributed`` group, scoring with the same bits at every TP size.

Megatron's layout, with the library's TP-invariant layers where a reduction crosses ranks:

* q/k/v and gate/up are column-parallel: rank r keeps its contiguous heads and
  intermediate columns. Each output column is one chain over the hidden size whatever
  other columns share the call, so no bit depends on the split; their input gradient is
  the N-tree over fixed segments of the output columns
  (:class:`~rlkernels.parallel.modules.TreeColumnParallelLinear`).
* o_proj and down_proj are row-parallel through the K-tree
  (:class:`~rlkernels.parallel.modules.TreeRowParallelLinear`): ``segments`` fixed
  segments of K, combined by one pairwise tree at every TP size.
* The input embedding and the LM head are vocabulary-parallel over contiguous blocks
  (:class:`~rlkernels.parallel.modules.VocabParallelEmbedding`,
  :class:`~rlkernels.parallel.modules.VocabParallelHead`); ``token_logprobs`` scores the
  head by :func:`~rlkernels.parallel.vocab_parallel_linear_logprob` over ``vocab_shards``
  and ``generate`` draws by :func:`~rlkernels.parallel.vocab_parallel_linear_sample`.
* Norms, rotary tables and residual adds are replicated, and so are the mixture-of-experts
  blocks of the MoE families (:data:`MOE_FAMILIES`): their input is whole on every rank,
  so every rank computes the same routing and experts, the one-process layout's bits.

``group=None`` keeps every parameter whole but computes with the same tree and the same
vocabulary shards: the bits of TP = 2, 4 or 8 on one process, so a trainer there scores
a TP rollout's tokens bitwise. Those bits differ from the unsharded patched model's (the
tree and the shards are other orders of the same sums): an opt-in layout.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ...nn import RMSNorm, SparseMoeBlock
from ...parallel.modules import (HeadTreeRMSNorm, TreeColumnParallelLinear, TreeRowParallelLinear,
                                 VocabParallelEmbedding, VocabParallelHead)
from ...parallel.row_parallel import TREE_SEGMENTS
from ...parallel.tree import is_pow2, process_group_world
from ...parallel.vocab_parallel import VOCAB_SHARDS
from .coverage import decoder_of, family_of, is_patched
from .tp_layout import LAYOUT_ATTRIBUTE, TensorParallelLayout, layout_of

OP = "tensor_parallel"
# Dense families whose decoder layer is attention (q/k/v/o projections, per-head norms at
# most) then a gated MLP (gate/up/down): the layout above is their whole forward.
FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
# Mixture-of-experts families whose attention is one of the above (heads split whole, per-head
# norms at most): their expert blocks are replicated, their dense layers sharded as above.
# (OLMoE's q/k norms span every head of a projection: a rank's heads cannot be normed alone.)
MOE_FAMILIES = frozenset({"qwen3_moe", "qwen2_moe", "mixtral"})


def _need(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(f"rlkernels.{OP}: {message}")


def _rows(param: torch.Tensor | None, rank: int, world: int) -> nn.Parameter | None:
    """Rank ``rank``'s contiguous block of ``param``'s rows (dim 0), a new Parameter."""
    if param is None:
        return None
    block = param.shape[0] // world
    return nn.Parameter(param.detach()[rank * block:(rank + 1) * block].clone(), requires_grad=param.requires_grad)


def _cols(param: torch.Tensor, rank: int, world: int) -> nn.Parameter:
    block = param.shape[1] // world
    return nn.Parameter(param.detach()[:, rank * block:(rank + 1) * block].contiguous(),
                        requires_grad=param.requires_grad)


def _column_parallel(linear: nn.Linear, group: dist.ProcessGroup | None, rank: int, world: int,
                     segments: int) -> None:
    if world > 1:
        linear.weight = _rows(linear.weight, rank, world)
        linear.bias = _rows(linear.bias, rank, world)
        linear.out_features = linear.weight.shape[0]
    TreeColumnParallelLinear.convert(linear, group, segments)


def _head_norms(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """(attention layer, name, module) of every per-head q/k norm holding a weight."""
    found = []
    for layer in decoder_of(model).layers:
        for name in ("q_norm", "k_norm"):
            norm = getattr(layer.self_attn, name, None)
            if isinstance(norm, nn.Module) and any(True for _ in norm.parameters()):
                found.append((layer.self_attn, name, norm))
    return found


def _no_backward(model: nn.Module, segments: int) -> str | None:
    """Why a backward across ranks is not built for ``model``'s layout (None: it is). A
    per-head norm's weight gradient sums over heads, by a tree over ``segments`` head
    segments: the library's plain RMSNorm, and heads that ``segments`` divides."""
    config = model.config
    for attn, name, norm in _head_norms(model):
        if type(norm) is not RMSNorm or norm.weight_in_fp32 or norm.weight_offset:
            return f"{type(attn).__name__}.{name} is not the library's plain RMSNorm"
        what = "num_attention_heads" if name == "q_norm" else "num_key_value_heads"
        heads = getattr(config, what)
        if heads % segments:
            return (f"{type(attn).__name__}.{name} holds one weight for every head, whose gradient is a tree over "
                    f"{segments} head segments, and {what} ({heads}) does not divide into them")
    return None




def _check(model: nn.Module, world: int, segments: int, vocab_shards: int) -> None:
    """Everything :func:`tensor_parallel` refuses, named, before any parameter moves."""
    _need(layout_of(model) is None, "the model is tensor-parallel already")
    _need(is_patched(model), f"{type(model).__name__} is not patched: call rlkernels.patch_model(model) first")
    family = family_of(model)
    _need(family in FAMILIES | MOE_FAMILIES,
          f"{type(model).__name__} ({family}) is not covered: the layout covers the dense families "
          f"{', '.join(sorted(FAMILIES))} and, with their experts replicated, {', '.join(sorted(MOE_FAMILIES))}")
    config = model.config
    _need(is_pow2(world), f"the group's size must be a power of two, got {world}")
    _need(is_pow2(segments) and segments % world == 0,
          f"segments ({segments}) must be a power of two that the group's size ({world}) divides")
    _need(is_pow2(vocab_shards) and vocab_shards % world == 0,
          f"vocab_shards ({vocab_shards}) must be a power of two that the group's size ({world}) divides")
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    dense = [layer.mlp for layer in decoder_of(model).layers if not isinstance(layer.mlp, SparseMoeBlock)]
    widths = [("intermediate_size", config.intermediate_size, segments)] if dense else []
    for name, value, by in [("num_attention_heads", heads, world), ("num_key_value_heads", kv_heads, world),
                            ("the attention output's width (heads x head_dim)", heads * head_dim, segments),
                            ("the key-value width (kv heads x head_dim)", kv_heads * head_dim, segments),
                            *widths]:
        _need(value % by == 0, f"{name} ({value}) must divide by {by} "
                               f"({'the group size' if by == world else 'segments'})")
    head = model.get_output_embeddings()
    vocab = head.weight.shape[0]
    _need(vocab % vocab_shards == 0,
          f"the vocabulary ({vocab} rows of the LM head) must divide by vocab_shards ({vocab_shards}); "
          "pad the embedding and the head to a multiple (model.resize_token_embeddings(V, pad_to_multiple_of=...))")
    _need(model.get_input_embeddings().weight.shape[0] == vocab,
          "the input embedding and the LM head must have the same number of rows")
    for layer in decoder_of(model).layers:
        attn, mlp = layer.self_attn, layer.mlp
        parts = [(attn, ("q_proj", "k_proj", "v_proj", "o_proj"))]
        if not isinstance(mlp, SparseMoeBlock):
            parts.append((mlp, ("gate_proj", "up_proj", "down_proj")))
        for owner, names in parts:
            for name in names:
                _need(isinstance(getattr(owner, name, None), nn.Linear),
                      f"{type(owner).__name__}.{name} is not a linear layer")


def tensor_parallel(model: nn.Module, group: dist.ProcessGroup | None = None, *, segments: int = TREE_SEGMENTS,
                    vocab_shards: int = VOCAB_SHARDS) -> nn.Module:
    """Shard a patched dense causal LM in place over ``group`` (TP = its size t); returns it.

    Every rank must hold the same full model (built or loaded, then patched). ``group``: a
    process group of a power-of-two size dividing ``segments`` and ``vocab_shards``, the
    attention and key-value heads; None keeps one process with the same bits. Then
    :func:`rlkernels.token_logprobs` returns, on every rank, bitwise the ``group=None``
    model's result, at TP = 1, 2, 4 and 8; the model's own forward gives every rank the
    whole fp32 logits. It trains: ``token_logprobs``' backward gives each rank its shard of
    the ``group=None`` model's gradients, bitwise (the column-parallel projections' input
    gradients by the N-tree, :mod:`rlkernels.parallel.column_parallel`; Qwen3's per-head
    q/k norms' weight gradients by a tree over ``segments`` head segments,
    :mod:`rlkernels.parallel.head_norm`). Where the heads do not divide into ``segments``,
    a backward at TP > 1 is refused, naming the module.
    ``rlkernels.generate`` and ``rollout`` (eager, untruncated, sampled or greedy) draw
    through the head's vocabulary-parallel sampler: the same tokens and bits on every rank
    and at every TP size, their log-probs ``token_logprobs``' bitwise.
    Mixture-of-experts models (Qwen3-MoE, Qwen2-MoE, Mixtral) keep their expert blocks
    whole on every rank; their attention and dense layers are sharded.
    Refusals (ValueError naming the value) come before any parameter moves: an unpatched
    model, a family other than Llama, Mistral, Qwen2, Qwen3 and those MoE families, or
    sizes the group, ``segments`` or ``vocab_shards`` do not divide.
    """
    rank, world = process_group_world(OP, group, True) if group is not None else (0, 1)
    _check(model, world, segments, vocab_shards)
    no_backward = _no_backward(model, segments)
    layout = TensorParallelLayout(group, rank, world, segments, vocab_shards, no_backward)
    if no_backward is None:
        for _, _, norm in _head_norms(model):
            HeadTreeRMSNorm.convert(norm, group, segments, rank, world)
    for layer in decoder_of(model).layers:
        attn, mlp = layer.self_attn, layer.mlp
        experts = isinstance(mlp, SparseMoeBlock)  # replicated: every rank computes the whole block
        for linear in (attn.q_proj, attn.k_proj, attn.v_proj) + (() if experts else (mlp.gate_proj, mlp.up_proj)):
            _column_parallel(linear, group, rank, world, segments)
        for owner, name in ((attn, "o_proj"),) + (() if experts else ((mlp, "down_proj"),)):
            linear = getattr(owner, name)
            weight = _cols(linear.weight, rank, world) if world > 1 else linear.weight
            setattr(owner, name, TreeRowParallelLinear(weight, linear.bias, group, segments))
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head.weight is emb.weight
    vocab = head.weight.shape[0]
    head_weight = _rows(head.weight, rank, world) if world > 1 else head.weight
    emb_weight = head_weight if tied else (_rows(emb.weight, rank, world) if world > 1 else emb.weight)
    model.set_input_embeddings(VocabParallelEmbedding(emb_weight, vocab, group, rank, world))
    new_head = VocabParallelHead(head_weight, _rows(head.bias, rank, world) if world > 1 else head.bias, vocab,
                                 group, world, vocab_shards)
    model.set_output_embeddings(new_head)
    setattr(model, LAYOUT_ATTRIBUTE, layout)
    return model
