"""What the TP-invariant modes cost on this machine: ``python -m rlkernels.parallel.measure``.

Each timing is the median of ``REPEATS`` calls with one intra-op thread per process
(the ranks of a gloo world share the host's cores). Prints one JSON line per row.
"""
from __future__ import annotations

import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..ops.linear_logprob import linear_logprob
from ..ops.matmul import linear
from . import tensor_parallel as tp

REPEATS = 5
M, K, N = 64, 1024, 1024
TOKENS, DIM, VOCAB = 64, 256, 8192


def _median(fn) -> float:
    fn()
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _inputs(dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(M, K, generator=g).to(dtype)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(dtype)
    h = torch.randn(TOKENS, DIM, generator=g).to(dtype)
    wv = (torch.randn(VOCAB, DIM, generator=g) / DIM ** 0.5).to(dtype)
    t = torch.randint(0, VOCAB, (TOKENS,), generator=g)
    return x, w, h, wv, t


def one_process(dtype: torch.dtype) -> list[dict]:
    x, w, h, wv, t = _inputs(dtype)
    rows = []
    base, tree = _median(lambda: linear(x, w)), _median(lambda: tp.tree_linear(x, w))
    rows.append({"what": "tree_linear vs linear", "shape": [M, K, N], "dtype": str(dtype)[6:],
                 "baseline_ms": round(base, 2), "invariant_ms": round(tree, 2), "ratio": round(tree / base, 3)})
    with torch.no_grad():
        base = _median(lambda: linear_logprob(h, wv, t, return_entropy=True))
        shard = _median(lambda: tp.sharded_linear_logprob(h, wv, t, return_entropy=True))
    rows.append({"what": "sharded_linear_logprob vs linear_logprob", "shape": [TOKENS, DIM, VOCAB],
                 "dtype": str(dtype)[6:], "baseline_ms": round(base, 2), "invariant_ms": round(shard, 2),
                 "ratio": round(shard / base, 3)})
    return rows


def _worker(rank: int, world: int, folder: str, dtype: torch.dtype) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(folder, 'store')}", rank=rank,
                            world_size=world)
    try:
        x, w, h, wv, t = _inputs(dtype)
        cols = slice(rank * K // world, (rank + 1) * K // world)
        xs, ws = x[:, cols].contiguous(), w[:, cols].contiguous()
        plain = _median(lambda: tp.plain_row_parallel_linear(xs, ws))
        tree = _median(lambda: tp.row_parallel_tree_linear(xs, ws))
        vr = VOCAB // world
        wr = wv[rank * vr:(rank + 1) * vr]
        with torch.no_grad():
            vocab = _median(lambda: tp.vocab_parallel_linear_logprob(h, wr, t, return_entropy=True))
        torch.save({"plain": plain, "tree": tree, "vocab": vocab}, os.path.join(folder, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def tensor_parallel(world: int, dtype: torch.dtype) -> list[dict]:
    with tempfile.TemporaryDirectory() as folder:
        mp.start_processes(_worker, args=(world, folder, dtype), nprocs=world, start_method="fork")
        r0 = torch.load(os.path.join(folder, "rank0.pt"))
    return [{"what": f"row_parallel_tree_linear vs plain all_reduce layer, TP={world}", "shape": [M, K, N],
             "dtype": str(dtype)[6:], "baseline_ms": round(r0["plain"], 2), "invariant_ms": round(r0["tree"], 2),
             "ratio": round(r0["tree"] / r0["plain"], 3)},
            {"what": f"vocab_parallel_linear_logprob, TP={world} (rank 0)", "shape": [TOKENS, DIM, VOCAB],
             "dtype": str(dtype)[6:], "invariant_ms": round(r0["vocab"], 2)}]


def main() -> None:
    torch.set_num_threads(1)
    for dtype in (torch.float32, torch.bfloat16):
        for row in one_process(dtype):
            print(json.dumps(row))
        for row in tensor_parallel(2, dtype):
            print(json.dumps(row))


if __name__ == "__main__":
    main()
