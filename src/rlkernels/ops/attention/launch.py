"""Launch parameters of the attention kernels: tiles, warps, stages, compile options, and
:class:`AttnTuning`, the chain and launch choices a call runs with.

None of the launch parameters changes a row's bits (the chain is :class:`~.key_blocks.Chain`'s);
they change how fast the kernels compute it.
"""
from __future__ import annotations

import dataclasses

from ..._env import triton_interpret
from ...runtime.launcher import NO_FP_FUSION
from .key_blocks import DEFAULT_CHAIN, Chain
from .layout import TMA_MIN_FLOPS


@dataclasses.dataclass(frozen=True)
class KernelLaunch:
    """One kernel's launch parameters (no effect on the bits): query rows per program or
    step (``block_m``), Triton's ``num_warps`` and ``num_stages``, and for the backward
    kernels key rows per program or step (``block_n``; the forward's key block is the
    chain's, :attr:`~.key_blocks.Chain.block_n`)."""

    block_m: int
    num_warps: int
    num_stages: int
    block_n: int = 0


@dataclasses.dataclass(frozen=True)
class FwdLaunch:
    """Launch parameters of the forward kernels (no effect on the bits): the full kernel's
    and the split-KV kernel's. ``tma``: the full kernel reads whole in-range K/V blocks
    through TMA descriptors where it can (:func:`~.layout.head_rows_desc`) and the call is
    large enough to pay for them (:func:`~.layout.tma_pays`). ``ws``: the full forward
    takes the warp-specialized Hopper kernel where it applies (:func:`~.ws_host.ws_fwd`)."""

    full: KernelLaunch = KernelLaunch(128, 8, 3)
    split: KernelLaunch = KernelLaunch(16, 4, 3)
    tma: bool = True
    ws: bool = True


@dataclasses.dataclass(frozen=True)
class BwdLaunch:
    """Launch parameters of the backward kernels: the dK/dV kernel's (``block_n`` keys per
    program, ``block_m`` query rows per step) and the dQ kernel's (``block_m`` query rows
    per program, ``block_n`` keys per step); ``tma`` as in :class:`FwdLaunch` (dQ: K/V
    blocks, dK/dV: q and dO blocks)."""

    dkdv: KernelLaunch = KernelLaunch(64, 4, 2, 64)
    dq: KernelLaunch = KernelLaunch(64, 4, 2, 64)
    tma: bool = True


def default_fwd_launch(head_dim: int, max_q: int = 0) -> FwdLaunch:
    """Measured on an H100 (bf16, causal, B * L = 16384; benchmarks/results/attention_h100.json):
    D = 128: 128 rows / 8 warps / 3 stages beat 2 and 4 stages and 64-row tiles at every L.
    The split-KV (decode) kernel: 4 warps / 3 stages at both head dims (D = 128, one query
    over 560-700 keys: 13.5 / 61.2 / 216 us at B = 16 / 64 / 256 against 15.0 / 63.4 / 226
    for 8 warps; docs/design/attention_kernels.md#decode). D = 64: 64 rows / 4 warps at
    L <= 2048 (190 vs 167 TFLOP/s for 128 / 8 at L = 1024), 128 rows / 4 warps beyond."""
    if triton_interpret():
        return FwdLaunch(KernelLaunch(16, 1, 1), KernelLaunch(16, 1, 1))
    if head_dim <= 64:
        return FwdLaunch(KernelLaunch(64, 4, 3) if max_q <= 2048 else KernelLaunch(128, 4, 3))
    if head_dim <= 128:
        return FwdLaunch(KernelLaunch(128, 8, 3), KernelLaunch(16, 4, 3))
    return FwdLaunch(KernelLaunch(64, 4, 2))


def default_bwd_launch(head_dim: int) -> BwdLaunch:
    """Measured on an H100 (bf16, causal, B * L = 16384): with the query-major dK/dV step,
    64 x 64 tiles / 4 warps / 2 stages for both kernels beat 128-row or 128-key tiles,
    8 warps and 3 stages at D = 128 and D = 64 (larger tiles spill the two accumulators)."""
    if triton_interpret():
        return BwdLaunch(KernelLaunch(16, 1, 1, 16), KernelLaunch(16, 1, 1, 16))
    if head_dim <= 128:
        return BwdLaunch(KernelLaunch(64, 4, 2, 64), KernelLaunch(64, 4, 2, 64))
    return BwdLaunch(KernelLaunch(32, 4, 1, 64), KernelLaunch(64, 4, 1, 32))


@dataclasses.dataclass(frozen=True)
class AttnTuning:
    """The chain and the launch choices a call runs with, passed as an argument down every
    route (the entry points' private ``_tuning``, for tests and tuning scripts only), so a
    call's choices are its own and no other call or thread sees them.

    ``chain``: the chain-defining constants; another chain gives other bits (the tests run
    a small one on the interpreter). ``fwd`` / ``bwd``: launch parameters, None for
    :func:`default_fwd_launch` / :func:`default_bwd_launch` of the call's shape.
    ``tma_min_flops``: the call size from which the kernels read through TMA
    (:func:`~.layout.tma_pays`; 0: every call that can). ``fwd``, ``bwd`` and
    ``tma_min_flops`` never change a row's bits, nor does ``ws_programs``: the persistent
    warp-specialized forward's program count (None: one per SM, at most one per tile;
    :func:`~.ws_host.ws_programs`), which only decides which program computes a tile.
    Under torch.compile the custom ops take the chain alone (plain ints in their schema)
    and launch with the defaults.
    """

    chain: Chain = DEFAULT_CHAIN
    fwd: FwdLaunch | None = None
    bwd: BwdLaunch | None = None
    tma_min_flops: float = TMA_MIN_FLOPS
    ws_programs: int | None = None


DEFAULT_TUNING = AttnTuning()


# The forward kernels compile without mul+add contraction: the chain's FMAs are written out
# (tl.fma) and nothing else is fused, so the masked and unmasked block steps round alike.
FWD_OPTIONS = NO_FP_FUSION
# The split-KV combine: columns per program, warps, stages (launch detail, no effect on the bits).
COMBINE_BLOCK_D = 32
COMBINE_WARPS = 1
COMBINE_STAGES = 4
# Triton's num_warps where a launch names none: the delta kernel is a light row sum that needs no more.
DELTA_WARPS = 4
