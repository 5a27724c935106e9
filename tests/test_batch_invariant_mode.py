"""set_batch_invariant_mode: stock torch calls become bitwise batch-invariant; state restores."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rlkernels import testing
from rlkernels.batch_invariant import is_batch_invariant_mode_enabled, set_batch_invariant_mode
from rlkernels.registry import triton_interpret

from .conftest import HAS_CUDA, randn


@pytest.fixture(autouse=True)
def _mode_off_after():
    yield
    set_batch_invariant_mode(False)


def _w(*shape, seed=1, dtype=torch.float32, device="cpu"):
    return randn(*shape, generator=torch.Generator().manual_seed(seed), scale=shape[0] ** -0.5,
                 dtype=dtype, device=device)


def _cases(dtype, device="cpu"):
    """name -> (fn of rows, rows): every call the mode promises to cover."""
    k = 96
    w, b = _w(k, 80, dtype=dtype, device=device), _w(80, seed=2, dtype=dtype, device=device)
    w3 = _w(5, 16, 24, seed=3, dtype=dtype, device=device)
    x = randn(40, k, generator=torch.Generator().manual_seed(0), dtype=dtype, device=device)
    return {
        "mm": (lambda r: torch.mm(r, w), x),
        "matmul_2d": (lambda r: r @ w, x),
        "addmm": (lambda r: torch.addmm(b, r, w), x),
        "addmm_scaled": (lambda r: torch.addmm(b, r, w, beta=0.5, alpha=2.0), x),
        "linear_2d": (lambda r: F.linear(r, w.t(), b), x),
        "linear_3d": (lambda r: F.linear(r.reshape(-1, 3, 32), w[:32].t(), b), x[:, :96]),
        "matmul_3d_2d": (lambda r: r.reshape(-1, 6, 16) @ w[:16], x),
        "bmm": (lambda r: torch.bmm(r.reshape(-1, 6, 16), r.reshape(-1, 16, 6)), x),
        "matmul_4d": (lambda r: r.reshape(-1, 2, 3, 16) @ r.reshape(-1, 2, 16, 3), x),
        "matmul_broadcast": (lambda r: r.reshape(-1, 1, 6, 16) @ w3, x),
        "baddbmm": (lambda r: torch.baddbmm(r.reshape(-1, 6, 16)[:, :, :6], r.reshape(-1, 6, 16), r.reshape(-1, 16, 6)), x),
        "softmax": (lambda r: torch.softmax(r * 3, -1), x),
        "softmax_fp32_out": (lambda r: torch.softmax(r, -1, dtype=torch.float32), x),
        "log_softmax": (lambda r: F.log_softmax(r * 3, dim=-1), x),
        "softmax_dim1_3d": (lambda r: torch.softmax(r.reshape(-1, 6, 16), dim=1), x),
        "mean_last": (lambda r: r.pow(2).mean(-1, keepdim=True), x),
        "mean_dims": (lambda r: r.reshape(-1, 6, 16).mean(dim=(1, 2)), x),
        "rms_norm_hf": (lambda r: r * torch.rsqrt(r.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(r.dtype), x),
        "silu": (lambda r: F.silu(r * 4), x),
    }


CASES = list(_cases(torch.float32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", CASES)
def test_mode_makes_calls_invariant(name, dtype):
    fn, x = _cases(dtype)[name]
    with set_batch_invariant_mode():
        testing.assert_batch_invariant(fn, x, sizes=[1, 2, 7, 13, 39])
        testing.assert_chunk_invariant(fn, x, chunks=[5, 1, 17, 17])
        testing.assert_padding_invariant(fn, x[:9], before=4, after=11)
        testing.assert_order_invariant(fn, x)
        got = fn(x)
    want = fn(x)  # stock, after the mode is gone
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = 2e-6 if dtype == torch.float32 else 2e-2
    assert testing.rel_error(got, want) <= tol


@pytest.mark.skipif(not triton_interpret(), reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("name", ["mm", "addmm", "linear_3d", "bmm", "softmax", "log_softmax", "mean_last"])
def test_mode_triton_backend_interpreter(name, monkeypatch):
    # The CUDA code path of the overrides (Triton GEMM + fixed-tile row sums), run by the interpreter.
    monkeypatch.setenv("RLKERNELS_BACKEND", "triton")
    fn, x = _cases(torch.float32)[name]
    x = x[:12]
    with set_batch_invariant_mode():
        testing.assert_batch_invariant(fn, x, sizes=[1, 2, 7])
        testing.assert_order_invariant(fn, x)
        got = fn(x)
    assert testing.rel_error(got, fn(x)) <= 2e-6


def test_stock_mm_is_not_invariant():
    # Sanity: the check above can fail -- stock CPU BLAS changes rows with the batch size.
    # Which sizes differ depends on the BLAS build and the CPU (MKL on an AVX-512 host:
    # only m = 1, a GEMV; other hosts also m = 2, 3, 7), so the check asks for any of them.
    a = randn(64, 512, generator=torch.Generator().manual_seed(0))
    b = _w(512, 300)
    sizes = [1, 2, 3, 7, 16, 17, 33]
    with pytest.raises(testing.InvarianceError):
        testing.assert_batch_invariant(lambda r: r @ b, a, sizes=sizes)
    with set_batch_invariant_mode():
        testing.assert_batch_invariant(lambda r: r @ b, a, sizes=sizes)


def test_enter_exit_restore_and_nesting():
    a = randn(64, 512, generator=torch.Generator().manual_seed(0))
    b = _w(512, 300)
    stock = a @ b
    assert not is_batch_invariant_mode_enabled()
    with set_batch_invariant_mode():
        ours = a @ b
        assert is_batch_invariant_mode_enabled()
        with set_batch_invariant_mode():
            assert is_batch_invariant_mode_enabled()
        assert is_batch_invariant_mode_enabled()
        assert torch.equal(a @ b, ours)
        with set_batch_invariant_mode(False):
            assert not is_batch_invariant_mode_enabled()
            assert torch.equal(a @ b, stock)
        assert is_batch_invariant_mode_enabled()
        assert torch.equal(a @ b, ours)
    assert not is_batch_invariant_mode_enabled()
    assert torch.equal(a @ b, stock)
    assert not torch.equal(stock, ours)  # the two paths really differ here (else this test proves nothing)


def test_restore_after_exception():
    with pytest.raises(RuntimeError, match="boom"):
        with set_batch_invariant_mode():
            raise RuntimeError("boom")
    assert not is_batch_invariant_mode_enabled()


def test_plain_call():
    set_batch_invariant_mode(True)
    assert is_batch_invariant_mode_enabled()
    set_batch_invariant_mode(True)
    set_batch_invariant_mode(False)
    assert not is_batch_invariant_mode_enabled()


def test_backward_goes_through_the_mode():
    x = randn(24, 64, generator=torch.Generator().manual_seed(0))
    w1, w2 = _w(64, 48).t().contiguous(), _w(48, 32, seed=2).t().contiguous()
    b1 = _w(48, seed=3)

    def grads(rows):
        r = rows.clone().requires_grad_()
        p1, p2 = w1.clone().requires_grad_(), w2.clone().requires_grad_()
        y = F.log_softmax(F.linear(F.silu(F.linear(r, p1, b1)), p2), -1)
        loss = (y * torch.linspace(-1, 1, 32)).sum()
        gx, g1, g2 = torch.autograd.grad(loss, (r, p1, p2))
        return gx, g1, g2

    with set_batch_invariant_mode():
        testing.assert_batch_invariant(lambda r: grads(r)[0], x, sizes=[1, 2, 7, 23])
        ours = grads(x)
        testing.assert_deterministic(lambda r: grads(r), x, runs=2)
    stock = grads(x)
    for o, s in zip(ours, stock):
        assert testing.rel_error(o, s) < 1e-5


def test_other_dtypes_still_work():
    with set_batch_invariant_mode():
        a64 = torch.randn(5, 7, dtype=torch.float64)
        assert torch.allclose(a64 @ a64.t(), torch.tensor(a64.numpy() @ a64.numpy().T), rtol=1e-12)
        ai = torch.randint(-5, 5, (4, 6))
        assert torch.equal(ai @ ai.t(), torch.tensor(ai.numpy() @ ai.numpy().T))
        h = torch.randn(3, 9).to(torch.float16)
        assert torch.softmax(h, -1, dtype=torch.float32).dtype == torch.float32
        assert torch.softmax(torch.randn(4, 0), -1).shape == (4, 0)
        assert torch.mean(torch.randn(4, 5), dim=0, dtype=torch.float64).dtype == torch.float64
        big = torch.randn(3, 7000)
        assert abs(big.mean().item() - big.double().mean().item()) < 1e-6
        assert (big.mean(dim=1).double() - big.double().mean(dim=1)).abs().max() < 1e-6  # a sequential fp32 chain: abs error ~ sqrt(n) eps
        assert torch.isnan(torch.randn(0, 3).mean())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("name", CASES)
def test_mode_gpu(name, dtype):
    fn, x = _cases(dtype, device="cuda")[name]
    with set_batch_invariant_mode():
        testing.assert_batch_invariant(fn, x, sizes=[1, 2, 7, 13, 39])
        testing.assert_chunk_invariant(fn, x, chunks=[5, 1, 17, 17])
        testing.assert_order_invariant(fn, x)
        testing.assert_deterministic(fn, x)
        got = fn(x)
    want = fn(x)
    tol = 2e-6 if dtype == torch.float32 else 2e-2
    assert testing.rel_error(got, want) <= tol


@pytest.mark.gpu
def test_mode_gpu_large_gemm_batch_invariance():
    a = torch.randn(1031, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, 768, device="cuda", dtype=torch.bfloat16) / 32
    with set_batch_invariant_mode():
        testing.assert_batch_invariant(lambda r: r @ w, a, sizes=[1, 7, 128, 129, 1000])
