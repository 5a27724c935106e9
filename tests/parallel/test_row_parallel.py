"""TP-invariant row-parallel linear (K-tree): the same bits at TP = 1, 2, 4, 8.

Each TP size runs as that many gloo processes on the CPU (``_workers.worker``); the
parent compares what the ranks saved; on several GPUs the same over NCCL (marked ``gpu``).
"""
from __future__ import annotations

import os

import pytest
import torch

from rlkernels import contract
from rlkernels._env import triton_interpret
from rlkernels.ops.matmul import gemm_backend_for
from rlkernels.parallel import plain_row_parallel_linear, row_parallel_tree_linear, tree_linear
from rlkernels.parallel import row_parallel as rp
from rlkernels.parallel import tree

from . import _workers as W


@pytest.mark.parametrize("dtype", W.dtypes(), ids=lambda d: str(d)[6:])
def test_row_parallel_forward_bitwise_across_tp(results, dtype):
    x, w, b, _ = W.linear_inputs(dtype)
    one = tree_linear(x, w, b, segments=W.SEGMENTS)
    for world in W.SIZES:
        for rank, out in enumerate(results[world]):
            assert torch.equal(out[W.names(dtype) + "y"], one), (world, rank)


@pytest.mark.parametrize("dtype", W.dtypes(), ids=lambda d: str(d)[6:])
def test_row_parallel_backward_is_the_tp1_slices(results, dtype):
    x, w, b, dy = W.linear_inputs(dtype)
    x, w, b = (t.clone().requires_grad_(True) for t in (x, w, b))
    tree_linear(x, w, b, segments=W.SEGMENTS).backward(dy)
    for world in W.SIZES:
        for rank, out in enumerate(results[world]):
            cols = W.cols(x.shape[1], world, rank)
            assert torch.equal(out[W.names(dtype) + "dx"], x.grad[:, cols]), (world, rank)
            assert torch.equal(out[W.names(dtype) + "dw"], w.grad[:, cols]), (world, rank)
            assert torch.equal(out[W.names(dtype) + "db"], b.grad), (world, rank)


