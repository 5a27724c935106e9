"""linear_logprob: accuracy vs float64, bitwise row invariance, deterministic backward, errors.

CPU: the torch backend always; the Triton kernels under TRITON_INTERPRET=1 (fp32/fp16;
the interpreter is slow, so its cases use the smallest shapes that still span
several vocabulary splits). The GPU tests (``-m gpu``, at the end) run the real sizes:
bf16 accuracy against float64, forward and backward, bitwise row invariance and
determinism, backward V chunking, int64 offsets and the memory bound.
"""
from __future__ import annotations

import math

import pytest
import torch

from rlkernels import contract
from rlkernels.ops.linear_logprob import TorchLinearLogprobBackend, TritonLinearLogprobBackend, linear_logprob
from rlkernels.ops.lm_head import backward_schedule as schedule_mod
from rlkernels.ops.lm_head.backward_schedule import backward_chunk
from rlkernels.ops.lm_head.config import FUSED_16BIT, FUSED_INTERPRETER
from rlkernels.reference import linear_logprob_ref
from rlkernels.registry import get_op, registered_ops
from rlkernels._env import triton_interpret
from rlkernels.testing import (
    assert_batch_invariant, assert_chunk_invariant, assert_deterministic, assert_order_invariant,
    assert_padding_invariant, rel_error,
)

from ..conftest import cpu_backend_cases, randn

F64, F32, F16, BF16 = torch.float64, torch.float32, torch.float16, torch.bfloat16

# Tolerances, named like the contract table (rlkernels.contract) until they move there.
# Forward: max |logp - ref| and max |entropy - ref| (abs). The reference runs on the
# same (already rounded) inputs, so 16-bit inputs only add the fp32 D-chain error.
LINEAR_LOGPROB_ABS = {dt: t.tolerance for dt, t in contract.CONTRACT["linear_logprob"].items()}
# Backward: rel_error of dhidden/dweight/dbias vs float64 autograd of the reference.
# g = dL/dlogits is rounded to the input dtype before the two GEMMs: 16-bit grads
# carry that rounding (unit roundoff 4.9e-4 fp16, 3.9e-3 bf16).
LINEAR_LOGPROB_GRAD_REL = {dt: t.tolerance for dt, t in contract.CONTRACT["linear_logprob_grad"].items()}

TEMP = 0.7


def _cases(dtypes):
    """cpu_backend_cases minus triton-float64 (float64 is a torch-backend-only dtype)."""
    return [c for c in cpu_backend_cases(dtypes) if not (c.values[0] == "triton" and c.values[1] == F64)]


def _is_triton(backend: str) -> bool:
    return backend == "triton"


def _data(n, d, v, dtype, gen, *, bias=True, ignore=True, shape=None, device="cpu"):
    h = randn(*(shape or (n,)), d, dtype=dtype, generator=gen, device=device)
    w = randn(v, d, dtype=dtype, generator=gen, scale=d ** -0.5 * 3, device=device)
    b = randn(v, dtype=dtype, generator=gen, device=device) if bias else None
    t = torch.randint(0, v, tuple(shape or (n,)), generator=gen).to(device)
    if ignore and t.numel() > 2:
        t.view(-1)[1::4] = -100
    return h, w, b, t


def _check_forward(h, w, b, t, backend, **kw):
    lp, ent = linear_logprob(h, w, t, b, return_entropy=True, backend=backend, **kw)
    rl, re = linear_logprob_ref(h, w, t, b, **kw)
    tol = LINEAR_LOGPROB_ABS[h.dtype]
    assert lp.dtype == (F64 if h.dtype == F64 else F32) and lp.shape == t.shape and ent.shape == t.shape
    e_lp = (lp.double() - rl).abs().max().item() if lp.numel() else 0.0
    e_h = (ent.double() - re).abs().max().item() if ent.numel() else 0.0
    assert e_lp <= tol, f"logp abs error {e_lp:.3e} > {tol}"
    assert e_h <= tol, f"entropy abs error {e_h:.3e} > {tol}"
    return lp, ent


# ------------------------------------------------------------------------------- forward

SHAPES = [(1, 16, 17), (7, 40, 100), (33, 16, 257)]


@pytest.mark.parametrize("backend,dtype", _cases((F32, F16, BF16, F64)))
@pytest.mark.parametrize("n,d,v", SHAPES, ids=lambda s: str(s))
def test_forward_accuracy(backend, dtype, n, d, v, gen):
    if _is_triton(backend) and n * v > 2000 and dtype != F32:
        pytest.skip("interpreter time: the largest shape runs for fp32 only")
    h, w, b, t = _data(n, d, v, dtype, gen)
    lp, ent = _check_forward(h, w, b, t, backend, temperature=TEMP)
    ignored = t == -100
    assert torch.all(lp[ignored] == 0) and torch.all(ent[ignored] == 0)
    assert torch.all(lp[~ignored] <= 0) and torch.all(ent[~ignored] >= 0)


@pytest.mark.parametrize("backend,dtype", _cases((F32,)))
def test_forward_no_bias_no_temperature_and_logp_only(backend, dtype, gen):
    h, w, _, t = _data(7, 40, 100, dtype, gen, bias=False)
    _check_forward(h, w, None, t, backend)
    lp = linear_logprob(h, w, t, backend=backend)
    assert isinstance(lp, torch.Tensor) and lp.shape == t.shape
    assert torch.equal(lp, linear_logprob(h, w, t, backend=backend, return_entropy=True)[0])


@pytest.mark.parametrize("backend,dtype", _cases((F32,)))
def test_leading_dims_and_ignore_index_inside_vocab(backend, dtype, gen):
    h, w, b, t = _data(0, 16, 100, dtype, gen, shape=(2, 5), ignore=False)
    t[0, 1] = 3
    t[1, 4] = 3
    lp, ent = _check_forward(h, w, b, t, backend, ignore_index=3)
    assert lp.shape == (2, 5) and lp[0, 1] == 0 and ent[1, 4] == 0
    # Same rows flattened: identical bits.
    lp2, ent2 = linear_logprob(h.reshape(10, 16), w, t.reshape(10), b, ignore_index=3, return_entropy=True,
                               backend=backend)
    assert torch.equal(lp.reshape(10), lp2) and torch.equal(ent.reshape(10), ent2)


@pytest.mark.parametrize("backend,dtype", _cases((F32,)))
def test_strided_inputs(backend, dtype, gen):
    """Non-contiguous hidden, weight and bias give the bits of their contiguous copies."""
    h, w, b, t = _data(7, 40, 100, dtype, gen)
    hs = torch.stack([h, -h], dim=-1)[..., 0]
    ws = w.t().contiguous().t()
    bs = torch.stack([b, b], dim=1)[:, 0]
    assert not (hs.is_contiguous() or ws.is_contiguous() or bs.is_contiguous())
    got = linear_logprob(hs, ws, t, bs, temperature=TEMP, return_entropy=True, backend=backend)
    want = linear_logprob(h, w, t, b, temperature=TEMP, return_entropy=True, backend=backend)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    gl = torch.randn(7, generator=gen)
    gs = _grads(hs, ws, bs, t, backend, gl, None)
    gw = _grads(h, w, b, t, backend, gl, None)
    assert all(torch.equal(x, y) for x, y in zip(gs, gw))


