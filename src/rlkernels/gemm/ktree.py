"""The K-tree GEMM on the Triton backend: one launch for a rank's whole subtree.

``ktree_gemm(x2, w_nk, seg, n_seg)`` is, bit for bit, the pairwise tree (left to right)
over ``n_seg`` segments of ``seg`` columns of K, each segment the canonical chain of the
Triton GEMM backend on that K-slice with an fp32 output: on Hopper the chain's bits do
not depend on the tile (``gemm.triton``'s module doc), so the segment chains here are
the GEMM backend's whatever tile this launch uses (``tests/gemm/test_ktree.py`` checks it
against the unfused tree on the GPU and in the interpreter). One launch instead of
``n_seg`` GEMMs with fp32 outputs and ``n_seg - 1`` additions through HBM: fewer bytes
and launches (measurements: docs/design/ktree.md).

Operands come by TMA, so the fused path needs a layout TMA can describe (unit inner
stride, 16-byte aligned rows; a Hopper GPU or the interpreter) and ``seg`` divisible by
the tile's K step; anything else runs the unfused tree, which gives the same bits.
"""
from __future__ import annotations

import torch

from .._env import triton_interpret
from ..kernels._triton import cdiv
from ..kernels.ktree import ktree_gemm_kernel
from ..runtime.device import capability
from ..runtime.launcher import cached_launcher
from .table import GemmConfig
from .tma import TensorDescriptor, tma_layout_ok

_launch_ktree = cached_launcher(ktree_gemm_kernel) if ktree_gemm_kernel is not None else None

# Tiles, with leaf pairs in registers (docs/design/ktree.md has the measurements): the
# 128 x 128 tile holds both accumulators without spilling, where the large-M GEMM tile
# (128 x 256) spills with them.
KTREE_SMALL_M = GemmConfig(64, 64, 128, group_m=8, num_warps=4, num_stages=4)
KTREE_LARGE_M = GemmConfig(128, 128, 64, group_m=8, num_warps=8, num_stages=4)
KTREE_SMALL_M_MAX = 256
KTREE_FP32 = GemmConfig(64, 64, 32, group_m=8, num_warps=4, num_stages=3)


def ktree_config(m: int, dtype: torch.dtype) -> GemmConfig:
    if triton_interpret():
        return GemmConfig(16, 32, 16, group_m=1, num_warps=4, num_stages=1)
    if dtype == torch.float32:
        return KTREE_FP32
    return KTREE_SMALL_M if m <= KTREE_SMALL_M_MAX else KTREE_LARGE_M


def ktree_fusable(x2: torch.Tensor, w_nk: torch.Tensor, seg: int) -> bool:
    """Whether :func:`ktree_gemm` runs the fused kernel for these operands (else the caller
    runs the unfused tree)."""
    if TensorDescriptor is None or _launch_ktree is None:
        return False
    if not triton_interpret() and not (x2.is_cuda and capability(x2.device)[0] >= 9):
        return False
    cfg = ktree_config(x2.shape[0], x2.dtype)
    return seg % cfg.block_k == 0 and tma_layout_ok(x2) and tma_layout_ok(w_nk)


def ktree_gemm(x2: torch.Tensor, w_nk: torch.Tensor, seg: int, n_seg: int, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype = torch.float32, *, config: GemmConfig | None = None,
               pairs: bool = True) -> torch.Tensor:
    """[M, N] in ``out_dtype``: the K-tree of x2 [M, n_seg*seg] @ w_nk [N, n_seg*seg]^T, plus
    ``bias`` [N] in fp32 (if given), rounded once. ``n_seg`` a power of two; the operands
    as :func:`ktree_fusable` accepts them. ``config`` overrides the tile; ``pairs=False``
    adds leaf pairs through the scratch slots instead of in registers (a second
    accumulator). Either way the bits are the same (benchmarks and tests compare them)."""
    M, N = x2.shape[0], w_nk.shape[0]
    out = torch.empty(M, N, dtype=out_dtype, device=x2.device)
    if M == 0 or N == 0:
        return out
    cfg = config or ktree_config(M, x2.dtype)
    pairs = pairs and n_seg >= 2
    tiles = cdiv(M, cfg.block_m) * cdiv(N, cfg.block_n)
    levels = max(1, n_seg.bit_length() - 1)
    # Each program's pending tree nodes, one slot per level that waits in memory (level 0 stays
    # in registers with pairs): [BLOCK_M, BLOCK_N] fp32 each, L2-resident while used.
    slots = levels - int(pairs)
    scratch = torch.empty(max(1, tiles * slots * cfg.block_m * cfg.block_n), dtype=torch.float32,
                          device=x2.device)
    a_desc = TensorDescriptor(x2, [M, x2.shape[1]], [x2.stride(0), 1], [cfg.block_m, cfg.block_k])
    b_desc = TensorDescriptor(w_nk, [N, w_nk.shape[1]], [w_nk.stride(0), 1], [cfg.block_n, cfg.block_k])
    _launch_ktree(
        (tiles,),
        (a_desc, b_desc, out, bias.contiguous() if bias is not None else out, scratch, M, N, seg,
         out.stride(0), out.stride(1)),
        dict(N_SEG=n_seg, LEVELS=levels, PAIRS=pairs, HAS_BIAS=bias is not None, IEEE=x2.dtype == torch.float32,
             BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out
