"""``nn.Module`` wrappers over the functional ops."""
from __future__ import annotations

import torch
from torch import nn

from .gemm.chain import accumulator_dtype
from .ops.activations import gelu_tanh, sigmoid, silu
from .ops.matmul import linear
from .ops.moe import SILU_GATE, GatedActivation, moe_experts, moe_topk
from .ops.norms import layer_norm, rms_norm


class Linear(nn.Linear):
    """Drop-in ``nn.Linear`` whose forward and backward keep the invariance contract.

    Same parameters and state_dict as ``nn.Linear``. If ``weight.main_grad``
    (fp32, Megatron-LM convention) exists, dW and dbias accumulate into it inside
    the kernel; otherwise ``.grad`` gets the fp32-accumulated gradient rounded once.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

    @classmethod
    def from_torch(cls, module: nn.Linear) -> "Linear":
        """A ``Linear`` sharing ``module``'s Parameter objects (no copy)."""
        if not isinstance(module, nn.Linear):
            raise TypeError(f"rlkernels.Linear.from_torch: expected nn.Linear, got {type(module).__name__}")
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = module.in_features, module.out_features
        new.weight = module.weight
        new.bias = module.bias
        return new


class LMHead(Linear):
    """The LM head as a :class:`Linear` whose logits are fp32: the canonical chain's sums,
    never rounded to the model's dtype.

    These are the logits :func:`rlkernels.linear_logprob` scores and
    :func:`rlkernels.linear_sample` draws from, so a sampler reading a patched model's
    logits (Hugging Face ``generate``) draws from the distribution the trainer scores,
    not from its bf16 rounding. A full forward's [B, L, V] logits take twice the memory
    of bf16 ones; ``token_logprobs`` never builds them.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, out_dtype=torch.float32)


class RMSNorm(nn.Module):
    """Drop-in for HF ``*RMSNorm`` modules (``weight``, ``variance_epsilon``): Llama's
    ``weight * xhat.to(x.dtype)``, or with ``weight_in_fp32`` OLMo 2's ``(weight * xhat).to(x.dtype)``
    (:func:`rlkernels.ops.norms.rms_norm`). ``weight_offset`` (Gemma's 1.0, with
    ``weight_in_fp32``): the factor is ``weight_offset + weight.float()``, formed in fp32 in
    every forward (so a captured graph reads the weight as it is at replay)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, *, weight_in_fp32: bool = False,
                 weight_offset: float = 0.0, device=None, dtype=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.variance_epsilon = eps
        self.weight_in_fp32 = weight_in_fp32
        self.weight_offset = _check_offset(weight_offset, weight_in_fp32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight if not self.weight_offset else self.weight_offset + self.weight.float()
        return rms_norm(x, w, self.variance_epsilon, weight_in_fp32=self.weight_in_fp32)

    @classmethod
    def from_module(cls, module: nn.Module, *, weight_in_fp32: bool = False,
                    weight_offset: float = 0.0) -> "RMSNorm":
        """An ``RMSNorm`` sharing ``module.weight`` (no copy); eps from ``variance_epsilon``/``eps``."""
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
        if eps is None or not isinstance(getattr(module, "weight", None), torch.Tensor):
            raise TypeError(f"rlkernels.RMSNorm.from_module: {type(module).__name__} has no weight/eps")
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.weight = module.weight
        new.variance_epsilon = float(eps)
        new.weight_in_fp32 = weight_in_fp32
        new.weight_offset = _check_offset(weight_offset, weight_in_fp32)
        return new

    def extra_repr(self) -> str:
        order = ", weight_in_fp32=True" if self.weight_in_fp32 else ""
        offset = f", weight_offset={self.weight_offset}" if self.weight_offset else ""
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}{order}{offset}"


def _check_offset(offset: float, weight_in_fp32: bool) -> float:
    """The offset as a float; an offset's factor is formed in fp32, so it needs ``weight_in_fp32``."""
    offset = float(offset)
    if offset and not weight_in_fp32:
        raise ValueError(f"rlkernels.RMSNorm: weight_offset={offset} needs weight_in_fp32=True (the factor "
                         "offset + weight is formed in fp32)")
    return offset


