"""rms_norm / layer_norm / softmax / log_softmax: accuracy vs fp64, bitwise invariance, backward."""
from __future__ import annotations

import pytest
import torch

from rlkernels import contract, reference, testing
from rlkernels.nn import RMSNorm
from rlkernels.ops import norms, reductions, softmax as softmax_ops
from rlkernels.ops.norms import layer_norm, rms_norm
from rlkernels.registry import implementation
from rlkernels.registry import get_op

from ..conftest import cpu_backend_cases, interpreter_only, randn

_OPS = {"rms_norm": norms.rms_norm, "softmax": softmax_ops.softmax, "log_softmax": softmax_ops.log_softmax}

# (dtype) -> rel tolerance used here; measured values are reported by test_report_errors.
# The loosest of the three ops' contract rows (the tests share one bound per dtype).
TOL = {dt: max(contract.CONTRACT[op][dt].tolerance for op in ("rms_norm", "softmax", "log_softmax"))
       for dt in contract.CONTRACT["softmax"]}


@pytest.mark.parametrize("backend,dtype", cpu_backend_cases((torch.float32, torch.float16, torch.bfloat16, torch.float64)))
@pytest.mark.parametrize("rows,n", [(1, 1), (7, 13), (33, 97), (5, 1100)])
def test_norm_accuracy(backend, dtype, rows, n, gen):
    if backend == "triton" and dtype == torch.float64:
        pytest.skip("fp64 runs on the torch backend")
    x = randn(rows, n, dtype=dtype, generator=gen, scale=3.0)
    w = (1 + 0.1 * randn(n, generator=gen)).to(dtype)
    y = norms.rms_norm(x, w, 1e-6, backend=backend)
    assert y.dtype == dtype and y.shape == x.shape
    assert testing.rel_error(y, reference.rms_norm_ref(x, w, 1e-6)) <= TOL[dtype]
    for log, ref in ((False, reference.softmax_ref), (True, reference.log_softmax_ref)):
        fn = softmax_ops.log_softmax if log else softmax_ops.softmax
        out = fn(x, -1, backend=backend)
        assert out.dtype == dtype
        assert testing.rel_error(out, ref(x, -1)) <= TOL[dtype]
        xs = x[:, :50]  # dim 0: one program per column under the interpreter, keep it small
        out32 = fn(xs, 0, dtype=torch.float32 if dtype != torch.float64 else None, backend=backend)
        assert testing.rel_error(out32, ref(xs, 0)) <= TOL[torch.float32 if dtype != torch.float64 else dtype]


@pytest.mark.parametrize("backend,dtype", cpu_backend_cases())
@pytest.mark.parametrize("op", ["rms_norm", "softmax", "log_softmax"])
def test_norm_row_invariance(backend, dtype, op, gen):
    n = 77
    x = randn(40, n, dtype=dtype, generator=gen, scale=2.0)
    w = (1 + 0.1 * randn(n, generator=gen)).to(dtype)
    if op == "rms_norm":
        def fn(rows):
            return norms.rms_norm(rows, w, 1e-6, backend=backend)
    else:
        f = _OPS[op]

        def fn(rows):
            return f(rows, -1, backend=backend)
    testing.assert_batch_invariant(fn, x)
    testing.assert_chunk_invariant(fn, x, chunks=[5, 1, 17, 17])
    testing.assert_padding_invariant(fn, x[:9], before=4, after=11)
    testing.assert_order_invariant(fn, x)
    testing.assert_deterministic(fn, x, runs=2)


@pytest.mark.parametrize("backend,dtype", cpu_backend_cases((torch.float32, torch.float16)))
@pytest.mark.parametrize("log", [False, True])
def test_softmax_trailing_mask_invariance(backend, dtype, log, gen):
    # An attention row scored over more (masked) keys must keep its bits: the masked
    # keys give exp() == 0 exactly, and zeros after the row end add exactly 0.
    x = randn(6, 50, dtype=dtype, generator=gen, scale=2.0)
    fn = softmax_ops.log_softmax if log else softmax_ops.softmax
    base = fn(x, -1, dtype=torch.float32, backend=backend)
    for extra in (1, 14, 1100):
        pad = torch.full((6, extra), torch.finfo(dtype).min, dtype=dtype)
        longer = fn(torch.cat([x, pad], -1), -1, dtype=torch.float32, backend=backend)
        if log:
            assert torch.equal(longer[:, :50], base)
        else:
            assert torch.equal(longer[:, :50], base) and torch.equal(longer[:, 50:], torch.zeros_like(longer[:, 50:]))


