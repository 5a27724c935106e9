"""The per-head norm's weight gradient by the head-segment tree: every rank gets the
one-process gradient bitwise at TP = 1, 2, 4, 8 (and its heads' input gradients); an
all-reduce of the ranks' own weight gradients does not give those bits."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from rlkernels import contract
from rlkernels.ops.norms import rms_norm
from rlkernels.parallel.head_norm import head_tree_rms_norm

from . import _workers as W

SEGMENTS, HEADS, DIM = 8, 16, 24


def _inputs(dtype: torch.dtype):
    g = torch.Generator().manual_seed(6)
    x = (torch.randn(3, 5, HEADS, DIM, generator=g) * 3).to(dtype)
    w = (1 + 0.1 * torch.randn(DIM, generator=g)).to(dtype)
    dy = torch.randn(3, 5, HEADS, DIM, generator=g).to(dtype)
    return x, w, dy


def _grads(x, w, dy, group=None, rank=0, world=1):
    heads = slice(rank * HEADS // world, (rank + 1) * HEADS // world)
    xs, ws = x[..., heads, :].clone().requires_grad_(True), w.clone().requires_grad_(True)
    y = head_tree_rms_norm(xs, ws, 1e-6, segments=SEGMENTS, group=group, rank=rank, world=world)
    y.backward(dy[..., heads, :])
    return y.detach(), xs.grad, ws.grad


def _worker(rank: int, world: int, folder: str) -> None:
    with W.gloo_group(rank, world, folder):
        out = {}
        for dtype in (torch.float32, torch.bfloat16):
            x, w, dy = _inputs(dtype)
            out[dtype] = _grads(x, w, dy, dist.group.WORLD, rank, world)
            # The stock layer: each rank's weight gradient over its heads, summed by all_reduce.
            heads = slice(rank * HEADS // world, (rank + 1) * HEADS // world)
            ws = w.float().clone().requires_grad_(True)
            rms_norm(x[..., heads, :].float(), ws, 1e-6).backward(dy[..., heads, :].float())
            dist.all_reduce(ws.grad)
            out[f"stock {dtype}"] = ws.grad
        torch.save(out, os.path.join(folder, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def worlds():
    return {world: W.run_world(world, _worker) for world in W.SIZES}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_every_rank_gets_the_one_process_weight_gradient_and_its_heads_input_gradients(worlds, dtype):
    x, w, dy = _inputs(dtype)
    y, dx, dw = _grads(x, w, dy)
    assert torch.equal(_bits(y), _bits(rms_norm(x, w, 1e-6)))  # the forward is the op's
    for world, ranks in worlds.items():
        for rank, out in enumerate(ranks):
            heads = slice(rank * HEADS // world, (rank + 1) * HEADS // world)
            gy, gdx, gdw = out[dtype]
            assert torch.equal(_bits(gy), _bits(y[..., heads, :].contiguous())), (world, rank)
            assert torch.equal(_bits(gdx), _bits(dx[..., heads, :].contiguous())), (world, rank)
            assert torch.equal(_bits(gdw), _bits(dw)), (world, rank)


def test_the_stock_all_reduce_of_the_ranks_weight_gradients_drifts_across_tp(worlds):
    by_world = {world: ranks[0]["stock torch.float32"] for world, ranks in worlds.items()}
    assert any(not torch.equal(by_world[1], by_world[t]) for t in (2, 4, 8))


def test_the_weight_gradient_is_accurate_against_float64():
    for dtype in (torch.float32, torch.bfloat16):
        x, w, dy = _inputs(dtype)
        _, _, dw = _grads(x, w, dy)
        xd = x.double()
        xhat = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6)
        if dtype != torch.float32:  # the factor is xhat rounded to x's dtype, as the forward uses it
            xhat = xhat.to(dtype).double()
        contract.check("rms_norm", dtype, dw, (dy.double() * xhat).sum(dim=(0, 1, 2)))


def test_heads_that_do_not_divide_into_the_segments_are_refused():
    x, w, _ = _inputs(torch.float32)
    with pytest.raises(ValueError, match=r"rlkernels.head_tree_rms_norm: heads=16 is not divisible by segments=32"):
        head_tree_rms_norm(x, w, 1e-6, segments=32)
    with pytest.raises(ValueError, match=r"rlkernels.head_tree_rms_norm: segments must be a power of two"):
        head_tree_rms_norm(x, w, 1e-6, segments=6)
