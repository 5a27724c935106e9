"""The training triad on the CPU: dX invariance, micro-batch-invariant dW/dbias, Linear."""
from __future__ import annotations

import pytest
import torch

import rlkernels
from rlkernels import contract, reference, testing

from ..conftest import cpu_backend_cases, randn

TB = rlkernels.TOKEN_BLOCK


def _layer(k, n, dtype, gen, bias=True, main_grad=True):
    lin = rlkernels.Linear(k, n, bias=bias, dtype=dtype)
    with torch.no_grad():
        lin.weight.copy_(randn(n, k, generator=gen, scale=k ** -0.5))
        if bias:
            lin.bias.copy_(randn(n, generator=gen))
    if main_grad:
        lin.weight.main_grad = torch.zeros(n, k, dtype=torch.float32)
        if bias:
            lin.bias.main_grad = torch.zeros(n, dtype=torch.float32)
    return lin


def _backward(lin, x, dy):
    x = x.detach().requires_grad_(True)
    lin(x).backward(dy)
    return x.grad


@pytest.mark.parametrize("backend,dtype", cpu_backend_cases())
@pytest.mark.parametrize("with_bias", [False, True])
def test_microbatch_accumulation_equals_one_batch(backend, dtype, with_bias, gen, monkeypatch):
    monkeypatch.setenv("RLKERNELS_BACKEND", backend)
    T, K, N = 5 * TB, 37, 29
    x, dy = randn(T, K, dtype=dtype, generator=gen), randn(T, N, dtype=dtype, generator=gen)
    one = _layer(K, N, dtype, gen, bias=with_bias)
    mb = _layer(K, N, dtype, gen, bias=with_bias)
    mb.load_state_dict(one.state_dict())
    start = randn(N, K, generator=gen)  # accumulation starts from the current main_grad
    one.weight.main_grad.copy_(start)
    mb.weight.main_grad.copy_(start)
    _backward(one, x, dy)
    for lo, hi in ((0, TB), (TB, 3 * TB), (3 * TB, 4 * TB), (4 * TB, T)):
        _backward(mb, x[lo:hi], dy[lo:hi])
    assert torch.equal(mb.weight.main_grad, one.weight.main_grad)
    assert one.weight.grad is None  # main_grad took the gradient
    ref_w = start.double() + reference.matmul_ref(dy.t(), x)
    contract.check("matmul", torch.float32, one.weight.main_grad, ref_w)
    if with_bias:
        assert torch.equal(mb.bias.main_grad, one.bias.main_grad)
        contract.check("matmul", torch.float32, one.bias.main_grad, dy.double().sum(0))


@pytest.mark.parametrize("backend,dtype", cpu_backend_cases())
def test_grad_without_main_grad_and_dx_invariance(backend, dtype, gen, monkeypatch):
    monkeypatch.setenv("RLKERNELS_BACKEND", backend)
    T, K, N = 23, 40, 19
    lin = _layer(K, N, dtype, gen, main_grad=False)
    x, dy = randn(T, K, dtype=dtype, generator=gen), randn(T, N, dtype=dtype, generator=gen)
    dx = _backward(lin, x, dy)
    assert lin.weight.grad.dtype == dtype and lin.bias.grad.dtype == dtype
    contract.check("matmul", dtype, lin.weight.grad, reference.matmul_ref(dy.t(), x))
    contract.check("matmul", dtype, lin.bias.grad, dy.double().sum(0))
    contract.check("matmul", dtype, dx, reference.matmul_ref(dy, lin.weight))
    # dX rows depend on their own dY row only.
    testing.assert_batch_invariant(lambda rows: _backward(lin, x[: rows.shape[0]], rows), dy, sizes=[1, 2, 7, 16])


def test_gradcheck_fp64_torch_backend(gen):
    x = randn(6, 5, dtype=torch.float64, generator=gen).requires_grad_()
    w = randn(4, 5, dtype=torch.float64, generator=gen).requires_grad_()
    b = randn(4, dtype=torch.float64, generator=gen).requires_grad_()
    assert torch.autograd.gradcheck(lambda x, w, b: rlkernels.linear(x, w, b, backend="torch"), (x, w, b))
    bm = randn(5, 3, dtype=torch.float64, generator=gen).requires_grad_()
    assert torch.autograd.gradcheck(lambda x, bm: rlkernels.matmul(x, bm, backend="torch"), (x, bm))


def test_matmul_layout_main_grad_and_bias_only(gen):
    # b in [K, N] layout accumulates into its own main_grad; bias-only grads work too.
    x, b = randn(16, 6, generator=gen), randn(6, 5, generator=gen).requires_grad_()
    b.main_grad = torch.zeros(6, 5)
    rlkernels.matmul(x, b).sum().backward()
    contract.check("matmul", torch.float32, b.main_grad, reference.matmul_ref(x.t(), torch.ones(16, 5)))
    w, bias = randn(5, 6, generator=gen), randn(5, generator=gen).requires_grad_()
    dy = randn(16, 5, generator=gen)
    rlkernels.linear(x, w, bias).backward(dy)
    contract.check("matmul", torch.float32, bias.grad, dy.double().sum(0))


def test_linear_module_matches_nn_linear_and_shares_parameters(gen):
    ref = torch.nn.Linear(12, 7)
    lin = rlkernels.Linear.from_torch(ref)
    assert lin.weight is ref.weight and lin.bias is ref.bias
    assert lin.state_dict().keys() == ref.state_dict().keys()
    x = randn(3, 4, 12, generator=gen)
    contract.check("matmul", torch.float32, lin(x), reference.linear_ref(x, ref.weight, ref.bias))
    with torch.no_grad():
        assert not lin(x).requires_grad
    with pytest.raises(TypeError, match="expected nn.Linear"):
        rlkernels.Linear.from_torch(torch.nn.Conv1d(1, 1, 1))


def test_autocast_and_compile(gen):
    lin = _layer(16, 8, torch.float32, gen, main_grad=False)
    x = randn(5, 16, generator=gen)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = lin(x)
    assert y.dtype == torch.bfloat16
    compiled = torch.compile(lin, backend="aot_eager")
    assert torch.equal(compiled(x), lin(x))


def test_bad_main_grad_is_refused(gen):
    lin = _layer(8, 4, torch.float32, gen, main_grad=False)
    lin.weight.main_grad = torch.zeros(4, 8, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"weight.main_grad must be float32"):
        lin(randn(3, 8, generator=gen)).sum().backward()
