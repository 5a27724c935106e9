"""``nn.Module`` wrappers over the functional ops."""
from __future__ import annotations

import torch
from torch import nn

from .ops.matmul import linear


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