def test_softmax_leading_mask_invariance_torch_backend(gen):
    # The torch chain is a plain sequential sum: zeros in front add exactly 0 too.
    x = randn(6, 50, generator=gen, scale=2.0)
    base = softmax_ops.softmax(x, -1, backend="torch")
    pad = torch.full((6, 9), torch.finfo(torch.float32).min)
    assert torch.equal(softmax_ops.softmax(torch.cat([pad, x], -1), -1, backend="torch")[:, 9:], base)


@pytest.mark.parametrize("backend,dtype", cpu_backend_cases((torch.float32, torch.float64)))
def test_norm_backward(backend, dtype, gen):
    if backend == "triton" and dtype == torch.float64:
        pytest.skip("fp64 runs on the torch backend")
    x = randn(9, 23, dtype=dtype, generator=gen).requires_grad_()
    w = (1 + 0.1 * randn(23, generator=gen)).to(dtype).requires_grad_()
    g = randn(9, 23, dtype=dtype, generator=gen)
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    y = norms.rms_norm(x, w, 1e-6, backend=backend)
    dx, dw = torch.autograd.grad(y, (x, w), g)
    xr, wr = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    rdx, rdw = torch.autograd.grad(reference.rms_norm_ref(xr, wr, 1e-6), (xr, wr), g.double())
    assert testing.rel_error(dx, rdx) <= tol and testing.rel_error(dw, rdw) <= tol
    for log, ref in ((False, reference.softmax_ref), (True, reference.log_softmax_ref)):
        fn = softmax_ops.log_softmax if log else softmax_ops.softmax
        (d,) = torch.autograd.grad(fn(x, -1, backend=backend), (x,), g)
        (rd,) = torch.autograd.grad(ref(xr, -1), (xr,), g.double())
        assert testing.rel_error(d, rd) <= tol


def test_rms_norm_gradcheck():
    x = torch.randn(4, 7, dtype=torch.float64, requires_grad=True)
    w = torch.randn(7, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: norms.rms_norm(a, b, 1e-6, backend="torch"), (x, w))
    assert torch.autograd.gradcheck(lambda a: softmax_ops.log_softmax(a, 0, backend="torch"), (x,))
    assert torch.autograd.gradcheck(lambda a: softmax_ops.softmax(a, 1, backend="torch"), (x,))


@pytest.mark.parametrize("backend,dtype", cpu_backend_cases((torch.float32,)))
def test_rms_norm_dw_microbatch_invariance(backend, dtype, gen):
    # dW reduces over tokens in an order fixed by M: torch one row at a time; triton in blocks of
    # ROWS_PER_BLOCK rows, and 30 rows are one block, i.e. one chain (more: test_rms_norm_triton_*).
    x = randn(30, 19, generator=gen)
    w = (1 + 0.1 * randn(19, generator=gen)).requires_grad_()
    g = randn(30, 19, generator=gen)
    f = implementation("rms_norm", backend)
    full = f.backend_impl.col_sum(g * x)
    acc = torch.zeros(19, dtype=torch.float64 if backend == "torch" else torch.float32)  # torch chains in fp64
    for i in range(30):
        acc = acc + (g[i] * x[i]).to(acc.dtype)
    assert torch.equal(full, acc.float())
    # and the per-row dx is batch invariant
    testing.assert_batch_invariant(
        lambda rows: torch.autograd.grad(norms.rms_norm(rows.requires_grad_(), w, 1e-6, backend=backend),
                                         rows, torch.ones_like(rows))[0], x)


def test_rms_norm_module_from_hf_like():
    class Fake(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(8))
            self.variance_epsilon = 1e-5
    src = Fake()
    mod = RMSNorm.from_module(src)
    assert mod.weight is src.weight and mod.variance_epsilon == 1e-5
    x = torch.randn(3, 8)
    assert testing.rel_error(mod(x), reference.rms_norm_ref(x, src.weight, 1e-5)) < 2e-6


