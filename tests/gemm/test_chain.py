"""The torch backend's chains (gemm.chain) against a slow, obviously correct reference.

``chain_matmul`` and ``chain_sum`` lay their operands out and block their calls for
speed; the bits of every output element must still be those of the plain per-k
loop below: product ``fl(a_k * b_k)`` rounded on its own, added to the accumulator
in ascending k, one rounded add per step, starting from zero (or ``acc``).
Bits are compared as integer patterns, so NaN payloads and signed zeros count.
"""
from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rlkernels.gemm.chain import accumulator_dtype, chain_matmul, chain_sum

from ..conftest import randn

SIZES = (1, 7, 33, 100)
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_INT_OF = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16,
           torch.bfloat16: torch.int16}


def reference_chain_matmul(a: torch.Tensor, b: torch.Tensor, acc: torch.Tensor | None = None) -> torch.Tensor:
    """One multiply and one add per k, in ascending k, over the whole output."""
    adt = accumulator_dtype(torch.promote_types(a.dtype, b.dtype))
    if acc is None:
        shape = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1])
        acc = torch.zeros(shape, dtype=adt)
    a_, b_ = a.to(adt), b.to(adt)
    for k in range(a.shape[-1]):
        p = torch.empty_like(acc)
        torch.mul(a_[..., :, k:k + 1], b_[..., k:k + 1, :], out=p)
        acc.add_(p)
    return acc


def reference_chain_sum(x: torch.Tensor, dim: int, acc: torch.Tensor | None = None) -> torch.Tensor:
    adt = accumulator_dtype(x.dtype)
    if acc is None:
        shape = list(x.shape)
        del shape[dim]
        acc = torch.zeros(shape, dtype=adt)
    for i in range(x.shape[dim]):
        acc.add_(x.select(dim, i).to(adt))
    return acc


def assert_same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.dtype, want.shape)
    g, w = got.contiguous().view(_INT_OF[got.dtype]), want.contiguous().view(_INT_OF[want.dtype])
    if not torch.equal(g, w):
        bad = (g != w).nonzero()[0].tolist()
        raise AssertionError(f"bits differ at {bad}: {got[tuple(bad)].item()!r} vs {want[tuple(bad)].item()!r}")


def _with_specials(x: torch.Tensor) -> torch.Tensor:
    """Sprinkle signed zeros (fl(0 + -0) is +0: the chain's start matters) and small values."""
    x = x.clone()
    flat = x.view(-1)
    flat[::5] = -0.0
    flat[1::11] = 0.0
    flat[2::13] *= 1e-3
    return x


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("with_acc", [False, True], ids=["zero", "acc"])
def test_chain_matmul_bits_odd_shapes(dtype, with_acc, gen):
    for M, K, N in itertools.product(SIZES, SIZES, SIZES):
        a = _with_specials(randn(M, K, dtype=dtype, generator=gen))
        b = randn(K, N, dtype=dtype, generator=gen)
        acc = randn(M, N, dtype=accumulator_dtype(dtype), generator=gen) if with_acc else None
        want = reference_chain_matmul(a, b, None if acc is None else acc.clone())
        # Small chunk and block budgets reach the row chunks, the k blocks and their tails.
        for chunk, block in ((1 << 24, 1 << 20), (3 * N, 5 * N), (N, 1)):
            got = chain_matmul(a, b, acc=None if acc is None else acc.clone(), chunk_elements=chunk,
                               block_elements=block)
            assert_same_bits(got, want)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("a_batch,b_batch", [((2, 3), ()), ((), (2,)), ((2, 1), (3,)), ((4,), (4,))],
                         ids=["a_batched", "b_batched", "broadcast", "bmm"])
def test_chain_matmul_bits_batched(dtype, a_batch, b_batch, gen):
    for M, K, N in ((7, 33, 1), (33, 7, 100), (1, 100, 7)):
        a = _with_specials(randn(*a_batch, M, K, dtype=dtype, generator=gen))
        b = randn(*b_batch, K, N, dtype=dtype, generator=gen)
        want = reference_chain_matmul(a, b)
        for chunk, block in ((1 << 24, 1 << 20), (5 * N, 40 * N), (1, 1)):
            assert_same_bits(chain_matmul(a, b, chunk_elements=chunk, block_elements=block), want)
        acc = randn(*want.shape, dtype=want.dtype, generator=gen)
        assert_same_bits(chain_matmul(a, b, acc=acc.clone(), chunk_elements=2 * N, block_elements=3 * N),
                         reference_chain_matmul(a, b, acc.clone()))


