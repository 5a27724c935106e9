"""Tensor-parallel layers whose bits do not depend on the TP size (opt-in contracts).

A stock row-parallel layer sums each rank's partial product with ``all_reduce``, and a
stock vocab-parallel lm head merges per-rank softmax statistics the same way: the sum's
association follows the TP size and the collective's algorithm, so TP = 1, 2, 4 give
different bits. Here every cross-rank combine gathers the partials (``all_gather``,
an exact copy) and combines them in a fixed order on every rank, and the local work is
cut on boundaries that are a function of the problem shape alone, never of the TP size.

* Row-parallel linear, the **K-tree**: K is cut into ``segments`` equal segments of
  ``SEG = K / segments`` elements (``segments`` a power of two, default
  :data:`TREE_SEGMENTS`; K not divisible is refused). Each segment is one ascending
  canonical chain (the library's GEMM backend on that K-slice, fp32 output kept
  unrounded); the segment partials are combined by a fixed binary tree (pairwise, left
  to right, fp32), then the bias is added in fp32 and the sum rounded once. At TP = t
  (a power of two dividing ``segments``) rank r holds segments ``r*segments/t ..``,
  builds the lower ``log2(segments/t)`` levels of the same tree locally, and the top
  ``log2(t)`` levels run over the gathered rank partials, in rank order. Same tree,
  same leaves, so the same bits at every TP size.
* Vocab-parallel ``linear_logprob``: the vocabulary is cut into ``shards`` equal
  shards (default :data:`VOCAB_SHARDS`); each shard's per-token statistics (max ``m``,
  ``s = sum exp(z - m)``, ``u = sum exp(z - m) (z - m)``, the target logit) are an
  ascending chain over its ``chunk``-wide vocab pieces, then the shards' statistics
  are merged left to right in shard order (rank 0's shards first) by one fixed formula
  (:func:`merge_stats`). A rank holds ``shards / t`` whole shards; the one-process
  :func:`sharded_linear_logprob` computes the same shards and the same merge.
  Forward only.

Gathering costs memory a sum would not (t partials of [M, N] fp32 per layer); that is
the price of a fixed order (docs/operators/tensor_parallel.md gives measured costs).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..gemm.chain import accumulator_dtype
from ..ops import _validate as V
from ..ops.linear_logprob import _INT_DTYPES, online_softmax_step, validate as validate_logprob
from ..ops.matmul import gemm_backend_for, linear_backward

# Default number of K-tree segments: SEG = K / 8, so TP = 1, 2, 4, 8 all split K on
# segment boundaries (K = 4096: 512-element chains, multiples of every GEMM backend's K step).
TREE_SEGMENTS = 8
# Default number of vocabulary shards of the vocab-parallel log-prob (TP up to 8).
VOCAB_SHARDS = 8
# Vocabulary piece of a shard's chain (the last piece of a shard may be shorter).
VOCAB_CHUNK = 1024
# Token rows per step of the log-prob (memory only: every row's work is its own).
ROW_CHUNK = 128

TREE_OP = "tree_linear"
ROW_OP = "row_parallel_tree_linear"
SHARDED_OP = "sharded_linear_logprob"
VOCAB_OP = "vocab_parallel_linear_logprob"


def _is_pow2(n: object) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n > 0 and n & (n - 1) == 0


def _world(op: str, group: dist.ProcessGroup | None, distributed: bool) -> tuple[int, int]:
    """(rank, world size) of ``group``; (0, 1) for the one-process ops."""
    if not distributed:
        return 0, 1
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"rlkernels.{op}: torch.distributed is not initialized (call "
                           "torch.distributed.init_process_group first, or use the one-process op)")
    return dist.get_rank(group), dist.get_world_size(group)


def tree_segment(op: str, k_total: int, segments: int, world: int = 1) -> int:
    """SEG, the K-tree's segment length: ``k_total / segments``; refuses what the tree cannot cut."""
    if not _is_pow2(segments):
        raise ValueError(f"rlkernels.{op}: segments must be a power of two (the K-tree is a full binary "
                         f"tree), got {segments!r}")
    if segments % world:
        raise ValueError(f"rlkernels.{op}: a TP size of {world} does not divide segments={segments}: each "
                         f"rank must hold whole segments (TP must be a power of two <= {segments})")
    if k_total % segments:
        raise ValueError(f"rlkernels.{op}: K={k_total} is not divisible by segments={segments}; the K-tree "
                         f"cuts K into equal segments (pad K, or pick a power-of-two segments dividing it)")
    return k_total // segments


