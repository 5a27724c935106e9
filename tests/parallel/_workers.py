"""Worker processes for the tensor-parallel tests: one gloo process per emulated TP rank.

Every rank builds the same full inputs from a fixed seed, keeps its own shard, runs the
ops (and planted wrong combines), and saves what it got to ``<dir>/rank<r>.pt``.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from rlkernels._env import triton_interpret
from rlkernels.parallel import tensor_parallel as tp

SEGMENTS = 8
SHARDS = 8
CHUNK = 20  # a 48-wide shard: pieces of 20, 20, 8
TEMPERATURE = 0.7


def dtypes() -> tuple[torch.dtype, ...]:
    # The Triton interpreter's tl.dot is wrong on bf16 operands (refused there): fp16 instead.
    return (torch.float32, torch.float16) if triton_interpret() else (torch.float32, torch.bfloat16)


def linear_inputs(dtype: torch.dtype, m: int = 6, k: int = 128, n: int = 40):
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    dy = torch.randn(m, n, generator=g).to(dtype)
    return x, w, b, dy


def logprob_inputs(dtype: torch.dtype, n: int = 10, d: int = 48, v: int = 384):
    g = torch.Generator().manual_seed(4321)
    h = torch.randn(n, d, generator=g).to(dtype)
    w = (torch.randn(v, d, generator=g) * 2 / d ** 0.5).to(dtype)
    b = torch.randn(v, generator=g).to(dtype)
    t = torch.randint(0, v, (n,), generator=g)
    t[3] = -100
    t[0], t[1] = 0, v - 1  # the first and the last id
    return h, w, b, t


def _row_parallel(rank: int, world: int, dtype: torch.dtype, out: dict, tag: str) -> None:
    x, w, b, dy = linear_inputs(dtype)
    kr = x.shape[1] // world
    cols = slice(rank * kr, (rank + 1) * kr)
    xs = x[:, cols].clone().requires_grad_(True)
    ws = w[:, cols].clone().requires_grad_(True)
    bs = b.clone().requires_grad_(True)
    y = tp.row_parallel_tree_linear(xs, ws, bs, segments=SEGMENTS)
    y.backward(dy)
    out[f"{tag}y"] = y.detach()
    out[f"{tag}dx"], out[f"{tag}dw"], out[f"{tag}db"] = xs.grad, ws.grad, bs.grad
    with torch.no_grad():
        out[f"{tag}plain"] = tp.plain_row_parallel_linear(x[:, cols], w[:, cols], b)


def _vocab_parallel(rank: int, world: int, dtype: torch.dtype, out: dict, tag: str) -> None:
    h, w, b, t = logprob_inputs(dtype)
    vr = w.shape[0] // world
    rows = slice(rank * vr, (rank + 1) * vr)
    with torch.no_grad():
        lp, ent = tp.vocab_parallel_linear_logprob(h, w[rows], t, b[rows], shards=SHARDS, chunk=CHUNK,
                                                   temperature=TEMPERATURE, return_entropy=True)
    out[f"{tag}logp"], out[f"{tag}ent"] = lp, ent


def _all_reduce_combine(parts: list[torch.Tensor]) -> torch.Tensor:
    """Planted: the collective's own sum of the rank partials (what a stock layer does)."""
    mine = parts[dist.get_rank()].clone()
    dist.all_reduce(mine)
    return mine


def _sequential_combine(parts: list[torch.Tensor]) -> torch.Tensor:
    """Planted: rank partials folded left to right instead of by the tree's top levels."""
    acc = parts[0]
    for p in parts[1:]:
        acc = acc + p
    return acc


def _reversed_combine(parts: list[torch.Tensor]) -> torch.Tensor:
    """Planted: the tree's top levels over the ranks in reverse order (its mirror image)."""
    return tp.tree_combine(parts[::-1])


def _reversed_shard_order(gathered: list[torch.Tensor], per_rank: int) -> list[torch.Tensor]:
    """Planted: the ranks' shard blocks taken last rank first (each block's shards in order)."""
    return [block[i] for block in gathered[::-1] for i in range(per_rank)]


def _stock_vocab_parallel(rank: int, world: int, dtype: torch.dtype, out: dict, tag: str) -> None:
    """Planted: the stock vocab-parallel combine -- the same shard statistics, merged locally,
    then ``all_reduce`` MAX of the max and SUM of the rescaled sums (the collective's order)."""
    h, w, b, t = logprob_inputs(dtype)
    vr = w.shape[0] // world
    rows = slice(rank * vr, (rank + 1) * vr)
    gemm_backend = tp.gemm_backend_for(h.device)
    width, per_rank = w.shape[0] // SHARDS, SHARDS // world
    with torch.no_grad():
        stats = [tp.shard_stats(gemm_backend, h, w[rows], b[rows], t, i * width, (i + 1) * width, rank * vr,
                                TEMPERATURE, CHUNK) for i in range(per_rank)]
        acc = stats[0]
        for st in stats[1:]:
            acc = tp.merge_stats(acc, st)
        m_loc = acc[0].clone()
        m = acc[0].clone()
        dist.all_reduce(m, op=dist.ReduceOp.MAX)
        e = torch.exp(m_loc - m)
        s = e * acc[1]
        u = e * (acc[2] + (m_loc - m) * acc[1])
        inside = (t >= rank * vr) & (t < (rank + 1) * vr)
        zt = torch.where(inside, sum(st[3] for st in stats), torch.zeros_like(m))
        for v in (s, u, zt):
            dist.all_reduce(v)
        log_s = torch.log(s)
        valid = t >= 0
        out[f"{tag}logp"] = torch.where(valid, (zt - m) - log_s, torch.zeros_like(m))
        out[f"{tag}ent"] = torch.where(valid, log_s - u / s, torch.zeros_like(m))


def worker(rank: int, world: int, folder: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(folder, 'store')}", rank=rank,
                            world_size=world)
    try:
        out: dict = {}
        for dtype in dtypes():
            name = str(dtype).replace("torch.", "")
            _row_parallel(rank, world, dtype, out, f"{name}/")
            _vocab_parallel(rank, world, dtype, out, f"{name}/")
        dtype = torch.float32
        combine, order = tp._combine_ranks, tp._shard_order
        for plant, fn in (("all_reduce", _all_reduce_combine), ("sequential", _sequential_combine),
                          ("reversed", _reversed_combine)):
            tp._combine_ranks = fn
            _row_parallel(rank, world, dtype, out, f"plant_{plant}/")
        tp._combine_ranks = combine
        tp._shard_order = _reversed_shard_order
        _vocab_parallel(rank, world, dtype, out, "plant_reversed_ranks/")
        tp._shard_order = order
        _stock_vocab_parallel(rank, world, dtype, out, "plant_all_reduce_stats/")
        torch.save(out, os.path.join(folder, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