def test_chain_matmul_bits_layouts_and_mixed_dtypes(gen):
    # A transposed weight (linear, linear_logprob), a transposed a, an expanded b,
    # a non-contiguous acc updated in place, mixed input dtypes, an fp64 acc for fp32.
    w = randn(100, 33, generator=gen)
    a = randn(7, 33, generator=gen)
    assert_same_bits(chain_matmul(a, w.t()), reference_chain_matmul(a, w.t()))
    at = randn(33, 7, generator=gen).t()
    assert_same_bits(chain_matmul(at, w.t(), block_elements=50), reference_chain_matmul(at, w.t()))
    be = randn(33, 1, generator=gen).expand(33, 9)
    assert_same_bits(chain_matmul(a, be), reference_chain_matmul(a, be))
    base = randn(100, 7, generator=gen)
    acc_t = base.clone().t()
    out = chain_matmul(a, w.t(), acc=acc_t, chunk_elements=300)
    assert out is acc_t
    assert_same_bits(acc_t, reference_chain_matmul(a, w.t(), base.clone().t()))
    a16, w32 = a.half(), w.t()
    assert_same_bits(chain_matmul(a16, w32), reference_chain_matmul(a16, w32))
    a64 = a.double()
    assert_same_bits(chain_matmul(a64, w.t()), reference_chain_matmul(a64, w.t()))
    acc64 = randn(7, 100, dtype=torch.float64, generator=gen)
    assert_same_bits(chain_matmul(a, w.t(), acc=acc64.clone(), block_elements=150),
                     reference_chain_matmul(a, w.t(), acc64.clone()))


def test_chain_matmul_bits_nonfinite(gen):
    a = randn(33, 100, generator=gen)
    b = randn(100, 7, generator=gen)
    a[0, 3] = float("inf")
    a[1, 5] = float("nan")
    b[10, 2] = float("-inf")
    a[2] *= 1e30
    b[:, 4] *= 1e30
    assert_same_bits(chain_matmul(a, b, block_elements=7 * 33 * 4), reference_chain_matmul(a, b))


def test_chain_matmul_empty(gen):
    for dtype in DTYPES:
        adt = accumulator_dtype(dtype)
        # K = 0: the sum of nothing, zeros (or acc untouched).
        out = chain_matmul(randn(7, 0, dtype=dtype), randn(0, 33, dtype=dtype))
        assert_same_bits(out, torch.zeros(7, 33, dtype=adt))
        acc = randn(7, 33, dtype=adt, generator=gen)
        assert chain_matmul(randn(7, 0, dtype=dtype), randn(0, 33, dtype=dtype), acc=acc) is acc
        # Empty M, empty N, empty batch.
        assert chain_matmul(randn(0, 5, dtype=dtype), randn(5, 3, dtype=dtype)).shape == (0, 3)
        assert chain_matmul(randn(4, 5, dtype=dtype), randn(5, 0, dtype=dtype)).shape == (4, 0)
        assert chain_matmul(randn(0, 4, 5, dtype=dtype), randn(5, 3, dtype=dtype)).shape == (0, 4, 3)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_chain_sum_bits(dtype, gen):
    for shape in ((1,), (100,), (7, 33), (33, 7, 100), (2, 1, 7)):
        x = _with_specials(randn(*shape, dtype=dtype, generator=gen))
        for dim in range(-len(shape), len(shape)):
            want = reference_chain_sum(x, dim)
            assert_same_bits(chain_sum(x, dim), want)
            acc = torch.randn(want.shape, generator=gen).to(want.dtype)
            assert_same_bits(chain_sum(x, dim, acc=acc.clone()), reference_chain_sum(x, dim, acc.clone()))
    xt = randn(33, 7, dtype=dtype, generator=gen).t()
    assert_same_bits(chain_sum(xt, -1), reference_chain_sum(xt, -1))
    assert_same_bits(chain_sum(randn(7, 0, dtype=dtype), -1), torch.zeros(7, dtype=accumulator_dtype(dtype)))
    assert chain_sum(randn(0, 7, dtype=dtype), -1).shape == (0,)


