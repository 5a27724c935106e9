"""How the fused LM-head kernels launch: their tile configs, their operands (pointers or TMA
descriptors) and the temperature step's mode. Shared by the statistics pass and by the
kernels that recompute the logits after it (``linear_logprob``'s g, ``linear_sample``'s
second draw).
"""
from __future__ import annotations

import dataclasses
import struct

import torch

from ..._env import triton_interpret
from ...gemm.tma import TensorDescriptor, tma_layout_ok
from ...kernels.lm_head import TEMP_DIVIDE, TEMP_NONE, TEMP_RECIPROCAL
from .lse import LSE_SPLIT, LSE_TILE


@dataclasses.dataclass(frozen=True)
class FusedConfig:
    """Tile config of the fused logits kernels, fixed per dtype. The forward's statistics
    do not depend on it (the LSE order's fixed-point tile sums); ``block_v`` must be the
    LSE order's tile."""

    block_m: int
    block_v: int  # the LSE order's tile (the forward's statistics follow it)
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    # Operand tiles by TMA (Hopper+, 16-byte aligned rows) instead of pointer loads: the
    # same D-chain, zero-filled edges (gemm.tma).
    tma: bool = False
    # Backward g kernel: NUM_SMS programs walk the tiles instead of one program per tile.
    persistent: bool = False
    # Backward g kernel, with TMA loads: g stored by TMA too where its layout allows.
    tma_store: bool = False
    # Forward at N <= small_n rows: the logits [N, V] fp32 by the GEMM backend (the same
    # canonical chain, decode-tuned tiles over all of V), then the statistics over them in
    # blocks of small_block_m rows. At small N the fused kernel has one token block and
    # V / 2048 programs; the GEMM spreads the weight read over the whole GPU. The bits are
    # the fused kernel's either way (tests/ops/test_linear_logprob.py, on the GPU too).
    small_n: int = 64
    small_block_m: int = 16

    def __post_init__(self) -> None:
        if self.block_v != LSE_TILE:
            raise ValueError(f"rlkernels: FusedConfig.block_v must be the LSE order's tile {LSE_TILE} (the "
                             f"forward's statistics are taken tile by tile), got {self.block_v}")

    @property
    def split_v(self) -> int:
        """Forward: columns per program, the LSE order's split."""
        return LSE_SPLIT

    def short(self) -> str:
        return (f"{self.block_m}x{self.block_v}x{self.block_k}/g{self.group_m}"
                f"/w{self.num_warps}/s{self.num_stages}{'/tma' if self.tma else ''}"
                f"{'/pers' if self.persistent else ''}{'/tmastore' if self.tma_store else ''}")


# Checked in, never tuned at run time. The 16-bit entry matches the large-M tile of the
# GEMM table (128x256x64, 8 warps, 3 stages): the fused kernels are GEMMs with an epilogue.
# Why TMA loads, the persistent g schedule and the TMA store of g (same bits, measured):
# docs/design/linear_logprob_schedule.md.
FUSED_16BIT = FusedConfig(128, 256, 64, group_m=16, num_warps=8, num_stages=3, tma=True, persistent=True,
                          tma_store=True)
FUSED_FP32 = FusedConfig(32, 256, 32, group_m=8, num_warps=8, num_stages=2)
# The interpreter's tl.dot is numpy's BLAS, whose rounding depends on a row's place in
# the tile (see gemm.table): one row per program keeps every row's numpy calls identical.
# BLOCK_K = 16 as the interpreter's GEMM config: the interpreter sums a whole BLOCK_K
# per step, so the logits are rlkernels.linear's bits (as on the GPU, where the tensor
# cores' 16-wide K step is the same in every tile).
FUSED_INTERPRETER = FusedConfig(1, 256, 16, group_m=1, num_warps=4, num_stages=1, small_n=4, small_block_m=1)


