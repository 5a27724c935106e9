"""Worker processes for the tensor-parallel tests: one gloo process per emulated TP rank.

Every rank builds the same full inputs from a fixed seed, keeps its own shard, runs the
ops (and planted wrong combines), and saves what it got to ``<dir>/rank<r>.pt``.
"""
from __future__ import annotations

import contextlib
import math
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlkernels._env import triton_interpret
from rlkernels.parallel import row_parallel as rp
from rlkernels.parallel import tree
from rlkernels.parallel import vocab_parallel as vp
from rlkernels.parallel import vocab_parallel_sample as vps

SEGMENTS = 8
SHARDS = 8  # V = 384: shards of 48 rows
TEMPERATURE = 0.7


SIZES = (1, 2, 4, 8)
# A model's logit transform the head applies (scale, then a soft-cap the scaled logits pass).
CAPPED = dict(logit_scale=2.0, logit_softcap=6.0)


def run_world(world: int, fn, start_method: str | None = None) -> list[dict]:
    """Start ``world`` processes running ``fn(rank, world, folder)``; their saved dicts by rank.

    The CPU tests fork (no re-import of torch per rank: seconds on a small machine)
    where no GPU is visible; on a GPU machine a forked child cannot initialize CUDA once
    the parent (Triton's driver probe at import, say) has, and FSDP2 touches it even on a
    CPU mesh, so processes are spawned there, as CUDA workers always are."""
    if start_method is None:
        start_method = "spawn" if torch.cuda.is_available() else "fork"
    with tempfile.TemporaryDirectory() as folder:
        mp.start_processes(fn, args=(world, folder), nprocs=world, join=True, start_method=start_method)
        return [torch.load(os.path.join(folder, f"rank{r}.pt")) for r in range(world)]


@contextlib.contextmanager
def gloo_group(rank: int, world: int, folder: str):
    """One gloo rank of the CPU tests (one thread: the ranks share the machine's cores)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(folder, 'store')}", rank=rank,
                            world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def nccl_group(rank: int, world: int, folder: str):
    """One NCCL rank on GPU ``rank`` for the ``gpu`` tests; yields its device."""
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{os.path.join(folder, 'store')}", rank=rank,
                            world_size=world, device_id=torch.device("cuda", rank))
    try:
        yield torch.device("cuda", rank)
    finally:
        dist.destroy_process_group()


NCCL_SIZES = tuple(t for t in SIZES if t > 1)


def run_nccl_world(world: int, fn) -> list[dict]:
    """:func:`run_world` over NCCL, one GPU a rank; skips where fewer GPUs are visible."""
    import pytest

    if torch.cuda.device_count() < world:
        pytest.skip(f"TP = {world} needs {world} CUDA devices, {torch.cuda.device_count()} visible")
    return run_world(world, fn, start_method="spawn")


def names(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "") + "/"


def bits(x: torch.Tensor) -> torch.Tensor:
    """x's bit pattern as integers of its width (bitwise comparisons of any float dtype)."""
    return x.view({8: torch.int64, 4: torch.int32, 2: torch.int16}[x.element_size()])


