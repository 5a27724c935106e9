"""rlkernels.integrations.trainers.verl.linear_cross_entropy: verl's signature and meaning.

Against a float64 reference (log_softmax of the full logits) within the contract's
linear_logprob tolerances, gradients too; torch backend always, the Triton kernels
under TRITON_INTERPRET=1 (fp32/fp16). Against verl's own kernel when verl and a GPU
are present (skipped otherwise).
"""
from __future__ import annotations

import pytest
import torch

from rlkernels import contract
from rlkernels.integrations.trainers.verl import linear_cross_entropy
from rlkernels.testing import rel_error

from ...conftest import cpu_backend_cases, randn

F64, F32, F16, BF16 = torch.float64, torch.float32, torch.float16, torch.bfloat16
TEMP = 0.7


def _cases():
    return cpu_backend_cases((F32, F16, BF16)) + [pytest.param("torch", F64, id="torch-float64")]


def _data(dtype, gen, *, b=2, t=5, d=16, v=100, device="cpu"):
    h = randn(b, t, d, dtype=dtype, generator=gen, device=device)
    w = randn(v, d, dtype=dtype, generator=gen, scale=d ** -0.5 * 3, device=device)
    labels = torch.randint(0, v, (b, t), generator=gen).to(device)
    return h, w, labels


def _ref(h, w, labels, temperature):
    """(logp [N], entropy [N]) in float64 from the full logits; differentiable."""
    logits = (h.double().reshape(-1, h.shape[-1]) @ w.double().t()) / temperature
    logsm = torch.log_softmax(logits, dim=-1)
    logp = logsm.gather(1, labels.reshape(-1, 1).long())[:, 0]
    entropy = -(logsm.exp() * logsm).sum(-1)
    return logp, entropy


def _abs_err(out, ref):
    return (out.detach().double() - ref.detach().double()).abs().max().item() if out.numel() else 0.0


@pytest.mark.parametrize("backend,dtype", _cases())
@pytest.mark.parametrize("temperature", [1.0, TEMP])
def test_none_matches_float64_reference(backend, dtype, temperature, gen):
    h, w, labels = _data(dtype, gen)
    logp, ent = linear_cross_entropy(h, w, labels, temperature, "none", backend=backend)
    rl, re = _ref(h, w, labels, temperature)
    # verl's convention: flat [N] fp32 outputs whatever the input dtype / labels' shape.
    want = F64 if dtype == F64 else F32
    assert logp.shape == ent.shape == (10,) and logp.dtype == ent.dtype == want
    assert bool((logp <= 0).all()), "log-probs, not cross-entropies (which are >= 0)"
    tol = contract.tolerance("linear_logprob", dtype).tolerance
    assert _abs_err(logp, rl) <= tol
    assert _abs_err(ent, re) <= tol


@pytest.mark.parametrize("backend,dtype", _cases())
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_gradients_match_float64_reference(backend, dtype, reduction, gen):
    h, w, labels = _data(dtype, gen)
    h.requires_grad_(True)
    w.requires_grad_(True)
    logp, ent = linear_cross_entropy(h, w, labels, TEMP, reduction, backend=backend)
    g_lp = torch.randn(logp.shape, generator=gen).to(logp.dtype)
    g_ent = randn(*ent.shape, dtype=ent.dtype, generator=gen)
    torch.autograd.backward((logp, ent), (g_lp, g_ent))

    hr, wr = h.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    rl, re = _ref(hr, wr, labels, TEMP)
    rl = {"none": rl, "sum": rl.sum(), "mean": rl.mean()}[reduction]
    torch.autograd.backward((rl, re), (g_lp.double(), g_ent.double()))
    tol = contract.tolerance("linear_logprob_grad", dtype).tolerance
    assert h.grad.shape == h.shape and w.grad.shape == w.shape
    assert rel_error(h.grad, hr.grad) <= tol, rel_error(h.grad, hr.grad)
    assert rel_error(w.grad, wr.grad) <= tol, rel_error(w.grad, wr.grad)


@pytest.mark.parametrize("backend,dtype", cpu_backend_cases((F32, F16)))
def test_sum_and_mean_reduce_the_logprobs_only(backend, dtype, gen):
    h, w, labels = _data(dtype, gen)
    per_tok, ent_none = linear_cross_entropy(h, w, labels, TEMP, "none", backend=backend)
    total, ent_sum = linear_cross_entropy(h, w, labels, TEMP, "sum", backend=backend)
    mean, ent_mean = linear_cross_entropy(h, w, labels, TEMP, "MEAN", backend=backend)  # verl lower()s it
    assert total.shape == mean.shape == () and total.dtype == mean.dtype == F32
    # The entropy stays per token, bit for bit the same as with "none".
    assert torch.equal(ent_sum, ent_none) and torch.equal(ent_mean, ent_none)
    assert torch.equal(total, per_tok.sum())
    assert torch.equal(mean, per_tok.sum() / per_tok.numel())
    rl, _ = _ref(h, w, labels, TEMP)
    tol = contract.tolerance("linear_logprob", dtype).tolerance
    assert abs(total.item() - rl.sum().item()) <= tol * rl.numel()
    assert abs(mean.item() - rl.mean().item()) <= tol


