"""verl: a drop-in for ``verl.utils.kernel.linear_cross_entropy.linear_cross_entropy``.

Swapping is one import::

    # from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy
    from rlkernels.integrations.trainers.verl import linear_cross_entropy

    log_probs, entropy = linear_cross_entropy(hidden_states, lm_head.weight, labels, temperature, "none")

verl's function (its fused LM-head kernel) takes the same arguments and returns the
same values; this one computes them with :func:`rlkernels.linear_logprob`, so a
token's log-prob, entropy and dhidden row are bitwise the same whatever else is in
the batch, and dW is one deterministic fp32 chain over tokens (accumulated into
``weight.main_grad`` when it exists).

verl's meaning, which this function keeps:

* ``hidden`` [..., D] and ``labels`` with as many elements as ``hidden`` has rows are
  flattened to N tokens; both outputs are flat [N] (not ``labels``' shape).
* The first output is the **log-probability** of the label (``<= 0``; despite the
  function's name, not the cross-entropy, which is its negation), the second the
  entropy of ``softmax(logits / temperature)``, in nats.
* ``temperature`` divides the logits before the softmax, for both outputs.
* ``reduction`` (case-insensitive) applies to the log-probs only: ``"none"`` gives
  [N], ``"sum"`` their sum and ``"mean"`` their sum / N as 0-dim tensors (NaN for
  N = 0). The entropy is per token [N] under every reduction.
* No ignore index: every label must be a token id in ``[0, V)`` (verl's kernel
  reads an out-of-range label as a logit of 0; here it is refused).
* Outputs are fp32 whatever the input dtype (fp64 for fp64 inputs, which verl does
  not take); gradients flow to ``hidden`` and ``weight``.

Not supported: ``dist_process_group`` (verl's vocabulary-parallel LM head, a weight
sharded over tensor-parallel ranks) raises NotImplementedError.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from ...ops import _validate as V
from ...ops.linear_logprob import linear_logprob

OP = "integrations.trainers.verl.linear_cross_entropy"
REDUCTIONS = ("none", "sum", "mean")
_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def _reduction(reduction: object) -> str:
    if not isinstance(reduction, str) or reduction.lower() not in REDUCTIONS:
        raise ValueError(f"rlkernels.{OP}: reduction must be one of {', '.join(map(repr, REDUCTIONS))} "
                         f"(case-insensitive, as in verl), got {reduction!r}")
    return reduction.lower()


def _validate(hidden: object, weight: object, labels: object, temperature: object) -> int:
    """Host-side checks before any launch; returns the token count N."""
    for name, t in (("hidden", hidden), ("weight", weight), ("labels", labels)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"rlkernels.{OP}: {name} must be a torch.Tensor, got {type(t).__name__}")
    V.require_temperature(OP, temperature)
    if hidden.dim() < 1:
        raise ValueError(f"rlkernels.{OP}: hidden must be [..., D], got a 0-dim tensor")
    if labels.dtype not in _INT_DTYPES:
        raise ValueError(f"rlkernels.{OP}: labels must be an integer tensor of token ids, got {labels.dtype}")
    if weight.dim() != 2:
        raise ValueError(f"rlkernels.{OP}: weight must be [V, D] (lm_head layout), got shape {tuple(weight.shape)}")
    n = math.prod(hidden.shape[:-1])
    if labels.numel() != n:
        raise ValueError(f"rlkernels.{OP}: hidden {tuple(hidden.shape)} has {n} token rows but labels "
                         f"{tuple(labels.shape)} has {labels.numel()} elements; they must be equal")
    vocab = weight.shape[0]
    if n and labels.device.type != "meta":  # meta tensors hold no ids to check
        flat = labels.reshape(-1)
        bad = (flat < 0) | (flat >= vocab)
        if bool(bad.any()):  # one host sync
            pos = int(bad.nonzero()[0, 0])
            raise ValueError(f"rlkernels.{OP}: label {int(flat[pos])} at flat position {pos} is outside "
                             f"[0, {vocab}); verl's linear_cross_entropy has no ignore index, so every label "
                             "must be a token id (drop padded positions, or use rlkernels.linear_logprob "
                             "with ignore_index)")
    return n


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         temperature: float = 1.0, reduction: str = "none",
                         dist_process_group: Any = None, *,
                         backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs and entropies of an LM head, with verl's signature and return values.

    hidden: [..., D] bf16/fp16/fp32 (fp64 on the torch backend); weight: [V, D] of the
    same dtype and device; labels: integer ids in [0, V), ``prod(hidden.shape[:-1])``
    of them in any shape. Returns ``(log_probs, entropy)``: ``log_probs`` is [N] fp32
    for ``reduction="none"``, or a 0-dim fp32 tensor for ``"sum"`` / ``"mean"`` (their
    sum / mean over the N tokens); ``entropy`` is [N] fp32 under every reduction
    (fp64 for fp64 inputs). Both are of ``softmax(hidden @ weight.T / temperature)``.
    Differentiable w.r.t. ``hidden`` and ``weight`` (first order); dW accumulates
    into ``weight.main_grad`` when present.

    ``dist_process_group`` must be None (a vocabulary-parallel head is not supported);
    ``backend`` ("torch" / "triton", keyword only, not in verl) forces a backend.
    Errors (bad reduction, labels outside [0, V), shape mismatch) are raised before
    any kernel runs.
    """
    if dist_process_group is not None:
        raise NotImplementedError(f"rlkernels.{OP}: dist_process_group (a vocabulary-parallel lm head, got "
                                  f"{dist_process_group!r}) is not supported; gather the full [V, D] weight, or "
                                  "keep verl's kernel for tensor-parallel heads")
    red = _reduction(reduction)
    n = _validate(hidden, weight, labels, temperature)
    h2 = hidden.reshape(n, hidden.shape[-1])  # explicit N: -1 is ambiguous when D = 0
    logp, entropy = linear_logprob(h2, weight, labels.reshape(n), temperature=float(temperature),
                                   return_entropy=True, backend=backend)
    if red == "sum":
        logp = logp.sum()
    elif red == "mean":
        logp = logp.sum() / n  # 0 / 0 = NaN for no tokens, as verl's mean
    return logp, entropy