def tree_combine(parts: list[torch.Tensor]) -> torch.Tensor:
    """Pairwise tree sum, left to right: ((p0 + p1) + (p2 + p3)) + ...; len(parts) a power of two."""
    while len(parts) > 1:
        parts = [parts[i] + parts[i + 1] for i in range(0, len(parts), 2)]
    return parts[0]


def _combine_ranks(parts: list[torch.Tensor]) -> torch.Tensor:
    """The top levels of the K-tree over the gathered rank partials (rank order)."""
    return tree_combine(parts)


def _local_tree(gemm_backend, x2: torch.Tensor, w_nk: torch.Tensor, seg: int, n_seg: int) -> torch.Tensor:
    """The subtree over this rank's ``n_seg`` segments: fp32 (fp64 for fp64) [M, N].

    A stack of (level, partial): two partials of one level merge as soon as both exist,
    so at most log2(n_seg) + 1 partials are alive, and the additions are exactly the
    pairwise left-to-right tree's."""
    adt = accumulator_dtype(x2.dtype)
    stack: list[tuple[int, torch.Tensor]] = []
    for s in range(n_seg):
        k0, k1 = s * seg, (s + 1) * seg
        part = gemm_backend.gemm(x2[:, k0:k1], w_nk[:, k0:k1].t(), out_dtype=adt)
        level = 0
        while stack and stack[-1][0] == level:
            part = stack.pop()[1] + part
            level += 1
        stack.append((level, part))
    return stack[0][1]


