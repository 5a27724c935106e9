"""The fixed reduction shape every cross-rank combine of ``rlkernels.parallel`` uses.

A pairwise binary tree over a power-of-two number of partials, left to right:
``((p0 + p1) + (p2 + p3)) + ...``. A rank that holds a contiguous, power-of-two run of
the leaves builds that subtree locally (:func:`stack_tree`); the ranks' subtrees are
then gathered (``all_gather``: an exact copy, never a collective sum) and every rank
runs the top levels in rank order (:func:`combine_across_ranks`, which splits that
work by columns). Same leaves, same tree: the
same bits at every TP size that divides the leaf count.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch
import torch.distributed as dist


def is_pow2(n: object) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n > 0 and n & (n - 1) == 0


def leaf_width(op: str, dim: str, total: int, name: str, leaves: object, world: int, why: str) -> int:
    """``total / leaves``: the width of each of the tree's equal leaves along ``dim`` (K, V);
    refuses a leaf count that is not a power of two (``why``: what the tree combines), that a
    TP size of ``world`` does not divide (each rank holds whole leaves), or that does not
    divide ``total``."""
    if not is_pow2(leaves):
        raise ValueError(f"rlkernels.{op}: {name} must be a power of two ({why}), got {leaves!r}")
    if leaves % world:
        raise ValueError(f"rlkernels.{op}: a TP size of {world} does not divide {name}={leaves}: each rank "
                         f"must hold whole {name} (TP must be a power of two <= {leaves})")
    if total % leaves:
        raise ValueError(f"rlkernels.{op}: {dim}={total} is not divisible by {name}={leaves}; {dim} is cut "
                         f"into equal {name} (pad {dim}, or pick a power-of-two {name} dividing it)")
    return total // leaves


def process_group_world(op: str, group: dist.ProcessGroup | None, distributed: bool) -> tuple[int, int]:
    """(rank, world size) of ``group``; (0, 1) for the one-process ops."""
    if not distributed:
        return 0, 1
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"rlkernels.{op}: torch.distributed is not initialized (call "
                           "torch.distributed.init_process_group first, or use the one-process op)")
    return dist.get_rank(group), dist.get_world_size(group)


def all_gather_cat(local: torch.Tensor, group: dist.ProcessGroup | None, world: int, dim: int) -> torch.Tensor:
    """The ranks' ``local`` tensors side by side along ``dim``, in rank order (copies, never a sum)."""
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def tree_combine(parts: list[torch.Tensor]) -> torch.Tensor:
    """Pairwise tree sum, left to right; ``len(parts)`` a power of two. Adds into ``parts``' tensors."""
    while len(parts) > 1:
        parts = [parts[i].add_(parts[i + 1]) for i in range(0, len(parts), 2)]
    return parts[0]


def stack_tree(parts: Iterable[torch.Tensor]) -> torch.Tensor:
    """The pairwise tree over a power-of-two stream of partials, each consumed as it comes.

    A stack of (level, partial): two partials of one level merge as soon as both exist,
    so at most log2(count) + 1 partials are alive, and the additions are exactly
    :func:`tree_combine`'s."""
    stack: list[tuple[int, torch.Tensor]] = []
    for part in parts:
        level = 0
        while stack and stack[-1][0] == level:
            part = stack.pop()[1].add_(part)
            level += 1
        stack.append((level, part))
    if len(stack) != 1:
        raise ValueError(f"stack_tree: the number of partials must be a power of two (levels left: "
                         f"{[lvl for lvl, _ in stack]})")
    return stack[0][1]


def _combine_ranks(parts: list[torch.Tensor]) -> torch.Tensor:
    """The top levels of the tree over the gathered rank partials (rank order)."""
    return tree_combine(parts)


def combine_across_ranks(local: torch.Tensor, group: dist.ProcessGroup | None, rank: int, world: int,
                         finish: Callable[[torch.Tensor, int], torch.Tensor]) -> torch.Tensor:
    """The tree's top levels over every rank's ``local`` [M, N] fp32 subtree, finished, on every rank.

    ``finish(root_columns, c0)`` turns the root's columns ``c0 .. c0 + width`` (fp32) into
    the result's (adding a bias, rounding once); it is elementwise, so finishing column
    chunks gives the bits of finishing the whole. Rank r combines column chunk r of every
    rank's subtree, in rank order (one ``all_to_all``, an exact copy), finishes it, and the
    finished chunks are gathered (``all_gather``). Each rank receives (t - 1)/t of one fp32
    partial and of one finished result, not t - 1 whole fp32 partials."""
    if world == 1:
        return finish(local, 0)
    M, N = local.shape
    width = -(-N // world)  # equal chunks (gloo's all_to_all wants them); the last may be padded
    padded = local if width * world == N else torch.nn.functional.pad(local, (0, width * world - N))
    send = [padded[:, i * width:(i + 1) * width].contiguous() for i in range(world)]
    recv = [torch.empty_like(send[0]) for _ in range(world)]
    dist.all_to_all(recv, send, group=group)
    mine = finish(_combine_ranks(recv), rank * width).contiguous()
    chunks = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(chunks, mine, group=group)
    return torch.cat(chunks, dim=1)[:, :N]