@pytest.mark.parametrize("backend,dtype", _cases((F32, F64)))
def test_empty_batch(backend, dtype, gen):
    _, w, b, _ = _data(1, 16, 17, dtype, gen)
    w.requires_grad_()
    h = torch.empty(0, 16, dtype=dtype, requires_grad=True)
    t = torch.empty(0, dtype=torch.int64)
    lp, ent = linear_logprob(h, w, t, b, return_entropy=True, backend=backend)
    assert lp.shape == (0,) and ent.shape == (0,)
    (lp.sum() + ent.sum()).backward()
    assert h.grad.shape == (0, 16) and torch.equal(w.grad, torch.zeros_like(w))


def _zero_dim_ref(b, t, v, gl, ge, temperature):
    """(logp, entropy, dbias) in float64 when D = 0: the logits are bias / T (zeros without bias)."""
    bd = b.detach().double().requires_grad_() if b is not None else None
    z = (bd / temperature) if bd is not None else torch.zeros(v, dtype=F64)
    logsm = torch.log_softmax(z, dim=0)
    flat = t.reshape(-1)
    valid = flat != -100
    logp = torch.where(valid, logsm[flat.clamp(min=0)], torch.zeros((), dtype=F64))
    ent = torch.where(valid, -(logsm.exp() * logsm).sum(), torch.zeros((), dtype=F64))
    db = None
    if bd is not None:
        loss = (logp * gl.double().reshape(-1)).sum() + (ent * ge.double().reshape(-1)).sum()
        (db,) = torch.autograd.grad(loss, bd)
    return logp.reshape(t.shape), ent.reshape(t.shape), db


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("backend,dtype", _cases((F32, F16)))
def test_zero_hidden_dim(backend, dtype, bias, gen):
    # D = 0: every logit is the bias (or 0), as stock matmul gives for K = 0.
    v = 37
    b = randn(v, dtype=dtype, generator=gen) if bias else None
    t = torch.tensor([[0, 36, -100], [5, 5, 1]])
    h = torch.empty(2, 3, 0, dtype=dtype, requires_grad=True)
    w = torch.empty(v, 0, dtype=dtype, requires_grad=True)
    bb = b.clone().requires_grad_() if bias else None
    lp, ent = linear_logprob(h, w, t, bb, temperature=TEMP, return_entropy=True, backend=backend)
    assert lp.shape == ent.shape == t.shape and lp.dtype == ent.dtype == F32
    gl, ge = torch.randn(t.shape, generator=gen), torch.randn(t.shape, generator=gen)
    rl, re, rdb = _zero_dim_ref(b, t, v, gl, ge, TEMP)
    tol = LINEAR_LOGPROB_ABS[dtype]
    assert (lp.double() - rl).abs().max().item() <= tol
    assert (ent.double() - re).abs().max().item() <= tol
    if not bias:  # uniform over the vocabulary
        assert (lp[t != -100].double() + math.log(v)).abs().max().item() <= tol
    grads = torch.autograd.grad((lp * gl).sum() + (ent * ge).sum(), [x for x in (h, w, bb) if x is not None])
    assert grads[0].shape == (2, 3, 0) and grads[1].shape == (v, 0)
    assert grads[0].dtype == grads[1].dtype == dtype
    if bias:
        assert grads[2].dtype == dtype
        assert rel_error(grads[2], rdb) <= LINEAR_LOGPROB_GRAD_REL[dtype]


@pytest.mark.parametrize("backend,dtype", _cases((F32,)))
def test_zero_hidden_dim_and_no_tokens(backend, dtype, gen):
    h = torch.empty(0, 0, dtype=dtype, requires_grad=True)
    b = randn(5, dtype=dtype, generator=gen).requires_grad_()
    lp, ent = linear_logprob(h, torch.empty(5, 0, dtype=dtype), torch.empty(0, dtype=torch.int64), b,
                             return_entropy=True, backend=backend)
    assert lp.shape == ent.shape == (0,)
    (lp.sum() + ent.sum()).backward()
    assert h.grad.shape == (0, 0) and torch.equal(b.grad, torch.zeros_like(b))


@pytest.mark.parametrize("backend,dtype", _cases((F32,)))
def test_double_backward_is_refused(backend, dtype, gen):
    h, w, b, t = _data(6, 16, 50, dtype, gen)
    h, w = h.requires_grad_(), w.requires_grad_()
    plain = torch.autograd.grad(linear_logprob(h, w, t, b, backend=backend).sum(), (h, w))
    # create_graph=True alone is fine (same first-order bits) ...
    gh, gw = torch.autograd.grad(linear_logprob(h, w, t, b, backend=backend).sum(), (h, w), create_graph=True)
    assert torch.equal(gh, plain[0]) and torch.equal(gw, plain[1])
    # ... but differentiating the gradients must not silently drop the second-order terms.
    with pytest.raises(RuntimeError, match=r"rlkernels\.linear_logprob: double backward is not supported"):
        torch.autograd.grad((gh * h).sum(), h)
    gw = torch.autograd.grad(linear_logprob(h, w, t, b, backend=backend).sum(), w, create_graph=True)[0]
    with pytest.raises(RuntimeError, match=r"rlkernels\.linear_logprob: double backward is not supported"):
        gw.square().sum().backward()


def test_large_logits_stay_finite(gen):
    # Logits around +-1e4: the online max keeps every exp in range; the error is the
    # fp32 rounding of the logits themselves (relative to their size).
    h, w, b, t = _data(5, 16, 300, F32, gen)
    h = h * 300
    lp, ent = linear_logprob(h, w, t, b, return_entropy=True)
    rl, re = linear_logprob_ref(h, w, t, b)
    scale = (h.double() @ w.double().t()).abs().max().item()
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all()
    assert (lp.double() - rl).abs().max().item() <= 1e-6 * scale
    assert (ent.double() - re).abs().max().item() <= 1e-6 * scale


# ------------------------------------------------------------------- truncated (logit_threshold)


def _trained(data):
    """``_data``'s (h, w, b, t) with the head at a trained model's scale (logit std ~6)."""
    h, w, b, t = data
    return h, w * 2, b, t


def _thresholds(h, w, b, keep, temperature=TEMP):
    """Per row: midway between the keep-th and (keep+1)-th largest float64 scaled logits (no
    logit near it, so fp32 rounding cannot move the kept set); -inf on every third row."""
    z = linear_logprob_ref_logits(h, w, b, temperature)
    top = z.topk(keep + 1, dim=-1).values
    tau = ((top[..., keep - 1] + top[..., keep]) / 2).to(F64 if h.dtype == F64 else F32)
    tau.view(-1)[::3] = -math.inf
    return tau


def linear_logprob_ref_logits(h, w, b, temperature):
    z = h.double().reshape(-1, h.shape[-1]) @ w.double().T + (b.double() if b is not None else 0)
    return (z / temperature).reshape(*h.shape[:-1], w.shape[0])


@pytest.mark.parametrize("backend,dtype", _cases((F32, F16, BF16, F64)))
def test_truncated_forward_accuracy(backend, dtype, gen):
    h, w, b, _ = _trained(_data(7, 40, 100, dtype, gen))
    tau = _thresholds(h, w, b, 12)
    z = linear_logprob_ref_logits(h, w, b, TEMP)
    # Targets inside each row's kept set (ignored rows aside): what a sampler drew.
    t = torch.multinomial(torch.softmax(torch.where(z < tau.double()[:, None], -math.inf, z), -1), 1,
                          generator=gen)[:, 0]
    t[1] = -100
    lp, ent = _check_forward(h, w, b, t, backend, temperature=TEMP, logit_threshold=tau)
    full = linear_logprob(h, w, t, b, temperature=TEMP, backend=backend)
    truncated = torch.isfinite(tau) & (t >= 0)
    assert (lp[truncated] >= full[truncated]).all() and (lp[truncated] > full[truncated]).any()
    # -inf keeps every logit: the untruncated log-prob's bits.
    assert torch.equal(lp[~torch.isfinite(tau)], full[~torch.isfinite(tau)])


