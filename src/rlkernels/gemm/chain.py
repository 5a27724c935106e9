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


# ATen runs an elementwise op on the calling thread below at::internal::GRAIN_SIZE
# (32768) elements and splits it over its OpenMP threads from there. A chain's ops are
# small and many; split, each one waits for every worker thread, and on a loaded CPU
# a descheduled worker stalls it for a scheduler time slice (2 cores loaded by two busy
# loops: a 104 x 64 x 128 chain took 44-64 ms with its multiplies split, 0.35-1.1 ms
# without). Blocks of products stay below the split, so a chain whose output is smaller
# runs on the calling thread throughout.
SERIAL_ELEMENTS = 32767


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _converted(x: torch.Tensor, dtype: torch.dtype, *, dense: bool) -> torch.Tensor:
    """``x`` in ``dtype``, copied in one pass into a row-major layout when it must be
    converted, or when ``dense`` and its last dim is strided (so elementwise ops
    stream it); otherwise ``x`` itself. The conversion only ever widens (bf16/fp16 to
    fp32, anything to the fp32/fp64 accumulator), which is exact.
    """
    if x.dtype == dtype and (not dense or x.dim() == 0 or x.shape[-1] <= 1 or x.stride(-1) == 1):
        return x
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    out.copy_(x)
    return out


def chain_matmul(a: torch.Tensor, b: torch.Tensor, *, acc: torch.Tensor | None = None,
                 chunk_elements: int = 1 << 24, block_elements: int = SERIAL_ELEMENTS) -> torch.Tensor:
    """``acc + a @ b`` as one ascending chain over K per element.

    a: [..., M, K], b: [..., K, N] (broadcastable batch dims), any float dtype.
    acc: optional fp32/fp64 [..., M, N] start value, updated in place and returned.
    Returns the fp32 (fp64 for fp64 inputs) accumulator. Rows are processed in
    chunks of at most ``chunk_elements`` outputs to bound temporaries; chunking is
    over M, never over K.

    Speed without touching the chain: both operands are converted to the
    accumulator dtype once per call (not per k), and ``b`` is copied k-major
    ([K, ..., 1, N], dense rows) when its rows are strided, as a transposed weight's
    are (the multiply then gathered every element). For small outputs one broadcast
    multiply writes the products of a block of kb values, [kb, ..., M, N], at most
    ``block_elements`` of them (by default fewer than ATen splits over threads, see
    ``SERIAL_ELEMENTS``, which also keeps them in cache beside the accumulator; large
    outputs get kb = 1, where a bigger block only moves the products out of cache),
    and each add reads one contiguous slice: fewer calls.
    Every product is still its own rounded multiply and every step its own rounded
    add into the accumulator, in ascending k, so the bits are those of one multiply
    and one add per k.
    """
    K = a.shape[-1]
    adt = accumulator_dtype(torch.promote_types(a.dtype, b.dtype))
    out_shape = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1])
    if acc is None:
        acc = torch.zeros(out_shape, dtype=adt, device=a.device)
    M, N = a.shape[-2], b.shape[-1]
    if acc.numel() == 0 or K == 0:
        return acc
    nbatch = acc.dim() - 2
    batch = max(1, acc.numel() // max(1, M * N))
    rows = max(1, min(M, chunk_elements // max(1, batch * N)))
    kb = max(1, min(K, block_elements // max(1, batch * rows * N)))
    # b as [K, 1.., *b_batch, 1, N]: left-padded batch dims broadcast against acc's.
    b_k = _converted(b.movedim(-2, 0), adt, dense=True).unsqueeze(-2)
    b_k = b_k.reshape((K,) + (1,) * (nbatch - (b.dim() - 2)) + tuple(b_k.shape[1:]))
    # The products take the accumulator's dtype, as ``torch.mul(..., out=acc-like)``.
    prod = torch.empty((kb,) + tuple(acc.shape[:-2]) + (rows, N), dtype=acc.dtype, device=acc.device)
    for m0 in range(0, M, rows):
        m1 = min(M, m0 + rows)
        a_k = _converted(a[..., m0:m1, :].movedim(-1, 0), adt, dense=False).unsqueeze(-1)
        a_k = a_k.reshape((K,) + (1,) * (nbatch - (a.dim() - 2)) + tuple(a_k.shape[1:]))
        view = acc[..., m0:m1, :]
        # A contiguous working copy (exact) so every add streams; written back at the end.
        work = view if view.is_contiguous() else view.contiguous()
        # The last, shorter chunk takes the front of the same buffer, still contiguous.
        prod_rows = prod if m1 - m0 == rows else prod.view(-1)[:kb * work.numel()].view((kb,) + tuple(work.shape))
        # Views made once per chunk, not per k: at kb = 1 the Python-side slicing
        # otherwise costs as much as a small multiply.
        slices = prod_rows.unbind(0)
        for a_blk, b_blk in zip(a_k.split(kb), b_k.split(kb)):
            n = a_blk.shape[0]
            torch.mul(a_blk, b_blk, out=prod_rows if n == kb else prod_rows[:n])
            for p_k in slices[:n]:
                work.add_(p_k)
        if work is not view:
            view.copy_(work)
    return acc


def chain_sum(x: torch.Tensor, dim: int = -1, *, acc: torch.Tensor | None = None) -> torch.Tensor:
    """Ascending-order sum over ``dim`` (kept out), accumulated in fp32 (fp64 for fp64).

    x: any float dtype and shape; acc: optional start value of x's shape without
    ``dim``, updated in place and returned. ``x`` is converted once and laid out with
    ``dim`` first, so each step adds one contiguous slice.
    """
    dim = dim % x.dim() if x.dim() else 0
    adt = accumulator_dtype(x.dtype)
    if acc is None:
        shape = x.shape[:dim] + x.shape[dim + 1:]
        acc = torch.zeros(shape, dtype=adt, device=x.device)
    if x.shape[dim] == 0 or acc.numel() == 0:
        return acc
    xs = x.movedim(dim, 0)
    if xs.dtype != adt or not xs.is_contiguous():
        xs = torch.empty(xs.shape, dtype=adt, device=x.device).copy_(xs)
    for x_i in xs.unbind(0):
        acc.add_(x_i)
    return acc
