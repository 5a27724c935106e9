"""Several GPUs, NCCL: the TP-invariant layers at real shapes equal one GPU bit for bit.

Marked ``gpu``; skipped unless two CUDA devices are present. TP = 2, 4 and 8, each where
that many devices are visible, on an 8B model's ``o_proj`` / ``down_proj`` and a
151936-row vocabulary head, forward and backward, against the one-process ops on one GPU.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from rlkernels.parallel import (plain_row_parallel_linear, row_parallel_tree_linear, sharded_linear_logprob,
                                tree_linear, vocab_parallel_linear_logprob)

from . import _workers as W

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (NCCL)")]

# (name, M tokens, K, N): Llama-3-8B-shaped row-parallel layers.
LINEARS = (("o_proj", 512, 4096, 4096), ("down_proj", 512, 14336, 4096))
TOKENS, DIM, VOCAB = 1024, 4096, 151936


def _linear_inputs(m: int, k: int, n: int):
    g = torch.Generator().manual_seed(k + n)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = (torch.randn(n, k, generator=g) / k ** 0.5).bfloat16()
    dy = torch.randn(m, n, generator=g).bfloat16()
    return x, w, dy


def _head_inputs():
    g = torch.Generator().manual_seed(7)
    h = torch.randn(TOKENS, DIM, generator=g).bfloat16()
    w = (torch.randn(VOCAB, DIM, generator=g) * 2 / DIM ** 0.5).bfloat16()
    t = torch.randint(0, VOCAB, (TOKENS,), generator=g)
    t[5] = -100
    g_lp, g_ent = torch.randn(TOKENS, generator=g), torch.randn(TOKENS, generator=g)
    return h, w, t, g_lp, g_ent


def _run_linear(x, w, dy, fn, **kw):
    x, w = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    y = fn(x, w, **kw)
    y.backward(dy)
    return {"y": y.detach().cpu(), "dx": x.grad.cpu(), "dw": w.grad.cpu()}


def _run_head(h, w, t, g_lp, g_ent, fn, **kw):
    h, w = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    lp, ent = fn(h, w, t, return_entropy=True, **kw)
    torch.autograd.backward((lp, ent), (g_lp, g_ent))
    return {"logp": lp.detach().cpu(), "ent": ent.detach().cpu(), "dh": h.grad.cpu(), "dw": w.grad.cpu()}


def _nccl_worker(rank: int, world: int, folder: str) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{os.path.join(folder, 'store')}", rank=rank,
                            world_size=world, device_id=torch.device("cuda", rank))
    try:
        dev = torch.device("cuda", rank)
        out: dict = {}
        for name, m, k, n in LINEARS:
            x, w, dy = (t.to(dev) for t in _linear_inputs(m, k, n))
            cols = W.cols(k, world, rank)
            out[name] = _run_linear(x[:, cols], w[:, cols], dy, row_parallel_tree_linear)
            with torch.no_grad():
                out[name]["plain"] = plain_row_parallel_linear(x[:, cols], w[:, cols]).cpu()
        h, w, t, g_lp, g_ent = (a.to(dev) for a in _head_inputs())
        out["head"] = _run_head(h, w[W.cols(VOCAB, world, rank)], t, g_lp, g_ent, vocab_parallel_linear_logprob)
        torch.save(out, os.path.join(folder, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [t for t in W.SIZES if t > 1])
def test_nccl_tp_equals_one_gpu(world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"TP = {world} needs {world} CUDA devices, {torch.cuda.device_count()} visible")
    ranks = W.run_world(world, _nccl_worker, start_method="spawn")
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
    h, w, t, g_lp, g_ent = (a.cuda() for a in _head_inputs())
    one = _run_head(h, w, t, g_lp, g_ent, sharded_linear_logprob)
    for rank, out in enumerate(ranks):
        for key in ("logp", "ent", "dh"):
            assert torch.equal(out["head"][key], one[key]), (key, rank)
        assert torch.equal(out["head"]["dw"], one["dw"][W.cols(VOCAB, world, rank)]), rank