@pytest.mark.parametrize("backend,dtype", cpu_backend_cases((torch.float32, torch.float16, torch.bfloat16)))
def test_rms_norm_weight_in_fp32_rounds_once_after_the_weight(backend, dtype, gen):
    # OLMo 2's order: (weight * xhat).to(x.dtype), the product in fp32. Bitwise the fp32
    # normalized rows times the weight, rounded once; within the contract of an fp64 reference.
    x = randn(9, 131, dtype=dtype, generator=gen, scale=3.0).requires_grad_()
    w = (1 + 0.1 * randn(131, generator=gen)).to(dtype).requires_grad_()
    y = norms.rms_norm(x, w, 1e-6, weight_in_fp32=True, backend=backend)
    xhat = implementation("rms_norm", backend)().forward_fp32(x.detach(), None, 1e-6)
    assert y.dtype == dtype and torch.equal(y, (w.detach().float() * xhat).to(dtype))
    with torch.no_grad():
        assert torch.equal(norms.rms_norm(x, w, 1e-6, weight_in_fp32=True, backend=backend), y)  # the fused path
        xd = x.double()
        want = (w.double() * (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6))).to(dtype)
    assert testing.rel_error(y, want) <= TOL[dtype]
    if dtype != torch.float32:  # Llama's order rounds twice: the two differ somewhere
        assert not torch.equal(y, norms.rms_norm(x, w, 1e-6, backend=backend))
    g = randn(9, 131, dtype=dtype, generator=gen)
    gx, gw = torch.autograd.grad(y, (x, w), g)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    y64 = w64 * (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6))
    gx64, gw64 = torch.autograd.grad(y64, (x64, w64), g.double())
    assert gx.dtype == dtype and gw.dtype == dtype
    assert testing.rel_error(gx, gx64) <= TOL[dtype] and testing.rel_error(gw, gw64) <= TOL[dtype]
    rows = [norms.rms_norm(x[i:i + 1].detach(), w.detach(), 1e-6, weight_in_fp32=True, backend=backend)
            for i in range(9)]
    assert torch.equal(torch.cat(rows), y.detach())  # a row alone: the same bits


@pytest.mark.parametrize("backend,dtype", cpu_backend_cases((torch.float32, torch.float16, torch.bfloat16)))
def test_rms_norm_with_gemmas_weight_offset(backend, dtype, gen):
    # Gemma's norm: (xhat * (1 + weight.float())).to(x.dtype), the weight stored around 0.
    # Within the contract of an fp64 reference, forward and backward; a row alone == the batch.
    norm = RMSNorm(131, weight_in_fp32=True, weight_offset=1.0, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(0.1 * randn(131, generator=gen))
    x = randn(9, 131, dtype=dtype, generator=gen, scale=3.0).requires_grad_()
    ctx = _norms_on(backend)
    with ctx:
        y = norm(x)
        rows = [norm(x[i:i + 1].detach()) for i in range(9)]
    assert y.dtype == dtype and torch.equal(torch.cat(rows), y.detach())
    x64, w64 = x.detach().double().requires_grad_(), norm.weight.detach().double().requires_grad_()
    y64 = (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6)) * (1.0 + w64)
    assert testing.rel_error(y, y64) <= TOL[dtype]
    g = randn(9, 131, dtype=dtype, generator=gen)
    with ctx:
        gx, gw = torch.autograd.grad(y, (x, norm.weight), g)
    gx64, gw64 = torch.autograd.grad(y64, (x64, w64), g.double())
    assert gw.dtype == dtype and testing.rel_error(gx, gx64) <= TOL[dtype] and testing.rel_error(gw, gw64) <= TOL[dtype]
    with pytest.raises(ValueError, match="weight_offset=1.0 needs weight_in_fp32=True"):
        RMSNorm(131, weight_offset=1.0)


def _norms_on(backend: str):
    """rlkernels.RMSNorm's op on ``backend`` for the duration (the module takes no backend)."""
    from unittest import mock

    import rlkernels.nn

    return mock.patch.object(rlkernels.nn, "rms_norm",
                             lambda *a, **k: norms.rms_norm(*a, **{**k, "backend": backend}))


