"""The invariance kit itself: bitwise comparisons (NaN, signed zeros) and loud argument errors."""
from __future__ import annotations

import collections

import pytest
import torch

from rlkernels import testing
from rlkernels.testing import InvarianceError


def _with_nan(n: int = 8, d: int = 5) -> torch.Tensor:
    x = torch.randn(n, d, generator=torch.Generator().manual_seed(0))
    x[2, 1] = float("nan")
    x[5, 4] = float("nan")
    return x


def _nan_with_payload(payload: int) -> torch.Tensor:
    return torch.tensor([0x7FC00000 | payload], dtype=torch.int32).view(torch.float32)


# --- bitwise comparison -------------------------------------------------------------------

@pytest.mark.parametrize("check", ["batch", "chunk", "padding", "order", "determinism"])
def test_nan_with_identical_bits_passes(check):
    x = _with_nan()
    fn = lambda r: r * 1.0  # noqa: E731
    {"batch": lambda: testing.assert_batch_invariant(fn, x),
     "chunk": lambda: testing.assert_chunk_invariant(fn, x, chunks=[3, 0, 5]),
     "padding": lambda: testing.assert_padding_invariant(fn, x),
     "order": lambda: testing.assert_order_invariant(fn, x),
     "determinism": lambda: testing.assert_deterministic(fn, x, runs=2)}[check]()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64, torch.complex64, torch.bool,
                                   torch.int32])
def test_other_dtypes_and_zero_dim_outputs_pass(dtype):
    x = _with_nan().to(dtype) if dtype != torch.bool else _with_nan() > 0
    testing.assert_batch_invariant(lambda r: (r.clone(), r[:, :0]), x, sizes=[0, 1, 8])
    testing.assert_deterministic(lambda r: (r.clone(), r.sum()), x, runs=2)


def test_nan_with_different_payload_is_caught():
    x = torch.zeros(4, 1)

    def fn(r: torch.Tensor) -> torch.Tensor:
        # Row 0's NaN payload depends on the batch size: values "match", bits do not.
        out = r.clone()
        out[0] = _nan_with_payload(r.shape[0])
        return out

    with pytest.raises(InvarianceError, match=r"rows differ: \[0\].*bits only"):
        testing.assert_batch_invariant(fn, x, sizes=[2])


def test_signed_zero_is_caught():
    def fn(r: torch.Tensor) -> torch.Tensor:
        out = r.clone()
        if r.shape[0] == 2:
            out[1] = -out[1]  # 0.0 -> -0.0: equal values, different bits
        return out

    with pytest.raises(InvarianceError, match=r"1 of 2 rows differ: \[1\].*bits only"):
        testing.assert_batch_invariant(fn, torch.zeros(4, 3), sizes=[2])


def test_non_invariant_fn_still_raises():
    w = torch.randn(64, 7, generator=torch.Generator().manual_seed(1))

    def fn(r: torch.Tensor) -> torch.Tensor:
        return r @ w + r.shape[0] * 1e-3 * (torch.arange(r.shape[0])[:, None] == 3)

    x = torch.randn(10, 64, generator=torch.Generator().manual_seed(2))
    with pytest.raises(InvarianceError, match=r"rows differ: \[3\]; max \|delta\|"):
        testing.assert_batch_invariant(fn, x, sizes=[5])
    with pytest.raises(InvarianceError, match="chunk invariance"):
        testing.assert_chunk_invariant(fn, x, chunks=[4, 6])
    with pytest.raises(InvarianceError, match="run-to-run"):
        calls = iter(range(10))
        testing.assert_deterministic(lambda r: r + next(calls), x, runs=2)


def test_namedtuple_outputs():
    Out = collections.namedtuple("Out", "a b")
    x = _with_nan()
    testing.assert_batch_invariant(lambda r: Out(r * 2, r[:, 0]), x, sizes=[1, 3])
    testing.assert_chunk_invariant(lambda r: Out(r * 2, r[:, 0]), x, chunks=[3, 5])


def test_output_hash_of_zero_dim_and_nan():
    assert testing.output_hash(torch.tensor(1.5)) != testing.output_hash(torch.tensor(2.5))
    assert testing.output_hash(_nan_with_payload(1)) != testing.output_hash(_nan_with_payload(2))


# --- argument errors ----------------------------------------------------------------------

