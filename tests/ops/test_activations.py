"""SiLU and tanh-GELU: a row's bits do not depend on the tensor's size; SiLU's not on the batch-invariant mode."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import rlkernels
from rlkernels import contract
from rlkernels.nn import GELUTanh, SiLU
from rlkernels.ops.activations import gelu_tanh, silu


def _rows_alone_vs_batched(fn, x: torch.Tensor) -> bool:
    full = fn(x)
    return all(torch.equal(fn(x[i:i + 1]), full[i:i + 1]) for i in range(x.shape[0]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_silu_rows_do_not_depend_on_the_batch(dtype):
    x = (torch.randn(9, 67, generator=torch.Generator().manual_seed(0)) * 4).to(dtype)
    assert _rows_alone_vs_batched(silu, x)
    ref = F.silu(x.double()).to(dtype)
    assert (silu(x).double() - ref.double()).abs().max() <= 2 * torch.finfo(dtype).eps * ref.double().abs().max()


def test_stock_cpu_silu_rows_move_with_the_tensor_size():
    """The control: ATen's vector body and scalar tail round some elements differently."""
    x = torch.randn(64, 67, generator=torch.Generator().manual_seed(1)) * 4
    assert not _rows_alone_vs_batched(F.silu, x)


def test_silu_module_gives_the_modes_bits_forward_and_backward():
    x = (torch.randn(5, 67, generator=torch.Generator().manual_seed(2)) * 4).requires_grad_(True)
    g = torch.randn(5, 67, generator=torch.Generator().manual_seed(3))
    out = SiLU()(x)
    (dx,) = torch.autograd.grad(out, x, g)
    with rlkernels.set_batch_invariant_mode(True):
        out_mode = F.silu(x)
        (dx_mode,) = torch.autograd.grad(out_mode, x, g)
        out_in_mode = SiLU()(x)
    assert torch.equal(out, out_mode) and torch.equal(dx, dx_mode) and torch.equal(out, out_in_mode)


def _gate_up(n, dtype, device="cpu", seed=4):
    g = torch.Generator().manual_seed(seed)
    gate = torch.randn(n, generator=g) * 12  # exp(-g) over (1e-6, 1e5), and past fp32's range below
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), -100.0])[:n]
    gate[:len(specials)] = specials
    up = torch.randn(n, generator=g) * 3
    return gate.to(dtype).to(device), up.to(dtype).to(device)


def test_silu_mul_is_silu_times_up_with_gradients():
    from rlkernels.ops.activations import silu_mul, silu_mul_fused_ok

    gate, up = _gate_up(1001, torch.float32)
    gate.requires_grad_(True)
    assert not silu_mul_fused_ok(gate, up)
    out = silu_mul(gate, up)
    assert torch.equal(out.view(torch.int32), (silu(gate) * up).view(torch.int32))
    (grad,) = torch.autograd.grad(out[4:].sum(), gate)
    assert torch.isfinite(grad[4:]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_silu_mul_kernel_gives_atens_two_ops_bits_gpu(dtype):
    from rlkernels.ops.activations import silu_mul, silu_mul_fused_ok
    from rlkernels.testing import _bits_equal

    for n in (1, 1023, 16 * 6144, 3 * 257 * 6144 + 5):
        gate, up = _gate_up(n, dtype, device="cuda", seed=n)
        assert silu_mul_fused_ok(gate, up)
        assert _bits_equal(silu_mul(gate, up), F.silu(gate) * up), (n, dtype)


def test_linear_silu_mul_is_the_three_ops_with_gradients_off_the_gpu():
    from rlkernels.ops.activations import _one_launch_linear_silu_mul, linear_silu_mul, silu_mul

    g = torch.Generator().manual_seed(7)
    x = (torch.randn(2, 5, 24, generator=g) * 2).requires_grad_()
    w_gate = (torch.randn(19, 24, generator=g) * 0.6).requires_grad_()
    w_up = (torch.randn(19, 24, generator=g) * 0.2).requires_grad_()
    assert not _one_launch_linear_silu_mul(x, w_gate, w_up)
    out = linear_silu_mul(x, w_gate, w_up)
    ref = silu_mul(rlkernels.linear(x, w_gate), rlkernels.linear(x, w_up))
    assert out.shape == (2, 5, 19) and torch.equal(out.view(torch.int32), ref.view(torch.int32))
    grads = torch.autograd.grad(out.square().sum(), (x, w_gate, w_up))
    ref_grads = torch.autograd.grad(ref.square().sum(), (x, w_gate, w_up))
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads))