@pytest.mark.parametrize("backend,dtype", _cases((F32, F64)))
def test_a_kept_set_inside_one_vocabulary_split_gives_a_finite_entropy(backend, dtype, gen):
    """V = 5000 spans three 2048-id splits; keeping 6 logits leaves whole splits without one
    (their max -inf and mass 0), which the splits' merge must add as nothing."""
    h, w, b, _ = _trained(_data(5, 8, 5000, dtype, gen))
    b[:10] += 40.0  # the largest logits all in the first split
    tau = _thresholds(h, w, b, 6)
    t = linear_logprob_ref_logits(h, w, b, TEMP).argmax(dim=-1)
    lp, ent = _check_forward(h, w, b, t, backend, temperature=TEMP, logit_threshold=tau)
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all()


@pytest.mark.parametrize("backend,dtype", _cases((F32, F16, F64)))
def test_truncated_backward_matches_float64_autograd(backend, dtype, gen):
    h, w, b, _ = _trained(_data(9, 24, 70, dtype, gen))
    tau = _thresholds(h, w, b, 8)
    z = linear_logprob_ref_logits(h, w, b, TEMP)
    t = z.argmax(dim=-1)
    t[2] = -100
    gl, ge = randn(9, generator=gen, dtype=F64), randn(9, generator=gen, dtype=F64)
    hh, ww, bb = (x.detach().clone().requires_grad_() for x in (h, w, b))
    lp, ent = linear_logprob(hh, ww, t, bb, temperature=TEMP, return_entropy=True, logit_threshold=tau,
                             backend=backend)
    (lp.double() * gl + ent.double() * ge).sum().backward()
    rh, rw, rb = (x.detach().double().requires_grad_() for x in (h, w, b))
    rl, re = linear_logprob_ref(rh, rw, t, rb, temperature=TEMP, logit_threshold=tau)
    (rl * gl + re * ge).sum().backward()
    tol = LINEAR_LOGPROB_GRAD_REL[dtype]
    for got, want in ((hh.grad, rh.grad), (ww.grad, rw.grad), (bb.grad, rb.grad)):
        assert torch.isfinite(got).all()
        assert rel_error(got, want) <= tol


@pytest.mark.parametrize("backend,dtype", _cases((F32,)))
def test_a_target_outside_its_kept_set_gets_minus_inf_and_no_gradient(backend, dtype, gen):
    h, w, b, _ = _trained(_data(4, 16, 50, dtype, gen))
    z = linear_logprob_ref_logits(h, w, b, 1.0)
    tau = _thresholds(h, w, b, 5, 1.0)
    tau[0] = z[0].max().float()  # row 0 keeps its largest logit only
    t = z.argmin(dim=-1)  # never kept where tau is finite
    hh = h.clone().requires_grad_()
    lp = linear_logprob(hh, w, t, b, logit_threshold=tau, backend=backend)
    assert torch.isneginf(lp[torch.isfinite(tau)]).all() and torch.isfinite(lp[~torch.isfinite(tau)]).all()
    lp[~torch.isfinite(tau)].sum().backward()
    assert torch.isfinite(hh.grad).all() and (hh.grad[torch.isfinite(tau)] == 0).all()


@pytest.mark.parametrize("backend,dtype", _cases((F32, F16)))
def test_truncated_rows_are_batch_invariant(backend, dtype, gen):
    h, w, b, t = _trained(_data(13, 24, 90, dtype, gen, ignore=False))
    tau = _thresholds(h, w, b, 10)
    full = linear_logprob(h, w, t, b, temperature=TEMP, return_entropy=True, logit_threshold=tau, backend=backend)
    for rows in (torch.tensor([5]), torch.tensor([12, 0, 5]), torch.randperm(13, generator=gen)):
        part = linear_logprob(h[rows], w, t[rows], b, temperature=TEMP, return_entropy=True,
                              logit_threshold=tau[rows], backend=backend)
        for got, want in zip(part, full):
            assert torch.equal(got.view(torch.int32), want[rows].view(torch.int32))


@pytest.mark.parametrize("threshold, err, match", [
    ([0.0] * 4, TypeError, r"logit_threshold must be a tensor, got list"),
    (torch.zeros(3), ValueError, r"logit_threshold shape \(3,\) must equal \(4,\) \(one threshold per scored token\)"),
    (torch.zeros(4, dtype=torch.float64), ValueError, r"logit_threshold must be torch.float32 .*got torch.float64"),
    (torch.zeros(4, dtype=torch.bfloat16), ValueError, r"logit_threshold must be torch.float32"),
    (torch.tensor([0.0, float("nan"), 0.0, 0.0]), ValueError, r"logit_threshold is NaN at flat position 1"),
    (torch.zeros(4, device="meta"), ValueError, r"logit_threshold is on meta, the tokens on cpu"),
])
def test_bad_thresholds_are_refused_naming_the_op(threshold, err, match, gen):
    h, w, b, t = _trained(_data(4, 8, 30, F32, gen, ignore=False))
    with pytest.raises(err, match=rf"rlkernels.linear_logprob: {match}"):
        linear_logprob(h, w, t, b, logit_threshold=threshold)


# --------------------------------------------------- a model's logit transform (scale, soft-cap)

# Cohere's scale, Gemma's soft-cap (at a trained head's spread, past the cap), and both.
TRANSFORMS = [dict(logit_scale=0.25), dict(logit_softcap=6.0), dict(logit_scale=2.0, logit_softcap=6.0)]


def _transform_cases(dtypes):
    """(backend, dtype, transform): every transform on the torch backend, the combined one
    interpreted (interpreter time)."""
    return [pytest.param(*c.values, kw, id=f"{c.id}-{'-'.join(f'{k}{v:g}' for k, v in kw.items())}")
            for c in _cases(dtypes) for kw in TRANSFORMS if c.values[0] == "torch" or len(kw) == 2]


@pytest.mark.parametrize("backend,dtype,transform", _transform_cases((F32, F16, F64)))
def test_logit_transform_forward_and_backward_match_float64(backend, dtype, transform, gen):
    h, w, b, t = _trained(_data(9, 24, 70, dtype, gen))
    gl, ge = torch.randn(9, generator=gen), torch.randn(9, generator=gen)
    _check_forward(h, w, b, t, backend, temperature=TEMP, **transform)
    got = _grads(h, w, b, t, backend, gl, ge, temperature=TEMP, **transform)
    want = _ref_grads(h, w, b, t, gl, ge, temperature=TEMP, **transform)
    for name, g, r in zip(("dhidden", "dweight", "dbias"), got, want):
        assert rel_error(g, r) <= LINEAR_LOGPROB_GRAD_REL[dtype], name
    # The transform moves the distribution: the plain head's log-probs are far off.
    plain = linear_logprob(h, w, t, b, temperature=TEMP, backend=backend)
    assert float((plain - linear_logprob(h, w, t, b, temperature=TEMP, backend=backend, **transform)).abs().max()) > 0.1


