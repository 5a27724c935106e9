"""The LM head's input checks, shared by every op that takes a head: ``linear_logprob``,
``linear_sample`` and the vocab-parallel log-probs. Each check raises naming the public op
the user called (``op``) and the operands as that op's signature names them
(:class:`HeadNames`), on the host before any launch.
"""
from __future__ import annotations

import dataclasses
import math
import numbers

import torch

from .. import _validate as V_
from ...registry import select_backend
from .config import LogitTransform

INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


@dataclasses.dataclass(frozen=True)
class HeadNames:
    """How a public op names the head in its signature and errors: the weight and bias
    arguments, and what the weight's rows are (the vocabulary ``V``, or one rank's shard
    of it)."""

    weight: str = "weight"
    bias: str = "bias"
    rows: str = "V"


WHOLE_HEAD = HeadNames()


def validate_head(op: str, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  temperature: float, names: HeadNames = WHOLE_HEAD) -> None:
    """The head's operands and temperature: hidden [..., D], weight [rows, D] with rows > 0,
    bias [rows] or None, one float dtype, temperature a finite Python number > 0.
    Raises TypeError/ValueError naming ``op``. Devices are the caller's check (with its
    other tensors)."""
    V_.require_tensor(op, "hidden", hidden)
    V_.require_tensor(op, names.weight, weight)
    if bias is not None:
        V_.require_tensor(op, names.bias, bias)
    V_.require_float(op, "hidden", hidden)
    V_.require_float(op, names.weight, weight)
    if bias is not None:
        V_.require_float(op, names.bias, bias)
    V_.require_ndim(op, "hidden", hidden, 1)
    V_.require_ndim(op, names.weight, weight, 2, 2)
    if bias is not None:
        V_.require_ndim(op, names.bias, bias, 1, 1)
    V_.require_same_dtype(op, **{"hidden": hidden, names.weight: weight, names.bias: bias})
    rows, dim = weight.shape
    if hidden.shape[-1] != dim:
        raise ValueError(f"rlkernels.{op}: hidden {tuple(hidden.shape)} has D={hidden.shape[-1]} but {names.weight} "
                         f"{tuple(weight.shape)} (lm_head layout [{names.rows}, D]) has D={dim}")
    if rows == 0:
        raise ValueError(f"rlkernels.{op}: {names.weight} has an empty vocabulary ({names.rows}=0)")
    if bias is not None and tuple(bias.shape) != (rows,):
        raise ValueError(f"rlkernels.{op}: {names.bias} must have shape ({rows},) to match {names.weight}'s "
                         f"{names.rows}, got {tuple(bias.shape)}")
    V_.require_temperature(op, temperature)


def validate_targets(op: str, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                     bias: torch.Tensor | None, ignore_index: int, names: HeadNames = WHOLE_HEAD,
                     world: int | None = None) -> int:
    """The target ids of a head already checked by :func:`validate_head`: an integer tensor
    of hidden's leading shape, every id in [0, V) or ``ignore_index``, all tensors on one
    device. V is weight's rows, times ``world`` where weight is one of ``world`` equal
    vocabulary shards (None: the whole head). Syncs once to check the ids (not on meta
    tensors). Returns V."""
    V_.require_tensor(op, "target", target)
    if target.dtype not in INT_DTYPES:
        raise ValueError(f"rlkernels.{op}: target must be an integer tensor of token ids, got {target.dtype}")
    V_.require_same_device(op, **{"hidden": hidden, names.weight: weight, "target": target, names.bias: bias})
    rows = weight.shape[0]
    vocab = rows * (world or 1)
    if tuple(target.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"rlkernels.{op}: target shape {tuple(target.shape)} must equal hidden's leading "
                         f"shape {tuple(hidden.shape[:-1])}")
    if target.numel() and target.device.type != "meta":  # meta tensors hold no ids to check
        t = target.reshape(-1)
        bad = (t != ignore_index) & ((t < 0) | (t >= vocab))
        if bool(bad.any()):  # the one host sync of the call
            pos = int(bad.nonzero()[0, 0])
            sharded = f" (V = {rows} x TP {world})" if world is not None else ""
            raise ValueError(f"rlkernels.{op}: target id {int(t[pos])} at flat position {pos} is outside "
                             f"[0, {vocab}){sharded} and is not ignore_index={ignore_index}")
    return vocab


def head_backend(registry_op: str, op: str, hidden: torch.Tensor, backend: str | None) -> str:
    """The registry's backend for ``registry_op`` on hidden's device (or ``backend``);
    refuses, naming ``op``, what that backend cannot run (interpreted bf16, fp64 on Triton)."""
    name, _ = select_backend(registry_op, hidden.device, backend)
    V_.refuse_interpreted_bf16(op, name, hidden)
    if name == "triton" and hidden.dtype == torch.float64:
        raise ValueError(f"rlkernels.{op}: float64 runs on the torch backend only (RLKERNELS_BACKEND=torch)")
    return name


def validate_threshold(op: str, threshold: object, lead: tuple[int, ...], dtype: torch.dtype,
                       device: torch.device, name: str = "logit_threshold") -> None:
    """A truncated distribution's per-row threshold for token rows of shape ``lead`` whose
    hidden states are ``dtype`` on ``device``: a tensor of that shape in the log-probs'
    dtype (fp32; fp64 for fp64) on that device, no value NaN (checked where reading costs
    no device sync: a CPU tensor). -inf keeps every logit."""
    if not isinstance(threshold, torch.Tensor):
        raise TypeError(f"rlkernels.{op}: {name} must be a tensor, got {type(threshold).__name__}")
    if tuple(threshold.shape) != tuple(lead):
        raise ValueError(f"rlkernels.{op}: {name} shape {tuple(threshold.shape)} must equal {tuple(lead)} "
                         f"(one threshold per scored token)")
    want = torch.float64 if dtype == torch.float64 else torch.float32
    if threshold.dtype != want:
        raise ValueError(f"rlkernels.{op}: {name} must be {want} (a scaled logit, as the sampler returns it), "
                         f"got {threshold.dtype}")
    if threshold.device != device:
        raise ValueError(f"rlkernels.{op}: {name} is on {threshold.device}, the tokens on {device}")
    if threshold.device.type == "cpu" and threshold.numel() and bool(torch.isnan(threshold).any()):
        pos = int(torch.isnan(threshold.reshape(-1)).nonzero()[0, 0])
        raise ValueError(f"rlkernels.{op}: {name} is NaN at flat position {pos} (use -inf to keep every logit)")


def validate_transform(op: str, logit_scale: object, logit_softcap: object) -> LogitTransform:
    """The model's logit transform (:class:`~.config.LogitTransform`) from an op's
    ``logit_scale`` (a finite Python number > 0) and ``logit_softcap`` (a finite Python
    number >= 0, 0: no soft-cap); raises TypeError/ValueError naming ``op``. Tensors are
    refused, as temperatures are: reading one is a host sync."""
    for name, value in (("logit_scale", logit_scale), ("logit_softcap", logit_softcap)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"rlkernels.{op}: {name} must be a Python number, got {type(value).__name__} {value!r}")
    if not math.isfinite(float(logit_scale)) or float(logit_scale) <= 0:
        raise ValueError(f"rlkernels.{op}: logit_scale must be a finite number > 0 (1: none), got {logit_scale!r}")
    if not math.isfinite(float(logit_softcap)) or float(logit_softcap) < 0:
        raise ValueError(f"rlkernels.{op}: logit_softcap must be a finite number >= 0 (0: no soft-cap), got "
                         f"{logit_softcap!r}")
    return LogitTransform(float(logit_scale), float(logit_softcap))
