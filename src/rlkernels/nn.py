"""``nn.Module`` wrappers over the functional ops."""
from __future__ import annotations

import torch
from torch import nn

from .ops.activations import silu
from .ops.matmul import linear
from .ops.norms import rms_norm


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
    """Drop-in for HF ``*RMSNorm`` modules (``weight``, ``variance_epsilon``)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, *, device=None, dtype=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.variance_epsilon)

    @classmethod
    def from_module(cls, module: nn.Module) -> "RMSNorm":
        """An ``RMSNorm`` sharing ``module.weight`` (no copy); eps from ``variance_epsilon``/``eps``."""
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
        if eps is None or not isinstance(getattr(module, "weight", None), torch.Tensor):
            raise TypeError(f"rlkernels.RMSNorm.from_module: {type(module).__name__} has no weight/eps")
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.weight = module.weight
        new.variance_epsilon = float(eps)
        return new

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


class SiLU(nn.Module):
    """Drop-in for ``nn.SiLU`` / transformers' ``SiLUActivation`` whose bits do not depend on
    the batch or on the batch-invariant mode (:func:`rlkernels.ops.activations.silu`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu(x)