@pytest.mark.parametrize("backend,dtype,transform", _transform_cases((F32, F16)))
def test_logit_transform_rows_are_batch_invariant(backend, dtype, transform, gen):
    h, w, b, t = _trained(_data(11, 24, 300, dtype, gen))
    fn = _row_fn(h, w, b, t, backend, temperature=TEMP, **transform)
    rows = torch.arange(11)
    assert_batch_invariant(fn, rows, sizes=[1, 5, 10])
    assert_padding_invariant(fn, rows, before=2, after=1)
    assert_order_invariant(fn, rows)


@pytest.mark.parametrize("backend,dtype", _cases((F32,)))
def test_neutral_logit_transform_gives_the_plain_bits(backend, dtype, gen):
    h, w, b, t = _trained(_data(7, 24, 70, dtype, gen))
    plain = linear_logprob(h, w, t, b, temperature=TEMP, return_entropy=True, backend=backend)
    neutral = linear_logprob(h, w, t, b, temperature=TEMP, return_entropy=True, backend=backend, logit_scale=1,
                             logit_softcap=0)
    for got, want in zip(neutral, plain):
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("kw, err, match", [
    (dict(logit_scale=0.0), ValueError, r"logit_scale must be a finite number > 0 \(1: none\), got 0.0"),
    (dict(logit_scale=-2.0), ValueError, r"logit_scale must be a finite number > 0"),
    (dict(logit_scale=float("nan")), ValueError, r"logit_scale must be a finite number > 0"),
    (dict(logit_scale=torch.tensor(0.5)), TypeError, r"logit_scale must be a Python number, got Tensor"),
    (dict(logit_softcap=-1.0), ValueError, r"logit_softcap must be a finite number >= 0 \(0: no soft-cap\)"),
    (dict(logit_softcap=float("inf")), ValueError, r"logit_softcap must be a finite number >= 0"),
    (dict(logit_softcap=None), TypeError, r"logit_softcap must be a Python number, got NoneType"),
    (dict(logit_softcap=True), TypeError, r"logit_softcap must be a Python number, got bool"),
])
def test_bad_logit_transforms_are_refused_naming_the_op(kw, err, match, gen):
    h, w, b, t = _data(4, 8, 30, F32, gen, ignore=False)
    with pytest.raises(err, match=rf"rlkernels.linear_logprob: {match}"):
        linear_logprob(h, w, t, b, **kw)


# ----------------------------------------------------------------------------- invariance

def _row_fn(h, w, b, t, backend, **kw):
    def fn(rows: torch.Tensor):
        return linear_logprob(h[rows], w, t[rows], b, return_entropy=True, backend=backend, **kw)
    return fn


@pytest.mark.parametrize("backend,dtype", _cases((F32, F16, BF16)))
def test_forward_invariance(backend, dtype, gen):
    n, d, v = (13, 40, 150) if _is_triton(backend) else (33, 40, 257)
    h, w, b, t = _data(n, d, v, dtype, gen)
    fn = _row_fn(h, w, b, t, backend, temperature=TEMP)
    rows = torch.arange(n)
    sizes = [1, 6, n - 1] if _is_triton(backend) else None
    assert_batch_invariant(fn, rows, sizes=sizes)
    assert_chunk_invariant(fn, rows)
    assert_padding_invariant(fn, rows, before=2, after=3)
    assert_order_invariant(fn, rows)
    assert_deterministic(fn, rows, runs=2)


# ------------------------------------------------------------------------------- backward

def _grads(h, w, b, t, backend, gl, ge, **kw):
    """(dh, dw, db) of sum(gl * logp + ge * entropy); gl/ge may be None (output unused)."""
    leaves = [x.detach().clone().requires_grad_() for x in (h, w, b) if x is not None]
    hh, ww = leaves[0], leaves[1]
    bb = leaves[2] if b is not None else None
    lp, ent = linear_logprob(hh, ww, t, bb, return_entropy=True, backend=backend, **kw)
    loss = 0
    if gl is not None:
        loss = loss + (lp * gl.to(lp.dtype)).sum()
    if ge is not None:
        loss = loss + (ent * ge.to(ent.dtype)).sum()
    return torch.autograd.grad(loss, leaves)


def _ref_grads(h, w, b, t, gl, ge, **kw):
    leaves = [x.detach().double().requires_grad_() for x in (h, w, b) if x is not None]
    lp, ent = linear_logprob_ref(leaves[0], leaves[1], t, leaves[2] if b is not None else None, **kw)
    loss = 0
    if gl is not None:
        loss = loss + (lp * gl.double()).sum()
    if ge is not None:
        loss = loss + (ent * ge.double()).sum()
    return torch.autograd.grad(loss, leaves)


@pytest.mark.parametrize("backend,dtype", _cases((F32, F16, BF16, F64)))
@pytest.mark.parametrize("which", ["both", "logp", "entropy"])
def test_backward_accuracy(backend, dtype, which, gen):
    if _is_triton(backend) and which != "both" and dtype != F32:
        pytest.skip("interpreter time")
    n, d, v = (9, 40, 100) if _is_triton(backend) else (33, 40, 257)
    h, w, b, t = _data(n, d, v, dtype, gen)
    gl = torch.randn(n, generator=gen) if which != "entropy" else None
    ge = torch.randn(n, generator=gen) if which != "logp" else None
    got = _grads(h, w, b, t, backend, gl, ge, temperature=TEMP)
    want = _ref_grads(h, w, b, t, gl, ge, temperature=TEMP)
    for name, g, r in zip(("dhidden", "dweight", "dbias"), got, want):
        assert g.dtype == dtype
        err = rel_error(g, r)
        assert err <= LINEAR_LOGPROB_GRAD_REL[dtype], f"{name}: rel error {err:.3e}"
    # Ignored rows get exactly zero gradient.
    assert torch.all(got[0][t == -100] == 0)


@pytest.mark.parametrize("backend,dtype", _cases((F32, F16)))
def test_backward_deterministic_and_dhidden_invariant(backend, dtype, gen):
    if _is_triton(backend) and dtype != F32:
        pytest.skip("interpreter time: fp16 kernel logic is covered by the accuracy tests")
    n, d, v = (9, 40, 100) if _is_triton(backend) else (33, 40, 257)
    h, w, b, t = _data(n, d, v, dtype, gen)
    gl, ge = torch.randn(n, generator=gen), torch.randn(n, generator=gen)

    def all_grads(rows):
        return _grads(h[rows], w, b, t[rows], backend, gl[rows], ge[rows], temperature=TEMP)

    rows = torch.arange(n)
    assert_deterministic(all_grads, rows, runs=2)

    def dhidden(rows):
        return all_grads(rows)[0]

    sizes = [1, n - 2] if _is_triton(backend) else None
    assert_batch_invariant(dhidden, rows, sizes=sizes)
    if not _is_triton(backend):
        assert_padding_invariant(dhidden, rows)
        assert_order_invariant(dhidden, rows)


def test_backward_no_bias_hidden_only_and_weight_only(gen):
    h, w, _, t = _data(7, 16, 100, F32, gen, bias=False)
    gl = torch.randn(7, generator=gen)
    want = _ref_grads(h, w, None, t, gl, None)
    hh = h.clone().requires_grad_()
    linear_logprob(hh, w, t).mul(gl).sum().backward()
    assert rel_error(hh.grad, want[0]) <= LINEAR_LOGPROB_GRAD_REL[F32]
    ww = w.clone().requires_grad_()
    linear_logprob(h, ww, t).mul(gl).sum().backward()
    assert rel_error(ww.grad, want[1]) <= LINEAR_LOGPROB_GRAD_REL[F32]