def fused_config(dtype: torch.dtype) -> FusedConfig:
    """The checked-in config for ``dtype`` (the interpreter's under TRITON_INTERPRET=1)."""
    if triton_interpret():
        return FUSED_INTERPRETER
    return FUSED_FP32 if dtype == torch.float32 else FUSED_16BIT


def kernel_operands(h2: torch.Tensor, weight: torch.Tensor, cfg: FusedConfig) -> tuple[object, object, bool]:
    """(h, W, tma) for the logits kernels: TMA descriptors where ``cfg`` asks and the layouts
    allow, else the tensors themselves (pointer loads)."""
    if cfg.tma and (h2.is_cuda or triton_interpret()) and TensorDescriptor is not None \
            and tma_layout_ok(h2) and tma_layout_ok(weight):
        N, D = h2.shape
        return (TensorDescriptor(h2, [N, D], [h2.stride(0), 1], [cfg.block_m, cfg.block_k]),
                TensorDescriptor(weight, list(weight.shape), [weight.stride(0), 1], [cfg.block_v, cfg.block_k]),
                True)
    return h2, weight, False


@dataclasses.dataclass(frozen=True)
class LogitTransform:
    """How a model makes its logits from its head's raw output x = h W^T + b, before any
    temperature: ``y = x * scale``, then, with a soft-cap c > 0, ``c * tanh(y / c)``
    (Cohere's ``logit_scale``; Gemma 2's ``final_logit_softcapping``), each step in fp32 as
    torch computes it on the logits' device (``y / c`` by :func:`temperature_scaling`'s
    rule). The fused head's distribution is then ``softmax(transform(x) / T)``.
    :data:`NO_TRANSFORM` (scale 1, soft-cap 0: none) leaves x as it is, and the kernels
    compile the steps out."""

    scale: float = 1.0
    softcap: float = 0.0

    @property
    def neutral(self) -> bool:
        return self.scale == 1.0 and self.softcap == 0.0

    def launch_args(self, temperature: float, device: torch.device) -> tuple[tuple[float, ...], dict[str, int]]:
        """What every logits kernel takes for z = transform(x) / T: the arguments (T's, the
        scale, the soft-cap division's, c), in that order, and the constexprs TEMP
        (:func:`temperature_scaling`), SCALE and CAP (the soft-cap division's ``TEMP`` mode,
        0 without a soft-cap) of ``kernels.lm_head.model_logits``."""
        temp_arg, temp_mode = temperature_scaling(temperature, device)
        if self.softcap == 0.0:
            cap_arg, cap_mode = 1.0, TEMP_NONE
        else:
            cap_arg, cap_mode = temperature_scaling(self.softcap, device)
            if cap_mode == TEMP_NONE:  # c = 1: y / c is y, but the cap still applies
                cap_arg, cap_mode = 1.0, TEMP_DIVIDE
        return ((temp_arg, float(self.scale), cap_arg, float(self.softcap)),
                dict(TEMP=temp_mode, SCALE=self.scale != 1.0, CAP=cap_mode))


NO_TRANSFORM = LogitTransform()


def temperature_scaling(temperature: float, device: torch.device) -> tuple[float, int]:
    """(kernel argument, ``TEMP`` constexpr) for z / T computed as torch computes
    ``logits / T`` for a Python float T on ``device`` -- what samplers and trainers write
    (Hugging Face's temperature warper, TRL, verl), so their log_softmax of the scores
    gives the fused ops' bits: on CUDA ATen multiplies by fl32(1 / fl32(T)); elsewhere it
    divides, correctly rounded."""
    if temperature == 1.0:
        return 1.0, TEMP_NONE
    if device.type == "cuda":
        # In doubles, then rounded to fp32: the correctly rounded fp32 quotient (a double
        # holds more than 2 * 24 + 2 bits, so the double rounding is innocuous), with no
        # tensor made on the host per call (decode calls are host-bound).
        return to_fp32(1.0 / to_fp32(temperature)), TEMP_RECIPROCAL
    return float(temperature), TEMP_DIVIDE


def to_fp32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]