def test_linear_silu_mul_refuses_what_linear_refuses():
    from rlkernels.ops.activations import linear_silu_mul

    with pytest.raises((ValueError, RuntimeError), match="linear"):
        linear_silu_mul(torch.randn(3, 8), torch.randn(5, 7), torch.randn(5, 7))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_linear_silu_mul_one_launch_gives_the_three_ops_bits_gpu(dtype):
    from rlkernels.gemm.table import SILU_MUL_MAX_M
    from rlkernels.ops.activations import _one_launch_linear_silu_mul, linear_silu_mul, silu_mul
    from rlkernels.testing import _bits_equal

    g = torch.Generator().manual_seed(11)
    for k, n in ((2048, 6144), (1000, 3001), (4096, 12288)):
        # A trained MLP's scale: gate pre-activations over several units, some rows large.
        x = (torch.randn(SILU_MUL_MAX_M + 1, 2, k, generator=g) * 2).to(dtype).cuda()[:, 1]  # strided rows
        w_gate = (torch.randn(n, k, generator=g) * 2 / k ** 0.5).to(dtype).cuda()
        w_up = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype).cuda()
        with torch.no_grad():
            for m in (1, 5, 9, SILU_MUL_MAX_M):
                rows = x[:m]
                assert _one_launch_linear_silu_mul(rows, w_gate, w_up), (k, n, m)
                fused = linear_silu_mul(rows, w_gate, w_up)
                ref = silu_mul(rlkernels.linear(rows, w_gate), rlkernels.linear(rows, w_up))
                assert _bits_equal(fused, ref), (k, n, m, dtype)
                alone = linear_silu_mul(rows[m - 1:m], w_gate, w_up)
                assert _bits_equal(alone, fused[m - 1:m]), (k, n, m, dtype)
            # Past the fused sizes: the three ops, the same bits per row.
            big = (torch.randn(SILU_MUL_MAX_M + 60, k, generator=g) * 2).to(dtype).cuda()
            assert not _one_launch_linear_silu_mul(big, w_gate, w_up)
            assert _bits_equal(linear_silu_mul(big, w_gate, w_up)[:7], linear_silu_mul(big[:7], w_gate, w_up))


def _offsets_equal(fn, x: torch.Tensor, width: int = 29) -> bool:
    """Each run of ``width`` elements starting at offsets 0..36 == the same elements of one call."""
    full = fn(x)
    return all(torch.equal(fn(x[o:o + width]), full[o:o + width]) for o in range(37))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gelu_tanh_elements_do_not_depend_on_where_they_sit(dtype):
    x = (torch.randn(100003, generator=torch.Generator().manual_seed(5)) * 4).to(dtype)
    assert _offsets_equal(gelu_tanh, x) and _rows_alone_vs_batched(gelu_tanh, x[:999].reshape(9, 111))
    want = F.gelu(x.double(), approximate="tanh")
    contract.check("activation", dtype, gelu_tanh(x), want)
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), -100.0, 100.0, 0.0, -0.0]).to(dtype)
    ours, stock = gelu_tanh(special), F.gelu(special, approximate="tanh")  # NaN at NaN and -inf, as stock
    assert torch.equal(ours.isnan(), stock.isnan()) and torch.equal(ours[~ours.isnan()], stock[~stock.isnan()])


def test_stock_cpu_gelu_tanh_elements_move_with_the_tensor_size():
    """The control: ATen's fp32 tanh-GELU rounds some elements of its scalar tail otherwise."""
    x = torch.randn(100003, generator=torch.Generator().manual_seed(5)) * 4
    assert not _offsets_equal(lambda t: F.gelu(t, approximate="tanh"), x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gelu_tanh_gradient_is_the_formulas(dtype):
    x = (torch.randn(4, 257, generator=torch.Generator().manual_seed(6)) * 3).to(dtype).requires_grad_(True)
    g = torch.randn(4, 257, generator=torch.Generator().manual_seed(7)).to(dtype)
    (dx,) = torch.autograd.grad(GELUTanh()(x), x, g)
    xd = x.detach().double().requires_grad_(True)
    (want,) = torch.autograd.grad(F.gelu(xd, approximate="tanh"), xd, g.double())
    contract.check("activation_grad", dtype, dx, want)
    assert _rows_alone_vs_batched(lambda t: torch.autograd.grad(GELUTanh()(t), t, torch.ones_like(t))[0],
                                  x.detach().clone().requires_grad_(True))