@pytest.mark.parametrize("backend,dtype", cpu_backend_cases((torch.float32,)))
def test_rms_norm_of_rows_with_no_features_is_empty_like_stock(backend, dtype):
    # torch.nn.functional.rms_norm gives an empty result for [..., 0]; so does this, with grads.
    x = torch.randn(2, 3, 0, dtype=dtype, requires_grad=True)
    w = torch.ones(0, dtype=dtype, requires_grad=True)
    y = norms.rms_norm(x, w, backend=backend)
    assert y.shape == torch.nn.functional.rms_norm(x, (0,), w).shape == (2, 3, 0)
    gx, gw = torch.autograd.grad(y.sum(), (x, w))
    assert gx.shape == (2, 3, 0) and gw.shape == (0,)
    normed, summed = norms.add_rms_norm(x.detach(), x.detach(), None, backend=backend)
    assert normed.shape == summed.shape == (2, 3, 0)


def test_invalid_inputs():
    with pytest.raises(ValueError):
        norms.rms_norm(torch.randn(3, 4), torch.randn(5))
    with pytest.raises(ValueError):
        softmax_ops.softmax(torch.arange(4))


@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
@pytest.mark.parametrize("shape,dim", [((3, 8), 2), ((3, 8), -3), ((2, 3, 4), 3), ((), 1), ((), -2)])
def test_softmax_out_of_range_dim_raises_stocks_index_error(op, shape, dim):
    # A dim wrapped modulo ndim would reduce over a dim the caller never named.
    x = torch.randn(shape)
    with pytest.raises(IndexError) as stock:
        getattr(torch, op)(x, dim)
    with pytest.raises(IndexError, match=rf"^rlkernels\.{op}: ") as got:
        _OPS[op](x, dim)
    assert str(got.value) == f"rlkernels.{op}: {stock.value}"
    with pytest.raises(IndexError, match=rf"^rlkernels\.{op}: "):
        get_op(op, backend="torch")(x, dim)


@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
@pytest.mark.parametrize("dim", [0, -1])
def test_softmax_zero_dim_tensor_takes_dims_0_and_minus_1(op, dim):
    x = torch.tensor(1.5)
    assert torch.equal(_OPS[op](x, dim), getattr(torch, op)(x, dim))


@pytest.mark.parametrize("backend,dtype", cpu_backend_cases((torch.float32, torch.float16)))
@pytest.mark.parametrize("log", [False, True])
def test_softmax_non_finite_rows_match_stock(backend, dtype, log):
    # A +inf (or NaN) in a row makes stock's whole row NaN; an all -inf row is NaN too.
    inf, nan = float("inf"), float("nan")
    rows = [[1.0, inf, 2.0, 0.5], [inf, inf, 1.0, -inf], [-inf] * 4, [1.0, nan, 2.0, 0.5],
            [-inf, 1.0, 2.0, -inf], [0.25, -1.0, 2.0, 3.0]]
    x = torch.tensor(rows, dtype=dtype)
    fn = softmax_ops.log_softmax if log else softmax_ops.softmax
    got = fn(x, -1, backend=backend)
    want = (torch.log_softmax if log else torch.softmax)(x.float(), -1).to(dtype)
    assert torch.equal(got.isnan(), want.isnan()), (got, want)
    assert torch.equal(got.isneginf(), want.isneginf()), (got, want)
    finite = want.isfinite()
    assert (got[finite].float() - want[finite].float()).abs().max() < 1e-3
    # Each row's bits are its own: alone, or in the batch beside the non-finite rows.
    for i in range(len(rows)):
        alone = fn(x[i:i + 1], -1, backend=backend)
        assert torch.equal(alone.view(torch.int16 if dtype == torch.float16 else torch.int32),
                           got[i:i + 1].view(torch.int16 if dtype == torch.float16 else torch.int32))
    # dim 0 takes the same path through movedim.
    assert torch.equal(fn(x.t(), 0, backend=backend).t().isnan(), want.isnan())