@pytest.mark.parametrize("sizes,bad", [([-3], "-3"), ([1, 9], "9"), ([2.0], "2.0"), ([True], "True")])
def test_bad_sizes_rejected(sizes, bad):
    with pytest.raises(ValueError, match=rf"assert_batch_invariant: sizes entry.*8 rows.*got {bad}"):
        testing.assert_batch_invariant(lambda r: r, torch.zeros(8, 2), sizes=sizes)


def test_empty_sizes_and_empty_x_rejected():
    with pytest.raises(ValueError, match="sizes is empty"):
        testing.assert_batch_invariant(lambda r: r, torch.zeros(8, 2), sizes=[])
    for check in (testing.assert_batch_invariant, testing.assert_chunk_invariant,
                  testing.assert_padding_invariant, testing.assert_order_invariant):
        with pytest.raises(ValueError, match=r"x has no rows \(shape \(0, 2\)\)"):
            check(lambda r: r, torch.zeros(0, 2))


@pytest.mark.parametrize("runs", [0, -1])
def test_bad_runs_rejected(runs):
    with pytest.raises(ValueError, match=rf"assert_deterministic: runs must be >= 1, got {runs}"):
        testing.assert_deterministic(lambda r: r, torch.zeros(3, 2), runs=runs)


def test_runs_one_without_processes_rejected():
    with pytest.raises(ValueError, match="runs=1 with processes=0 compares nothing"):
        testing.assert_deterministic(lambda r: r, torch.zeros(3, 2), runs=1)
    with pytest.raises(ValueError, match="processes must be >= 0, got -1"):
        testing.assert_deterministic(lambda r: r, torch.zeros(3, 2), processes=-1)


def test_bad_chunks_and_padding_rejected():
    x = torch.zeros(6, 2)
    with pytest.raises(ValueError, match=r"chunks entry must be >= 0, got -1"):
        testing.assert_chunk_invariant(lambda r: r, x, chunks=[4, -1, 3])
    with pytest.raises(ValueError, match=r"sum to 5, not len\(x\) = 6"):
        testing.assert_chunk_invariant(lambda r: r, x, chunks=[2, 3])
    with pytest.raises(ValueError, match="before must be >= 0, got -2"):
        testing.assert_padding_invariant(lambda r: r, x, before=-2)


@pytest.mark.parametrize("out,what", [
    (1.5, "got float"),
    ({"a": 1}, "got dict"),
    ((torch.zeros(3), "x"), "got str"),
])
@pytest.mark.parametrize("check", ["batch", "chunk", "padding", "order", "determinism"])
def test_non_tensor_output_gets_type_error(check, out, what):
    x = torch.zeros(3, 2)
    fn = lambda r: out  # noqa: E731
    call = {"batch": lambda: testing.assert_batch_invariant(fn, x),
            "chunk": lambda: testing.assert_chunk_invariant(fn, x),
            "padding": lambda: testing.assert_padding_invariant(fn, x),
            "order": lambda: testing.assert_order_invariant(fn, x),
            "determinism": lambda: testing.assert_deterministic(fn, x, runs=2)}[check]
    with pytest.raises(TypeError, match=rf"rlkernels\.testing.*fn must return a tensor or a tuple/list of tensors.*"
                                        rf"{what}"):
        call()


@pytest.mark.parametrize("check", ["batch", "chunk", "padding", "order"])
def test_zero_dim_or_rowless_output_gets_type_error(check):
    x = torch.zeros(3, 2)
    call = {"batch": testing.assert_batch_invariant, "chunk": testing.assert_chunk_invariant,
            "padding": testing.assert_padding_invariant, "order": testing.assert_order_invariant}[check]
    with pytest.raises(TypeError, match="with x's rows as dim 0.*0-dim tensor"):
        call(lambda r: r.sum(), x)
    with pytest.raises(TypeError, match=r"with x's rows as dim 0; given (\d+) rows, output 1 has shape \(2, \1\)"):
        call(lambda r: (r, torch.zeros(2, r.shape[0])), x)


def test_x_must_have_rows():
    with pytest.raises(TypeError, match="0-dim tensor"):
        testing.assert_batch_invariant(lambda r: r, torch.tensor(1.0))
    with pytest.raises(TypeError, match="x must be a tensor"):
        testing.assert_order_invariant(lambda r: r, [1, 2])
