"""The LSE order: log_softmax of fp32 logits and linear_logprob take one log-sum-exp."""
from __future__ import annotations

import math

import pytest
import torch

import rlkernels
from rlkernels import linear, linear_logprob
from rlkernels.contract import check
from rlkernels.ops.lm_head.lse import LSE_SPLIT, LSE_TILE, log_softmax_rows, tile_mass

from ...conftest import cpu_backend_cases, randn

F32, BF16 = torch.float32, torch.bfloat16


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def _head(n, d, v, dtype, gen, *, bias=True, device="cpu", logit_std=6.0):
    """An LM head at a trained model's logit scale (std ~6, where bf16 rounding moves probabilities)."""
    h = randn(n, d, dtype=dtype, generator=gen, device=device)
    w = randn(v, d, dtype=dtype, generator=gen, scale=logit_std / d ** 0.5, device=device)
    b = randn(v, dtype=dtype, generator=gen, device=device) if bias else None
    return h, w, b


def _float_tile_mass(e: torch.Tensor) -> torch.Tensor:
    """A float sum in index order: what the tile sum would be without the fixed point."""
    acc = torch.zeros(e.shape[0], dtype=e.dtype)
    for j in range(e.shape[1]):
        acc = acc + e[:, j]
    return acc


def test_tile_mass_is_exact_in_any_order(gen):
    e = torch.rand(64, LSE_TILE, generator=gen) ** 8  # many scales, like e^(z - m)
    perm = torch.randperm(LSE_TILE, generator=gen)
    assert torch.equal(_bits(tile_mass(e)), _bits(tile_mass(e[:, perm])))
    exact = e.double().sum(dim=1)
    assert ((tile_mass(e).double() - exact).abs() <= exact * 2 ** -23).all()
    # The control: a float sum's bits follow its order.
    assert not torch.equal(_float_tile_mass(e), _float_tile_mass(e[:, perm]))


@pytest.mark.parametrize("backend", [c.values[0] for c in cpu_backend_cases((F32,))])
def test_log_softmax_is_independent_of_the_order_inside_a_tile(backend, gen):
    x = randn(5, 3 * LSE_TILE + 17, generator=gen, scale=6.0)
    perm = torch.arange(x.shape[1])
    perm[LSE_TILE:2 * LSE_TILE] = LSE_TILE + torch.randperm(LSE_TILE, generator=gen)
    out = log_softmax_rows(x, backend)
    assert torch.equal(_bits(out[:, perm]), _bits(log_softmax_rows(x[:, perm].contiguous(), backend)))


@pytest.mark.parametrize("backend, dtype", cpu_backend_cases((F32, BF16)))
@pytest.mark.parametrize("n, d, v, bias, temperature", [(11, 48, 2 * LSE_SPLIT + 3, True, 0.7),
                                                        (1, 33, 257, False, 1.0), (6, 16, LSE_SPLIT, True, 1.3)])
def test_log_softmax_of_the_heads_logits_is_linear_logprob(backend, dtype, n, d, v, bias, temperature, gen):
    h, w, b = _head(n, d, v, dtype, gen, bias=bias)
    target = torch.randint(0, v, (n,), generator=gen)
    # The patched LM head's logits (fp32, unrounded), divided by T as samplers divide them.
    z = linear(h, w, b, out_dtype=F32, backend=backend) / temperature
    assert z.std() > 5
    picked = rlkernels.log_softmax(z, -1, backend=backend).gather(1, target[:, None])[:, 0]
    ref = linear_logprob(h, w, target, b, temperature=temperature, backend=backend)
    assert torch.equal(_bits(picked), _bits(ref))


def test_stock_log_softmax_of_the_same_logits_is_not_linear_logprob(gen):
    # The control: another order of the same sum (ATen's) gives other bits at this scale.
    h, w, b = _head(64, 48, 2 * LSE_SPLIT + 3, F32, gen)
    target = torch.randint(0, w.shape[0], (64,), generator=gen)
    z = linear(h, w, b, out_dtype=F32, backend="torch")
    stock = torch.log_softmax(z, -1).gather(1, target[:, None])[:, 0]
    assert not torch.equal(_bits(stock), _bits(linear_logprob(h, w, target, b, backend="torch")))


@pytest.mark.parametrize("backend", [c.values[0] for c in cpu_backend_cases((F32,))])
def test_log_softmax_rows_are_invariant_to_the_batch_and_trailing_padding(backend, gen):
    x = randn(9, LSE_SPLIT + 300, generator=gen, scale=7.0)
    full = rlkernels.log_softmax(x, -1, backend=backend)
    alone = rlkernels.log_softmax(x[4:5], -1, backend=backend)
    assert torch.equal(_bits(full[4:5]), _bits(alone))
    # Padding past a split boundary: -inf columns add exactly nothing.
    padded = torch.cat([x, torch.full((9, LSE_SPLIT), -math.inf)], dim=1)
    out = rlkernels.log_softmax(padded, -1, backend=backend)
    assert torch.equal(_bits(out[:, :x.shape[1]]), _bits(full))
    assert (out[:, x.shape[1]:] == -math.inf).all()


@pytest.mark.parametrize("backend", [c.values[0] for c in cpu_backend_cases((F32,))])
def test_log_softmax_is_accurate_at_a_trained_models_scale(backend, gen):
    x = randn(7, 3 * LSE_SPLIT + 5, generator=gen, scale=8.0)
    x[:, 100] = 40.0  # a dominant logit, as trained heads have
    check("log_softmax", F32, rlkernels.log_softmax(x, -1, backend=backend), torch.log_softmax(x.double(), -1))


@pytest.mark.parametrize("backend", [c.values[0] for c in cpu_backend_cases((F32,))])
def test_log_softmax_dim_and_empty_shapes(backend, gen):
    x = randn(3, LSE_TILE + 1, 4, generator=gen, scale=5.0)
    out = rlkernels.log_softmax(x, 1, backend=backend)
    rows = rlkernels.log_softmax(x.movedim(1, -1).contiguous(), -1, backend=backend).movedim(-1, 1)
    assert torch.equal(_bits(out), _bits(rows))
    assert rlkernels.log_softmax(torch.empty(0, 7), -1, backend=backend).shape == (0, 7)
    assert rlkernels.log_softmax(torch.empty(3, 0), -1, backend=backend).shape == (3, 0)


# ------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, torch.float16, F32])
@pytest.mark.parametrize("n, d, v, temperature", [(1, 2048, 151936, 1.0), (37, 4096, 32003, 0.7),
                                                  (300, 1024, 50257, 1.0)])
def test_gpu_log_softmax_of_the_heads_logits_is_linear_logprob(dtype, n, d, v, temperature, gen):
    h, w, b = _head(n, d, v, dtype, gen, device="cuda")
    target = torch.randint(0, v, (n,), generator=gen).cuda()
    z = linear(h, w, b, out_dtype=F32) / temperature
    ref = linear_logprob(h, w, target, b, temperature=temperature)
    picked = rlkernels.log_softmax(z, -1).gather(1, target[:, None])[:, 0]
    assert torch.equal(_bits(picked), _bits(ref))
    with rlkernels.set_batch_invariant_mode(True):
        moded = torch.log_softmax(z, -1).gather(1, target[:, None])[:, 0]
    assert torch.equal(_bits(moded), _bits(ref))
    # Alone and in the batch (the control, stock's order giving other bits, is the
    # Hugging Face test's: at some shapes ATen's order happens to round alike).
    alone = rlkernels.log_softmax(z[-1:], -1)[0, target[-1]]
    assert torch.equal(_bits(alone), _bits(ref[-1]))