def test_bias_grad_only(gen):
    h, w, b, t = _data(7, 16, 100, F32, gen)
    gl = torch.randn(7, generator=gen)
    bb = b.clone().requires_grad_()
    linear_logprob(h, w, t, bb).mul(gl).sum().backward()
    assert rel_error(bb.grad, _ref_grads(h, w, b, t, gl, None)[2]) <= LINEAR_LOGPROB_GRAD_REL[F32]


def test_main_grad_chains_like_one_batch(gen):
    """weight.main_grad (fp32) accumulates micro-batches exactly like one big batch."""
    h, w, b, t = _data(32, 16, 100, F32, gen)
    gl = torch.randn(32, generator=gen)

    def run(parts):
        ww = w.clone().requires_grad_()
        ww.main_grad = torch.zeros(w.shape, dtype=torch.float32)
        for sl in parts:
            linear_logprob(h[sl], ww, t[sl], b).mul(gl[sl]).sum().backward()
        assert ww.grad is None
        return ww.main_grad

    one = run([slice(0, 32)])
    two = run([slice(0, 16), slice(16, 32)])
    assert torch.equal(one, two)
    assert rel_error(one, _ref_grads(h, w, b, t, gl, None)[1]) <= LINEAR_LOGPROB_GRAD_REL[F32]


@pytest.mark.parametrize("backend,dtype", _cases((F32,)))
def test_backward_chunk_size_does_not_change_bits(backend, dtype, gen, monkeypatch):
    """The dH chain is split at backward V chunks; the split points must not change any bit."""
    import rlkernels.ops.linear_logprob as mod

    n, v = (5, 150) if _is_triton(backend) else (9, 600)
    h, w, b, t = _data(n, 16, v, dtype, gen)
    gl, ge = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    base = _grads(h, w, b, t, backend, gl, ge, temperature=TEMP)  # one chunk
    monkeypatch.setattr(mod, "backward_chunk", lambda n_rows, vocab, elem: 64)
    chunked = _grads(h, w, b, t, backend, gl, ge, temperature=TEMP)  # partial last chunk too
    for name, x, y in zip(("dhidden", "dweight", "dbias"), base, chunked):
        assert torch.equal(x, y), name


# (n, v, chunk, main-loop chunk factor): the tail inside a main-loop chunk, with the
# last chunk's g (a 1-column sliver, swapped for a wider buffer) kept for the columns
# past 256; a 3x wider main loop; the whole tail inside the kept last chunk (nothing
# recomputed); the recompute in the last chunk's own buffer.
TAIL_CASES = [(33, 257, 64, 1), (33, 257, 64, 3), (7, 300, 64, 1), (33, 300, 64, 1)]


@pytest.mark.parametrize("n,v,cv,main_chunks", TAIL_CASES, ids=["mid_chunk", "wide_main_loop", "all_in_last", "recompute_in_last_buffer"])
@pytest.mark.parametrize("backend,dtype", _cases((F16, BF16)))
def test_dh_accumulator_in_dw_tail_keeps_the_bits(backend, dtype, n, v, cv, main_chunks, gen, monkeypatch):
    """dH accumulated in dW's not-yet-written last rows (their dW computed after dH from
    the kept last chunk of g or a recomputed one, in chunks other than the main loop's)
    gives the bits of a separate accumulator."""
    import rlkernels.ops.linear_logprob as mod

    d = 40
    h, w, b, t = _data(n, d, v, dtype, gen)
    gl, ge = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    monkeypatch.setattr(mod, "backward_chunk", lambda n_rows, vocab, elem: cv)
    monkeypatch.setattr(mod, "dw_tail_rows", lambda *args: None)
    separate = _grads(h, w, b, t, backend, gl, ge, temperature=TEMP)
    monkeypatch.undo()
    monkeypatch.setattr(mod, "backward_chunk", lambda n_rows, vocab, elem: cv)
    monkeypatch.setattr(schedule_mod, "ACC_IN_DW_MAX_RECOMPUTE", 1.0)
    monkeypatch.setattr(mod, "main_loop_chunk", lambda cv_, dim: main_chunks * cv_)
    tail = mod.dw_tail_rows(n, d, v, cv, torch.float32, torch.empty(v, d, dtype=dtype))
    assert tail is not None and tail % cv != 0
    in_tail = _grads(h, w, b, t, backend, gl, ge, temperature=TEMP)
    for name, x, y in zip(("dhidden", "dweight", "dbias"), separate, in_tail):
        assert torch.equal(x, y), name


@pytest.mark.parametrize("backend,dtype", _cases((F16, BF16)))
def test_g_in_dw_free_rows_keeps_the_bits(backend, dtype, gen, monkeypatch):
    """The main loop's widest chunks keep g in dW's rows not yet written (before dH's
    accumulator): the grads are bitwise those of the same loop with a separate g buffer,
    and of a separate accumulator."""
    import rlkernels.ops.linear_logprob as mod

    n, d, v, cv = 7, 40, 300, 32
    h, w, b, t = _data(n, d, v, dtype, gen)
    gl, ge = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    # Splits of the dH chain at multiples of 16: the interpreter GEMM's K step (the torch
    # chain splits anywhere), so the small shape can hold a chunk wider than the buffer.
    monkeypatch.setattr(schedule_mod, "BWD_CHUNK_ALIGN", 16)
    monkeypatch.setattr(mod, "backward_chunk", lambda n_rows, vocab, elem: cv)
    monkeypatch.setattr(schedule_mod, "ACC_IN_DW_MAX_RECOMPUTE", 1.0)
    tail = mod.dw_tail_rows(n, d, v, cv, F32, torch.empty(v, d, dtype=dtype))
    schedule = mod.main_loop_schedule(mod.last_chunk_start(v, cv), mod.main_loop_chunk(cv, d), tail, n, d, 2)
    assert [off is None for _, _, off in schedule] == [False, True], schedule
    aliased = _grads(h, w, b, t, backend, gl, ge, temperature=TEMP)
    plain_schedule = mod.main_loop_schedule
    monkeypatch.setattr(mod, "main_loop_schedule",
                        lambda last, main_cv, free_end, *rest: plain_schedule(last, main_cv, None, *rest))
    in_buffer = _grads(h, w, b, t, backend, gl, ge, temperature=TEMP)
    monkeypatch.setattr(mod, "dw_tail_rows", lambda *args: None)
    separate = _grads(h, w, b, t, backend, gl, ge, temperature=TEMP)
    for name, x, y, z in zip(("dhidden", "dweight", "dbias"), aliased, in_buffer, separate):
        assert torch.equal(x, y) and torch.equal(x, z), name


def test_dh_accumulator_in_dw_tail_with_odd_v_times_d(gen, monkeypatch):
    """V * D odd: dW's bytes are not a whole number of fp32 words, its tail slice still is."""
    import rlkernels.ops.linear_logprob as mod

    n, d, v = 7, 41, 257
    h, w, b, t = _data(n, d, v, BF16, gen)
    gl, ge = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    monkeypatch.setattr(mod, "backward_chunk", lambda n_rows, vocab, elem: 32)
    monkeypatch.setattr(schedule_mod, "ACC_IN_DW_MAX_RECOMPUTE", 1.0)
    assert mod.dw_tail_rows(n, d, v, 32, torch.float32, torch.empty(v, d, dtype=BF16)) is not None
    in_tail = _grads(h, w, b, t, "torch", gl, ge, temperature=TEMP)
    monkeypatch.setattr(mod, "dw_tail_rows", lambda *args: None)
    separate = _grads(h, w, b, t, "torch", gl, ge, temperature=TEMP)
    for name, x, y in zip(("dhidden", "dweight", "dbias"), separate, in_tail):
        assert torch.equal(x, y), name


