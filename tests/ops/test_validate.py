"""Refusals shared by every op: bf16 on the interpreted Triton backend, argument names, dtypes."""
from __future__ import annotations

import pytest
import torch

import rlkernels
from rlkernels.registry import BackendUnavailableError

from ..conftest import interpreter_only, randn


_BF16_CALLS = {
    "matmul": lambda a, b, w, t: rlkernels.matmul(a, b),
    "linear": lambda a, b, w, t: rlkernels.linear(a, w),
    "bmm": lambda a, b, w, t: rlkernels.bmm(a.reshape(2, 2, 8), b.expand(2, 8, 5)),
    "linear_logprob": lambda a, b, w, t: rlkernels.linear_logprob(a, w, t),
}


@interpreter_only
@pytest.mark.parametrize("op", list(_BF16_CALLS))
@pytest.mark.parametrize("requires_grad", [False, True])
def test_bf16_is_refused_on_the_interpreted_triton_backend(op, requires_grad, monkeypatch, gen):
    # The interpreter's tl.dot returns values near 1e10 for bf16 operands: refuse, naming the op.
    monkeypatch.setenv("RLKERNELS_BACKEND", "triton")
    a = randn(4, 8, dtype=torch.bfloat16, generator=gen).requires_grad_(requires_grad)
    b = randn(8, 5, dtype=torch.bfloat16, generator=gen)
    w = randn(5, 8, dtype=torch.bfloat16, generator=gen)
    t = torch.tensor([0, 1, 2, 4])
    name = "linear" if op == "linear" else op
    with pytest.raises(BackendUnavailableError, match=rf"rlkernels\.{name}: bfloat16 .*TRITON_INTERPRET=1"):
        _BF16_CALLS[op](a, b, w, t)


@interpreter_only
def test_fp16_still_runs_on_the_interpreted_triton_backend(monkeypatch, gen):
    monkeypatch.setenv("RLKERNELS_BACKEND", "triton")
    a, b = randn(4, 8, dtype=torch.float16, generator=gen), randn(8, 5, dtype=torch.float16, generator=gen)
    want = a.double() @ b.double()
    assert (rlkernels.matmul(a, b).double() - want).abs().max() < 1e-2


def test_bf16_runs_on_the_torch_backend(gen):
    a, b = randn(4, 8, dtype=torch.bfloat16, generator=gen), randn(8, 5, dtype=torch.bfloat16, generator=gen)
    got = rlkernels.matmul(a, b, backend="torch")
    assert (got.double() - a.double() @ b.double()).abs().max() < 5e-2


def test_linear_errors_name_x_and_weight(gen):
    x, w = randn(3, 4, generator=gen), randn(2, 4, generator=gen)
    with pytest.raises(ValueError, match=r"rlkernels\.linear: .*x torch\.float32, weight torch\.float64"):
        rlkernels.linear(x, w.double())
    with pytest.raises(ValueError, match=r"rlkernels\.linear: .*x torch\.float32, weight torch\.float32, bias torch\.float64"):
        rlkernels.linear(x, w, torch.zeros(2, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"rlkernels\.matmul: .*a torch\.float32, b torch\.float64"):
        rlkernels.matmul(x, w.t().double())


def test_out_dtype_must_be_a_float_torch_dtype(gen):
    a, b = randn(3, 4, generator=gen), randn(4, 2, generator=gen)
    with pytest.raises(TypeError, match=r"rlkernels\.matmul: out_dtype must be a torch\.dtype .*torch\.float32, not the string"):
        rlkernels.matmul(a, b, out_dtype="float32")
    with pytest.raises(ValueError, match=r"rlkernels\.matmul: out_dtype must be one of .* got torch\.int32"):
        rlkernels.matmul(a, b, out_dtype=torch.int32)


@pytest.mark.parametrize("call", ["matmul", "linear", "bmm"])
def test_meta_tensors_give_shapes_like_stock(call):
    # Shape inference on the meta device (as torch.compile's fake tensors do) works like stock.
    a, b = torch.empty(3, 4, device="meta"), torch.empty(4, 2, device="meta")
    if call == "matmul":
        got, want = rlkernels.matmul(a, b), a @ b
    elif call == "linear":
        got, want = rlkernels.linear(a, b.t()), torch.nn.functional.linear(a, b.t())
    else:
        a3, b3 = a.expand(5, 3, 4), b.expand(5, 4, 2)
        got, want = rlkernels.bmm(a3, b3), torch.bmm(a3, b3)
    assert got.device.type == "meta" and got.shape == want.shape and got.dtype == want.dtype


def test_linear_logprob_on_meta_tensors_gives_shapes():
    h, w = torch.empty(3, 4, device="meta"), torch.empty(5, 4, device="meta")
    t = torch.empty(3, dtype=torch.long, device="meta")
    lp, ent = rlkernels.linear_logprob(h, w, t, return_entropy=True)
    assert lp.device.type == "meta" and lp.shape == (3,) and ent.shape == (3,) and lp.dtype == torch.float32


_META_CALLS = {
    "matmul": (lambda t, dt: rlkernels.matmul(t(2, 4, 8, dt), t(8, 5, dt), t(5, dt)),
               lambda t, dt: t(2, 4, 8, dt) @ t(8, 5, dt) + t(5, dt)),
    "linear": (lambda t, dt: rlkernels.linear(t(4, 8, dt), t(5, 8, dt), t(5, dt)),
               lambda t, dt: torch.nn.functional.linear(t(4, 8, dt), t(5, 8, dt), t(5, dt))),
    "bmm": (lambda t, dt: rlkernels.bmm(t(3, 4, 8, dt), t(3, 8, 5, dt)),
            lambda t, dt: torch.bmm(t(3, 4, 8, dt), t(3, 8, 5, dt))),
    "rms_norm": (lambda t, dt: rlkernels.rms_norm(t(4, 8, dt), t(8, dt)),
                 lambda t, dt: torch.nn.functional.rms_norm(t(4, 8, dt), (8,), t(8, dt))),
    "softmax": (lambda t, dt: rlkernels.softmax(t(4, 8, dt), 0),
                lambda t, dt: torch.softmax(t(4, 8, dt), 0)),
    "log_softmax": (lambda t, dt: rlkernels.log_softmax(t(4, 8, dt), -1, dtype=torch.float32),
                    lambda t, dt: torch.log_softmax(t(4, 8, dt), -1, dtype=torch.float32)),
}


@pytest.mark.parametrize("forced", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("op", list(_META_CALLS))
def test_meta_tensors_give_stocks_shapes_whatever_backend_is_forced(op, dtype, forced, monkeypatch):
    # Meta tensors hold no values: no backend's bits are at stake, so a forced backend
    # must not refuse them (stock gives the shapes); the torch backend propagates them.
    monkeypatch.setenv("RLKERNELS_BACKEND", forced)

    def t(*shape):
        *shape, dt = shape
        return torch.empty(*shape, device="meta", dtype=dt)

    ours, stock = (f(t, dtype) for f in _META_CALLS[op])
    assert ours.device.type == "meta" and ours.shape == stock.shape and ours.dtype == stock.dtype
    h = t(4, 8, dtype).requires_grad_()
    lp, ent = rlkernels.linear_logprob(h, t(50, 8, dtype), t(4, torch.int64), temperature=0.7, return_entropy=True)
    assert lp.device.type == "meta" and lp.shape == (4,) and ent.shape == (4,)
    lp.sum().backward()
    assert h.grad.shape == h.shape and h.grad.device.type == "meta"
