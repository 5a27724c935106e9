"""The column-parallel linear's input gradient by the N-tree: every rank gets the one-process
layer's dX bitwise at TP = 1, 2, 4, 8, and its rows of dW and dbias; a stock all-reduce of
the ranks' partial dX does not give those bits."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from rlkernels import contract
from rlkernels.parallel import column_parallel_tree_linear

from . import _workers as W

SEGMENTS = 8


def _inputs(dtype: torch.dtype):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(7, 48, generator=g).to(dtype)
    w = (torch.randn(64, 48, generator=g) / 48 ** 0.5).to(dtype)
    b = torch.randn(64, generator=g).to(dtype)
    dy = torch.randn(7, 64, generator=g).to(dtype)
    return x, w, b, dy


def _grads(x, w, b, dy, group=None, rank=0, world=1):
    rows = slice(rank * w.shape[0] // world, (rank + 1) * w.shape[0] // world)
    xs, ws, bs = x.clone().requires_grad_(True), w[rows].clone().requires_grad_(True), b[rows].clone().requires_grad_(True)
    y = column_parallel_tree_linear(xs, ws, bs, segments=SEGMENTS, group=group)
    y.backward(dy[:, rows])
    return y.detach(), xs.grad, ws.grad, bs.grad


def _worker(rank: int, world: int, folder: str) -> None:
    with W.gloo_group(rank, world, folder):
        out = {}
        for dtype in (torch.float32, torch.bfloat16):
            x, w, b, dy = _inputs(dtype)
            out[dtype] = _grads(x, w, b, dy, dist.group.WORLD, rank, world)
            # The stock layer: the rank's partial dX, summed by all_reduce.
            partial = (dy[:, rank * 64 // world:(rank + 1) * 64 // world].float()
                       @ w[rank * 64 // world:(rank + 1) * 64 // world].float())
            dist.all_reduce(partial)
            out[f"stock {dtype}"] = partial.to(dtype)
        torch.save(out, os.path.join(folder, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def worlds():
    return {world: W.run_world(world, _worker) for world in W.SIZES}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_every_rank_gets_the_one_process_input_gradient_and_its_rows_of_the_rest(worlds, dtype):
    x, w, b, dy = _inputs(dtype)
    y, dx, dw, db = _grads(x, w, b, dy)
    for world, ranks in worlds.items():
        for rank, out in enumerate(ranks):
            rows = slice(rank * 64 // world, (rank + 1) * 64 // world)
            gy, gdx, gdw, gdb = out[dtype]
            assert torch.equal(_bits(gy), _bits(y[:, rows].contiguous())), (world, rank)
            assert torch.equal(_bits(gdx), _bits(dx)), (world, rank)
            assert torch.equal(_bits(gdw), _bits(dw[rows].contiguous())), (world, rank)
            assert torch.equal(_bits(gdb), _bits(db[rows].contiguous())), (world, rank)


def test_the_stock_all_reduce_of_partial_input_gradients_drifts_across_tp(worlds):
    """The control: a rank's partial dX summed by all_reduce gives other bits at some TP size."""
    by_world = {world: ranks[0]["stock torch.float32"] for world, ranks in worlds.items()}
    assert any(not torch.equal(by_world[1], by_world[t]) for t in (2, 4, 8))


def test_the_input_gradient_is_accurate_against_float64():
    for dtype in (torch.float32, torch.bfloat16):
        x, w, b, dy = _inputs(dtype)
        _, dx, dw, db = _grads(x, w, b, dy)
        contract.check("matmul", dtype, dx, dy.double() @ w.double())
        contract.check("matmul", dtype, dw, dy.double().T @ x.double())


def test_segments_that_do_not_cut_n_are_refused():
    x, w, b, _ = _inputs(torch.float32)
    with pytest.raises(ValueError, match=r"rlkernels.column_parallel_tree_linear: N=64 is not divisible by "
                                         r"segments=128"):
        column_parallel_tree_linear(x, w, b, segments=128)
    with pytest.raises(ValueError, match=r"rlkernels.column_parallel_tree_linear: segments must be a power of two"):
        column_parallel_tree_linear(x, w, b, segments=3)