def test_empty_batch_at_every_tp(results):
    for world in W.SIZES:
        for out in results[world]:
            assert out["empty/y"].shape == (0, 37) and out["empty/dx"].shape == (0, 128)
            assert torch.equal(out["empty/dw"], torch.zeros(37, 128 // world))


def test_plain_row_parallel_layer_drifts_across_tp(results):
    """The stock layer (one chain over K/TP, then all_reduce) is what the K-tree fixes."""
    name = W.names(W.dtypes()[0])
    plain = {world: results[world][0][name + "plain"] for world in W.SIZES}
    assert not any(torch.equal(plain[1], plain[world]) for world in W.SIZES[1:])


def test_planted_rank_combines(results):
    """A wrong cross-rank combine gives other bits; mirroring the tree does not (addition commutes)."""
    ref = results[1][0]["float32/y"]
    for plant in ("aten_sum", "sequential"):
        for world in (4, 8):
            got = [out[f"plant_{plant}/y"] for out in results[world]]
            assert not any(torch.equal(g, ref) for g in got), (plant, world)
        # At TP = 2 each is one addition of two partials: a + b == b + a, the tree's own bits.
        assert torch.equal(results[2][0][f"plant_{plant}/y"], ref), plant
    for world in W.SIZES:
        assert torch.equal(results[world][0]["plant_reversed/y"], ref), world


def test_tree_linear_accuracy_vs_float64():
    for dtype in W.dtypes():
        x, w, b, dy = W.linear_inputs(dtype, k=256)
        x, w, b = (t.clone().requires_grad_(True) for t in (x, w, b))
        y = tree_linear(x, w, b)
        y.backward(dy)
        xd, wd, bd = (t.detach().double().requires_grad_(True) for t in (x, w, b))
        ref = torch.nn.functional.linear(xd, wd, bd)
        ref.backward(dy.double())
        contract.check("matmul", dtype, y, ref)
        for got, want in ((x.grad, xd.grad), (w.grad, wd.grad), (b.grad, bd.grad)):
            contract.check("matmul", dtype, got, want)


def test_tree_linear_chunking_and_batch_invariance():
    x, w, b, _ = W.linear_inputs(torch.float32, m=9, k=64)
    full = tree_linear(x, w, b)
    for m in (1, 4):
        assert torch.equal(tree_linear(x[:m], w, b), full[:m])
    assert tree_linear(x[:0], w, b).shape == (0, w.shape[0])
    # segments changes the tree: other (still accurate) bits, so it is part of the contract
    assert not torch.equal(tree_linear(x, w, b, segments=4), full)


def test_tree_linear_accumulates_weight_and_bias_gradients_into_main_grad():
    """Megatron's fp32 buffers: dW and dbias land in main_grad (their chains from zero: the
    same bits as .grad in fp32), and .grad stays None; dX is unchanged."""
    x, w, b, _ = W.linear_inputs(torch.float32, m=9, k=64)
    dy = torch.randn(9, w.shape[0], generator=torch.Generator().manual_seed(2))
    plain = [t.clone().requires_grad_(True) for t in (x, w, b)]
    tree_linear(*plain).backward(dy)
    kept = [t.clone().requires_grad_(True) for t in (x, w, b)]
    kept[1].main_grad, kept[2].main_grad = torch.zeros_like(w), torch.zeros_like(b)
    tree_linear(*kept).backward(dy)
    assert kept[1].grad is None and kept[2].grad is None
    assert torch.equal(kept[0].grad, plain[0].grad)
    assert torch.equal(kept[1].main_grad, plain[1].grad) and torch.equal(kept[2].main_grad, plain[2].grad)


def test_stack_tree_is_the_pairwise_tree():
    g = torch.Generator().manual_seed(3)
    parts = [torch.randn(5, 7, generator=g) * 10 ** i for i in range(8)]
    want = ((parts[0] + parts[1]) + (parts[2] + parts[3])) + ((parts[4] + parts[5]) + (parts[6] + parts[7]))
    assert torch.equal(tree.stack_tree(p.clone() for p in parts), want)
    assert torch.equal(tree.tree_combine([p.clone() for p in parts]), want)
    with pytest.raises(ValueError, match="power of two"):
        tree.stack_tree(p.clone() for p in parts[:3])


def test_tree_linear_refusals():
    x, w, b, _ = W.linear_inputs(torch.float32, k=96)
    with pytest.raises(ValueError, match=r"rlkernels.tree_linear: K=96 is not divisible by segments=64"):
        tree_linear(x, w, b, segments=64)
    with pytest.raises(ValueError, match=r"rlkernels.tree_linear: segments must be a power of two.*6"):
        tree_linear(x, w, b, segments=6)
    with pytest.raises(ValueError, match=r"TP size of 16 does not divide segments=8"):
        rp.tree_segment("row_parallel_tree_linear", 128, 8, world=16)
    with pytest.raises(ValueError, match=r"rlkernels.tree_linear: x \(6, 96\) has K=96 but weight \(37, 64\)"):
        tree_linear(x, w[:, :64], b)
    with pytest.raises(ValueError, match=r"rlkernels.tree_linear: x has dtype torch.int64"):
        tree_linear(x.long(), w, b)
    with pytest.raises(RuntimeError, match=r"rlkernels.row_parallel_tree_linear: torch.distributed is not init"):
        row_parallel_tree_linear(x, w, b)


@pytest.mark.skipif(not triton_interpret(), reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("dtype", (torch.float32, torch.float16), ids=("float32", "float16"))
def test_triton_gemm_backend_rank_subtrees_rebuild_tree_linear(dtype):
    """What each rank runs (its subtree on strided K-slices) recombined in rank order equals
    tree_linear on the Triton GEMM backend, at every TP size."""
    x, w, b, _ = W.linear_inputs(dtype, m=3, k=64, n=16)
    one = tree_linear(x, w, b, backend="triton")
    gemm_backend = gemm_backend_for(x.device, "triton")
    for world in W.SIZES:
        parts = [rp.local_tree(gemm_backend, x[:, W.cols(64, world, r)], w[:, W.cols(64, world, r)],
                               64 // W.SEGMENTS, W.SEGMENTS // world) for r in range(world)]
        y = (tree.tree_combine(parts) + b.float()).to(dtype)
        assert torch.equal(y, one), world

# ---------------------------------------------------------------- several GPUs (NCCL)
# TP = 2, 4 and 8, each where that many devices are visible, on an 8B model's o_proj /
# down_proj, forward and backward, against the one-process layer on one GPU.

LINEARS = (("o_proj", 512, 4096, 4096), ("down_proj", 512, 14336, 4096))


def _linear_inputs(m: int, k: int, n: int):
    g = torch.Generator().manual_seed(k + n)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = (torch.randn(n, k, generator=g) / k ** 0.5).bfloat16()
    dy = torch.randn(m, n, generator=g).bfloat16()
    return x, w, dy


def _run_linear(x, w, dy, fn, **kw):
    x, w = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    y = fn(x, w, **kw)
    y.backward(dy)
    return {"y": y.detach().cpu(), "dx": x.grad.cpu(), "dw": w.grad.cpu()}


def _nccl_linear_worker(rank: int, world: int, folder: str) -> None:
    with W.nccl_group(rank, world, folder) as dev:
        out: dict = {}
        for name, m, k, n in LINEARS:
            x, w, dy = (t.to(dev) for t in _linear_inputs(m, k, n))
            cols = W.cols(k, world, rank)
            out[name] = _run_linear(x[:, cols], w[:, cols], dy, row_parallel_tree_linear)
            with torch.no_grad():
                out[name]["plain"] = plain_row_parallel_linear(x[:, cols], w[:, cols]).cpu()
        torch.save(out, os.path.join(folder, f"rank{rank}.pt"))


@pytest.mark.gpu
@pytest.mark.parametrize("world", W.NCCL_SIZES)
def test_nccl_tree_linear_equals_one_gpu(world):
    ranks = W.run_nccl_world(world, _nccl_linear_worker)
    plain_differs = []
    for name, m, k, n in LINEARS:
        x, w, dy = (a.cuda() for a in _linear_inputs(m, k, n))
        one = _run_linear(x, w, dy, tree_linear)
        with torch.no_grad():
            plain_one = plain_row_parallel_linear(x, w).cpu()  # TP = 1: one chain over K
        for rank, out in enumerate(ranks):
            cols = W.cols(k, world, rank)
            assert torch.equal(out[name]["y"], one["y"]), (name, rank)
            assert torch.equal(out[name]["dx"], one["dx"][:, cols]), (name, rank)
            assert torch.equal(out[name]["dw"], one["dw"][:, cols]), (name, rank)
        plain_differs.append(not torch.equal(ranks[0][name]["plain"], plain_one))
    # The stock layer (all_reduce of per-rank chains) leaves the one-GPU bits on at least one shape.
    assert any(plain_differs), plain_differs