def test_empty_batch_gives_verl_reductions():
    h, w, labels = torch.zeros(0, 8), torch.randn(11, 8), torch.zeros(0, dtype=torch.long)
    lp, ent = linear_cross_entropy(h, w, labels)
    assert lp.shape == ent.shape == (0,)
    assert linear_cross_entropy(h, w, labels, reduction="sum")[0].item() == 0.0
    assert torch.isnan(linear_cross_entropy(h, w, labels, reduction="mean")[0])


@pytest.mark.parametrize("backend,dtype", cpu_backend_cases((F32, F16)))
def test_labels_any_shape_and_rows_are_batch_invariant(backend, dtype, gen):
    h, w, labels = _data(dtype, gen)
    full, ent = linear_cross_entropy(h, w, labels, TEMP, backend=backend)
    flat, ent_flat = linear_cross_entropy(h, w, labels.reshape(-1), TEMP, backend=backend)
    assert torch.equal(full, flat) and torch.equal(ent, ent_flat)
    # Each sequence alone gives its rows of the batched call, bitwise.
    for i in range(h.shape[0]):
        one, one_ent = linear_cross_entropy(h[i], w, labels[i], TEMP, backend=backend)
        t = h.shape[1]
        assert torch.equal(one, full[i * t:(i + 1) * t]) and torch.equal(one_ent, ent[i * t:(i + 1) * t])


def test_main_grad_receives_dw(gen):
    h, w, labels = _data(F32, gen)
    w.requires_grad_(True)
    w.main_grad = torch.zeros_like(w, dtype=F32)
    logp, ent = linear_cross_entropy(h, w, labels, TEMP, backend="torch")
    (logp.sum() + ent.sum()).backward()
    assert w.grad is None and bool(w.main_grad.abs().sum() > 0)


@pytest.mark.parametrize("reduction", ["avg", "elementwise_mean", "", None, 1])
def test_unknown_reduction_raises(reduction, gen):
    h, w, labels = _data(F32, gen)
    with pytest.raises(ValueError, match=r"rlkernels\.integrations\.trainers\.verl\.linear_cross_entropy: "
                                         r"reduction must be one of 'none', 'sum', 'mean'.*got"):
        linear_cross_entropy(h, w, labels, 1.0, reduction)


def test_refusals_name_the_op_and_values(gen):
    h, w, labels = _data(F32, gen)
    op = r"rlkernels\.integrations\.trainers\.verl\.linear_cross_entropy: "
    bad = labels.clone()
    bad[1, 2] = -100  # verl has no ignore index
    with pytest.raises(ValueError, match=op + r"label -100 at flat position 7 is outside \[0, 100\)"):
        linear_cross_entropy(h, w, bad)
    bad[1, 2] = 100
    with pytest.raises(ValueError, match=op + r"label 100 at flat position 7"):
        linear_cross_entropy(h, w, bad)
    with pytest.raises(ValueError, match=op + r"hidden \(2, 5, 16\) has 10 token rows but labels \(9,\)"):
        linear_cross_entropy(h, w, labels.reshape(-1)[:9])
    with pytest.raises(ValueError, match=op + r"temperature must be a finite number > 0, got 0"):
        linear_cross_entropy(h, w, labels, 0.0)
    with pytest.raises(TypeError, match=op + r"temperature must be a Python number \(float or int\), got Tensor "):
        linear_cross_entropy(h, w, labels, torch.tensor(0.7))
    with pytest.raises(ValueError, match=op + r"labels must be an integer tensor"):
        linear_cross_entropy(h, w, labels.float())
    with pytest.raises(NotImplementedError, match=op + r"dist_process_group"):
        linear_cross_entropy(h, w, labels, 1.0, "none", object())


# ------------------------------------------------------------------- against verl itself

@pytest.mark.gpu
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_matches_verl_on_shared_inputs(reduction):
    verl_lce = pytest.importorskip("verl.utils.kernel.linear_cross_entropy").linear_cross_entropy
    gen = torch.Generator().manual_seed(7)
    # verl's kernel needs D % 128 == 0 and a CUDA device.
    b, t, d, v = 1, 257, 256, 5003
    h = randn(b, t, d, dtype=BF16, generator=gen, device="cuda")
    w = randn(v, d, dtype=BF16, generator=gen, scale=d ** -0.5 * 3, device="cuda")
    labels = torch.randint(0, v, (b, t), generator=gen).cuda()
    outs = {}
    for name, fn in (("rlkernels", linear_cross_entropy), ("verl", verl_lce)):
        hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        logp, ent = fn(hh, ww, labels, TEMP, reduction)
        (logp.sum() + 0.5 * ent.sum()).backward()
        outs[name] = (logp.detach(), ent.detach(), hh.grad, ww.grad)
    (lp, en, gh, gw), (vlp, ven, vgh, vgw) = outs["rlkernels"], outs["verl"]
    assert lp.shape == vlp.shape and lp.dtype == vlp.dtype and en.shape == ven.shape and en.dtype == ven.dtype
    # verl's kernel is the less accurate of the two (entropy errors near 5e-3 measured).
    scale = t if reduction == "sum" else 1
    assert _abs_err(lp, vlp) <= 1e-2 * scale
    assert _abs_err(en, ven) <= 1e-2
    assert rel_error(gh, vgh) <= 3e-2 and rel_error(gw, vgw) <= 3e-2