def cols(k: int, world: int, rank: int) -> slice:
    """Rank ``rank``'s contiguous share of ``k`` columns (or rows) at TP = ``world``."""
    return slice(rank * k // world, (rank + 1) * k // world)


def dtypes() -> tuple[torch.dtype, ...]:
    # The Triton interpreter's tl.dot is wrong on bf16 operands (refused there): fp16 instead.
    return (torch.float32, torch.float16) if triton_interpret() else (torch.float32, torch.bfloat16)


def linear_inputs(dtype: torch.dtype, m: int = 6, k: int = 128, n: int = 37):
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    dy = torch.randn(m, n, generator=g).to(dtype)
    return x, w, b, dy


def logprob_inputs(dtype: torch.dtype, n: int = 10, d: int = 45, v: int = 384):
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
    y = rp.row_parallel_tree_linear(xs, ws, bs, segments=SEGMENTS)
    y.backward(dy)
    out[f"{tag}y"] = y.detach()
    out[f"{tag}dx"], out[f"{tag}dw"], out[f"{tag}db"] = xs.grad, ws.grad, bs.grad
    with torch.no_grad():
        out[f"{tag}plain"] = rp.plain_row_parallel_linear(x[:, cols], w[:, cols], b)


def logprob_grads(n: int, dtype: torch.dtype = torch.float32):
    """Upstream gradients of (logp, entropy): fixed random fp32 [n] each."""
    g = torch.Generator().manual_seed(99)
    return torch.randn(n, generator=g), torch.randn(n, generator=g)


def logprob_thresholds(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(bias with the 6 largest logits of every row in the first shard, each row's threshold
    keeping them; -inf on every third row): a kept set that leaves whole shards empty."""
    h, w, b, t = logprob_inputs(dtype)
    b = b.clone()
    b[:6] += 30.0
    z = (h.double() @ w.double().T + b.double()) / TEMPERATURE
    top = z.topk(7, dim=1).values
    tau = ((top[:, 5] + top[:, 6]) / 2).to(torch.float64 if dtype == torch.float64 else torch.float32)
    tau[::3] = -math.inf
    return b.to(dtype), tau


def _vocab_parallel(rank: int, world: int, dtype: torch.dtype, out: dict, tag: str,
                    truncated: bool = False, **transform) -> None:
    h, w, b, t = logprob_inputs(dtype)
    tau = None
    if truncated:
        b, tau = logprob_thresholds(dtype)
    vr = w.shape[0] // world
    rows = slice(rank * vr, (rank + 1) * vr)
    hs = h.clone().requires_grad_(True)
    ws = w[rows].clone().requires_grad_(True)
    bs = b[rows].clone().requires_grad_(True)
    lp, ent = vp.vocab_parallel_linear_logprob(hs, ws, t, bs, shards=SHARDS, temperature=TEMPERATURE,
                                               return_entropy=True, logit_threshold=tau, **transform)
    g_lp, g_ent = logprob_grads(t.numel())
    torch.autograd.backward((lp, ent), (g_lp, g_ent))
    for name, value in (("logp", lp.detach()), ("ent", ent.detach()), ("dh", hs.grad), ("dw", ws.grad),
                        ("db", bs.grad)):
        out[f"{tag}vocab_{name}"] = value


# The truncated draw's top-k and top-p: rows keep a few logits, some of them across shards.
TRUNCATION = dict(top_k=40, top_p=0.9)


def sample_inputs(dtype: torch.dtype):
    """logprob_inputs' head and rows, with each row's (stream, position) and a seed."""
    h, w, b, _ = logprob_inputs(dtype)
    g = torch.Generator().manual_seed(99)
    streams = torch.randint(0, 1 << 40, (h.shape[0],), generator=g)
    positions = torch.randint(0, 4096, (h.shape[0],), generator=g)
    return h, w, b, streams, positions, 1234


def _vocab_parallel_sample(rank: int, world: int, dtype: torch.dtype, out: dict, tag: str, **transform) -> None:
    h, w, b, streams, positions, seed = sample_inputs(dtype)
    rows = cols(w.shape[0], world, rank)
    tok, lp, ent = vps.vocab_parallel_linear_sample(h, w[rows], b[rows], shards=SHARDS, temperature=TEMPERATURE,
                                                    seed=seed, streams=streams, positions=positions,
                                                    return_entropy=True, **transform)
    out[f"{tag}sample_token"], out[f"{tag}sample_logp"], out[f"{tag}sample_ent"] = tok, lp, ent
    tok, lp, ent = vps.vocab_parallel_linear_sample(h, w[rows], b[rows], shards=SHARDS, temperature=TEMPERATURE,
                                                    greedy=True, return_entropy=True, **transform)
    out[f"{tag}greedy_token"], out[f"{tag}greedy_logp"], out[f"{tag}greedy_ent"] = tok, lp, ent
    tok, lp, ent, tau = vps.vocab_parallel_linear_sample(h, w[rows], b[rows], shards=SHARDS, temperature=TEMPERATURE,
                                                         seed=seed, streams=streams, positions=positions,
                                                         return_entropy=True, return_threshold=True, **TRUNCATION,
                                                         **transform)
    out[f"{tag}truncated_token"], out[f"{tag}truncated_logp"], out[f"{tag}truncated_ent"] = tok, lp, ent
    out[f"{tag}truncated_tau"] = tau


def _empty_batches(rank: int, world: int, out: dict) -> None:
    """No tokens: both layers return empty results and zero weight gradients at every TP size."""
    x = torch.zeros(0, 128, requires_grad=True)
    w = torch.randn(37, 128 // world, requires_grad=True)
    xs = x[:, cols(128, world, rank)]
    y = rp.row_parallel_tree_linear(xs, w, torch.zeros(37), segments=SEGMENTS)
    y.sum().backward()
    out["empty/y"], out["empty/dx"], out["empty/dw"] = y.detach(), x.grad, w.grad
    h = torch.zeros(0, 45, requires_grad=True)
    wv = torch.randn(384 // world, 45, requires_grad=True)
    lp, ent = vp.vocab_parallel_linear_logprob(h, wv, torch.zeros(0, dtype=torch.long), shards=SHARDS,
                                               return_entropy=True)
    (lp.sum() + ent.sum()).backward()
    out["empty/logp"], out["empty/dh"], out["empty/vocab_dw"] = lp.detach(), h.grad, wv.grad


def _aten_sum_combine(parts: list[torch.Tensor]) -> torch.Tensor:
    """Planted: ATen's own sum over the rank partials (its order, not the tree's)."""
    return torch.stack(parts).sum(0)


def _sequential_combine(parts: list[torch.Tensor]) -> torch.Tensor:
    """Planted: rank partials folded left to right instead of by the tree's top levels."""
    acc = parts[0]
    for p in parts[1:]:
        acc = acc + p
    return acc


def _reversed_combine(parts: list[torch.Tensor]) -> torch.Tensor:
    """Planted: the tree's top levels over the ranks in reverse order (its mirror image)."""
    return tree.tree_combine(parts[::-1])


def _reversed_shard_order(gathered: list[torch.Tensor], per_rank: int) -> list[torch.Tensor]:
    """Planted: the ranks' shard blocks taken last rank first (each block's shards in order)."""
    return [block[i] for block in gathered[::-1] for i in range(per_rank)]


def _stock_vocab_parallel(rank: int, world: int, dtype: torch.dtype, out: dict, tag: str) -> None:
    """Planted: the stock vocab-parallel combine -- the same shard statistics, merged on the
    rank, then ``all_reduce`` MAX of the lse and SUM of the rescaled sums (the collective's order)."""
    h, w, b, t = logprob_inputs(dtype)
    vr = w.shape[0] // world
    layout = vp.vocab_layout("plant", w.shape[0], SHARDS, rank, world)
    logprob_backend, _ = vp.backends_for("plant", h)
    wr, br = w[rank * vr:(rank + 1) * vr], b[rank * vr:(rank + 1) * vr]
    width = layout.width
    with torch.no_grad():
        stats = [vp.shard_stats(logprob_backend, h, wr[i * width:(i + 1) * width], br[i * width:(i + 1) * width],
                                vp.local_targets(t, layout.first_id(i), width), TEMPERATURE)
                 for i in range(layout.per_rank)]
        lse_loc = torch.logsumexp(torch.stack([st[0] for st in stats]), 0)
        big = lse_loc.clone()
        dist.all_reduce(big, op=dist.ReduceOp.MAX)
        total = torch.exp(lse_loc - big)
        dist.all_reduce(total)
        lse = big + torch.log(total)
        ent = sum(torch.exp(st[0] - lse) * (st[1] + (lse - st[0])) for st in stats)
        dist.all_reduce(ent)
        logp = torch.zeros_like(lse)
        for i, st in enumerate(stats):
            lo = layout.first_id(i)
            logp = torch.where((t >= lo) & (t < lo + width), st[2] + (st[0] - lse), logp)
        dist.all_reduce(logp)
        valid = t >= 0
        out[f"{tag}vocab_logp"] = torch.where(valid, logp, torch.zeros_like(lse))
        out[f"{tag}vocab_ent"] = torch.where(valid, ent, torch.zeros_like(lse))


# ---------------------------------------------------------------- column-parallel and per-head norm
COLUMN_N = 64  # output columns of the column-parallel layer: 8 segments of 8
NORM_HEADS, NORM_DIM = 16, 24  # the per-head norm's heads (8 segments of 2) and head size


def column_inputs(dtype: torch.dtype):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(7, 48, generator=g).to(dtype)
    w = (torch.randn(COLUMN_N, 48, generator=g) / 48 ** 0.5).to(dtype)
    b = torch.randn(COLUMN_N, generator=g).to(dtype)
    dy = torch.randn(7, COLUMN_N, generator=g).to(dtype)
    return x, w, b, dy


def column_grads(x, w, b, dy, group=None, rank: int = 0, world: int = 1):
    """(y, dX, dW, dbias) of rank ``rank``'s block of the column-parallel layer."""
    from rlkernels.parallel import column_parallel_tree_linear

    rows = cols(w.shape[0], world, rank)
    xs, ws, bs = (t.clone().requires_grad_(True) for t in (x, w[rows], b[rows]))
    y = column_parallel_tree_linear(xs, ws, bs, segments=SEGMENTS, group=group)
    y.backward(dy[:, rows])
    return y.detach(), xs.grad, ws.grad, bs.grad


def head_norm_inputs(dtype: torch.dtype):
    g = torch.Generator().manual_seed(6)
    x = (torch.randn(3, 5, NORM_HEADS, NORM_DIM, generator=g) * 3).to(dtype)
    w = (1 + 0.1 * torch.randn(NORM_DIM, generator=g)).to(dtype)
    dy = torch.randn(3, 5, NORM_HEADS, NORM_DIM, generator=g).to(dtype)
    return x, w, dy


def head_norm_grads(x, w, dy, group=None, rank: int = 0, world: int = 1):
    """(y, dX, dW) of the per-head norm over rank ``rank``'s heads."""
    from rlkernels.parallel.head_norm import head_tree_rms_norm

    heads = cols(x.shape[-2], world, rank)
    xs, ws = x[..., heads, :].clone().requires_grad_(True), w.clone().requires_grad_(True)
    y = head_tree_rms_norm(xs, ws, 1e-6, segments=SEGMENTS, group=group, rank=rank, world=world)
    y.backward(dy[..., heads, :])
    return y.detach(), xs.grad, ws.grad


def _column_and_head_norm(rank: int, world: int, out: dict) -> None:
    """Both layers in fp32 and bf16, and the stock layers' controls: the ranks' partial input
    gradients, and the norms' own weight gradients, summed by all_reduce."""
    from rlkernels.ops.norms import rms_norm

    for dtype in (torch.float32, torch.bfloat16):
        x, w, b, dy = column_inputs(dtype)
        out[f"column/{dtype}"] = column_grads(x, w, b, dy, dist.group.WORLD, rank, world)
        rows = cols(COLUMN_N, world, rank)
        partial = dy[:, rows].float() @ w[rows].float()
        dist.all_reduce(partial)
        out[f"column/stock {dtype}"] = partial.to(dtype)
        x, w, dy = head_norm_inputs(dtype)
        out[f"head_norm/{dtype}"] = head_norm_grads(x, w, dy, dist.group.WORLD, rank, world)
        heads = cols(NORM_HEADS, world, rank)
        ws = w.float().clone().requires_grad_(True)
        rms_norm(x[..., heads, :].float(), ws, 1e-6).backward(dy[..., heads, :].float())
        dist.all_reduce(ws.grad)
        out[f"head_norm/stock {dtype}"] = ws.grad


def worker(rank: int, world: int, folder: str) -> None:
    with gloo_group(rank, world, folder):
        out: dict = {}
        for dtype in dtypes():
            name = str(dtype).replace("torch.", "")
            _row_parallel(rank, world, dtype, out, f"{name}/")
            _vocab_parallel(rank, world, dtype, out, f"{name}/")
            _vocab_parallel(rank, world, dtype, out, f"{name}/truncated/", truncated=True)
            _vocab_parallel_sample(rank, world, dtype, out, f"{name}/")
        _vocab_parallel(rank, world, torch.float32, out, "capped/", **CAPPED)
        _vocab_parallel_sample(rank, world, torch.float32, out, "capped/", **CAPPED)
        _empty_batches(rank, world, out)
        _column_and_head_norm(rank, world, out)
        dtype = torch.float32
        combine, order = tree._combine_ranks, vp._shard_order
        for plant, fn in (("aten_sum", _aten_sum_combine), ("sequential", _sequential_combine),
                          ("reversed", _reversed_combine)):
            tree._combine_ranks = fn
            _row_parallel(rank, world, dtype, out, f"plant_{plant}/")
            _vocab_parallel(rank, world, dtype, out, f"plant_{plant}/")
        tree._combine_ranks = combine
        vp._shard_order = _reversed_shard_order
        _vocab_parallel(rank, world, dtype, out, "plant_reversed_ranks/")
        vp._shard_order = order
        _stock_vocab_parallel(rank, world, dtype, out, "plant_all_reduce_stats/")
        torch.save(out, os.path.join(folder, f"rank{rank}.pt"))
