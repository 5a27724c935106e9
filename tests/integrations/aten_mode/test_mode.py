"""set_batch_invariant_mode: stock torch calls become bitwise batch-invariant; state restores."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rlkernels import testing
from rlkernels.integrations.aten_mode import is_batch_invariant_mode_enabled, set_batch_invariant_mode
from rlkernels._env import triton_interpret

from ...conftest import HAS_CUDA, randn


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


# ---------------------------------------------------------------- the overrides keep stock's checks


def _t(*shape, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed + 7 * len(shape))
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).to(device)
    return torch.randint(-3, 4, shape, generator=g).to(dtype).to(device)


def _nonfinite_rows(device):
    inf, nan = float("inf"), float("nan")
    return torch.tensor([[1.0, inf, 2.0], [-inf, -inf, -inf], [1.0, nan, 2.0], [-inf, 1.0, 2.0], [0.5, 1.0, 2.0]],
                        device=device)


def _odd_inputs(device):
    """name -> a call of an overridden op on inputs stock rejects, or on unusual ones it accepts."""
    f64, i64, c64 = torch.float64, torch.int64, torch.complex64
    t = lambda *s, dtype=torch.float32: _t(*s, dtype=dtype, device=device)  # noqa: E731
    return {
        "mm_inner_mismatch": lambda: torch.mm(t(3, 4), t(5, 2)),
        "matmul_inner_mismatch": lambda: t(3, 4) @ t(5, 2),
        "matmul_3d_inner_mismatch": lambda: t(2, 3, 4) @ t(5, 2),
        "addmm_inner_mismatch": lambda: torch.addmm(t(2), t(3, 4), t(5, 2)),
        "linear_weight_mismatch": lambda: F.linear(t(3, 4), t(2, 5)),
        "linear_bias_mismatch": lambda: F.linear(t(3, 4), t(2, 4), t(3)),
        "linear_1d_input": lambda: F.linear(t(4), t(2, 4), t(2)),
        "bmm_inner_mismatch": lambda: torch.bmm(t(2, 3, 4), t(2, 5, 2)),
        "bmm_batch_mismatch": lambda: torch.bmm(t(2, 3, 4), t(3, 4, 2)),
        "bmm_2d": lambda: torch.bmm(t(3, 4), t(4, 2)),
        "baddbmm_base_mismatch": lambda: torch.baddbmm(t(2, 3, 3), t(2, 3, 4), t(2, 4, 2)),
        "baddbmm_dtype_mismatch": lambda: torch.baddbmm(t(2, 3, 2, dtype=f64), t(2, 3, 4), t(2, 4, 2)),
        "mm_fp32_fp64": lambda: torch.mm(t(3, 4), t(4, 2, dtype=f64)),
        "matmul_fp32_fp64": lambda: t(3, 4) @ t(4, 2, dtype=f64),
        "bmm_fp32_fp64": lambda: torch.bmm(t(2, 3, 4), t(2, 4, 2, dtype=f64)),
        "addmm_bias_dtype": lambda: torch.addmm(t(2, dtype=f64), t(3, 4), t(4, 2)),
        "addmm_bias_column": lambda: torch.addmm(t(3, 1), t(3, 4), t(4, 2)),
        "addmm_bias_bad_broadcast": lambda: torch.addmm(t(3), t(3, 4), t(4, 2)),
        "addmm_beta0_nan_bias": lambda: torch.addmm(torch.full((2,), float("nan"), device=device), t(3, 4), t(4, 2),
                                                    beta=0),
        "mm_1d": lambda: torch.mm(t(4), t(4, 2)),
        "mm_int64": lambda: torch.mm(t(3, 4, dtype=i64), t(4, 2, dtype=i64)),
        "mm_bool": lambda: torch.mm(t(3, 4, dtype=torch.bool), t(4, 2, dtype=torch.bool)),
        "mm_complex": lambda: torch.mm(t(3, 4, dtype=c64), t(4, 2, dtype=c64)),
        "mm_empty_rows": lambda: torch.mm(t(0, 4), t(4, 2)),
        "mm_k0": lambda: torch.mm(t(3, 0), t(0, 2)),
        "mm_out_wrong_dtype": lambda: torch.mm(t(3, 4), t(4, 2), out=torch.empty(3, 2, dtype=f64, device=device)),
        "mv": lambda: t(5, 4) @ t(4),
        "mv_mismatch": lambda: t(5, 4) @ t(3),
        "dot": lambda: t(4) @ t(4),
        "dot_mismatch": lambda: torch.dot(t(4), t(3)),
        "dot_dtype": lambda: torch.dot(t(4), t(4, dtype=f64)),
        "addmv": lambda: torch.addmv(t(5), t(5, 4), t(4), beta=0.5, alpha=2.0),
        "softmax_dim_out_of_range": lambda: torch.softmax(t(3, 4), 5),
        "softmax_int": lambda: torch.softmax(t(3, 4, dtype=i64), -1),
        "log_softmax_int": lambda: F.log_softmax(t(3, 4, dtype=i64), -1),
        "softmax_0d": lambda: torch.softmax(torch.tensor(2.0, device=device), 0),
        "softmax_0d_dim_out_of_range": lambda: torch.softmax(torch.tensor(2.0, device=device), 1),
        "log_softmax_dim_below_range": lambda: F.log_softmax(t(3, 4), -3),
        # Non-finite rows: stock's outcome (a +inf or NaN makes the whole row NaN, an all -inf row too).
        "softmax_nonfinite_rows": lambda: torch.softmax(_nonfinite_rows(device), -1),
        "log_softmax_nonfinite_rows": lambda: torch.log_softmax(_nonfinite_rows(device), -1),
        "softmax_half_to_fp32": lambda: torch.softmax(t(3, 4, dtype=torch.float16), -1, dtype=torch.float32),
        "softmax_empty": lambda: torch.softmax(t(0, 4), -1),
        "softmax_backward_shape": lambda: torch.ops.aten._softmax_backward_data(t(3, 4), t(3, 5), 1, torch.float32),
        "mean_int": lambda: t(3, 4, dtype=i64).mean(),
        "mean_dim_int": lambda: t(3, 4, dtype=i64).mean(-1),
        "mean_dim_out_of_range": lambda: t(3, 4).mean(5),
        "mean_dtype_int": lambda: t(3, 4).mean(-1, dtype=i64),
        "mean_duplicate_dim": lambda: t(3, 4).mean((0, 0)),
        "mean_complex": lambda: t(3, 4, dtype=c64).mean(-1),
        "mean_bool": lambda: t(3, 4, dtype=torch.bool).mean(),
        "mean_empty_dim_list": lambda: t(3, 4).mean(dim=[]),
        "mean_out": lambda: torch.mean(t(3, 4), -1, out=torch.empty(7, device=device)),
        "silu_int": lambda: F.silu(t(3, 4, dtype=i64)),
    }


ODD = list(_odd_inputs("cpu"))


def _outcome(fn):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 -- the outcome is the exception itself
        return e


def _assert_same_outcome(name, device):
    stock = _outcome(_odd_inputs(device)[name])
    with set_batch_invariant_mode():
        ours = _outcome(_odd_inputs(device)[name])
    if isinstance(stock, Exception):
        assert type(ours) is type(stock), f"{name}: stock raised {stock!r}, the mode gave {ours!r}"
        assert str(ours).strip()
        return
    assert not isinstance(ours, Exception), f"{name}: stock returned, the mode raised {ours!r}"
    assert ours.dtype == stock.dtype and ours.shape == stock.shape and ours.device == stock.device, name
    if stock.dtype.is_floating_point or stock.dtype.is_complex:
        torch.testing.assert_close(ours, stock, rtol=1e-5, atol=1e-5, equal_nan=True)
    else:
        assert torch.equal(ours, stock)


@pytest.mark.parametrize("name", ODD)
def test_overrides_raise_and_accept_what_stock_does(name):
    _assert_same_outcome(name, "cpu")


@pytest.mark.skipif(not triton_interpret(), reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("name", ODD)
def test_overrides_raise_and_accept_what_stock_does_triton_backend(name, monkeypatch):
    monkeypatch.setenv("RLKERNELS_BACKEND", "triton")
    _assert_same_outcome(name, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ODD)
def test_overrides_raise_and_accept_what_stock_does_gpu(name):
    _assert_same_outcome(name, "cuda")


def test_stock_kernel_is_really_replaced_for_out_and_vector_forms():
    # out= and matrix @ vector reach other ATen overloads (mm.out, mv, dot): each is
    # covered, so its rows are the functional mode's rows bit for bit.
    a = randn(33, 96, generator=torch.Generator().manual_seed(0))
    w = _w(96, 80)
    with set_batch_invariant_mode():
        want = a @ w
        out = torch.empty(0)
        torch.mm(a, w, out=out)
        assert torch.equal(out, want)
        assert torch.equal(a @ w[:, 5], want[:, 5])
        assert torch.equal(a[3] @ w[:, 5], want[3, 5])
        testing.assert_batch_invariant(lambda r: r @ w[:, 7], a, sizes=[1, 2, 7, 32])
        sm = torch.empty(0)
        torch.softmax(a, -1, out=sm) if hasattr(torch.softmax, "out") else torch.ops.aten._softmax.out(a, -1, False,
                                                                                                      out=sm)
        assert torch.equal(sm, torch.softmax(a, -1))


@pytest.mark.skipif(not triton_interpret(), reason="needs TRITON_INTERPRET=1")
def test_mode_refuses_bf16_on_the_interpreted_triton_backend(monkeypatch):
    monkeypatch.setenv("RLKERNELS_BACKEND", "triton")
    a, b = torch.randn(4, 8).bfloat16(), torch.randn(8, 5).bfloat16()
    with set_batch_invariant_mode():
        with pytest.raises(RuntimeError, match="bfloat16 on the Triton backend under TRITON_INTERPRET=1"):
            a @ b


# ---------------------------------------------------------------- process-wide state across threads


def test_threads_overlapping_blocks_never_run_with_the_mode_off():
    import threading
    import time

    seen: dict[str, list[bool]] = {"short": [], "long": []}
    start = threading.Barrier(2)

    def worker(name, seconds):
        start.wait()
        with set_batch_invariant_mode():
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                seen[name].append(is_batch_invariant_mode_enabled())
                time.sleep(0.005)

    threads = [threading.Thread(target=worker, args=("short", 0.2)), threading.Thread(target=worker, args=("long", 0.4))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert seen["short"] and seen["long"]
    assert all(seen["short"]) and all(seen["long"])  # no block ran with the mode off
    assert not is_batch_invariant_mode_enabled()      # off after the last holder left


def test_threads_exception_and_nesting():
    import threading

    inside = threading.Event()
    release = threading.Event()
    errors = []

    def holder():
        try:
            with set_batch_invariant_mode():
                with set_batch_invariant_mode():
                    inside.set()
                    release.wait(5)
                    raise RuntimeError("boom")
        except RuntimeError as e:
            errors.append(e)

    th = threading.Thread(target=holder)
    th.start()
    inside.wait(5)
    assert is_batch_invariant_mode_enabled()
    # This thread's own block and its exit leave the other thread's hold alone.
    with set_batch_invariant_mode():
        pass
    assert is_batch_invariant_mode_enabled()
    # An "off" here cannot remove the overrides under the other thread's block.
    with set_batch_invariant_mode(False):
        assert is_batch_invariant_mode_enabled()
    release.set()
    th.join()
    assert len(errors) == 1
    assert not is_batch_invariant_mode_enabled()


def test_plain_call_in_one_thread_holds_until_turned_off():
    import threading

    th = threading.Thread(target=lambda: set_batch_invariant_mode(True))
    th.start()
    th.join()
    assert is_batch_invariant_mode_enabled()  # a plain call stays until changed
    with set_batch_invariant_mode():
        pass
    assert is_batch_invariant_mode_enabled()


# ---------------------------------------------------------------- the guard of a plain call


def test_plain_call_guard_exit_restores_the_setting_before_the_call():
    g = set_batch_invariant_mode(True)
    assert is_batch_invariant_mode_enabled()
    g.__exit__(None, None, None)  # like leaving a with-block: back to off
    assert not is_batch_invariant_mode_enabled()

    set_batch_invariant_mode(True)
    g = set_batch_invariant_mode(False)
    assert not is_batch_invariant_mode_enabled()
    g.__exit__(None, None, None)  # back to the plain "on" from before the call
    assert is_batch_invariant_mode_enabled()
    set_batch_invariant_mode(False)
    g.__exit__(None, None, None)  # a second exit undoes nothing more
    assert not is_batch_invariant_mode_enabled()


def test_plain_call_guard_in_an_exit_stack():
    import contextlib

    with contextlib.ExitStack() as stack:
        stack.push(set_batch_invariant_mode(True))  # registered, never entered
        assert is_batch_invariant_mode_enabled()
    assert not is_batch_invariant_mode_enabled()


def test_entered_guard_exits_once_as_a_block():
    g = set_batch_invariant_mode(True)
    with g:
        assert is_batch_invariant_mode_enabled()
    assert not is_batch_invariant_mode_enabled()  # the block restored the state before the call
    set_batch_invariant_mode(True)
    g.__exit__(None, None, None)  # left already: a stray exit leaves the later plain call alone
    assert is_batch_invariant_mode_enabled()


def test_plain_call_guard_exit_leaves_another_threads_block_alone():
    import threading

    inside, release = threading.Event(), threading.Event()

    def holder():
        with set_batch_invariant_mode():
            inside.set()
            release.wait(5)

    th = threading.Thread(target=holder)
    th.start()
    assert inside.wait(5)
    g = set_batch_invariant_mode(True)
    g.__exit__(None, None, None)
    assert is_batch_invariant_mode_enabled()  # the other thread's block still holds the mode
    # The undo is of a process-wide setting: another thread may make it.
    g = set_batch_invariant_mode(True)
    release.set()
    th.join()
    assert is_batch_invariant_mode_enabled()  # the plain "on" outlives the block
    undo = threading.Thread(target=g.__exit__, args=(None, None, None))
    undo.start()
    undo.join()
    assert not is_batch_invariant_mode_enabled()
