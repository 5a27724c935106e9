"""The LSE order on the torch backend, and the log-softmax that follows it.

The LSE order (``kernels.lse``) is the one order in which the token distribution's
log-sum-exp is taken: splits of ``LSE_SPLIT`` columns, tiles of ``LSE_TILE`` inside a
split with each tile's mass summed in fixed point, splits merged in ascending order.
The LM head's statistics pass (:mod:`.statistics`) runs it over logits it computes tile
by tile; :func:`log_softmax_rows` runs it over logits given as a tensor, so
``log_softmax(z)`` at a token equals ``linear_logprob``'s log-prob of that token bit for
bit, on each backend.

The torch functions here mirror the Triton ones op for op; their ``exp``/``log`` are
ATen's, so the two backends give close but not identical bits.
"""
from __future__ import annotations

import math

import torch

from ...kernels._triton import cdiv
from ...kernels.lse import (LSE_SPLIT, LSE_TILE, MASS_SCALE, MASS_UNIT, log_softmax_out_kernel,
                            lse_partial_kernel)
from ...runtime.launcher import cached_launcher

__all__ = ["LSE_SPLIT", "LSE_TILE", "tile_mass", "lse_step", "merge_splits", "log_softmax_rows"]

# Rows per program of the Triton log-softmax (memory-bound; any count gives the same bits).
LOG_SOFTMAX_ROWS = 4

_launch_partial = cached_launcher(lse_partial_kernel) if lse_partial_kernel is not None else None
_launch_out = cached_launcher(log_softmax_out_kernel) if log_softmax_out_kernel is not None else None


def tree_rowsum(x: torch.Tensor) -> torch.Tensor:
    """Sum over dim 1 by a pairwise tree of elementwise adds (shape-fixed order per row).

    ATen's reductions pick their order from the whole tensor; an elementwise add
    rounds each element alone, so a row's sum depends on its own values only.
    """
    while x.shape[1] > 1:
        half = x.shape[1] // 2
        folded = x[:, :half] + x[:, half:2 * half]
        x = torch.cat([folded, x[:, 2 * half:]], dim=1) if x.shape[1] % 2 else folded
    return x[:, 0]


def tile_mass(e: torch.Tensor) -> torch.Tensor:
    """Row sums of ``e`` [R, <= LSE_TILE] (values in [-1, 1]): fp32 in fixed point, exact
    in any order (as the Triton kernels); fp64 (the torch backend's fp64 path) by a
    pairwise tree, whose order is fixed by the tile's width."""
    if e.dtype == torch.float64:
        return tree_rowsum(e)
    q = (e * MASS_SCALE).to(torch.int64).sum(dim=1)
    # e * 0 is 0, or NaN where e is: NaN reaches the row's mass, as in a float sum.
    return q.to(e.dtype) * MASS_UNIT + (e * 0.0).sum(dim=1)


def lse_step(m: torch.Tensor, s: torch.Tensor, z: torch.Tensor):
    """One tile of the LSE order: (m_new, m_ref, alpha, e, d, mass, s_new); see ``kernels.lse.lse_step``."""
    m_new = torch.maximum(m, z.amax(dim=1))
    m_ref = torch.where(m_new == -math.inf, torch.zeros_like(m_new), m_new)
    d = z - m_ref[:, None]
    e = torch.exp(d)
    alpha = torch.exp(m - m_ref)
    mass = tile_mass(e)
    return m_new, m_ref, alpha, e, d, mass, alpha * s + mass


def merge_splits(m: torch.Tensor, s: torch.Tensor, u: torch.Tensor | None = None):
    """(max, mass[, u]) [R] of per-split (m, s[, u]) [n_split, R], merged in ascending split
    order as the Triton combine merges them."""
    mx = m.amax(dim=0)  # max is exact: any order is fine
    # A row that keeps no logit at all (its max -inf) merges to s = 0, not exp(-inf + inf).
    ref = torch.where(mx == -math.inf, torch.zeros_like(mx), mx)
    total = torch.zeros_like(mx)
    u_total = torch.zeros_like(mx) if u is not None else None
    for k in range(m.shape[0]):
        a = torch.exp(m[k] - ref)
        if u is not None:
            # A split with no logit kept has s = 0 and m = -inf: its term is 0, not (-inf) * 0.
            u_total = u_total + a * (u[k] + torch.where(s[k] > 0, m[k] - mx, 0.0) * s[k])
        total = total + a * s[k]
    return (mx, total) if u is None else (mx, total, u_total)


def _torch_log_softmax_rows(x: torch.Tensor) -> torch.Tensor:
    M, R = x.shape
    n_split = cdiv(R, LSE_SPLIT)
    m_parts = torch.empty(n_split, M, dtype=x.dtype, device=x.device)
    s_parts = torch.empty_like(m_parts)
    for k in range(n_split):
        m = torch.full((M,), -math.inf, dtype=x.dtype, device=x.device)
        s = torch.zeros(M, dtype=x.dtype, device=x.device)
        for c0 in range(k * LSE_SPLIT, min(R, (k + 1) * LSE_SPLIT), LSE_TILE):
            m, _, _, _, _, _, s = lse_step(m, s, x[:, c0:c0 + LSE_TILE])
        m_parts[k], s_parts[k] = m, s
    mx, total = merge_splits(m_parts, s_parts)
    return (x - mx[:, None]) - torch.log(total)[:, None]


def _triton_log_softmax_rows(x: torch.Tensor) -> torch.Tensor:
    M, R = x.shape
    n_split = cdiv(R, LSE_SPLIT)
    m_parts = torch.empty(n_split, M, dtype=torch.float32, device=x.device)
    s_parts = torch.empty_like(m_parts)
    out = torch.empty_like(x)
    grid = (cdiv(M, LOG_SOFTMAX_ROWS), n_split)
    _launch_partial(grid, (x, m_parts, s_parts, M, R, x.stride(0)),
                    dict(ROWS=LOG_SOFTMAX_ROWS, TILE=LSE_TILE, SPLIT=LSE_SPLIT),
                    num_warps=4, num_stages=2)
    _launch_out(grid, (x, m_parts, s_parts, out, M, R, n_split, x.stride(0), out.stride(0)),
                dict(ROWS=LOG_SOFTMAX_ROWS, TILE=LSE_TILE, SPLIT=LSE_SPLIT), num_warps=4, num_stages=2)
    return out


def log_softmax_rows(x: torch.Tensor, backend: str) -> torch.Tensor:
    """log_softmax over dim 1 of ``x`` [M, R] (fp32, contiguous rows) in the LSE order, on
    the ``"torch"`` or ``"triton"`` backend: out = (x - max) - log(mass)."""
    if x.shape[0] == 0 or x.shape[1] == 0:
        return torch.empty_like(x)
    if backend == "triton":
        return _triton_log_softmax_rows(x)
    return _torch_log_softmax_rows(x)
