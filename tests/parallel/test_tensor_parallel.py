"""TP-invariant row-parallel linear and vocab-parallel log-prob: the same bits at TP = 1, 2, 4, 8.

Each TP size runs as that many gloo processes on the CPU (``_workers.worker``); the
parent compares what the ranks saved. The GPU tests (NCCL, several GPUs) are marked
``gpu`` and skip unless two CUDA devices are present.
"""
from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.multiprocessing as mp

from rlkernels import contract
from rlkernels._env import triton_interpret
from rlkernels.parallel import (row_parallel_tree_linear, sharded_linear_logprob,
                                tree_linear, vocab_parallel_linear_logprob)
from rlkernels.parallel import tensor_parallel as tp

from . import _workers as W

SIZES = (1, 2, 4, 8)


def run_world(world: int, fn=W.worker, start_method: str = "fork") -> list[dict]:
    """Start ``world`` processes running ``fn(rank, world, folder)``; their saved dicts by rank.

    The CPU tests fork (no re-import of torch per rank: seconds on a small machine);
    CUDA needs fresh processes (spawn)."""
    with tempfile.TemporaryDirectory() as folder:
        mp.start_processes(fn, args=(world, folder), nprocs=world, join=True, start_method=start_method)
        return [torch.load(os.path.join(folder, f"rank{r}.pt")) for r in range(world)]


@pytest.fixture(scope="module")
def results() -> dict[int, list[dict]]:
    return {world: run_world(world) for world in SIZES}


def _names(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "") + "/"


