"""Benchmark: the TP-invariant layers of ``rlkernels.parallel`` against the stock TP layers.

    rlkernels bench tp [--device cuda|cpu] [--world N] [--json PATH] [--no-model]

One process per rank (NCCL on GPUs, gloo on the CPU); TP sizes 1, 2, 4, .. up to
``--world`` (default: every visible GPU; 2 on the CPU), each as a process group of the
first ranks. Rank 0 reports, per layer and TP size:

- row-parallel linear forward (Llama-3-8B ``o_proj`` and ``down_proj``, a decode-sized and
  a prefill-sized M): stock = one chain over the rank's K/t then ``all_reduce`` (at TP = 1
  ``torch.nn.functional.linear``, cuBLAS), rlkernels = the K-tree
  (:func:`row_parallel_tree_linear`, at TP = 1 :func:`tree_linear`); also
  :func:`rlkernels.linear` at TP = 1;
- vocab-parallel log-prob + entropy, forward and forward+backward (151936-row head):
  stock = each rank's logits materialized in fp32, row max / sums / target logit
  combined by differentiable ``all_reduce`` (the Megatron / verl pattern; at TP = 1
  ``log_softmax`` of the full logits), rlkernels = :func:`vocab_parallel_linear_logprob`
  (at TP = 1 :func:`sharded_linear_logprob`); also :func:`rlkernels.linear_logprob` at TP = 1.

and, unless ``--no-model``, the whole model (:mod:`rlkernels.bench.tp_model`).

Times are medians of a fixed number of calls per rank (every rank runs the same
collectives, so no rank waits on a call another never makes), by CUDA events on a GPU and
the wall clock on the CPU; ``ratio`` = rlkernels / stock. ``bitwise_tp1`` says whether
the rlkernels output at this TP size equals its TP = 1 output (logp, entropy and dhidden
for the head): the contract, checked on the timed shapes.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..ops.linear_logprob import linear_logprob
from ..ops.matmul import linear
from ..parallel import (plain_row_parallel_linear, row_parallel_tree_linear, sharded_linear_logprob, tree_linear,
                        vocab_parallel_linear_logprob)
from .common import environment, fixed_call_times_ms, print_table, write_json
from .tp_model import model_rows, progress

NEEDS_CUDA = False  # `--device cpu` runs gloo processes anywhere

# (name, K, N) of Llama-3-8B's row-parallel layers; M: a decode step of 128 rows, a 4096-token prefill.
GPU_LINEARS = (("o_proj", 4096, 4096), ("down_proj", 14336, 4096))
GPU_MS = (128, 4096)
GPU_HEAD = (4096, 4096, 151936)  # tokens, D, V
CPU_LINEARS = (("linear", 1024, 1024),)
CPU_MS = (64,)
CPU_HEAD = (64, 256, 8192)
WARMUP, REPS = 3, 15
TEMPERATURE = 0.7


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None,
                        help="cuda (default when two or more GPUs are visible: NCCL) or cpu (gloo)")
    parser.add_argument("--world", type=int, default=None,
                        help="processes (the largest TP size); default: the visible GPUs, 2 on the CPU")
    parser.add_argument("--model", action=argparse.BooleanOptionalAction, default=True,
                        help="also the whole model: a Qwen3-1.7B-shaped tensor_parallel model's scoring and "
                             "decode step (a tiny Qwen3 on the CPU)")


def _timer(device: torch.device, group: dist.ProcessGroup | None) -> Callable[[Callable[[], Any]], float]:
    def median_ms(fn: Callable[[], Any]) -> float:
        for _ in range(WARMUP):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if group is not None:
            dist.barrier(group=group)
        return statistics.median(fixed_call_times_ms(fn, REPS, device.type == "cuda"))
    return median_ms


class _ReduceFromTensorParallel(torch.autograd.Function):
    """Megatron's reduce from the tensor-parallel region: ``all_reduce`` forward, identity backward
    (the result is replicated, so each rank's gradient of it is already the whole gradient)."""

    @staticmethod
    def forward(ctx, x, group):  # type: ignore[override]
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad, None


def _stock_vocab_parallel(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, first_id: int, world: int,
                          group: dist.ProcessGroup | None) -> tuple[torch.Tensor, torch.Tensor]:
    """logp and entropy from this rank's materialized fp32 logits, combined by all_reduce."""
    def reduce(x: torch.Tensor) -> torch.Tensor:
        return _ReduceFromTensorParallel.apply(x, group) if world > 1 else x

    z = (h @ w.t()).float() / TEMPERATURE
    big = z.amax(-1).detach()
    if world > 1:
        dist.all_reduce(big, op=dist.ReduceOp.MAX, group=group)
    e = torch.exp(z - big[:, None])
    total = reduce(e.sum(-1))
    lse = big + torch.log(total)
    inside = (t >= first_id) & (t < first_id + w.shape[0])
    local = (t - first_id).clamp(0, w.shape[0] - 1)
    zt = reduce(torch.where(inside, z.gather(1, local[:, None])[:, 0], torch.zeros_like(lse)))
    ent = lse - reduce(((e / total[:, None]) * z).sum(-1))
    return zt - lse, ent


def _fwd_bwd(fn: Callable[..., Any], h: torch.Tensor, w: torch.Tensor) -> Callable[[], None]:
    hh, ww = h.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    g = torch.ones(h.shape[0], device=h.device)

    def run() -> None:
        hh.grad = ww.grad = None
        lp, ent = fn(hh, ww)
        torch.autograd.backward((lp, ent), (g, g))
    run.grads = lambda: hh.grad  # type: ignore[attr-defined]
    return run


def _worker(rank: int, world: int, folder: str, device_type: str, with_model: bool) -> None:
    cuda = device_type == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{os.path.join(folder, 'store')}",
                            rank=rank, world_size=world, **({"device_id": device} if cuda else {}))
    dtype = torch.bfloat16 if cuda else torch.float32
    linears, ms, head = (GPU_LINEARS, GPU_MS, GPU_HEAD) if cuda else (CPU_LINEARS, CPU_MS, CPU_HEAD)
    rows: list[dict] = []
    sizes = [1 << i for i in range(world.bit_length()) if 1 << i <= world]
    groups = {t: dist.new_group(list(range(t))) for t in sizes if t > 1}
    try:
        ref: dict[str, dict[str, torch.Tensor]] = {}
        for tp in sizes:
            group = groups.get(tp)
            progress(rank, f"layers, TP = {tp}")
            member = rank < tp
            median_ms = _timer(device, group)
            if member:
                for name, k, n in linears:
                    gen = torch.Generator().manual_seed(k * n)  # the same inputs at every TP size
                    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(device, dtype)
                    for m in ms:
                        x = torch.randn(m, k, generator=gen).to(device, dtype)
                        key = f"{name} M={m}"
                        cols = slice(rank * k // tp, (rank + 1) * k // tp)
                        xs, ws = x[:, cols].contiguous(), w[:, cols].contiguous()
                        with torch.no_grad():
                            if tp == 1:
                                stock = median_ms(lambda: torch.nn.functional.linear(x, w))
                                chain = median_ms(lambda: linear(x, w))
                                tree = median_ms(lambda: tree_linear(x, w))
                                y = tree_linear(x, w)
                                ref[key] = {"y": y}
                                same = True
                            else:
                                stock = median_ms(lambda: plain_row_parallel_linear(xs, ws, group=group))
                                chain = None
                                tree = median_ms(lambda: row_parallel_tree_linear(xs, ws, group=group))
                                y = row_parallel_tree_linear(xs, ws, group=group)
                                same = bool(torch.equal(y.cpu(), ref[key]["y"].cpu())) if rank == 0 else None
                        rows.append({"layer": key, "shape": [m, k, n], "tp": tp, "pass": "fwd", "stock_ms": stock,
                                     "rlkernels_linear_ms": chain, "rlkernels_ms": tree, "ratio": tree / stock,
                                     "bitwise_tp1": same})
                tokens, d, v = head
                gen = torch.Generator().manual_seed(v)
                h = torch.randn(tokens, d, generator=gen).to(device, dtype)
                wv = (torch.randn(v, d, generator=gen) * 2 / d ** 0.5).to(device, dtype)
                t = torch.randint(0, v, (tokens,), generator=gen).to(device)
                vr = v // tp
                ws = wv[rank * vr:(rank + 1) * vr].contiguous()

                def ours(hh: torch.Tensor, ww: torch.Tensor) -> Any:
                    if tp == 1:
                        return sharded_linear_logprob(hh, ww, t, temperature=TEMPERATURE, return_entropy=True)
                    return vocab_parallel_linear_logprob(hh, ww, t, temperature=TEMPERATURE, return_entropy=True,
                                                         group=group)

                def stock_fn(hh: torch.Tensor, ww: torch.Tensor) -> Any:
                    return _stock_vocab_parallel(hh, ww, t, rank * vr, tp, group)

                with torch.no_grad():
                    fwd = {"stock": median_ms(lambda: stock_fn(h, ws)), "ours": median_ms(lambda: ours(h, ws))}
                    lp, ent = ours(h, ws)
                    fused = median_ms(lambda: linear_logprob(h, wv, t, temperature=TEMPERATURE,
                                                             return_entropy=True)) if tp == 1 else None
                step_ours, step_stock = _fwd_bwd(ours, h, ws), _fwd_bwd(stock_fn, h, ws)
                bwd = {"stock": median_ms(step_stock), "ours": median_ms(step_ours)}
                fused_bwd = median_ms(_fwd_bwd(lambda hh, ww: linear_logprob(hh, ww, t, temperature=TEMPERATURE,
                                                                               return_entropy=True), h, wv)) \
                    if tp == 1 else None
                step_ours()
                got = {"logp": lp, "ent": ent, "dh": step_ours.grads()}
                if tp == 1:
                    ref["head"] = got
                    same = True
                else:
                    same = all(torch.equal(got[x].cpu(), ref["head"][x].cpu()) for x in got) if rank == 0 else None
                for what, times, fused_ms in (("fwd", fwd, fused), ("fwd+bwd", bwd, fused_bwd)):
                    rows.append({"layer": "lm head logp+entropy", "shape": [tokens, d, v], "tp": tp, "pass": what,
                                 "stock_ms": times["stock"], "rlkernels_linear_ms": fused_ms,
                                 "rlkernels_ms": times["ours"], "ratio": times["ours"] / times["stock"],
                                 "bitwise_tp1": same})
                del h, wv, ws, step_ours, step_stock
                if cuda:
                    torch.cuda.empty_cache()
            dist.barrier()
        if with_model:
            rows += model_rows(rank, sizes, groups, device, folder)
        if rank == 0:
            torch.save(rows, os.path.join(folder, "rows.pt"))
    finally:
        dist.destroy_process_group()


def run(args: argparse.Namespace) -> list[dict]:
    device = args.device or ("cuda" if torch.cuda.device_count() >= 2 else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("rlkernels bench tp: --device cuda, but torch sees no CUDA GPU here; --device cpu runs "
                         "gloo processes")
    world = args.world or (torch.cuda.device_count() if device == "cuda" else 2)
    if world < 1 or (device == "cuda" and world > torch.cuda.device_count()):
        raise SystemExit(f"rlkernels bench tp: --world {world}: expected 1 .. {torch.cuda.device_count()} "
                         "(one process per GPU)" if device == "cuda" else f"rlkernels bench tp: --world {world} < 1")
    with tempfile.TemporaryDirectory() as folder:
        mp.start_processes(_worker, args=(world, folder, device, args.model), nprocs=world, join=True,
                           start_method="spawn" if device == "cuda" else "fork")
        rows = torch.load(os.path.join(folder, "rows.pt"))
    for r in rows:
        for key in ("stock_ms", "rlkernels_linear_ms", "rlkernels_ms", "ratio"):
            if r[key] is not None:
                r[key] = round(r[key], 4)
    print_table(f"TP-invariant layers vs stock TP layers ({device}, {world} processes)", rows,
                ["layer", "tp", "pass", "stock_ms", "rlkernels_linear_ms", "rlkernels_ms", "ratio", "bitwise_tp1"])
    for r in rows:
        if r.get("note"):
            print(f"  {r['layer']} tp={r['tp']}: {r['note']}")
    write_json(args.json, "tp", rows, {"world": world, "backend": "nccl" if device == "cuda" else "gloo",
                                       "environment_rank0": environment()})
    return rows