def test_reference_comparison_sees_a_changed_chain(gen):
    # The comparison is sharp enough to see a reordered chain: the same products
    # added in descending k differ from the ascending chain somewhere.
    a = randn(33, 100, generator=gen)
    b = randn(100, 33, generator=gen)
    descending = reference_chain_matmul(a.flip(-1), b.flip(-2))
    with pytest.raises(AssertionError, match="bits differ"):
        assert_same_bits(chain_matmul(a, b), descending)


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def test_chain_matmul_multiplies_blocks_of_k():
    # One broadcast multiply per block of k values, not one per k; still one add per k.
    a, b = randn(16, 48), randn(48, 32)
    with _CountOps() as ops:
        chain_matmul(a, b)
    assert ops.counts.get("mul", 0) == 1, ops.counts
    assert ops.counts.get("add_", 0) == 48, ops.counts
    with _CountOps() as ops:
        chain_matmul(a, b, block_elements=16 * 32 * 8)
    assert ops.counts.get("mul", 0) == 48 // 8, ops.counts


class _OpSizes(TorchDispatchMode):
    """The element count of every multiply's and add's result."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: dict[str, list[int]] = {"mul": [], "add_": []}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in self.sizes:
            self.sizes[name].append(out.numel())
        return out


@pytest.mark.parametrize("m,k,n", [(16, 64, 32), (104, 64, 128), (104, 128, 64), (64, 100, 128), (1, 64, 512)])
def test_small_chain_ops_run_on_the_calling_thread(m, k, n):
    # ATen splits an elementwise op over threads from 32768 elements (at::internal::GRAIN_SIZE);
    # on a loaded CPU each split op waits for descheduled workers. A chain whose output is
    # smaller than that must keep every multiply and add below it.
    a, b = randn(m, k), randn(k, n)
    with _OpSizes() as ops:
        chain_matmul(a, b)
    assert ops.sizes["mul"] and ops.sizes["add_"]
    assert max(ops.sizes["mul"] + ops.sizes["add_"]) < 32768, {k: max(v) for k, v in ops.sizes.items()}


def test_chain_sum_converts_once():
    x = randn(8, 50, dtype=torch.bfloat16)
    with _CountOps() as ops:
        chain_sum(x, -1)
    conversions = sum(ops.counts.get(name, 0) for name in ("_to_copy", "copy_", "clone", "contiguous"))
    assert conversions <= 1, ops.counts
    assert ops.counts.get("add_", 0) == 50, ops.counts


class _MulOperands(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.b_strides: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ == "mul":
            self.b_strides.append(args[1].stride(-1))
        return func(*args, **(kwargs or {}))


def test_chain_matmul_reads_a_transposed_weight_densely():
    # linear / linear_logprob pass weight.t(): [K, N] with N strided by K. The
    # multiplies must read b's rows densely (one conversion up front, not a gather per k).
    x, w = randn(8, 64), randn(96, 64)
    with _MulOperands() as ops:
        chain_matmul(x, w.t())
    assert ops.b_strides and set(ops.b_strides) == {1}, ops.b_strides


def test_bench_cpu_suite_runs_small(tmp_path):
    # `rlkernels bench cpu` on tiny shapes: rows with times and ratios, a JSON record.
    import argparse
    import json

    from rlkernels.bench import cpu

    assert cpu.NEEDS_CUDA is False
    parser = argparse.ArgumentParser()
    cpu.add_arguments(parser)
    args = parser.parse_args(["--repeats", "1", "--matmul", "7,33,5", "--logprob", "3,16,50"])
    args.quick, args.json = False, str(tmp_path / "cpu.json")
    rows = cpu.run(args)
    assert [r["op"] for r in rows] == ["matmul", "linear_logprob"]
    assert all(r["row_invariant"] and r["ratio"] > 0 for r in rows)
    doc = json.loads((tmp_path / "cpu.json").read_text())
    assert doc["environment"]["device"] == "cpu" and doc["cpu"]["cores"] >= 1
    with pytest.raises(SystemExit, match="--matmul"):
        cpu.run(parser.parse_args(["--matmul", "7,0,5"]))
