"""The backward, the custom ops and the routes a call takes: dQ/dK/dV accurate and the
same alone, packed and run to run; a padded batch's dense form == index tensors; every
route (no autograd, the autograd Function, torch.compile's custom ops) gives one result.
"""
from __future__ import annotations

import pytest
import torch
from torch._dynamo.backends.debugging import aot_eager

from rlkernels import testing
from rlkernels.ops import attention as A
from rlkernels.registry import implementation
from rlkernels.registry import get_op, registered_ops

from ...conftest import cpu_backend_cases, randn
from ._cases import (SMALL_CHAIN, bits_equal, check_packed_backward, check_padded_batch_grads_equal_bounds,
                     nan_cache, qkv, sizes)


@pytest.mark.parametrize("backend,dtype", cpu_backend_cases((torch.float32, torch.float16)))
def test_backward_accuracy_and_invariance(backend, dtype, gen, attn):
    """dQ/dK/dV vs float64 autograd; a sequence's grads alone == inside a packed batch;
    run to run equal."""
    hq, hkv, d = sizes(backend)
    lens = [1, 37, 29] if backend == "triton" else [1, 70, 41]

    seqs = [[randn(n, h, d, dtype=dtype, generator=gen) for h in (hq, hkv, hkv, hq)] for n in lens]
    check_packed_backward(attn, seqs, lens, dtype, backend)


@pytest.mark.parametrize("backend,dtype", cpu_backend_cases((torch.float32, torch.float16)))
def test_padded_batch_grads_equal_index_tensors(backend, dtype, gen, attn):
    """The two index forms (a padded batch's dense form, index tensors) give one result."""
    hq, hkv, d = sizes(backend)
    for b, lq, lk in ((3, 37, 37), (2, 5, 40), (1, 1, 1)):
        q = randn(b, lq, hq, d, dtype=dtype, generator=gen)
        k, v = (randn(b, lk, hkv, d, dtype=dtype, generator=gen) for _ in range(2))
        check_padded_batch_grads_equal_bounds(attn, q, k, v, randn(b, lq, hq, d, dtype=dtype, generator=gen),
                                               backend)


def test_gradcheck_float64_torch_backend(gen, attn):
    q = randn(1, 20, 2, 8, dtype=torch.float64, generator=gen).requires_grad_()
    k = randn(1, 20, 1, 8, dtype=torch.float64, generator=gen).requires_grad_()
    v = randn(1, 20, 1, 8, dtype=torch.float64, generator=gen).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b, c: attn.flash_attn_func(a, b, c, backend="torch"), (q, k, v))