def _validate_linear(op: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    V.require_float(op, "x", x)
    V.require_float(op, "weight", weight)
    if bias is not None:
        V.require_float(op, "bias", bias)
        V.require_ndim(op, "bias", bias, 1, 1)
    V.require_ndim(op, "x", x, 1)
    V.require_ndim(op, "weight", weight, 2, 2)
    V.require_same_device(op, x=x, weight=weight, bias=bias)
    V.require_same_dtype(op, x=x, weight=weight, bias=bias)
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"rlkernels.{op}: x {tuple(x.shape)} has K={x.shape[-1]} but weight "
                         f"{tuple(weight.shape)} ([N, K] layout) has K={weight.shape[1]}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"rlkernels.{op}: bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")


class _TreeLinearFunction(torch.autograd.Function):
    """y = x @ W^T + b by the K-tree; x and W hold this rank's K columns."""

    @staticmethod
    def forward(ctx, x, weight, bias, seg: int, n_seg: int, group, world: int, gemm_backend):  # type: ignore[override]
        K = x.shape[-1]
        x2 = x.reshape(x.shape[:-1].numel(), K)
        local = _local_tree(gemm_backend, x2, weight, seg, n_seg)
        if world > 1:
            gathered = [torch.empty_like(local) for _ in range(world)]
            dist.all_gather(gathered, local.contiguous(), group=group)
            local = _combine_ranks(gathered)
        if bias is not None:
            local = local + bias.to(local.dtype)
        ctx.save_for_backward(x2, weight, bias)
        ctx.gemm_backend, ctx.in_shape = gemm_backend, x.shape
        return local.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        # Everything is local: dY is replicated (the forward's output is), dX_rank = dY @ W_rank
        # is this rank's columns of dY @ W, dW_rank = dY^T @ X_rank its columns of dW; both
        # are the GEMM backend's chains over N and over tokens, the same bits as the one-process layer.
        x2, weight, bias = ctx.saved_tensors
        grads = linear_backward(ctx.gemm_backend, grad_out, x2, weight, bias, ctx.in_shape, ctx.needs_input_grad[:3],
                                use_main_grad=False)
        return (*grads, None, None, None, None, None)


def _tree_linear(op: str, x, weight, bias, segments, group, distributed: bool, backend: str | None):
    V.require_tensor(op, "x", x)
    V.require_tensor(op, "weight", weight)
    _validate_linear(op, x, weight, bias)
    _, world = _world(op, group, distributed)
    seg = tree_segment(op, weight.shape[1] * world, segments, world)
    gemm_backend = gemm_backend_for(x.device, backend)
    V.refuse_interpreted_bf16(op, gemm_backend.name, x)
    if x.dtype == torch.float64 and gemm_backend.name == "triton":
        raise ValueError(f"rlkernels.{op}: float64 runs on the torch backend only (RLKERNELS_BACKEND=torch)")
    return _TreeLinearFunction.apply(x, weight, bias, seg, segments // world, group, world, gemm_backend)


def tree_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                segments: int = TREE_SEGMENTS, backend: str | None = None) -> torch.Tensor:
    """``F.linear`` by the K-tree on one process: the bits of :func:`row_parallel_tree_linear` at any TP.

    x: [..., K]; weight: [N, K]; bias: [N] or None; one float dtype and device.
    ``segments``: a power of two dividing K (SEG = K / segments). Returns [..., N] in x's
    dtype, rounded once. Differentiable; the backward is that of :func:`rlkernels.linear`.
    These bits differ from :func:`rlkernels.linear`'s (one chain over K): an opt-in mode.
    """
    return _tree_linear(TREE_OP, x, weight, bias, segments, None, False, backend)


def row_parallel_tree_linear(x_shard: torch.Tensor, weight_shard: torch.Tensor, bias: torch.Tensor | None = None, *,
                             segments: int = TREE_SEGMENTS, group: dist.ProcessGroup | None = None,
                             backend: str | None = None) -> torch.Tensor:
    """Row-parallel linear (Megatron's RowParallelLinear layout) by the K-tree.

    Rank r of ``group`` (TP = t ranks, t a power of two dividing ``segments``) holds
    x_shard [..., K/t] and weight_shard [N, K/t], columns ``r*K/t .. (r+1)*K/t`` of x and
    W; bias [N] (replicated) or None. Returns the full y [..., N] on every rank, bitwise
    equal to :func:`tree_linear` on the whole x, W at the same ``segments``. The cross-rank
    step is an ``all_gather`` of fp32 [M, N] partials combined in rank order, never a
    collective sum. Backward is local (dX_rank, dW_rank; dbias replicated).
    """
    return _tree_linear(ROW_OP, x_shard, weight_shard, bias, segments, group, True, backend)


def plain_row_parallel_linear(x_shard: torch.Tensor, weight_shard: torch.Tensor, bias: torch.Tensor | None = None, *,
                              group: dist.ProcessGroup | None = None, backend: str | None = None) -> torch.Tensor:
    """The stock row-parallel layer, for comparison: one chain over the rank's K/t, then ``all_reduce``.

    Not TP-invariant (the chain length and the collective's sum order follow t); forward only.
    """
    _validate_linear("plain_row_parallel_linear", x_shard, weight_shard, bias)
    gemm_backend = gemm_backend_for(x_shard.device, backend)
    x2 = x_shard.reshape(x_shard.shape[:-1].numel(), x_shard.shape[-1])
    part = gemm_backend.gemm(x2, weight_shard.t(), out_dtype=accumulator_dtype(x2.dtype))
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(part, group=group)
    if bias is not None:
        part = part + bias.to(part.dtype)
    return part.to(x_shard.dtype).reshape(*x_shard.shape[:-1], weight_shard.shape[0])


# ---------------------------------------------------------------------------------------
# Vocab-parallel log-prob and entropy.
# ---------------------------------------------------------------------------------------

def shard_stats(gemm_backend, h2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tgt: torch.Tensor,
                v_lo: int, v_hi: int, vocab_offset: int, temperature: float, chunk: int) -> torch.Tensor:
    """Per-token statistics of one vocabulary shard: [4, N] (m, s, u, z_target), fp32 (fp64 for fp64).

    ``weight``/``bias`` hold local rows; the shard is local rows ``[v_lo, v_hi)``, i.e. global
    ids ``vocab_offset + v_lo ..``; ``tgt`` [N] global ids (-1: ignored). ``u`` is relative to
    the shard's max: sum e^(z-m) (z-m). z_target is 0 where the target is elsewhere. The
    logits of one [ROW_CHUNK, chunk] block at a time, an ascending chain over the chunks.
    """
    N = h2.shape[0]
    adt = accumulator_dtype(h2.dtype)
    out = torch.zeros(4, N, dtype=adt, device=h2.device)
    for r0 in range(0, N, ROW_CHUNK):
        h_rows, t = h2[r0:r0 + ROW_CHUNK], tgt[r0:r0 + ROW_CHUNK] - vocab_offset
        R = h_rows.shape[0]
        m = torch.full((R,), -math.inf, dtype=adt, device=h2.device)
        s = torch.zeros(R, dtype=adt, device=h2.device)
        u = torch.zeros_like(s)
        zt = torch.zeros_like(s)
        for v0 in range(v_lo, v_hi, chunk):
            v1 = min(v_hi, v0 + chunk)
            z = gemm_backend.gemm(h_rows, weight[v0:v1].t(), out_dtype=adt)
            if bias is not None:
                z.add_(bias[v0:v1].to(adt))
            if temperature != 1.0:
                z.div_(temperature)
            m, s, u, zt = online_softmax_step(m, s, u, zt, z, t, v0, v1)
        out[:, r0:r0 + R] = torch.stack([m, s, u, zt])
    return out


def merge_stats(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Statistics of the union of two vocab ranges, ``a`` on the left: [4, N] each.

    m = max(m_a, m_b); each side rescaled by e^(m_side - m); u rebased to the new max
    (u_side + (m_side - m) s_side). The target logit is taken from the stats by the caller.
    """
    m = torch.maximum(a[0], b[0])
    ea, eb = torch.exp(a[0] - m), torch.exp(b[0] - m)
    s = ea * a[1] + eb * b[1]
    u = ea * (a[2] + (a[0] - m) * a[1]) + eb * (b[2] + (b[0] - m) * b[1])
    return torch.stack([m, s, u, a[3]])


def _shard_order(gathered: list[torch.Tensor], per_rank: int) -> list[torch.Tensor]:
    """The gathered [per_rank, 4, N] blocks as one list of shard stats, rank 0's shards first."""
    return [block[i] for block in gathered for i in range(per_rank)]


def _merge_shards(stats: list[torch.Tensor], tgt: torch.Tensor,
                  ranges: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp, entropy) from the shards' stats (global id ranges ``ranges``), merged left to right."""
    acc = stats[0]
    zt = stats[0][3]  # 0 where the target is in another shard; replaced below
    for i in range(1, len(stats)):
        acc = merge_stats(acc, stats[i])
        inside = (tgt >= ranges[i][0]) & (tgt < ranges[i][1])
        zt = torch.where(inside, stats[i][3], zt)
    m, s, u = acc[0], acc[1], acc[2]
    log_s = torch.log(s)
    valid = tgt >= 0
    zero = torch.zeros_like(s)
    logp = torch.where(valid, (zt - m) - log_s, zero)
    ent = torch.where(valid, log_s - u / s, zero)
    return logp, ent


def _check_vocab_layout(op: str, vocab: int, shards: int, world: int, chunk: int) -> int:
    """The shard width V / shards; refuses a layout the contract cannot cut."""
    if not (isinstance(shards, int) and not isinstance(shards, bool) and shards > 0):
        raise ValueError(f"rlkernels.{op}: shards must be a positive int, got {shards!r}")
    if not (isinstance(chunk, int) and not isinstance(chunk, bool) and chunk > 0):
        raise ValueError(f"rlkernels.{op}: chunk must be a positive int, got {chunk!r}")
    if shards % world:
        raise ValueError(f"rlkernels.{op}: a TP size of {world} does not divide shards={shards}: each rank "
                         f"must hold whole vocabulary shards")
    if vocab % shards:
        raise ValueError(f"rlkernels.{op}: V={vocab} is not divisible by shards={shards}; the vocabulary is "
                         f"cut into equal shards (pad V, or pick shards dividing it)")
    return vocab // shards


def _refuse_grad(op: str, *tensors: torch.Tensor | None) -> None:
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        raise NotImplementedError(f"rlkernels.{op}: forward only (no backward yet); call it under "
                                  "torch.no_grad() or pass tensors that do not require grad")


def _prepare(op, hidden, target, ignore_index, backend):
    gemm_backend = gemm_backend_for(hidden.device, backend)
    V.refuse_interpreted_bf16(op, gemm_backend.name, hidden)
    if hidden.dtype == torch.float64 and gemm_backend.name == "triton":
        raise ValueError(f"rlkernels.{op}: float64 runs on the torch backend only (RLKERNELS_BACKEND=torch)")
    h2 = hidden.reshape(target.numel(), hidden.shape[-1])
    t1 = target.reshape(-1).to(torch.int64)
    tgt = torch.where(t1 == ignore_index, torch.full_like(t1, -1), t1)
    return gemm_backend, h2, tgt


def sharded_linear_logprob(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                           bias: torch.Tensor | None = None, *, shards: int = VOCAB_SHARDS, chunk: int = VOCAB_CHUNK,
                           temperature: float = 1.0, ignore_index: int = -100, return_entropy: bool = False,
                           backend: str | None = None):
    """One-process :func:`vocab_parallel_linear_logprob`: the same shards, the same merge, the same bits.

    Arguments as :func:`rlkernels.linear_logprob` (hidden [..., D], weight [V, D], target
    [...]) plus ``shards`` (dividing V) and ``chunk``. Returns logp [...] (and entropy)
    in fp32 (fp64 for fp64). Its bits may differ from ``linear_logprob``'s (another
    vocab cut): an opt-in mode. Forward only.
    """
    op = SHARDED_OP
    V.require_tensor(op, "hidden", hidden)
    V.require_tensor(op, "weight", weight)
    validate_logprob(hidden, weight, target, bias, temperature, ignore_index)
    _refuse_grad(op, hidden, weight, bias)
    vocab = weight.shape[0]
    width = _check_vocab_layout(op, vocab, shards, 1, chunk)
    gemm_backend, h2, tgt = _prepare(op, hidden, target, ignore_index, backend)
    ranges = [(i * width, (i + 1) * width) for i in range(shards)]
    stats = [shard_stats(gemm_backend, h2, weight, bias, tgt, lo, hi, 0, float(temperature), chunk)
             for lo, hi in ranges]
    logp, ent = _merge_shards(stats, tgt, ranges)
    logp, ent = logp.reshape(target.shape), ent.reshape(target.shape)
    return (logp, ent) if return_entropy else logp


def _validate_vocab_inputs(op: str, hidden: torch.Tensor, weight_shard: torch.Tensor, target: torch.Tensor,
                           bias_shard: torch.Tensor | None, world: int, temperature: float, ignore_index: int) -> int:
    """linear_logprob's checks with the head sharded: ids are checked against the whole V. Returns V."""
    V.require_float(op, "hidden", hidden)
    V.require_float(op, "weight_shard", weight_shard)
    if bias_shard is not None:
        V.require_tensor(op, "bias_shard", bias_shard)
        V.require_float(op, "bias_shard", bias_shard)
        V.require_ndim(op, "bias_shard", bias_shard, 1, 1)
    if target.dtype not in _INT_DTYPES:
        raise ValueError(f"rlkernels.{op}: target must be an integer tensor of token ids, got {target.dtype}")
    V.require_ndim(op, "hidden", hidden, 1)
    V.require_ndim(op, "weight_shard", weight_shard, 2, 2)
    V.require_same_device(op, hidden=hidden, weight_shard=weight_shard, target=target, bias_shard=bias_shard)
    V.require_same_dtype(op, hidden=hidden, weight_shard=weight_shard, bias_shard=bias_shard)
    local_v, dim = weight_shard.shape
    vocab = local_v * world
    if hidden.shape[-1] != dim:
        raise ValueError(f"rlkernels.{op}: hidden {tuple(hidden.shape)} has D={hidden.shape[-1]} but weight_shard "
                         f"{tuple(weight_shard.shape)} ([V/TP, D]) has D={dim}")
    if local_v == 0:
        raise ValueError(f"rlkernels.{op}: weight_shard has no vocabulary rows")
    if bias_shard is not None and tuple(bias_shard.shape) != (local_v,):
        raise ValueError(f"rlkernels.{op}: bias_shard must have shape ({local_v},), got {tuple(bias_shard.shape)}")
    if tuple(target.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"rlkernels.{op}: target shape {tuple(target.shape)} must equal hidden's leading "
                         f"shape {tuple(hidden.shape[:-1])}")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"rlkernels.{op}: temperature must be a finite number > 0, got {temperature!r}")
    t = target.reshape(-1)
    bad = (t != ignore_index) & ((t < 0) | (t >= vocab))
    if t.numel() and bool(bad.any()):
        pos = int(bad.nonzero()[0, 0])
        raise ValueError(f"rlkernels.{op}: target id {int(t[pos])} at flat position {pos} is outside "
                         f"[0, {vocab}) (V = {local_v} x TP {world}) and is not ignore_index={ignore_index}")
    return vocab


def vocab_parallel_linear_logprob(hidden: torch.Tensor, weight_shard: torch.Tensor, target: torch.Tensor,
                                  bias_shard: torch.Tensor | None = None, *, shards: int = VOCAB_SHARDS,
                                  chunk: int = VOCAB_CHUNK, temperature: float = 1.0, ignore_index: int = -100,
                                  return_entropy: bool = False, group: dist.ProcessGroup | None = None,
                                  backend: str | None = None):
    """``linear_logprob`` with the lm head sharded on the vocabulary over ``group`` (TP = t ranks).

    hidden [..., D] and target [...] (global ids) are replicated; rank r holds rows
    ``r*V/t .. (r+1)*V/t`` of the lm head, weight_shard [V/t, D] (bias_shard [V/t] or
    None), with t dividing ``shards`` and ``shards`` dividing V. Each rank computes its
    shards' statistics ([shards/t, 4, N] fp32), they are all-gathered, and every rank
    merges all shards left to right in shard order: logp (and entropy) [...] on every
    rank, bitwise equal to :func:`sharded_linear_logprob` with the same shards/chunk.
    Forward only.
    """
    op = VOCAB_OP
    V.require_tensor(op, "hidden", hidden)
    V.require_tensor(op, "weight_shard", weight_shard)
    V.require_tensor(op, "target", target)
    rank, world = _world(op, group, True)
    vocab = _validate_vocab_inputs(op, hidden, weight_shard, target, bias_shard, world, temperature, ignore_index)
    _refuse_grad(op, hidden, weight_shard, bias_shard)
    width = _check_vocab_layout(op, vocab, shards, world, chunk)
    gemm_backend, h2, tgt = _prepare(op, hidden, target, ignore_index, backend)
    per_rank = shards // world
    offset = rank * per_rank * width
    local = torch.stack([shard_stats(gemm_backend, h2, weight_shard, bias_shard, tgt, i * width, (i + 1) * width,
                                     offset, float(temperature), chunk) for i in range(per_rank)])
    if world > 1:
        gathered = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(gathered, local.contiguous(), group=group)
    else:
        gathered = [local]
    stats = _shard_order(gathered, per_rank)
    logp, ent = _merge_shards(stats, tgt, [(i * width, (i + 1) * width) for i in range(shards)])
    logp, ent = logp.reshape(target.shape), ent.reshape(target.shape)
    return (logp, ent) if return_entropy else logp
