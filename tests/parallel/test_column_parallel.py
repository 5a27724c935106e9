"""The column-parallel linear's input gradient by the N-tree: every rank gets the one-process
layer's dX bitwise at TP = 1, 2, 4, 8, and its rows of dW and dbias; a stock all-reduce of
the ranks' partial dX does not give those bits."""
from __future__ import annotations

import pytest
import torch

from rlkernels import contract
from rlkernels.parallel import column_parallel_tree_linear

from . import _workers as W


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_every_rank_gets_the_one_process_input_gradient_and_its_rows_of_the_rest(results, dtype):
    y, dx, dw, db = W.column_grads(*W.column_inputs(dtype))
    for world, ranks in results.items():
        for rank, out in enumerate(ranks):
            rows = W.cols(W.COLUMN_N, world, rank)
            gy, gdx, gdw, gdb = out[f"column/{dtype}"]
            assert torch.equal(W.bits(gy), W.bits(y[:, rows].contiguous())), (world, rank)
            assert torch.equal(W.bits(gdx), W.bits(dx)), (world, rank)
            assert torch.equal(W.bits(gdw), W.bits(dw[rows].contiguous())), (world, rank)
            assert torch.equal(W.bits(gdb), W.bits(db[rows].contiguous())), (world, rank)


def test_the_stock_all_reduce_of_partial_input_gradients_drifts_across_tp(results):
    """The control: a rank's partial dX summed by all_reduce gives other bits at some TP size."""
    by_world = {world: ranks[0][f"column/stock {torch.float32}"] for world, ranks in results.items()}
    assert any(not torch.equal(by_world[1], by_world[t]) for t in (2, 4, 8))


def test_the_gradients_are_accurate_against_float64():
    for dtype in (torch.float32, torch.bfloat16):
        x, w, b, dy = W.column_inputs(dtype)
        _, dx, dw, _ = W.column_grads(x, w, b, dy)
        contract.check("matmul", dtype, dx, dy.double() @ w.double())
        contract.check("matmul", dtype, dw, dy.double().T @ x.double())


def test_segments_that_do_not_cut_n_are_refused():
    x, w, b, _ = W.column_inputs(torch.float32)
    with pytest.raises(ValueError, match=r"rlkernels.column_parallel_tree_linear: N=64 is not divisible by "
                                         r"segments=128"):
        column_parallel_tree_linear(x, w, b, segments=128)
    with pytest.raises(ValueError, match=r"rlkernels.column_parallel_tree_linear: segments must be a power of two"):
        column_parallel_tree_linear(x, w, b, segments=3)