def test_rms_norm_shape_mismatch_blames_the_input():
    # The weight fixes normalized_shape (nn.RMSNorm's hidden_size): the input is what disagrees.
    with pytest.raises(ValueError, match=r"rlkernels\.rms_norm: input's last dim is 7 but the weight has 8 "
                                         r"elements \(normalized_shape \(8,\)\).*got \(3, 7\)"):
        RMSNorm(8)(torch.randn(3, 7))
    with pytest.raises(ValueError, match=r"rlkernels\.rms_norm: weight must be 1-D .*got shape \(2, 4\)"):
        norms.rms_norm(torch.randn(3, 8), torch.ones(2, 4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_report_errors(dtype, gen, capsys):
    # Measured errors vs fp64 on the CPU (torch backend), for the contract table.
    errs = {}
    for n in (64, 1000, 4099):
        x = randn(16, n, dtype=dtype, generator=gen, scale=3.0)
        w = (1 + 0.1 * randn(n, generator=gen)).to(dtype)
        errs.setdefault("rms_norm", []).append(testing.rel_error(norms.rms_norm(x, w, 1e-6), reference.rms_norm_ref(x, w, 1e-6)))
        errs.setdefault("softmax", []).append(testing.rel_error(softmax_ops.softmax(x), reference.softmax_ref(x)))
        errs.setdefault("log_softmax", []).append(testing.rel_error(softmax_ops.log_softmax(x), reference.log_softmax_ref(x)))
    with capsys.disabled():
        print(f"\n[contract] {dtype}: " + ", ".join(f"{k} rel {max(v):.2e}" for k, v in errs.items()))
    for v in errs.values():
        assert max(v) <= TOL[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("op", ["rms_norm", "softmax", "log_softmax"])
def test_norms_gpu(dtype, op):
    g = torch.Generator().manual_seed(7)
    n = 4099
    x = randn(300, n, dtype=dtype, device="cuda", generator=g, scale=3.0)
    w = (1 + 0.1 * randn(n, generator=g)).to(device="cuda", dtype=dtype)
    if op == "rms_norm":
        def fn(rows):
            return norms.rms_norm(rows, w, 1e-6)
        ref = reference.rms_norm_ref(x, w, 1e-6)
    else:
        f = _OPS[op]

        def fn(rows):
            return f(rows, -1)
        ref = getattr(reference, op + "_ref")(x, -1)
    err = testing.rel_error(fn(x), ref)
    print(f"[contract gpu] {op} {dtype}: rel {err:.2e}")
    assert err <= TOL[dtype]
    testing.assert_batch_invariant(fn, x, sizes=[1, 2, 3, 7, 16, 17, 129, 299])
    testing.assert_chunk_invariant(fn, x, chunks=[5, 1, 100, 194])
    testing.assert_order_invariant(fn, x)
    testing.assert_deterministic(fn, x)
    if op != "rms_norm":
        base = f(x[:8, :1000], -1, dtype=torch.float32)
        pad = torch.full((8, 3000), torch.finfo(dtype).min, dtype=dtype, device="cuda")
        assert torch.equal(f(torch.cat([x[:8, :1000], pad], -1), -1, dtype=torch.float32)[:, :1000], base)
    else:
        xg = x.detach().requires_grad_()
        wg = w.detach().requires_grad_()
        gy = torch.randn_like(x)
        dx, dw = torch.autograd.grad(norms.rms_norm(xg, wg, 1e-6), (xg, wg), gy)
        dx2, dw2 = torch.autograd.grad(norms.rms_norm(xg, wg, 1e-6), (xg, wg), gy)
        assert torch.equal(dx, dx2) and torch.equal(dw, dw2)
        dx7 = torch.autograd.grad(norms.rms_norm(xg[:7], wg, 1e-6), xg, gy[:7])[0]
        assert torch.equal(dx7[:7], dx[:7])


# ---------------------------------------------------------------- Triton RMSNorm: fused rows, blocked dW


def _blocked_dw_emulation(g: torch.Tensor, h: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """The Triton dW order on the host, in fp32: v = g * h; partial p = chain over rows
    p*ROWS_PER_BLOCK.. ascending from 0.0; then a chain over the partials, p ascending."""
    M, N = g.shape
    rpb = reductions.ROWS_PER_BLOCK
    P = -(-M // rpb)
    v = torch.zeros(P * rpb, N, dtype=torch.float32, device=g.device)
    v[:M] = g.float() * h.float()
    v = v.reshape(P, rpb, N)  # padded rows are exact zeros: adding them changes nothing
    part = torch.zeros(P, N, dtype=torch.float32, device=g.device)
    for k in range(rpb):  # every block's chain, one row step at a time
        part = part + v[:, k]
    total = torch.zeros(N, dtype=torch.float32, device=g.device)
    for p in range(P):
        total = total + part[p]
    return total.to(out_dtype)


def _unfused_rms(x: torch.Tensor, w: torch.Tensor, g: torch.Tensor, eps: float):
    """HF RMSNorm and its grad_x from torch elementwise ops and the Triton row_dot kernel."""
    red = reductions.TritonReductionBackend()
    N = x.shape[-1]
    xf = x.float()
    rstd = torch.rsqrt(red.row_dot(xf, xf) / N + eps)
    xhat = xf * rstd[:, None]
    y = w * xhat.to(x.dtype)
    gw = g.float() * w.float()
    dx = rstd[:, None] * (gw - xhat * (red.row_dot(gw, xhat) / N)[:, None])
    return y, dx.to(x.dtype)


def _check_triton_rms(x: torch.Tensor, w: torch.Tensor, gy: torch.Tensor, alone_rows: list[int],
                      exact_formula: bool) -> None:
    dtype = x.dtype
    M, N = x.shape
    eps = 1e-6

    def run(rows, grads):
        xr, wr = rows.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        y = norms.rms_norm(xr, wr, eps, backend="triton")
        dx, dw = torch.autograd.grad(y, (xr, wr), grads)
        return y.detach(), dx, dw

    y, dx, dw = run(x, gy)
    assert y.dtype == dtype and y.shape == (M, N) and dx.dtype == dtype and dw.dtype == w.dtype
    # a row alone gives the bits it has inside the batch (forward and grad_x)
    for r in alone_rows:
        y1, dx1, _ = run(x[r:r + 1], gy[r:r + 1])
        assert torch.equal(y1[0], y[r]) and torch.equal(dx1[0], dx[r]), f"row {r} of {M}x{N}"
    # dW: the same bits run to run, and exactly the blocked fixed order
    y2, dx2, dw2 = run(x, gy)
    assert torch.equal(y2, y) and torch.equal(dx2, dx) and torch.equal(dw2, dw)
    h = norms.rms_norm(x, None, eps, backend="triton")  # xhat rounded to x's dtype, same rstd
    assert torch.equal(dw, _blocked_dw_emulation(gy, h, w.dtype))
    assert torch.equal(implementation("rms_norm", "triton").backend_impl.col_sum(gy.float() * h.float()),
                       _blocked_dw_emulation(gy, h, torch.float32))
    if M == 0:
        assert torch.equal(dw, torch.zeros_like(dw))
        return
    if exact_formula:
        # the fused rows compute the HF formula with row_dot's sum order, bit for bit
        y_ref, dx_ref = _unfused_rms(x, w, gy, eps)
        assert torch.equal(y, y_ref) and torch.equal(dx, dx_ref)
    # accuracy against float64
    xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
    rdx, rdw = torch.autograd.grad(reference.rms_norm_ref(xd, wd, eps), (xd, wd), gy.double())
    tol = contract.tolerance("rms_norm", dtype).tolerance
    assert testing.rel_error(y, reference.rms_norm_ref(x, w, eps)) <= tol
    assert testing.rel_error(dw, rdw) <= tol and testing.rel_error(dx, rdx) <= (tol if dtype != torch.float32 else 2e-5)


_FUSED_CASES = [(dt, M, N) for dt in (torch.float32, torch.float16)
                for M, N in [(1, 128), (7, 13), (131, 128), (193, 37), (3, 2048), (5, 2053), (0, 64)]]
_FUSED_CASES += [(torch.float16, 2, 16411)]  # a row of 17 tiles (the interpreter is slow: one dtype)


@interpreter_only
@pytest.mark.parametrize("dtype,M,N", _FUSED_CASES)
def test_rms_norm_triton_fused_and_blocked_dw(dtype, M, N, gen):
    x = randn(M, N, dtype=dtype, generator=gen, scale=2.0)
    w = (1 + 0.1 * randn(N, generator=gen)).to(dtype)
    gy = randn(M, N, dtype=dtype, generator=gen)
    _check_triton_rms(x, w, gy, alone_rows=sorted({0, M // 2, M - 1}) if M else [], exact_formula=True)


@interpreter_only
def test_rms_norm_triton_dw_order_depends_on_m_only(gen):
    # Rows 0..199 of a 300-row batch: the first block's partial is the same chain either
    # way, and the dW of the 200 rows is the blocked order for M=200 (not a prefix of 300's).
    x = randn(300, 40, generator=gen)
    gy = randn(300, 40, generator=gen)
    h = norms.rms_norm(x, None, backend="triton")
    full = implementation("rms_norm", "triton").backend_impl.col_sum(gy * h)
    part = implementation("rms_norm", "triton").backend_impl.col_sum((gy * h)[:200])
    assert torch.equal(part, _blocked_dw_emulation(gy[:200], h[:200], torch.float32))
    assert torch.equal(full, _blocked_dw_emulation(gy, h, torch.float32))
    seq = torch.zeros(40)
    for r in range(300):
        seq = seq + (gy[r] * h[r])
    assert not torch.equal(full, seq), "300 rows must be summed in blocks, not one sequential chain"


@pytest.mark.gpu
@pytest.mark.parametrize("M,N", [(4096 * 16, 128), (4096, 2048)])
def test_rms_norm_triton_blocked_dw_gpu(M, N):
    g = torch.Generator().manual_seed(11)
    x = randn(M, N, dtype=torch.bfloat16, device="cuda", generator=g, scale=2.0)
    w = (1 + 0.1 * randn(N, generator=g)).to(device="cuda", dtype=torch.bfloat16)
    gy = randn(M, N, dtype=torch.bfloat16, device="cuda", generator=g)
    # bf16 products are exact in fp32, so the emulation matches whether or not the GPU fuses mul+add
    _check_triton_rms(x, w, gy, alone_rows=[0, 1, M // 2 + 3, M - 1], exact_formula=False)


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_rms_norm_inference_path_is_the_autograd_forward(dtype, gen):
    # Without autograd (a decode step) rms_norm skips the Function; the launch is the same.
    x = randn(3, 5, 131, dtype=dtype, generator=gen)
    w = (1 + 0.1 * randn(131, generator=gen)).to(dtype).requires_grad_()
    with_grad = norms.rms_norm(x.requires_grad_(), w, 1e-5, backend="triton")
    assert with_grad.grad_fn is not None
    with torch.no_grad():
        plain = norms.rms_norm(x, w, 1e-5, backend="triton")
    assert plain.grad_fn is None and plain.shape == x.shape
    assert torch.equal(plain, with_grad.detach())


@pytest.mark.parametrize("backend,dtype", cpu_backend_cases((torch.float32, torch.float16, torch.bfloat16)))
@pytest.mark.parametrize("rows,n", [(1, 1), (7, 13), (5, 1100)])
def test_add_rms_norm_is_the_add_and_the_norm(backend, dtype, rows, n, gen):
    # A residual stream several times the sublayer's output, as in a trained decoder.
    x = randn(rows, n, dtype=dtype, generator=gen)
    residual = randn(rows, n, dtype=dtype, generator=gen, scale=8.0)
    w = (1 + 0.1 * randn(n, generator=gen)).to(dtype)
    normed, summed = norms.add_rms_norm(x, residual, w, 1e-6, backend=backend)
    want_sum = residual + x
    want = norms.rms_norm(want_sum, w, 1e-6, backend=backend)
    assert testing._bits_equal(summed, want_sum) and testing._bits_equal(normed, want)
    alone, _ = norms.add_rms_norm(x[-1:], residual[-1:], w, 1e-6, backend=backend)
    assert testing._bits_equal(alone, normed[-1:])


def test_add_rms_norm_refuses_a_residual_that_does_not_match():
    with pytest.raises(ValueError, match="add_rms_norm: residual must match x"):
        norms.add_rms_norm(torch.randn(3, 8), torch.randn(3, 7), torch.ones(8))
    with pytest.raises(ValueError, match="add_rms_norm: residual must match x"):
        norms.add_rms_norm(torch.randn(3, 8), torch.randn(3, 8).double(), torch.ones(8))
    with pytest.raises(TypeError, match="add_rms_norm"):
        norms.add_rms_norm(torch.randn(3, 8), 1.0, torch.ones(8))
    with pytest.raises(ValueError, match="add_rms_norm"):
        norms.add_rms_norm(torch.randn(3, 8), torch.randn(3, 8), torch.ones(7))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_add_rms_norm_one_launch_gives_the_two_ops_bits_gpu(dtype):
    g = torch.Generator().manual_seed(17)
    for rows, n in ((1, 2048), (16, 2048), (257, 4096), (3, 1000)):
        x = torch.randn(rows, n, generator=g).to(dtype).cuda()
        residual = (torch.randn(rows, n, generator=g) * 8).to(dtype).cuda()
        w = (1 + 0.1 * torch.randn(n, generator=g)).to(dtype).cuda()
        normed, summed = norms.add_rms_norm(x, residual, w, 1e-6)
        want_sum = residual + x
        assert testing._bits_equal(summed, want_sum), (rows, n, dtype)
        assert testing._bits_equal(normed, norms.rms_norm(want_sum, w, 1e-6)), (rows, n, dtype)


# ---------------------------------------------------------------- layer_norm (Cohere's)


def _ln_case(rows, n, dtype, seed=0, heads=None):
    g = torch.Generator().manual_seed(seed)
    shape = (rows, heads, n) if heads else (rows, n)
    x = (3 + 2 * torch.randn(*shape, generator=g)).to(dtype)  # a mean far from 0: the centring matters
    w = (1 + 0.3 * torch.randn(*shape[1:], generator=g)).to(dtype)
    return x, w


@pytest.mark.parametrize("backend, dtype", cpu_backend_cases())
@pytest.mark.parametrize("n, heads", [(1, None), (96, None), (1031, None), (16, 3)])
def test_layer_norm_rows_are_the_same_alone_and_in_any_batch(backend, dtype, n, heads):
    x, w = _ln_case(37, n, dtype, heads=heads)
    batched = layer_norm(x, w, 1e-5, backend=backend)
    for r in (0, 18, 36):
        assert torch.equal(layer_norm(x[r:r + 1], w, 1e-5, backend=backend)[0], batched[r]), r
    assert torch.equal(layer_norm(x.flip(0), w, 1e-5, backend=backend).flip(0), batched)
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    xs = [x.clone().requires_grad_(), x[5:6].clone().requires_grad_()]
    for xi, gi in zip(xs, (grad, grad[5:6])):
        layer_norm(xi, w, 1e-5, backend=backend).backward(gi)
    assert torch.equal(xs[1].grad[0], xs[0].grad[5])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads", [None, 4])
def test_layer_norm_against_the_float64_reference(dtype, heads):
    x, w = _ln_case(29, 257, dtype, seed=2, heads=heads)
    contract.check("layer_norm", dtype, layer_norm(x, w, 1e-5), reference.layer_norm_ref(x, w, 1e-5))
    # Without the centring it is another function (the RMS norm): the test can fail.
    assert testing.rel_error(rms_norm(x.reshape(-1, 257), None, 1e-5).reshape(x.shape) * w,
                              reference.layer_norm_ref(x, w, 1e-5)) > 0.1


def test_layer_norm_gradients_float64():
    x, w = _ln_case(7, 11, torch.float64, seed=3, heads=2)
    assert torch.autograd.gradcheck(lambda a, b: layer_norm(a, b, 1e-5), (x.requires_grad_(), w.requires_grad_()))


@pytest.mark.parametrize("backend, dtype", cpu_backend_cases())
def test_layer_norm_backward_is_deterministic_and_matches_the_reference(backend, dtype):
    x, w = _ln_case(40, 64, dtype, seed=4, heads=2)
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(5)).to(dtype)
    runs = []
    for _ in range(2):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        layer_norm(xi, wi, 1e-5, backend=backend).backward(grad)
        runs.append((xi.grad, wi.grad))
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
    reference.layer_norm_ref(xd, wd, 1e-5).backward(grad.double())
    contract.check("layer_norm", dtype, runs[0][0], xd.grad)
    assert testing.rel_error(runs[0][1], wd.grad) <= (1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("weight, match", [
    (torch.ones(7), r"weight \(7,\) must be the last dims of x \(3, 8\)"),
    (torch.ones(2, 3, 8), r"weight \(2, 3, 8\) must be the last dims"),
    (torch.ones(8, dtype=torch.long), r"rlkernels.layer_norm: weight has dtype torch.int64"),
])
def test_layer_norm_bad_input_is_refused(weight, match):
    with pytest.raises((ValueError, TypeError), match=match):
        layer_norm(torch.randn(3, 8), weight)
