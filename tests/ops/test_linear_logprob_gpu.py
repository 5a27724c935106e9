"""linear_logprob's GPU properties at the real sizes (``pytest -m gpu``): bf16 accuracy
against float64, forward and backward, bitwise row invariance and determinism, backward
V chunking, int64 offsets and the memory bound. The shared helpers live in
``test_linear_logprob``.
"""
from __future__ import annotations

import pytest
import torch

from rlkernels.ops.linear_logprob import FUSED_16BIT, backward_chunk, linear_logprob
from rlkernels.reference import linear_logprob_ref
from rlkernels.testing import (
    assert_batch_invariant, assert_chunk_invariant, assert_deterministic, assert_order_invariant,
    assert_padding_invariant, rel_error,
)

from .test_linear_logprob import (BF16, F16, F32, LINEAR_LOGPROB_ABS, LINEAR_LOGPROB_GRAD_REL, TEMP,
                                  _check_forward, _data, _grads, _ref_grads, _row_fn)


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
    from rlkernels.ops.linear_logprob import dw_tail_rows

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
