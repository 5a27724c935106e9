"""How :func:`rlkernels.tensor_parallel` sharded a model, readable without importing
``rlkernels.parallel`` (scoring checks it on every call)."""
from __future__ import annotations

import dataclasses

import torch.distributed as dist
from torch import nn

# The model attribute that holds its layout.
LAYOUT_ATTRIBUTE = "_rlkernels_tensor_parallel"


@dataclasses.dataclass(frozen=True)
class TensorParallelLayout:
    """How a model was sharded: its group (None: one process), rank and size, the K-tree's
    segments and the head's vocabulary shards; ``no_backward``: why a backward across
    ranks is not built for it (None: it is)."""

    group: dist.ProcessGroup | None
    rank: int
    world: int
    segments: int
    vocab_shards: int
    no_backward: str | None = None


def layout_of(model: nn.Module) -> TensorParallelLayout | None:
    """The layout :func:`rlkernels.tensor_parallel` gave ``model``, or None."""
    return getattr(model, LAYOUT_ATTRIBUTE, None)