class LayerNorm(nn.Module):
    """Drop-in for Cohere's ``CohereLayerNorm`` (``weight`` of the normalized shape, [N] or
    per-head [heads, N] for its q/k norms, ``variance_epsilon``, no bias):
    ``(weight.float() * ((x - mean) * rsqrt(var + eps))).to(x.dtype)`` with the statistics
    in fp32 (:func:`rlkernels.ops.norms.layer_norm`)."""

    def __init__(self, weight: nn.Parameter, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = weight
        self.variance_epsilon = float(eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.variance_epsilon)

    @classmethod
    def from_module(cls, module: nn.Module) -> "LayerNorm":
        """A ``LayerNorm`` sharing ``module.weight`` (no copy), eps from ``variance_epsilon``."""
        eps = getattr(module, "variance_epsilon", None)
        if eps is None or not isinstance(getattr(module, "weight", None), torch.Tensor):
            raise TypeError(f"rlkernels.nn.LayerNorm.from_module: {type(module).__name__} has no weight/eps")
        return cls(module.weight, eps)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


class GELUTanh(nn.Module):
    """Drop-in for ``nn.GELU(approximate="tanh")`` / transformers' ``GELUTanh`` whose bits do
    not depend on the batch (:func:`rlkernels.ops.activations.gelu_tanh`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gelu_tanh(x)


class SiLU(nn.Module):
    """Drop-in for ``nn.SiLU`` / transformers' ``SiLUActivation`` whose bits do not depend on
    the batch or on the batch-invariant mode (:func:`rlkernels.ops.activations.silu`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu(x)


class MoeRouter(nn.Module):
    """Top-k router over ``weight`` [E, H] (and ``bias`` [E] or None): logits by the
    canonical chain in the input's dtype, then :func:`rlkernels.ops.moe.moe_topk` (fp32
    softmax, top-k with ties to the lowest expert id, renormalised with ``normalize``;
    ``round_weights`` rounds the weights to the logits' dtype, as Qwen2-MoE / Qwen3-MoE /
    GPT-OSS do). GPT-OSS's softmax over the k largest logits is the renormalised softmax
    over all of them."""

    def __init__(self, weight: nn.Parameter, top_k: int, *, normalize: bool, round_weights: bool = False,
                 bias: nn.Parameter | None = None) -> None:
        super().__init__()
        self.weight = weight
        self.bias = bias
        if isinstance(top_k, bool) or not isinstance(top_k, int):
            raise TypeError(f"rlkernels.nn.MoeRouter: top_k must be an int, got {top_k!r}")
        self.top_k = top_k
        self.num_experts = weight.shape[0]
        self.normalize = bool(normalize)
        self.round_weights = bool(round_weights)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, H] -> (logits [T, E] in x's dtype, weights [T, k] fp32, expert ids [T, k] int64)."""
        logits = linear(x, self.weight, self.bias)
        weights, index = moe_topk(logits, self.top_k, normalize=self.normalize,
                                  round_weights_to=logits.dtype if self.round_weights else None)
        return logits, weights, index

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, top_k={self.top_k}, normalize={self.normalize}, "
                f"round_weights={self.round_weights}, bias={self.bias is not None}")


class MoeExperts(nn.Module):
    """E gated experts held as transformers' fused 3-D parameters: ``gate_up_proj``
    [E, 2I, H] (gate rows first) and ``down_proj`` [E, H, I] with SiLU (the default), or
    GPT-OSS's layout with ``transposed`` ([E, H, 2I] and [E, I, H]), the biases
    ``gate_up_proj_bias`` [E, 2I] and ``down_proj_bias`` [E, H], and its interleaved,
    clamped SwiGLU (``activation``); forward is :func:`rlkernels.ops.moe.moe_experts`."""

    def __init__(self, gate_up_proj: nn.Parameter, down_proj: nn.Parameter, *,
                 gate_up_proj_bias: nn.Parameter | None = None, down_proj_bias: nn.Parameter | None = None,
                 activation: GatedActivation = SILU_GATE, transposed: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = gate_up_proj
        self.down_proj = down_proj
        self.gate_up_proj_bias = gate_up_proj_bias
        self.down_proj_bias = down_proj_bias
        self.activation = activation
        self.transposed = transposed
        self.num_experts = gate_up_proj.shape[0]

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, *,
                out_dtype: torch.dtype | None = None, check_ids: bool = True) -> torch.Tensor:
        return moe_experts(x, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj,
                           gate_up_bias=self.gate_up_proj_bias, down_bias=self.down_proj_bias,
                           activation=self.activation, transposed=self.transposed, out_dtype=out_dtype,
                           check_ids=check_ids)

    def extra_repr(self) -> str:
        if self.transposed:
            E, H, two_i = self.gate_up_proj.shape
        else:
            E, two_i, H = self.gate_up_proj.shape
        extra = "" if self.activation == SILU_GATE else f", activation={self.activation}"
        return (f"experts={E}, hidden={H}, intermediate={two_i // 2}, bias={self.gate_up_proj_bias is not None}"
                f"{extra}")


class SparseMoeBlock(nn.Module):
    """A mixture-of-experts MLP whose every token's output is a function of its own row.

    ``out = round((sum_r w_r * expert_r(x)) + sigmoid(shared_expert_gate(x)) * shared_expert(x))``:
    the routed experts' combine in fp32 in ascending rank order, then the shared expert (if
    any; its gate in fp32, ungated without ``shared_expert_gate``), rounded once to x's dtype.
    Children keep transformers' names (``gate``, ``experts``, ``shared_expert``,
    ``shared_expert_gate``), so a patched model's state_dict keys are the stock ones.
    """

    def __init__(self, gate: MoeRouter, experts: MoeExperts, shared_expert: nn.Module | None = None,
                 shared_expert_gate: Linear | None = None) -> None:
        super().__init__()
        if gate.num_experts != experts.num_experts:
            raise ValueError(f"rlkernels.SparseMoeBlock: the router scores {gate.num_experts} experts but the experts "
                             f"module holds {experts.num_experts}")
        if gate.weight.shape[1] != experts.gate_up_proj.shape[2]:
            raise ValueError(f"rlkernels.SparseMoeBlock: the router's hidden size {gate.weight.shape[1]} differs from "
                             f"the experts' {experts.gate_up_proj.shape[2]}")
        if shared_expert_gate is not None and shared_expert is None:
            raise ValueError("rlkernels.SparseMoeBlock: a shared_expert_gate needs a shared_expert")
        self.gate = gate
        self.experts = experts
        self.shared_expert = shared_expert
        self.shared_expert_gate = shared_expert_gate

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        _, weights, index = self.gate(x)
        acc = accumulator_dtype(x.dtype)
        # The router's ids are in [0, E) by construction: no range check, no read back per layer.
        # With a shared expert the routed sum stays fp32 until the shared term is added.
        out = self.experts(x, index, weights, out_dtype=acc if self.shared_expert is not None else x.dtype,
                           check_ids=False)
        if self.shared_expert is not None:
            shared = self.shared_expert(x).to(acc)
            if self.shared_expert_gate is not None:
                w = self.shared_expert_gate.weight
                shared = sigmoid(linear(x, w, self.shared_expert_gate.bias, out_dtype=acc)) * shared
            out = out + shared
        return out.to(hidden_states.dtype).reshape(shape)


class RoutedExpertsMlp(nn.Module):
    """GPT-OSS's MLP (``GptOssMLP``) with every token's output a function of its own row:
    children ``router`` (:class:`MoeRouter` with a bias) and ``experts``
    (:class:`MoeExperts` with biases and the clamped SwiGLU), transformers' names, so a
    patched model's state_dict keys are the stock ones.

    forward(x [B, L, H]) -> (out [B, L, H] in x's dtype, routing weights [B*L, k] in x's
    dtype): the routed experts' combine in fp32 in ascending rank order, rounded once.
    """

    def __init__(self, router: MoeRouter, experts: MoeExperts) -> None:
        super().__init__()
        if router.num_experts != experts.num_experts:
            raise ValueError(f"rlkernels.RoutedExpertsMlp: the router scores {router.num_experts} experts but the "
                             f"experts module holds {experts.num_experts}")
        self.router = router
        self.experts = experts

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        _, weights, index = self.router(x)
        # The router's ids are in [0, E) by construction: no range check, no read back per layer.
        out = self.experts(x, index, weights, out_dtype=x.dtype, check_ids=False)
        return out.reshape(shape), weights.to(x.dtype)
