"""The canonical K-chain GEMM with TMA tile loads (Hopper and later).

Same arithmetic as ``kernels.gemm.gemm_kernel`` -- ``acc = tl.dot(a_blk, b_blk, acc)`` over
k-blocks 0, 1, 2, ... in one fp32 accumulator, rounded once -- but the tiles are
brought in by the Tensor Memory Accelerator from host-built descriptors instead of
per-thread pointer loads. Out-of-range rows, columns and the K tail are zero-filled
by the hardware: a zero product adds exactly nothing to the chain, so the bits are
those of the pointer kernel (a GPU test compares them on every config).

Two schedules, both with a fixed K order inside every tile:
  * one program per output tile (``persistent=False``);
  * persistent: ``NUM_SMS`` programs walk the tiles in a fixed stride, optionally
    warp-specialized (producer warps issue the TMA loads, consumer warps the MMAs).
    Which program computes a tile changes where it runs, never its arithmetic.

Layouts: A is K-major ([M, K] rows) or M-major (dY^T of a [tokens, N] tensor); B is
K-major (an ``nn.Linear`` weight [N, K] read as its transpose) or N-major ([K, N] rows).
TMA wants 16-byte aligned bases and row strides and a unit inner stride; anything
else stays on the pointer kernel (:func:`tma_eligible`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..kernels._triton import cdiv
from ..kernels.gemm_tma import gemm_tma_kernel
from ..runtime.device import capability, sm_count
from ..runtime.launcher import cached_launcher, kept_launch_key, launch_with_key

if TYPE_CHECKING:
    from .table import GemmConfig

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except Exception:  # pragma: no cover - Triton without host-side descriptors
    TensorDescriptor = None


def tma_layout_ok(t: torch.Tensor, inner_dim: int = 1) -> bool:
    """A 2-D tensor TMA can describe with ``inner_dim`` innermost: unit stride there,
    16-byte aligned base and outer stride."""
    if t.dim() != 2 or t.stride(inner_dim) != 1 or t.data_ptr() % 16:
        return False
    outer = t.stride(1 - inner_dim)
    return (outer * t.element_size()) % 16 == 0 and outer >= t.shape[inner_dim]


def tma_layouts(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None) -> tuple[bool, bool, bool] | None:
    """(A K-major, B K-major, ``out`` rows describable) for 2-D operands on a Hopper-or-later
    GPU whose layouts TMA can describe (module doc), else None. ``out`` is written through
    pointers when its rows are not describable (any strides work there). Each layout is
    checked once: this runs on every large-M call."""
    if (TensorDescriptor is None or a.dim() != 2 or b.dim() != 2 or (out is not None and out.dim() != 2)
            or not a.is_cuda or capability(a.device)[0] < 9):
        return None
    a_kmajor = tma_layout_ok(a, 1)
    b_kmajor = tma_layout_ok(b, 0)
    if not (a_kmajor or tma_layout_ok(a, 0)) or not (b_kmajor or tma_layout_ok(b, 1)):
        return None
    return a_kmajor, b_kmajor, out is not None and tma_layout_ok(out, 1)


def tma_eligible(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None) -> bool:
    """Whether :func:`tma_gemm` can take these operands (:func:`tma_layouts`)."""
    return tma_layouts(a, b, out) is not None


# Triton's per-call binder costs more host time than a mid-size GEMM takes on the
# GPU (H100, 4096 x 4096 x 1024 bf16: 112 us eager vs 48 us of kernel): later
# launches skip it (runtime.launcher; descriptors are keyed by what Triton specializes).
_launch_tma = cached_launcher(gemm_tma_kernel) if gemm_tma_kernel is not None else None

class TmaPlan:
    """What :func:`tma_gemm` works out for a 2-D forward call besides the tensors: layouts,
    grid, integer arguments, constexprs, the launcher's key (``gemm.triton``'s launch plans,
    same reason: a 4096 x 4096 x 1024 GEMM takes ~48 us on the GPU, and the full TMA path's
    host time went past that on a slow H100 host). A later call with the same plan key
    builds the same three descriptors over its own tensors and launches the same kernel
    with the same arguments, so the bits are the same."""

    __slots__ = ("out_shape", "out_dtype", "b_as_kn", "layouts", "c_desc_ok", "blocks", "grid", "ints",
                 "constexprs", "num_warps", "num_stages", "launch_key")

    def __call__(self, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = a.new_empty(self.out_shape, dtype=self.out_dtype)
        if self.b_as_kn:
            b = b.t()
        args = (*_descriptors(a, b, out, self.layouts, self.c_desc_ok, self.blocks), out,
                out if bias is None else bias, *self.ints)
        launch_with_key(_launch_tma, self.launch_key, self.grid, args, self.constexprs, num_warps=self.num_warps,
                        num_stages=self.num_stages)
        return out


def _descriptors(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, layouts: tuple[bool, bool, bool],
                 c_desc_ok: bool, blocks: tuple[int, int, int]) -> tuple:
    """A, B and C descriptors over the operands' memory as it lies (rows along the
    unit-stride dim); C's is A's stand-in where ``out`` goes through pointers."""
    (M, K), N = a.shape, b.shape[1]
    bm, bn, bk = blocks
    a_kmajor, b_kmajor, _ = layouts
    a_desc = (TensorDescriptor(a, [M, K], [a.stride(0), 1], [bm, bk]) if a_kmajor
              else TensorDescriptor(a, [K, M], [a.stride(1), 1], [bk, bm]))
    b_desc = (TensorDescriptor(b, [N, K], [b.stride(1), 1], [bn, bk]) if b_kmajor
              else TensorDescriptor(b, [K, N], [b.stride(0), 1], [bk, bn]))
    c_desc = TensorDescriptor(out, [M, N], [out.stride(0), 1], [bm, bn]) if c_desc_ok else a_desc
    return a_desc, b_desc, c_desc


def tma_gemm(a: torch.Tensor, b: torch.Tensor, cfg: GemmConfig, *, bias: torch.Tensor | None = None,
             out: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
             accumulate: bool = False, layouts: tuple[bool, bool, bool] | None = None) -> torch.Tensor:
    """C = A @ B (+ bias) by the canonical K-chain with TMA loads; a [M, K], b [K, N], M, N, K > 0.

    The caller has checked :func:`tma_eligible`; ``layouts`` is :func:`tma_layouts` of
    these operands and ``out`` when the caller has it. With ``accumulate`` the fp32
    ``out`` is the chain's starting value and is updated in place. ``cfg.persistent``
    and ``cfg.warp_specialize`` pick the schedule (module doc).
    """
    return tma_gemm_planned(a, b, cfg, bias=bias, out=out, out_dtype=out_dtype, accumulate=accumulate,
                            layouts=layouts)[0]


def tma_gemm_planned(a: torch.Tensor, b: torch.Tensor, cfg: GemmConfig, *, bias: torch.Tensor | None = None,
                     out: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                     accumulate: bool = False, layouts: tuple[bool, bool, bool] | None = None,
                     plan_b_as_kn: bool | None = None) -> tuple[torch.Tensor, TmaPlan | None]:
    """:func:`tma_gemm`, and with ``plan_b_as_kn`` set (the caller's B was [N, K], given here
    as its [K, N] view: True) the :class:`TmaPlan` that repeats this call for a fresh output."""
    M, K = a.shape
    N = b.shape[1]
    if out is None:
        out = torch.empty((M, N), dtype=out_dtype or a.dtype, device=a.device)
    blocks = (cfg.block_m, cfg.block_n, cfg.block_k)
    if layouts is None:
        layouts = (tma_layout_ok(a, 1), tma_layout_ok(b, 0), tma_layout_ok(out, 1))
    a_kmajor, b_kmajor, out_rows_ok = layouts
    c_desc_ok = not accumulate and out.element_size() < 4 and out_rows_ok
    num_tiles = cdiv(M, cfg.block_m) * cdiv(N, cfg.block_n)
    sms = sm_count(a.device)
    grid = (min(sms, num_tiles),) if cfg.persistent else (num_tiles,)
    ints = (M, N, K, out.stride(0), out.stride(1))
    args = (*_descriptors(a, b, out, layouts, c_desc_ok, blocks), out, bias if bias is not None else out, *ints)
    constexprs = dict(HAS_BIAS=bias is not None, ACC_FROM_C=accumulate, C_DESC=c_desc_ok, IEEE=a.dtype == torch.float32,
                      A_KMAJOR=a_kmajor, B_KMAJOR=b_kmajor, BLOCK_M=blocks[0], BLOCK_N=blocks[1], BLOCK_K=blocks[2],
                      GROUP_M=cfg.group_m, NUM_SMS=sms, PERSISTENT=cfg.persistent, WARP_SPECIALIZE=cfg.warp_specialize)
    _launch_tma(grid, args, constexprs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if plan_b_as_kn is None:
        return out, None
    plan = TmaPlan()
    plan.out_shape, plan.out_dtype, plan.b_as_kn = (M, N), out.dtype, plan_b_as_kn
    plan.layouts, plan.c_desc_ok, plan.blocks, plan.grid, plan.ints = layouts, c_desc_ok, blocks, grid, ints
    plan.constexprs, plan.num_warps, plan.num_stages = constexprs, cfg.num_warps, cfg.num_stages
    plan.launch_key = kept_launch_key(_launch_tma, args, constexprs, cfg.num_warps, cfg.num_stages)
    return out, plan