def test_dh_accumulator_placement_rule():
    from rlkernels.ops.lm_head.backward_schedule import dw_tail_rows

    bf = torch.empty(1, dtype=BF16)
    # The benchmark shape: 16384 rows of dW hold the fp32 [8192, 4096] accumulator; the
    # columns from 135552 on (11% of V) compute dW after dH.
    assert dw_tail_rows(8192, 4096, 151936, 4096, F32, bf) == 151936 - 16384
    assert dw_tail_rows(1024, 4096, 151936, 32768, F32, bf) is None  # accumulator < g buffer
    assert dw_tail_rows(32768, 4096, 151936, 4096, F32, bf) is None  # 43% of V to recompute
    assert dw_tail_rows(8192, 4096, 151936, 4096, F32, torch.empty(1)) is None  # fp32: nothing to save
    assert dw_tail_rows(8192, 4096, 151936, 4096, F32, None) is None  # no dW buffer (main_grad)
    assert dw_tail_rows(100, 4095, 1000, 256, F32, bf) % 8 == 0  # 16-byte aligned start


def test_backward_chunk_rule():
    from rlkernels.ops.lm_head.backward_schedule import last_chunk_start, main_loop_chunk, main_loop_schedule

    assert backward_chunk(8192, 151936, 2) == 4096
    # The main loop beside an accumulator in dW's tail: wider by D, in multiples of 256.
    assert main_loop_chunk(4096, 4096) == 8192
    assert main_loop_chunk(4096, 4095) == 4096 + 3840
    assert main_loop_chunk(512, 200) == 512
    # The kept last chunk: starts at a multiple of 256, at most cv wide.
    assert last_chunk_start(151936, 4096) == 147968
    assert last_chunk_start(1000, 4096) == 0
    assert last_chunk_start(257, 64) == 256
    assert backward_chunk(32768, 151936, 2) == 4096
    assert backward_chunk(1024, 151936, 2) == 32768
    # The main loop at the benchmark shape: the first five chunks hold g in dW's free rows
    # (45056 columns wide at first), the rest the 8192-column buffer: 9 chunks instead of
    # 19 (docs/design/linear_logprob_schedule.md).
    n, d, tail, last = 8192, 4096, 151936 - 16384, 147968
    schedule = main_loop_schedule(last, 8192, tail, n, d, 2)
    assert len(schedule) == 9 and schedule[0][:2] == (0, 45056)
    assert [off is None for *_, off in schedule] == [False] * 5 + [True] * 4
    assert [v0 for v0, *_ in schedule] + [last] == [0] + [v1 for _, v1, _ in schedule]
    for v0, v1, off in schedule:
        assert v0 % 256 == 0 and (v1 % 256 == 0 or v1 == last)
        if off is None:
            assert v1 - v0 <= 8192
        else:  # 16-byte aligned, past this chunk's dW rows, before the accumulator
            assert off % 8 == 0 and v1 * d <= off and off + n * (v1 - v0) <= tail * d
    assert all(off is None for *_, off in main_loop_schedule(last, 8192, None, n, d, 2))
    assert all(backward_chunk(n, 151936, 2) % 256 == 0 for n in (1, 7, 100, 5000, 1 << 20))


def _det_case(rows: torch.Tensor):
    """Module-level for assert_deterministic(processes=1): grads of a fixed problem."""
    g = torch.Generator().manual_seed(7)
    h, w, b, t = _data(17, 16, 100, F32, g)
    gl, ge = torch.randn(17, generator=g), torch.randn(17, generator=g)
    return _grads(h[rows], w, b, t[rows], "torch", gl[rows], ge[rows], temperature=TEMP)


def test_backward_deterministic_across_processes():
    assert_deterministic(_det_case, torch.arange(17), runs=2, processes=1)