def _cols(k: int, world: int, rank: int) -> slice:
    return slice(rank * k // world, (rank + 1) * k // world)


# ---------------------------------------------------------------------------------------
# Row-parallel linear (K-tree).
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", W.dtypes(), ids=lambda d: str(d)[6:])
def test_row_parallel_forward_bitwise_across_tp(results, dtype):
    x, w, b, _ = W.linear_inputs(dtype)
    one = tree_linear(x, w, b, segments=W.SEGMENTS)
    for world in SIZES:
        for rank, out in enumerate(results[world]):
            assert torch.equal(out[_names(dtype) + "y"], one), (world, rank)


@pytest.mark.parametrize("dtype", W.dtypes(), ids=lambda d: str(d)[6:])
def test_row_parallel_backward_is_the_tp1_slices(results, dtype):
    x, w, b, dy = W.linear_inputs(dtype)
    x, w, b = (t.clone().requires_grad_(True) for t in (x, w, b))
    tree_linear(x, w, b, segments=W.SEGMENTS).backward(dy)
    for world in SIZES:
        for rank, out in enumerate(results[world]):
            cols = _cols(x.shape[1], world, rank)
            assert torch.equal(out[_names(dtype) + "dx"], x.grad[:, cols]), (world, rank)
            assert torch.equal(out[_names(dtype) + "dw"], w.grad[:, cols]), (world, rank)
            assert torch.equal(out[_names(dtype) + "db"], b.grad), (world, rank)


def test_plain_row_parallel_layer_drifts_across_tp(results):
    """The stock layer (one chain over K/TP, then all_reduce) is what the K-tree fixes."""
    name = _names(W.dtypes()[0])
    plain = {world: results[world][0][name + "plain"] for world in SIZES}
    assert not any(torch.equal(plain[1], plain[world]) for world in SIZES[1:])


def test_planted_rank_combines(results):
    """A wrong cross-rank combine gives other bits; mirroring the tree does not (addition commutes)."""
    ref = results[1][0]["float32/y"]
    for plant in ("all_reduce", "sequential"):
        for world in (4, 8):
            got = [out[f"plant_{plant}/y"] for out in results[world]]
            assert not any(torch.equal(g, ref) for g in got), (plant, world)
        # At TP = 2 each is one addition of two partials: a + b == b + a, the tree's own bits.
        assert torch.equal(results[2][0][f"plant_{plant}/y"], ref), plant
    for world in SIZES:
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
    # segments changes the tree: other (still accurate) bits, so it is part of the contract
    assert not torch.equal(tree_linear(x, w, b, segments=4), full)


def test_tree_linear_refusals():
    x, w, b, _ = W.linear_inputs(torch.float32, k=96)
    with pytest.raises(ValueError, match=r"rlkernels.tree_linear: K=96 is not divisible by segments=64"):
        tree_linear(x, w, b, segments=64)
    with pytest.raises(ValueError, match=r"rlkernels.tree_linear: segments must be a power of two.*6"):
        tree_linear(x, w, b, segments=6)
    with pytest.raises(ValueError, match=r"TP size of 16 does not divide segments=8"):
        tp.tree_segment("row_parallel_tree_linear", 128, 8, world=16)
    with pytest.raises(ValueError, match=r"rlkernels.tree_linear: x \(6, 96\) has K=96 but weight \(40, 64\)"):
        tree_linear(x, w[:, :64], b)
    with pytest.raises(RuntimeError, match=r"rlkernels.row_parallel_tree_linear: torch.distributed is not init"):
        row_parallel_tree_linear(x, w, b)


# ---------------------------------------------------------------------------------------
# Vocab-parallel log-prob and entropy.
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", W.dtypes(), ids=lambda d: str(d)[6:])
def test_vocab_parallel_bitwise_across_tp(results, dtype):
    h, w, b, t = W.logprob_inputs(dtype)
    lp, ent = sharded_linear_logprob(h, w, t, b, shards=W.SHARDS, chunk=W.CHUNK, temperature=W.TEMPERATURE,
                                     return_entropy=True)
    for world in SIZES:
        for rank, out in enumerate(results[world]):
            assert torch.equal(out[_names(dtype) + "logp"], lp), (world, rank)
            assert torch.equal(out[_names(dtype) + "ent"], ent), (world, rank)


def test_planted_vocab_combines(results):
    ref = results[1][0]
    for world in (2, 4, 8):
        for plant in ("plant_reversed_ranks/", "plant_all_reduce_stats/"):
            out = results[world][0]
            assert not (torch.equal(out[plant + "logp"], ref["float32/logp"])
                        and torch.equal(out[plant + "ent"], ref["float32/ent"])), (world, plant)


def _logprob_f64(h, w, b, t, temperature):
    z = (h.double() @ w.double().t() + b.double()) / temperature
    ls = z.log_softmax(-1)
    valid = t >= 0
    lp = torch.where(valid, ls.gather(1, t.clamp(0)[:, None])[:, 0], torch.zeros(()).double())
    ent = torch.where(valid, -(ls.exp() * ls).sum(-1), torch.zeros(()).double())
    return lp, ent


def test_sharded_logprob_accuracy_vs_float64():
    for dtype in W.dtypes():
        h, w, b, t = W.logprob_inputs(dtype)
        lp, ent = sharded_linear_logprob(h, w, t, b, shards=W.SHARDS, chunk=W.CHUNK, temperature=W.TEMPERATURE,
                                         return_entropy=True)
        ref_lp, ref_ent = _logprob_f64(h, w, b, t, W.TEMPERATURE)
        contract.check("linear_logprob", dtype, lp, ref_lp)
        contract.check("linear_logprob", dtype, ent, ref_ent)


def test_sharded_logprob_batch_invariance():
    h, w, b, t = W.logprob_inputs(torch.float32)
    full = sharded_linear_logprob(h, w, t, b, shards=4, chunk=W.CHUNK)
    for rows in (slice(0, 1), slice(3, 7)):
        assert torch.equal(sharded_linear_logprob(h[rows], w, t[rows], b, shards=4, chunk=W.CHUNK), full[rows])


def test_sharded_logprob_refusals():
    h, w, b, t = W.logprob_inputs(torch.float32)
    with pytest.raises(ValueError, match=r"rlkernels.sharded_linear_logprob: V=384 is not divisible by shards=5"):
        sharded_linear_logprob(h, w, t, b, shards=5)
    with pytest.raises(NotImplementedError, match=r"rlkernels.sharded_linear_logprob: forward only"):
        sharded_linear_logprob(h.requires_grad_(True), w, t, b)
    with pytest.raises(RuntimeError, match=r"rlkernels.vocab_parallel_linear_logprob: torch.distributed"):
        vocab_parallel_linear_logprob(h, w, t, b)


# ---------------------------------------------------------------------------------------
# Several GPUs, NCCL (not run on the CPU machines).
# ---------------------------------------------------------------------------------------

def _nccl_worker(rank: int, world: int, folder: str) -> None:
    import torch.distributed as dist
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{os.path.join(folder, 'store')}", rank=rank,
                            world_size=world)
    try:
        dev = torch.device("cuda", rank)
        x, w, b, _ = W.linear_inputs(torch.bfloat16, m=64, k=4096, n=512)
        cols = _cols(4096, world, rank)
        y = row_parallel_tree_linear(x[:, cols].to(dev), w[:, cols].to(dev), b.to(dev))
        h, wv, bv, t = W.logprob_inputs(torch.bfloat16, n=64, d=256, v=8192)
        vr = 8192 // world
        with torch.no_grad():
            lp, ent = vocab_parallel_linear_logprob(h.to(dev), wv[rank * vr:(rank + 1) * vr].to(dev), t.to(dev),
                                                    bv[rank * vr:(rank + 1) * vr].to(dev), return_entropy=True)
        torch.save({"y": y.cpu(), "logp": lp.cpu(), "ent": ent.cpu()}, os.path.join(folder, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (NCCL)")
def test_nccl_tp2_equals_one_gpu():
    x, w, b, _ = W.linear_inputs(torch.bfloat16, m=64, k=4096, n=512)
    one = tree_linear(x.cuda(), w.cuda(), b.cuda()).cpu()
    h, wv, bv, t = W.logprob_inputs(torch.bfloat16, n=64, d=256, v=8192)
    lp, ent = sharded_linear_logprob(h.cuda(), wv.cuda(), t.cuda(), bv.cuda(), return_entropy=True)
    for out in run_world(2, _nccl_worker, start_method="spawn"):
        assert torch.equal(out["y"], one)
        assert torch.equal(out["logp"], lp.cpu()) and torch.equal(out["ent"], ent.cpu())


# ---------------------------------------------------------------------------------------
# The Triton GEMM backend (interpreter): the rank-local work emulated in one process.
# ---------------------------------------------------------------------------------------

@pytest.mark.skipif(not triton_interpret(), reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("dtype", (torch.float32, torch.float16), ids=("float32", "float16"))
def test_triton_gemm_backend_rank_subtrees_rebuild_tree_linear(dtype):
    """What each rank runs (its subtree on strided K-slices) recombined in rank order equals
    tree_linear on the Triton GEMM backend, at every TP size."""
    from rlkernels.ops.matmul import gemm_backend_for
    x, w, b, _ = W.linear_inputs(dtype, m=3, k=64, n=16)
    one = tree_linear(x, w, b, backend="triton")
    gemm_backend = gemm_backend_for(x.device, "triton")
    for world in SIZES:
        kr = x.shape[1] // world
        parts = [tp._local_tree(gemm_backend, x[:, _cols(64, world, r)], w[:, _cols(64, world, r)], 64 // W.SEGMENTS,
                                W.SEGMENTS // world) for r in range(world)]
        y = (tp.tree_combine(parts) + b.float()).to(dtype)
        assert kr * world == 64 and torch.equal(y, one), world
