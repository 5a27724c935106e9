"""Attention sinks: a per-head logit in every row's softmax normalizer whose value row is
dropped (GPT-OSS's ``sinks``), and its gradient, which both backends share."""
from __future__ import annotations

import torch


def sink_grad(sinks: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor, exp) -> torch.Tensor:
    """dL/dsink_h = -sum over h's rows of p_sink * delta (delta = rowsum(dO * O)): a sink's
    probability takes its share from every key's. ``sinks`` [Hq] and ``lse`` [Hq, Tq] in the
    units ``exp`` inverts (log2 with exp2, natural with exp); rows outside every sequence have
    an infinite LSE (their delta is unread). Summed over the rows by torch's reduction."""
    p = exp(sinks[:, None] - lse)
    return -torch.where(torch.isfinite(lse), p * delta, torch.zeros_like(p)).sum(1)
