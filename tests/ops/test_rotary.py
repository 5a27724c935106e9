"""The fused rotary embedding: transformers' ``apply_rotary_pos_emb`` bit for bit, in one launch."""
from __future__ import annotations

import pytest
import torch

from rlkernels._env import triton_interpret
from rlkernels.ops import rotary
from rlkernels.testing import _bits_equal

transformers = pytest.importorskip("transformers")
from transformers.models.qwen3 import modeling_qwen3  # noqa: E402

# (B, HQ, HK, L, D, batch rows of cos/sin): primes, ones, a head dim that is not a power of two.
SHAPES = [(3, 5, 2, 7, 128, 3), (1, 1, 1, 1, 2, 1), (2, 3, 3, 5, 96, 1), (2, 6, 2, 1, 64, 2), (4, 7, 1, 3, 256, 4)]


def _inputs(B, HQ, HK, L, D, cos_rows, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    # q and k as the attention layers hand them over: [B, L, H, D] projections seen as [B, H, L, D].
    q = (torch.randn(B, L, HQ, D, generator=g) * 4).to(dtype).transpose(1, 2)
    k = (torch.randn(B, L, HK, D, generator=g) * 4).to(dtype).transpose(1, 2)
    # Angles of positions up to ~32k: cos and sin take every sign and magnitude.
    angle = torch.rand(cos_rows, L, D // 2, generator=g, dtype=torch.float64) * 32768
    emb = torch.cat([angle, angle], dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    return [t.to(device) for t in (q, k, cos, sin)]


def _same_bits(got, want) -> bool:
    return all(_bits_equal(a, b) for a, b in zip(got, want))


# The kernel on CPU tensors (the gpu-marked test runs it on CUDA).
needs_kernel = pytest.mark.skipif(not triton_interpret(), reason="the kernel on the CPU needs TRITON_INTERPRET=1")


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_the_fused_kernel_gives_transformers_bits(shape, dtype):
    q, k, cos, sin = _inputs(*shape, dtype)
    q[0, 0, 0, 0] = float("nan")  # a NaN stays in its own element
    assert rotary.fused_shapes_ok(q, k, cos, sin) and rotary.fused_backend_ok(q, k, cos, sin)
    got = rotary.rotary_embedding_fused(q, k, cos, sin)
    want = modeling_qwen3.apply_rotary_pos_emb(q, k, cos, sin)
    assert _same_bits(got, want)
    assert torch.isnan(got[0][0, 0, 0, 0]) and torch.isnan(got[0][0, 0, 0, shape[4] // 2])
    assert torch.isnan(got[0][0, 0]).sum() == 2


@needs_kernel
def test_an_empty_batch_gives_empty_outputs():
    q, k, cos, sin = _inputs(0, 3, 1, 4, 64, 1, torch.float32)
    got = rotary.rotary_embedding_fused(q, k, cos, sin)
    assert got[0].shape == q.shape and got[1].shape == k.shape


def test_inputs_that_need_a_gradient_take_the_torch_formula():
    q, k, cos, sin = _inputs(2, 3, 1, 5, 64, 2, torch.float32)
    q.requires_grad_(True)
    assert not rotary.fused_backend_ok(q, k, cos, sin)
    q_out, k_out = rotary.rotary_embedding(q, k, cos, sin)
    assert q_out.grad_fn is not None
    assert _same_bits((q_out, k_out), modeling_qwen3.apply_rotary_pos_emb(q, k, cos, sin))
    (grad,) = torch.autograd.grad(q_out.sum(), q)
    assert grad.shape == q.shape


@pytest.mark.parametrize("change", ["mixed dtypes", "odd head dim", "cos over heads", "strided last dim"])
def test_layouts_the_kernel_does_not_take_are_told_apart(change):
    q, k, cos, sin = _inputs(2, 3, 1, 5, 64, 2, torch.float32)
    if change == "mixed dtypes":
        cos = cos.double()
    elif change == "odd head dim":
        q, k, cos, sin = (t[..., :63] for t in (q, k, cos, sin))
    elif change == "cos over heads":
        cos, sin = cos[:, None], sin[:, None]
    else:
        q = q[..., ::2]
    assert not rotary.fused_shapes_ok(q, k, cos, sin)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_fused_kernel_gives_transformers_bits_gpu(dtype):
    # Decode (L = 1) and prefill shapes of the attention layers, head dims 64-256.
    for shape in SHAPES + [(16, 16, 8, 1, 128, 16), (16, 16, 8, 128, 128, 16), (5, 32, 8, 257, 64, 1),
                           (3, 8, 8, 33, 256, 3)]:
        q, k, cos, sin = _inputs(*shape, dtype, device="cuda", seed=sum(shape))
        assert rotary.fused_shapes_ok(q, k, cos, sin) and rotary.fused_backend_ok(q, k, cos, sin)
        got = rotary.rotary_embedding_fused(q, k, cos, sin)
        assert _same_bits(got, modeling_qwen3.apply_rotary_pos_emb(q, k, cos, sin)), (shape, dtype)
