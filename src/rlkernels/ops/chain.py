"""Ascending accumulation chains built from single IEEE elementwise ops.

This is the core of the ``torch`` backend. CPU BLAS and ATen's reductions pick
blocking and threading from the *whole* problem shape, so a row's bits depend on
how many rows share the call (measured: rows of ``a[:m] @ b`` differ from
``(a @ b)[:m]`` for m in {1, 2, 7} on torch 2.13 CPU). Here every output element
is ``fl(...fl(fl(p_0) + p_1)... + p_{K-1})`` with ``p_k`` an individually rounded
product, accumulated in ascending k in fp32 (fp64 for fp64 inputs). Each step is
one elementwise multiply and one elementwise add, and an elementwise op applies
the same single rounding to every element whatever the tensor's size, layout or
vectorisation, so an element's bits are a function of its own inputs alone.

A sequential chain also ignores zero padding at either end (``fl(0 + x) == x``),
which is what makes left- and right-padded attention invariant on this backend.
"""
from __future__ import annotations

import torch


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def chain_matmul(a: torch.Tensor, b: torch.Tensor, *, acc: torch.Tensor | None = None,
                 chunk_elements: int = 1 << 24) -> torch.Tensor:
    """``acc + a @ b`` as one ascending chain over K per element.

    a: [..., M, K], b: [..., K, N] (broadcastable batch dims), any float dtype.
    acc: optional fp32/fp64 [..., M, N] start value, updated in place and returned.
    Returns the fp32 (fp64 for fp64 inputs) accumulator. Rows are processed in
    chunks to bound temporaries; chunking is over M, never over K.
    """
    K = a.shape[-1]
    adt = accumulator_dtype(torch.promote_types(a.dtype, b.dtype))
    out_shape = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1])
    if acc is None:
        acc = torch.zeros(out_shape, dtype=adt, device=a.device)
    M, N = a.shape[-2], b.shape[-1]
    if acc.numel() == 0 or K == 0:
        return acc
    batch = max(1, acc.numel() // max(1, M * N))
    rows = max(1, min(M, chunk_elements // max(1, batch * N)))
    b_acc = b.to(adt)
    for m0 in range(0, M, rows):
        a_rows = a[..., m0:m0 + rows, :].to(adt)
        acc_rows = acc[..., m0:m0 + rows, :]
        prod = torch.empty_like(acc_rows)
        for k in range(K):
            torch.mul(a_rows[..., :, k:k + 1], b_acc[..., k:k + 1, :], out=prod)
            acc_rows.add_(prod)
    return acc


def chain_sum(x: torch.Tensor, dim: int = -1, *, acc: torch.Tensor | None = None) -> torch.Tensor:
    """Ascending-order sum over ``dim`` (kept out), accumulated in fp32 (fp64 for fp64)."""
    dim = dim % x.dim() if x.dim() else 0
    adt = accumulator_dtype(x.dtype)
    if acc is None:
        shape = x.shape[:dim] + x.shape[dim + 1:]
        acc = torch.zeros(shape, dtype=adt, device=x.device)
    for i in range(x.shape[dim]):
        acc.add_(x.select(dim, i).to(adt))
    return acc

