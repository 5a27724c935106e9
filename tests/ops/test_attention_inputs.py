"""An attention layer's q/k norms, rotary embedding and KV-cache write in one launch: the
bits of the library's separate ops (rms_norm, rotary_embedding, write_kv_slots), whatever
else shares the batch; inputs it does not take run those ops; bad input refused."""
from __future__ import annotations

import pytest
import torch

from rlkernels._env import triton_interpret
from rlkernels.ops import attention_inputs as ai
from rlkernels.ops.kv_cache import write_kv_slots
from rlkernels.ops.norms import rms_norm
from rlkernels.ops.rotary import rotary_embedding
from rlkernels.testing import _bits_equal

needs_kernel = pytest.mark.skipif(not (torch.cuda.is_available() or triton_interpret()),
                                  reason="the Triton kernel needs CUDA or TRITON_INTERPRET=1")

# (B, L, HQ, HK, D, batch rows of cos/sin): primes, ones, head dims that are not powers of two.
SHAPES = [(3, 5, 16, 8, 128, 3), (1, 1, 1, 1, 2, 1), (2, 7, 5, 3, 80, 1), (2, 1, 6, 2, 64, 2), (1, 3, 7, 1, 256, 1)]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(B, L, HQ, HK, D, cos_rows, dtype, seed=0, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    # A trained model's projections: rows of every scale, so the norms' rstd spans decades.
    scale = torch.exp(torch.randn(B, L, 1, 1, generator=g) * 2)
    q = (torch.randn(B, L, HQ, D, generator=g) * scale).to(dtype)
    k = (torch.randn(B, L, HK, D, generator=g) * scale).to(dtype)
    v = torch.randn(B, L, HK, D, generator=g).to(dtype)
    angle = torch.rand(cos_rows, L, D // 2, generator=g, dtype=torch.float64) * 32768
    emb = torch.cat([angle, angle], dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    q_w = (torch.rand(D, generator=g) * 2).to(dtype)
    k_w = (torch.rand(D, generator=g) * 2).to(dtype)
    return [t.to(device) for t in (q, k, v, cos, sin, q_w, k_w)]


def _cache(B, HK, S, D, dtype, start, device=DEVICE):
    # Unused slots hold NaN: a write must leave them alone and never read them.
    k_cache = torch.full((B, HK, S, D), float("nan"), dtype=dtype, device=device)
    return k_cache, k_cache.clone(), torch.tensor([start], dtype=torch.int64, device=device)


def _separate_ops(q, k, v, cos, sin, q_norm, k_norm, cache, backend):
    """The definition: the library's ops one by one."""
    if q_norm is not None:
        q = rms_norm(q, *q_norm, backend=backend)
        k = rms_norm(k, *k_norm, backend=backend)
    q, k = rotary_embedding(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    if cache is None:
        return q, k, v.transpose(1, 2)
    write_kv_slots(cache[0], cache[1], k, v.transpose(1, 2), cache[2])
    return q, cache[0], cache[1]


def _same_bits(got, want) -> bool:
    return all(a.shape == b.shape and _bits_equal(a, b) for a, b in zip(got, want))


def _kernel_dtypes():
    # bf16 runs on CUDA only: the interpreter rounds fp32 to bf16 by truncation.
    return [torch.float32, torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else [])


@needs_kernel
@pytest.mark.parametrize("dtype", _kernel_dtypes())
@pytest.mark.parametrize("normed", [True, False])
@pytest.mark.parametrize("shape", SHAPES)
def test_one_launch_gives_the_separate_ops_bits(shape, normed, dtype):
    B, L, HQ, HK, D, _ = shape
    q, k, v, cos, sin, q_w, k_w = _inputs(*shape, dtype)
    norms = ((q_w, 1e-6), (k_w, 1e-5)) if normed else (None, None)
    assert ai._fused_ok(q, k, v, cos, sin, *norms, None, "triton")
    got = ai.attention_inputs(q, k, v, cos, sin, q_norm=norms[0], k_norm=norms[1], backend="triton")
    assert _same_bits(got, _separate_ops(q, k, v, cos, sin, *norms, None, "triton"))
    # Into a cache at slot 3 of L + 6: the slots written hold the same keys, the others stay NaN.
    caches = [_cache(B, HK, L + 6, D, dtype, 3) for _ in range(2)]
    got = ai.attention_inputs(q, k, v, cos, sin, q_norm=norms[0], k_norm=norms[1], cache=caches[0],
                              backend="triton")
    want = _separate_ops(q, k, v, cos, sin, *norms, caches[1], "triton")
    assert _same_bits(got, want)
    assert got[1][:, :, :3].isnan().all() and got[1][:, :, 3 + L:].isnan().all()
    assert not got[1][:, :, 3:3 + L].isnan().any() and not got[2][:, :, 3:3 + L].isnan().any()


@needs_kernel
def test_a_row_has_its_bits_alone_and_in_a_batch():
    q, k, v, cos, sin, q_w, k_w = _inputs(5, 3, 4, 2, 64, 5, torch.float32, seed=3)
    norms = dict(q_norm=(q_w, 1e-6), k_norm=(k_w, 1e-6), backend="triton")
    batch = ai.attention_inputs(q, k, v, cos, sin, **norms)
    for b in (0, 4):
        alone = ai.attention_inputs(q[b:b + 1], k[b:b + 1], v[b:b + 1], cos[b:b + 1], sin[b:b + 1], **norms)
        assert _same_bits(alone, [t[b:b + 1] for t in batch])


@needs_kernel
def test_slots_past_the_cache_are_not_written():
    q, k, v, cos, sin, q_w, k_w = _inputs(2, 4, 2, 2, 32, 1, torch.float32)
    k_cache, v_cache, start = _cache(2, 2, 6, 32, torch.float32, 4)  # slots 4, 5 fit; 6, 7 do not
    ai.attention_inputs(q, k, v, cos, sin, q_norm=(q_w, 1e-6), k_norm=(k_w, 1e-6), cache=(k_cache, v_cache, start),
                        backend="triton")
    assert k_cache[:, :, :4].isnan().all() and not k_cache[:, :, 4:].isnan().any()
    assert torch.equal(v_cache[:, :, 4:], v[:, :2].transpose(1, 2))


@needs_kernel
def test_an_empty_batch_gives_empty_outputs():
    q, k, v, cos, sin, q_w, k_w = _inputs(0, 3, 4, 2, 64, 1, torch.float32)
    got = ai.attention_inputs(q, k, v, cos[:0], sin[:0], q_norm=(q_w, 1e-6), k_norm=(k_w, 1e-6), backend="triton")
    assert [t.shape for t in got] == [(0, 4, 3, 64), (0, 2, 3, 64), (0, 2, 3, 64)]


def test_nan_in_one_head_stays_in_that_head():
    q, k, v, cos, sin, q_w, k_w = _inputs(2, 3, 4, 2, 64, 1, torch.float32)
    q[1, 2, 3, 5] = float("nan")
    out = ai.attention_inputs(q, k, v, cos, sin, q_norm=(q_w, 1e-6), k_norm=(k_w, 1e-6))[0]
    assert out[1, 3, 2].isnan().all()  # the norm spreads it over its head row
    assert out.isnan().sum() == 64


@pytest.mark.parametrize("change", ["gradient", "mixed dtypes", "strided last dim", "torch backend"])
def test_inputs_the_kernel_does_not_take_run_the_separate_ops(change):
    q, k, v, cos, sin, q_w, k_w = _inputs(2, 3, 4, 2, 64, 1, torch.float32)
    backend = "triton" if torch.cuda.is_available() or triton_interpret() else None
    if change == "gradient":
        q.requires_grad_(True)
    elif change == "mixed dtypes":
        q_w = q_w.double()
    elif change == "strided last dim":
        v = torch.cat([v, v], dim=-1)[..., ::2]
    else:
        backend = "torch"
    norms = ((q_w, 1e-6), (k_w, 1e-6))
    assert not ai._fused_ok(q, k, v, cos, sin, *norms, None, backend)
    got = ai.attention_inputs(q, k, v, cos, sin, q_norm=norms[0], k_norm=norms[1], backend=backend)
    assert _same_bits(got, _separate_ops(q, k, v, cos, sin, *norms, None, backend))
    if change == "gradient":
        assert got[0].grad_fn is not None
        (grad,) = torch.autograd.grad(got[0].sum(), q)
        assert grad.shape == q.shape


@pytest.mark.parametrize("case, message", [
    ("q 3-D", "q must be"), ("v of another shape", "q must be"), ("odd head dim", "must be even"),
    ("cos of another length", "cos and sin must be"), ("norm weight of another size", "q_norm's weight must be"),
    ("negative eps", "eps must be"), ("cache of another batch", "k_cache must be"), ("integer q", "dtype"),
])
def test_bad_input_is_refused_naming_the_op(case, message):
    q, k, v, cos, sin, q_w, k_w = _inputs(2, 3, 4, 2, 64, 1, torch.float32, device="cpu")
    q_norm, cache = (q_w, 1e-6), None
    if case == "q 3-D":
        q = q[0]
    elif case == "v of another shape":
        v = v[:, :2]
    elif case == "odd head dim":
        q, k, v, cos, sin = (t[..., :63] for t in (q, k, v, cos, sin))
        q_norm = (q_w[:63], 1e-6)
    elif case == "cos of another length":
        cos, sin = cos[:, :2], sin[:, :2]
    elif case == "norm weight of another size":
        q_norm = (q_w[:32], 1e-6)
    elif case == "negative eps":
        q_norm = (q_w, -1.0)
    elif case == "cache of another batch":
        cache = _cache(3, 2, 8, 64, torch.float32, 0, device="cpu")
    else:
        q = q.to(torch.int32)
    with pytest.raises(ValueError, match=f"rlkernels.attention_inputs: .*{message}"):
        ai.attention_inputs(q, k, v, cos, sin, q_norm=q_norm, k_norm=(k_w, 1e-6), cache=cache)
