"""The per-head norm's weight gradient by the head-segment tree: every rank gets the
one-process gradient bitwise at TP = 1, 2, 4, 8 (and its heads' input gradients); an
all-reduce of the ranks' own weight gradients does not give those bits."""
from __future__ import annotations

import pytest
import torch

from rlkernels import contract
from rlkernels.ops.norms import rms_norm
from rlkernels.parallel.head_norm import head_tree_rms_norm

from . import _workers as W


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_every_rank_gets_the_one_process_weight_gradient_and_its_heads_input_gradients(results, dtype):
    x, w, dy = W.head_norm_inputs(dtype)
    y, dx, dw = W.head_norm_grads(x, w, dy)
    assert torch.equal(W.bits(y), W.bits(rms_norm(x, w, 1e-6)))  # the forward is the op's
    for world, ranks in results.items():
        for rank, out in enumerate(ranks):
            heads = W.cols(W.NORM_HEADS, world, rank)
            gy, gdx, gdw = out[f"head_norm/{dtype}"]
            assert torch.equal(W.bits(gy), W.bits(y[..., heads, :].contiguous())), (world, rank)
            assert torch.equal(W.bits(gdx), W.bits(dx[..., heads, :].contiguous())), (world, rank)
            assert torch.equal(W.bits(gdw), W.bits(dw)), (world, rank)


def test_the_stock_all_reduce_of_the_ranks_weight_gradients_drifts_across_tp(results):
    by_world = {world: ranks[0][f"head_norm/stock {torch.float32}"] for world, ranks in results.items()}
    assert any(not torch.equal(by_world[1], by_world[t]) for t in (2, 4, 8))


def test_the_weight_gradient_is_accurate_against_float64():
    for dtype in (torch.float32, torch.bfloat16):
        x, w, dy = W.head_norm_inputs(dtype)
        _, _, dw = W.head_norm_grads(x, w, dy)
        xd = x.double()
        xhat = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6)
        if dtype != torch.float32:  # the factor is xhat rounded to x's dtype, as the forward uses it
            xhat = xhat.to(dtype).double()
        contract.check("rms_norm", dtype, dw, (dy.double() * xhat).sum(dim=(0, 1, 2)))


def test_heads_that_do_not_divide_into_the_segments_are_refused():
    x, w, _ = W.head_norm_inputs(torch.float32)
    with pytest.raises(ValueError, match=r"rlkernels.head_tree_rms_norm: heads=16 is not divisible by segments=32"):
        head_tree_rms_norm(x, w, 1e-6, segments=32)
    with pytest.raises(ValueError, match=r"rlkernels.head_tree_rms_norm: segments must be a power of two"):
        head_tree_rms_norm(x, w, 1e-6, segments=6)