def test_registry_and_custom_op(gen, attn):
    assert registered_ops()["flash_attn"] == ("torch", "triton")
    q, k, v = qkv(9, 2, 1, 8, torch.float32, gen, batch=2)
    op = get_op("flash_attn", "torch")
    assert op.op_class == "attention" and bits_equal(op(q, k, v), A.flash_attn_func(q, k, v, backend="torch"))
    fn, x = implementation("flash_attn", "torch")().invariance_case(torch.device("cpu"), torch.float32, gen)
    testing.assert_batch_invariant(fn, x)
    # The custom op (what torch.compile sees) gives the eager path's bits and gradients.
    qs = q.reshape(-1, *q.shape[2:])
    ks, vs = (t.reshape(1, -1, *t.shape[2:]) for t in (k, v))  # keys [1, Tk, Hkv, D]: one packed run of rows
    ar = torch.arange(2, dtype=torch.int32)
    lens = torch.full((2,), 9, dtype=torch.int32)
    for window in (-1, 4):
        out, lse = torch.ops.rlkernels.flash_attn_fwd(qs, ks, vs, ar * 9, lens, ar * 9, lens, 9, 9, True, window,
                                                      0.35, *SMALL_CHAIN, "torch", False)
        assert bits_equal(out.view(2, 9, 2, 8), attn.flash_attn_func(q, k, v, softmax_scale=0.35,
                                                                     window_size=(window, 0), backend="torch"))
    for sinks, cap in ((None, 0.0), (torch.tensor([0.5, -1.0], requires_grad=True), 2.0)):
        torch.library.opcheck(torch.ops.rlkernels.flash_attn_fwd.default,
                              (qs.requires_grad_(), ks, vs, ar * 9, lens, ar * 9, lens, 9, 9, True, 4, 0.35,
                               *SMALL_CHAIN, "torch", False, sinks, cap),
                              test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


@pytest.mark.parametrize("backend,dtype", cpu_backend_cases((torch.float32, torch.float16)))
def test_every_route_gives_one_result(backend, dtype, gen, attn):
    """Each entry point's bits, gradients and cache writes are the same whichever route the
    call takes: without autograd (the forward core alone), with autograd (the Function) and
    traced by torch.compile (the custom ops, a padded batch's dense form as index tensors)."""
    torch._dynamo.reset()
    hq, hkv, d = sizes(backend)
    b, lq, lk = 2, 21, 37
    q = randn(b, lq, hq, d, dtype=dtype, generator=gen)
    k, v = (randn(b, lk, hkv, d, dtype=dtype, generator=gen) for _ in range(2))
    do = randn(b, lq, hq, d, dtype=dtype, generator=gen)
    traced_ops = set()

    def compiled(fn):
        """fn through torch.compile (AOTAutograd, no codegen), noting the ops of its graphs."""
        def recording(gm, example_inputs):
            traced_ops.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
            return aot_eager(gm, example_inputs)
        return torch.compile(fn, backend=recording)

    def with_grads(fn, *inputs, dout):
        leaves = [t.clone().requires_grad_() for t in inputs]
        out = fn(*leaves)
        return [out, *torch.autograd.grad(out, leaves, dout)]

    def same(fn, *inputs, dout):
        with torch.no_grad():
            plain = fn(*inputs)
        eager = with_grads(fn, *inputs, dout=dout)
        traced_ops.clear()
        traced = with_grads(compiled(fn), *inputs, dout=dout)
        assert "rlkernels.flash_attn_fwd.default" in traced_ops, "the traced route must run"
        assert bits_equal(plain, eager[0])
        for name, x, y in zip(("out", "dq", "dk", "dv"), eager, traced):
            assert bits_equal(x, y), name

    same(lambda q, k, v: attn.flash_attn_func(q, k, v, True, 0.3, backend=backend), q, k, v, dout=do)
    same(lambda q, k, v: attn.flash_attn_func(q, k, v, False, backend=backend), q, k, v, dout=do)
    same(lambda q, k, v: attn.flash_attn_func(q, k, v, window_size=(5, 0), backend=backend), q, k, v, dout=do)
    sinks = randn(hq, generator=gen)
    same(lambda q, k, v, s: attn.flash_attn_func(q, k, v, sinks=s, backend=backend), q, k, v, sinks, dout=do)
    same(lambda q, k, v: attn.flash_attn_func(q, k, v, softcap=1.5, backend=backend), q, k, v, dout=do)
    rows = q.reshape(b * lq, hq, d)
    ar = torch.arange(b, dtype=torch.int32)
    q_len, k_len = torch.full((b,), lq, dtype=torch.int32), torch.full((b,), lk, dtype=torch.int32)
    same(lambda q, k, v: attn.attention_by_bounds("test", q, k, v, ar * lq, q_len, ar * 0, k_len, lq, lk,
                                                  backend=backend), rows, k, v, dout=do.reshape(b * lq, hq, d))
    cu_q, cu_k = (torch.tensor([0, n, 2 * n], dtype=torch.int32) for n in (lq, lk))
    same(lambda q, k, v: attn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, lq, lk, backend=backend), rows,
         k.reshape(b * lk, hkv, d), v.reshape(b * lk, hkv, d), dout=do.reshape(b * lq, hq, d))
    # Decode steps appending to NaN-filled caches: one position for all, and one per sequence.
    cap = 48
    kn, vn = (randn(b, 1, hkv, d, dtype=dtype, generator=gen) for _ in range(2))
    for seqlens in (lk, torch.tensor([lk, 5], dtype=torch.int32)):
        traced_ops.clear()
        results = []
        for call in (attn.flash_attn_with_kvcache, compiled(attn.flash_attn_with_kvcache)):
            kc, vc = nan_cache(b, cap, hkv, d, dtype)
            kc[:, :lk], vc[:, :lk] = k, v
            results.append([call(q[:, -1:], kc, vc, kn, vn, seqlens, backend=backend), kc, vc])
        assert {"rlkernels.flash_attn_fwd.default", "rlkernels.flash_attn_kvcache_append.default"} <= traced_ops
        (out, kc, vc), (out_traced, kc_traced, vc_traced) = results
        assert bits_equal(out, out_traced), seqlens
        for name, x, y in (("k_cache", kc, kc_traced), ("v_cache", vc, vc_traced)):  # NaN in the free slots
            assert torch.equal(x.view(torch.int16 if dtype == torch.float16 else torch.int32),
                               y.view(torch.int16 if dtype == torch.float16 else torch.int32)), (name, seqlens)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,d", [(torch.bfloat16, 128), (torch.float16, 128), (torch.bfloat16, 64),
                                     (torch.bfloat16, 80), (torch.bfloat16, 256)])
def test_gpu_backward_invariant_and_deterministic(dtype, d):
    hq, hkv = 16, 8
    lens = [1, 1031, 2048, 509]
    g = torch.Generator(device="cuda").manual_seed(3)
    seqs = [[torch.randn(n, h, d, device="cuda", generator=g).to(dtype) for h in (hq, hkv, hkv, hq)] for n in lens]
    check_packed_backward(A, seqs, lens, dtype, None)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,d", [(torch.bfloat16, 128), (torch.bfloat16, 64), (torch.float16, 80)])
def test_gpu_padded_batch_grads_equal_index_tensors(dtype, d):
    g = torch.Generator(device="cuda").manual_seed(5)
    for b, lq, lk in ((3, 1031, 1031), (2, 67, 2053)):
        q, do = (torch.randn(b, lq, 16, d, device="cuda", generator=g).to(dtype) for _ in range(2))
        k, v = (torch.randn(b, lk, 8, d, device="cuda", generator=g).to(dtype) for _ in range(2))
        check_padded_batch_grads_equal_bounds(A, q, k, v, do, None)

