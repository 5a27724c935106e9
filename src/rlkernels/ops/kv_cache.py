"""Appending keys and values to a static KV cache at a device-held slot, in one launch.

``write_kv_slots(k_cache, v_cache, k_new, v_new, start)`` is what a static cache's layer
update does with ``index_copy_`` (two copies, plus the slot indices built from the counter):
rows ``0 .. L - 1`` of k_new / v_new go to slots ``start .. start + L - 1``. ``start`` stays
on the device, so a captured decode step writes where the counter says at every replay.
Copies only: no bit of a key or value changes.

Backends: the Triton kernel (``kernels.kv_cache``; CUDA, or the CPU under
``TRITON_INTERPRET=1``) where the head dims agree and the last dimensions have unit
stride; ``index_copy_`` otherwise, and wherever ``RLKERNELS_BACKEND=torch`` asks for it.
The slots must fit the cache (``start + L <= S``): the caller sizes the cache and owns the
counter, which the host does not read back (the kernel writes no slot past S).
"""
from __future__ import annotations

import torch

from ..kernels._triton import cdiv
from ..kernels.kv_cache import kv_write_kernel
from ..registry import triton_usable
from ..runtime.launcher import cached_launcher

OP = "write_kv_slots"
ROWS_PER_PROGRAM = 16  # slots one program copies
_launch_kv_write = cached_launcher(kv_write_kernel, leading_tensors=5)


def _check(k_cache: torch.Tensor, v_cache: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
           start: torch.Tensor) -> None:
    for name, cache, new in (("keys", k_cache, k_new), ("values", v_cache, v_new)):
        if cache.dim() != 4 or new.dim() != 4 or cache.shape[:2] != new.shape[:2] or cache.shape[3] != new.shape[3]:
            raise ValueError(f"rlkernels.{OP}: {name} must be [B, H, L, D] into a cache [B, H, S, D], got "
                             f"{tuple(new.shape)} into {tuple(cache.shape)}")
        if cache.dtype != new.dtype or cache.device != new.device:
            raise ValueError(f"rlkernels.{OP}: {name} are {new.dtype} on {new.device}, the cache {cache.dtype} "
                             f"on {cache.device}")
    if k_new.shape[2] != v_new.shape[2]:
        raise ValueError(f"rlkernels.{OP}: {k_new.shape[2]} key rows but {v_new.shape[2]} value rows")
    if start.dtype != torch.int64 or start.numel() != 1 or start.device != k_cache.device:
        raise ValueError(f"rlkernels.{OP}: start must be one int64 element on {k_cache.device}, got "
                         f"{start.dtype} {tuple(start.shape)} on {start.device}")


def _kernel_takes(k_cache: torch.Tensor, v_cache: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor) -> bool:
    if not triton_usable(k_cache.device):
        return False
    return k_cache.shape[3] == v_cache.shape[3] and all(t.stride(3) == 1 for t in (k_cache, v_cache, k_new, v_new))


def write_kv_slots(k_cache: torch.Tensor, v_cache: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                   start: torch.Tensor) -> None:
    """Copy k_new, v_new [B, H, L, D] into slots ``start .. start + L - 1`` of k_cache,
    v_cache [B, H, S, D] (in place); ``start``: one int64 element on the cache's device."""
    _check(k_cache, v_cache, k_new, v_new, start)
    B, H, L, D = k_new.shape
    if B * H * L == 0:
        return
    if not _kernel_takes(k_cache, v_cache, k_new, v_new):
        slots = torch.arange(L, device=k_cache.device) + start.reshape(())
        k_cache.index_copy_(2, slots, k_new)
        v_cache.index_copy_(2, slots, v_new)
        return
    _launch_kv_write((B * H, cdiv(L, ROWS_PER_PROGRAM)),
                     (k_new, v_new, k_cache, v_cache, start, H, L, k_cache.shape[2], D,
                      k_new.stride(0), k_new.stride(1), k_new.stride(2), v_new.stride(0), v_new.stride(1),
                      v_new.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                      v_cache.stride(0), v_cache.stride(1), v_cache.stride(2)),
                     dict(BLOCK_L=ROWS_PER_PROGRAM, BLOCK_D=1 << max(D - 1, 0).bit_length()),
                     num_warps=4, num_stages=1)
