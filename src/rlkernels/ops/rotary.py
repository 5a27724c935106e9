"""transformers' rotary position embedding of queries and keys, in one launch on the GPU.

``rotary_embedding(q, k, cos, sin)`` returns ``(q * cos + rotate_half(q) * sin,
k * cos + rotate_half(k) * sin)`` with cos and sin broadcast over the heads, exactly as
transformers' ``apply_rotary_pos_emb`` computes it with separate elementwise ops (four
multiplies, two negations, two concatenations and two adds), each rounded to the tensors'
dtype. Those ops round every element alone, so the formula is invariant already; what the
fused kernel changes is the launch count of a decode step (ten per layer become one) and
nothing in the bits: it reproduces each op's rounding (``kernels.rotary``), and a GPU test
compares it with transformers' function bit for bit in fp32, bf16 and fp16.

Backends: the Triton kernel (CUDA, or the CPU under ``TRITON_INTERPRET=1`` except in bf16,
which the interpreter rounds by truncation) where no input needs a gradient; the torch
formula otherwise (it carries autograd), and wherever ``RLKERNELS_BACKEND=torch`` asks
for it.
"""
from __future__ import annotations

import torch

from ..kernels._triton import cdiv
from ..kernels.rotary import rotary_kernel
from ..registry import triton_usable
from ..runtime.launcher import NO_FP_FUSION, cached_launcher

HEADS_PER_PROGRAM = 4  # heads one program rotates; elementwise, so any value gives the same bits
_launch_rotary = cached_launcher(rotary_kernel, leading_tensors=6, options=NO_FP_FUSION)

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``cat(-x2, x1)`` over the last dimension (x1, x2 its halves)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_embedding_torch(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                           sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The formula with torch's elementwise ops (autograd through them)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def fused_shapes_ok(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether the kernel takes these inputs: q [B, HQ, L, D], k [B, HK, L, D], cos/sin
    [B or 1, L, D], one float dtype and device, D even, unit stride along D."""
    if not (q.dim() == k.dim() == 4 and cos.dim() == sin.dim() == 3):
        return False
    B, _, L, D = q.shape
    if D % 2 or k.shape[0] != B or k.shape[2:] != (L, D) or cos.shape != sin.shape:
        return False
    if cos.shape[1:] != (L, D) or cos.shape[0] not in (1, B):
        return False
    dtype, device = q.dtype, q.device
    if dtype not in _DTYPES or any(t.dtype != dtype or t.device != device for t in (k, cos, sin)):
        return False
    return all(t.stride(-1) == 1 or t.shape[-1] == 1 for t in (q, k, cos, sin))


def fused_backend_ok(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """The Triton kernel can run here and no input asks for a gradient."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or cos.requires_grad or sin.requires_grad):
        return False
    if q.device.type == "cpu" and q.dtype == torch.bfloat16:
        return False  # the Triton interpreter rounds fp32 to bf16 by truncation, not to nearest
    return triton_usable(q.device)


def rotary_embedding(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of q [B, HQ, L, D] and k [B, HK, L, D] by cos, sin [B or 1, L, D].

    Returns (q_out, k_out) with q's and k's shapes and dtype (all four inputs share one
    float dtype): the bits of transformers' ``apply_rotary_pos_emb(q, k, cos, sin)``.
    Inputs the kernel does not take (other layouts, mixed dtypes, a gradient to carry) run
    the torch formula, whose bits are the same.
    """
    if not fused_ok(q, k, cos, sin):
        return rotary_embedding_torch(q, k, cos, sin)
    return rotary_embedding_fused(q, k, cos, sin)


def fused_ok(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """The kernel runs these inputs: :func:`fused_shapes_ok` and :func:`fused_backend_ok`."""
    return fused_shapes_ok(q, k, cos, sin) and fused_backend_ok(q, k, cos, sin)


def rotary_embedding_fused(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                           sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel (inputs as :func:`fused_shapes_ok` accepts); outputs laid out as q and k."""
    B, HQ, L, D = q.shape
    HK = k.shape[1]
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    if q_out.numel() == 0 and k_out.numel() == 0:
        return q_out, k_out
    half = D // 2
    # cos/sin with one batch row broadcast over B: a batch stride of 0.
    c_b = cos.stride(0) if cos.shape[0] > 1 else 0
    s_b = sin.stride(0) if sin.shape[0] > 1 else 0
    grid = (B * L, cdiv(HQ, HEADS_PER_PROGRAM) + cdiv(HK, HEADS_PER_PROGRAM))
    _launch_rotary(grid, (q, k, cos, sin, q_out, k_out, L, HQ, HK,
                          q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                          q_out.stride(0), q_out.stride(1), q_out.stride(2),
                          k_out.stride(0), k_out.stride(1), k_out.stride(2),
                          c_b, cos.stride(1), s_b, sin.stride(1)),
                   dict(HALF=half, BLOCK_HALF=1 << (half - 1).bit_length(), BLOCK_H=HEADS_PER_PROGRAM),
                   num_warps=1 if half * HEADS_PER_PROGRAM <= 256 else 4, num_stages=1)
    return q_out, k_out