@pytest.mark.skipif(not triton_interpret(), reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("dtype", [F32, F16])
def test_triton_grad_kernel_matches_torch_kernel(dtype, gen):
    """The fused g kernel against the torch backend's g, chunk by chunk (no GEMM backend)."""
    n, d, v = 5, 40, 150
    h, w, b, t = _data(n, d, v, dtype, gen)
    tgt = torch.where(t == -100, -1, t)
    logp, ent, lse = TorchLinearLogprobBackend().forward(h, w, b, tgt, TEMP)
    gl, ge = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    gl = torch.where(tgt >= 0, gl, 0.0)
    for v0, v1 in [(0, 100), (100, 150)]:
        a = torch.empty(n, v1 - v0, dtype=dtype)
        c = torch.empty_like(a)
        TritonLinearLogprobBackend().grad_logits(h, w, b, tgt, lse, ent, gl, ge, TEMP, v0, v1, a)
        TorchLinearLogprobBackend().grad_logits(h, w, b, tgt, lse, ent, gl, ge, TEMP, v0, v1, c)
        assert rel_error(a, c) <= (1e-5 if dtype == F32 else 2e-3)


@pytest.mark.skipif(not triton_interpret(), reason="needs TRITON_INTERPRET=1")
def test_tma_loads_and_persistent_g_kernel_keep_the_bits(gen):
    """Operands by TMA descriptors, the persistent g schedule and g stored by TMA: the pointer kernels' bits
    (fp16; the interpreter's fp32 dot rounds by memory layout, GPU tests cover bf16)."""
    import dataclasses

    n, d, v = 13, 64, 200
    h, w, b, t = _data(n, d, v, F16, gen)
    tgt = torch.where(t == -100, -1, t)
    base = TritonLinearLogprobBackend(FUSED_INTERPRETER)
    want = base.forward(h, w, b, tgt, TEMP)
    gl, ge = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    g_want = torch.empty(n, 128, dtype=F16)
    base.grad_logits(h, w, b, tgt, want[2], want[1], gl, ge, TEMP, 64, 192, g_want)
    for cfg in (dataclasses.replace(FUSED_INTERPRETER, tma=True),
                dataclasses.replace(FUSED_INTERPRETER, tma=True, persistent=True),
                # g stored by TMA: the chunk's 128 columns, clipped at N = 13 rows.
                dataclasses.replace(FUSED_INTERPRETER, tma=True, persistent=True, tma_store=True)):
        k = TritonLinearLogprobBackend(cfg)
        assert all(torch.equal(x, y) for x, y in zip(k.forward(h, w, b, tgt, TEMP), want)), cfg.short()
        g = torch.empty_like(g_want)
        k.grad_logits(h, w, b, tgt, want[2], want[1], gl, ge, TEMP, 64, 192, g)
        assert torch.equal(g, g_want), cfg.short()


# ------------------------------------------------------------------------------ errors

def test_errors(gen):
    h, w, b, t = _data(6, 16, 50, F32, gen, ignore=False)
    t_bad = t.clone()
    t_bad[2], t_bad[4] = 53, -7
    with pytest.raises(ValueError, match=r"linear_logprob.*target id 53"):
        linear_logprob(h, w, t_bad, b)
    t_neg = t.clone()
    t_neg[3] = -7
    with pytest.raises(ValueError, match=r"target id -7"):
        linear_logprob(h, w, t_neg, b)
    with pytest.raises(ValueError, match="linear_logprob.*D="):
        linear_logprob(h[:, :15], w, t, b)
    with pytest.raises(ValueError, match="linear_logprob.*bias"):
        linear_logprob(h, w, t, b[:49])
    with pytest.raises(ValueError, match="linear_logprob.*dtype"):
        linear_logprob(h, w.half(), t, b)
    with pytest.raises(ValueError, match="linear_logprob.*dtype"):
        linear_logprob(h.to(torch.int32), w, t, b)
    with pytest.raises(ValueError, match="linear_logprob.*target"):
        linear_logprob(h, w, t.float(), b)
    with pytest.raises(ValueError, match="linear_logprob.*target shape"):
        linear_logprob(h, w, t[:5], b)
    with pytest.raises(ValueError, match="linear_logprob.*device"):
        linear_logprob(h, w.to("meta"), t, b)
    with pytest.raises(ValueError, match="linear_logprob.*temperature"):
        linear_logprob(h, w, t, b, temperature=0.0)
    with pytest.raises(TypeError, match="linear_logprob"):
        linear_logprob(h.tolist(), w, t, b)
    # An id equal to ignore_index is fine even when it is out of range.
    t_ign = t.clone()
    t_ign[0] = -1
    linear_logprob(h, w, t_ign, b, ignore_index=-1)


@pytest.mark.parametrize("temperature,kind", [(torch.tensor(0.7), "Tensor"), (True, "bool"), ("0.7", "str"),
                                              (None, "NoneType")])
def test_temperature_must_be_a_python_number(temperature, kind, gen):
    # A tensor would be read with a host sync and, if it requires grad, treated as a constant.
    h, w, b, t = _data(3, 16, 20, F32, gen)
    with pytest.raises(TypeError, match=rf"^rlkernels\.linear_logprob: temperature must be a Python number "
                                        rf"\(float or int\), got {kind} "):
        linear_logprob(h, w, t, b, temperature=temperature)


@pytest.mark.parametrize("backend,dtype", _cases((F32, F16)))
def test_non_finite_logits_give_stocks_outcome(backend, dtype, gen):
    # Stock log_softmax + gather: a +inf (or NaN) logit makes the row NaN; -inf logits give
    # -inf at the target (a row of them: NaN). The other rows keep their bits.
    inf = float("inf")
    h, w, _, _ = _data(4, 16, 70, dtype, gen, bias=False)
    t = torch.tensor([3, 5, 3, 7])
    rows = torch.zeros(4, 70, dtype=dtype)
    rows[0, 9], rows[1, 3], rows[2, 3], rows[3] = inf, float("nan"), -inf, -inf
    for r in range(4):
        b = rows[r]
        lp, ent = linear_logprob(h, w, t, b, return_entropy=True, backend=backend)
        z = torch.nn.functional.linear(h.float(), w.float(), b.float())
        want = torch.log_softmax(z, -1).gather(1, t[:, None])[:, 0]
        assert torch.equal(lp.isnan(), want.isnan()) and torch.equal(lp.isneginf(), want.isneginf()), (r, lp, want)
        finite = want.isfinite()
        assert (lp[finite] - want[finite]).abs().max() < 1e-2 if finite.any() else True
        alone = [linear_logprob(h[i:i + 1], w, t[i:i + 1], b, backend=backend) for i in range(4)]
        assert torch.equal(torch.cat(alone).view(torch.int32), lp.view(torch.int32))


@pytest.mark.skipif(not triton_interpret(), reason="needs TRITON_INTERPRET=1")
def test_triton_rejects_fp64(gen):
    h, w, b, t = _data(3, 16, 20, F64, gen)
    with pytest.raises(ValueError, match="float64"):
        linear_logprob(h, w, t, b, backend="triton")


def test_registry():
    assert registered_ops()["linear_logprob"] == ("torch", "triton")
    op = get_op("linear_logprob")
    g = torch.Generator().manual_seed(1)
    h, w, b, t = _data(5, 16, 40, F32, g)
    assert torch.equal(op(h, w, t, b), linear_logprob(h, w, t, b))
    impl = get_op("linear_logprob", "torch").impl
    fn, rows = impl.invariance_case(torch.device("cpu"), F32, g)
    assert_batch_invariant(fn, rows, sizes=[1, 5])
    assert torch.equal(impl.forward_fp32(h, w, t, b), linear_logprob(h, w, t, b))


@pytest.mark.parametrize("backend, dtype", cpu_backend_cases((F32, F16)))
def test_logp_alone_skips_the_entropy_and_keeps_the_bits(backend, dtype, gen):
    # Without return_entropy the forward skips the entropy's sums; logp and its gradients
    # are the same chain, so the same bits.
    h, w, b, t = _data(13, 40, 600, dtype, gen)
    both = linear_logprob(h, w, t, b, temperature=0.7, return_entropy=True, backend=backend)[0]
    alone = linear_logprob(h, w, t, b, temperature=0.7, backend=backend)
    assert torch.equal(both, alone)
    grads = []
    for entropy in (True, False):
        hh = h.clone().requires_grad_()
        out = linear_logprob(hh, w, t, b, temperature=0.7, return_entropy=entropy, backend=backend)
        (out[0] if entropy else out).sum().backward()
        grads.append(hh.grad)
    assert torch.equal(grads[0], grads[1])


@pytest.mark.skipif(not triton_interpret(), reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("dtype", [F32, F16])
def test_small_batches_read_gemm_logits_with_the_fused_kernels_bits(dtype, gen):
    # N <= small_n takes the logits from the GEMM backend and runs the same statistics
    # over them: a row alone (that route) equals the row in a batch (the fused kernel).
    n = FUSED_INTERPRETER.small_n * 3 + 1
    h, w, b, t = _data(n, 40, 2 * 2048 + 77, dtype, gen)
    whole = linear_logprob(h, w, t, b, temperature=0.7, return_entropy=True, backend="triton")
    for r in (0, n // 2, n - 1):
        alone = linear_logprob(h[r:r + 1], w, t[r:r + 1], b, temperature=0.7, return_entropy=True,
                               backend="triton")
        assert all(torch.equal(a, x[r:r + 1]) for a, x in zip(alone, whole))


def test_cuda_temperature_is_atens_reciprocal(gen):
    # On CUDA ATen computes logits / T (a Python float) as logits * fl32(1 / fl32(T)).
    from rlkernels.ops.lm_head.config import temperature_scaling

    for t in [0.7, 0.3, 1.3, 1e-3, 977.0] + (torch.rand(200, generator=gen) * 4 + 0.01).tolist():
        arg, _ = temperature_scaling(t, torch.device("cuda"))
        assert arg == float(torch.tensor(1.0) / torch.tensor(t, dtype=torch.float32))


# ------------------------------------------------------------------------------ GPU

def _cuda_data(n, d, v, dtype, seed=0, bias=False):
    g = torch.Generator().manual_seed(seed)
    return _data(n, d, v, dtype, g, bias=bias, device="cuda")


def _ref_rows(h, w, b, t, rows, **kw):
    """float64 reference for selected rows only (the reference materializes [rows, V])."""
    return linear_logprob_ref(h[rows], w, t[rows], b, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("v", [32000, 151936])
def test_gpu_bf16_accuracy_real_sizes(v):
    n, d = 4096, 4096
    h, w, b, t = _cuda_data(n, d, v, BF16, bias=False)
    lp, ent = linear_logprob(h, w, t, return_entropy=True, temperature=TEMP)
    errs = []
    for r0 in range(0, n, 512):
        rows = torch.arange(r0, r0 + 512, device="cuda")
        rl, re = _ref_rows(h, w, None, t, rows, temperature=TEMP)
        errs.append(max((lp[rows].double() - rl).abs().max().item(), (ent[rows].double() - re).abs().max().item()))
    print(f"bf16 V={v}: max abs error {max(errs):.3e}")
    assert max(errs) <= LINEAR_LOGPROB_ABS[BF16] * 10  # 1e-3 at D=4096 on GPU until measured


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, F16, F32])
def test_gpu_accuracy_and_backward(dtype):
    n, d, v = 512, 1024, 32003
    h, w, b, t = _cuda_data(n, d, v, dtype, seed=1, bias=True)
    _check_forward(h, w, b, t, "triton", temperature=TEMP)
    g = torch.Generator().manual_seed(2)
    gl, ge = torch.randn(n, generator=g).cuda(), torch.randn(n, generator=g).cuda()
    got = _grads(h, w, b, t, "triton", gl, ge, temperature=TEMP)
    want = _ref_grads(h, w, b, t, gl, ge, temperature=TEMP)
    for name, x, r in zip(("dhidden", "dweight", "dbias"), got, want):
        err = rel_error(x, r)
        print(f"{dtype} {name}: rel error {err:.3e}")
        assert err <= LINEAR_LOGPROB_GRAD_REL[dtype]
    again = _grads(h, w, b, t, "triton", gl, ge, temperature=TEMP)
    assert all(torch.equal(x, y) for x, y in zip(got, again)), "backward not run-to-run deterministic"


@pytest.mark.gpu
@pytest.mark.parametrize("v", [32000, 151936])
def test_gpu_invariance_bitwise(v):
    n, d = 2048, 4096
    h, w, b, t = _cuda_data(n, d, v, BF16, seed=3)
    fn = _row_fn(h, w, b, t, "triton", temperature=TEMP)
    rows = torch.arange(n, device="cuda")
    assert_batch_invariant(fn, rows, sizes=[1, 2, 17, 128, 129, 1000, n - 1])
    assert_chunk_invariant(fn, rows, chunks=[1, 127, 300, 1620])
    assert_padding_invariant(fn, rows, before=5, after=77)
    assert_order_invariant(fn, rows)
    assert_deterministic(fn, rows, runs=3)


@pytest.mark.gpu
def test_gpu_dhidden_invariance_and_determinism():
    n, d, v = 1024, 4096, 32000
    h, w, b, t = _cuda_data(n, d, v, BF16, seed=4)
    g = torch.Generator().manual_seed(5)
    gl, ge = torch.randn(n, generator=g).cuda(), torch.randn(n, generator=g).cuda()

    def all_grads(rows):
        return _grads(h[rows], w, b, t[rows], "triton", gl[rows], ge[rows], temperature=TEMP)

    rows = torch.arange(n, device="cuda")
    assert_deterministic(all_grads, rows, runs=3)
    assert_batch_invariant(lambda r: all_grads(r)[0], rows, sizes=[1, 17, 300, n - 1])
    assert_order_invariant(lambda r: all_grads(r)[0], rows)


@pytest.mark.gpu
def test_gpu_backward_chunking_bitwise(monkeypatch):
    """Backward V chunks (multiples of 256, partial last chunk) give the one-chunk bits."""
    import rlkernels.ops.linear_logprob as mod

    n, d, v = 1000, 4096, 32000
    h, w, b, t = _cuda_data(n, d, v, BF16, seed=8, bias=True)
    g = torch.Generator().manual_seed(9)
    gl, ge = torch.randn(n, generator=g).cuda(), torch.randn(n, generator=g).cuda()
    base = _grads(h, w, b, t, "triton", gl, ge, temperature=TEMP)
    monkeypatch.setattr(mod, "backward_chunk", lambda n_rows, vocab, elem: 768)
    chunked = _grads(h, w, b, t, "triton", gl, ge, temperature=TEMP)
    for name, x, y in zip(("dhidden", "dweight", "dbias"), base, chunked):
        assert torch.equal(x, y), name
    want = _ref_grads(h, w, b, t, gl, ge, temperature=TEMP)
    for name, x, r in zip(("dhidden", "dweight", "dbias"), chunked, want):
        assert rel_error(x, r) <= LINEAR_LOGPROB_GRAD_REL[BF16], name


@pytest.mark.gpu
def test_gpu_int64_offsets():
    """N * V > 2^31: rows at the far end are still right."""
    n, d, v = 16384, 1024, 151936
    assert n * v > 2 ** 31
    h, w, b, t = _cuda_data(n, d, v, BF16, seed=6)
    lp, ent = linear_logprob(h, w, t, return_entropy=True)
    rows = torch.tensor([0, 1, n // 2, n - 2, n - 1], device="cuda")
    rl, re = _ref_rows(h, w, None, t, rows)
    assert (lp[rows].double() - rl).abs().max() <= 1e-3
    assert (ent[rows].double() - re).abs().max() <= 1e-3
    lp_tail = linear_logprob(h[-3:], w, t[-3:])
    assert torch.equal(lp_tail, lp[-3:])
    hh = h.clone().requires_grad_()
    linear_logprob(hh, w, t).sum().backward()
    assert torch.isfinite(hh.grad).all()


def forward_extra_bytes(n: int, v: int) -> int:
    """The forward's documented extra memory: partials + target logit + ids, plus slack."""
    n_split = -(-v // FUSED_16BIT.split_v)
    return n * (12 * n_split + 4 + 8 + 8 + 16) + (1 << 20)


def backward_extra_bytes(n: int, d: int, v: int, elem: int) -> int:
    """The backward's documented peak: dW + dbias + [N] vectors, plus either (fp32 dH in
    dW's last rows) g buffer + dH output -- which also bounds the main loop's g buffer,
    wider by at most D columns -- or fp32 dH + max(g buffer, dH output)."""
    from rlkernels.ops.lm_head.backward_schedule import dw_tail_rows

    cv = backward_chunk(n, v, elem)
    g_bytes, dh_bytes = n * min(cv, v) * elem, n * d * elem
    in_tail = dw_tail_rows(n, d, v, cv, torch.float32, torch.empty(1, dtype=BF16 if elem == 2 else F32))
    rest = g_bytes + dh_bytes if in_tail is not None else n * d * 4 + max(g_bytes, dh_bytes)
    return v * d * elem + v * 4 + rest + 64 * n + (8 << 20)


@pytest.mark.gpu
def test_gpu_memory_bound():
    n, d, v = 8192, 4096, 151936
    h, w, b, t = _cuda_data(n, d, v, BF16, seed=7)
    h.requires_grad_()
    w.requires_grad_()
    gl = torch.randn(n, device="cuda")
    ge = torch.randn(n, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    lp, ent = linear_logprob(h, w, t, return_entropy=True)
    torch.cuda.synchronize()
    fwd_peak = torch.cuda.max_memory_allocated() - base
    logits_bytes = n * v * 2
    print(f"forward extra peak {fwd_peak / 2**20:.1f} MiB (bound {forward_extra_bytes(n, v) / 2**20:.1f} MiB)")
    assert fwd_peak <= forward_extra_bytes(n, v) < logits_bytes // 50
    dh, dw = torch.autograd.grad((lp * gl).sum() + (ent * ge).sum(), (h, w))
    torch.cuda.synchronize()
    total = torch.cuda.max_memory_allocated() - base
    print(f"fwd+bwd extra peak {total / 2**30:.3f} GiB (bound {backward_extra_bytes(n, d, v, 2) / 2**30:.3f} GiB)")
    assert total <= forward_extra_bytes(n, v) + backward_extra_bytes(n, d, v, 2)
