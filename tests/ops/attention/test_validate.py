"""What the entry points refuse, and how they name it."""
from __future__ import annotations

import pytest
import torch

from rlkernels.ops import attention as A

from ...conftest import cpu_backend_cases, randn
from ._cases import bits_equal, sizes


def test_bad_inputs_are_refused():
    q = torch.randn(1, 8, 4, 16)
    k = torch.randn(1, 8, 3, 16)
    with pytest.raises(ValueError, match=r"rlkernels.flash_attn_func: query heads \(4\) must be a multiple of KV heads \(3\)"):
        A.flash_attn_func(q, k, k)
    with pytest.raises(ValueError, match="rlkernels.flash_attn_func: unsupported head_dim 300"):
        A.flash_attn_func(torch.randn(1, 2, 2, 300), torch.randn(1, 2, 2, 300), torch.randn(1, 2, 2, 300))
    with pytest.raises(ValueError, match="rlkernels.flash_attn_func: tensors must share one dtype"):
        A.flash_attn_func(q, q.half(), q)
    with pytest.raises(ValueError, match="rlkernels.flash_attn_func: q must have 4 dims"):
        A.flash_attn_func(q[0], q, q)
    for bad in (0.0, -0.5, float("nan")):
        with pytest.raises(ValueError, match="rlkernels.flash_attn_func: softmax_scale must be positive and finite"):
            A.flash_attn_func(q, q, q, softmax_scale=bad)
    t = torch.randn(10, 2, 16)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match="rlkernels.flash_attn_varlen_func: cu_seqlens_q must be int32, got torch.int64"):
        A.flash_attn_varlen_func(t, t, t, cu.long(), cu, 6, 6)
    with pytest.raises(ValueError, match="cu_seqlens_k must be non-decreasing, got cu_seqlens_k.1. = 7 > cu_seqlens_k.2. = 5"):
        A.flash_attn_varlen_func(t, t, t, cu, torch.tensor([0, 7, 5], dtype=torch.int32), 6, 7)
    with pytest.raises(ValueError, match="cu_seqlens_q must end at the total length 10, got 9"):
        A.flash_attn_varlen_func(t, t, t, torch.tensor([0, 4, 9], dtype=torch.int32), cu, 6, 6)
    with pytest.raises(ValueError, match="cu_seqlens_q must start at 0, got 1"):
        A.flash_attn_varlen_func(t, t, t, torch.tensor([1, 4, 10], dtype=torch.int32), cu, 6, 6)
    with pytest.raises(ValueError, match="a sequence of 6 tokens exceeds max_seqlen_q = 5"):
        A.flash_attn_varlen_func(t, t, t, cu, cu, 5, 6)
    with pytest.raises(ValueError, match=r"cu_seqlens_k must have shape \[3\]"):
        A.flash_attn_varlen_func(t, t, t, cu, cu[:2], 6, 6)
    kc = torch.zeros(2, 16, 2, 16)
    qd = torch.randn(2, 1, 2, 16)
    kn = torch.randn(2, 1, 2, 16)
    with pytest.raises(ValueError, match=r"rlkernels.flash_attn_with_kvcache: cache_seqlens\[1\] = 16 with 1 new tokens is beyond the cache of 16"):
        A.flash_attn_with_kvcache(qd, kc, kc.clone(), kn, kn, torch.tensor([3, 16], dtype=torch.int32))
    with pytest.raises(ValueError, match="cache_seqlens must be int32"):
        A.flash_attn_with_kvcache(qd, kc, kc.clone(), kn, kn, torch.tensor([3, 4]))
    with pytest.raises(ValueError, match="pass both k and v"):
        A.flash_attn_with_kvcache(qd, kc, kc.clone(), kn, None, 3)
    with pytest.raises(ValueError, match="must have a unit last stride"):
        odd = torch.zeros(2, 16, 16, 2).transpose(2, 3)  # [2, 16, 2, 16], last stride 2
        A.flash_attn_with_kvcache(qd, odd, odd, cache_seqlens=3)


def test_negative_cache_seqlens_is_named_as_such():
    kc, qd = torch.zeros(2, 16, 2, 16), torch.randn(2, 1, 2, 16)
    with pytest.raises(ValueError, match=r"rlkernels\.flash_attn_with_kvcache: cache_seqlens must be >= 0, "
                                         r"got cache_seqlens\[1\] = -1$"):
        A.flash_attn_with_kvcache(qd, kc, kc.clone(), cache_seqlens=torch.tensor([3, -1], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"rlkernels\.flash_attn_with_kvcache: cache_seqlens must be >= 0, got -2$"):
        A.flash_attn_with_kvcache(qd, kc, kc.clone(), cache_seqlens=-2)


@pytest.mark.parametrize("backend,dtype", cpu_backend_cases((torch.float32,)))
@pytest.mark.parametrize("seqlens", ["tensor", "int"])
def test_append_refuses_caches_whose_slots_share_memory(backend, dtype, seqlens, gen):
    # Appending into an expanded cache would write every row's new key into one slot (row 0
    # then reads row 1's key); k_cache and v_cache in one memory would swap keys for values.
    hq, hkv, d = sizes(backend)
    b, cap = 2, 8
    q = randn(b, 1, hq, d, dtype=dtype, generator=gen)
    kn, vn = randn(b, 1, hkv, d, dtype=dtype, generator=gen), randn(b, 1, hkv, d, dtype=dtype, generator=gen)
    cs = torch.tensor([3, 3], dtype=torch.int32) if seqlens == "tensor" else 3
    base_k = randn(1, cap, hkv, d, dtype=dtype, generator=gen)
    base_v = randn(1, cap, hkv, d, dtype=dtype, generator=gen)
    kc, vc = base_k.expand(b, cap, hkv, d), base_v.expand(b, cap, hkv, d)
    before = base_k.clone()
    with pytest.raises(ValueError, match=r"rlkernels\.flash_attn_with_kvcache: k_cache is written in place but "
                                         r"its dim 0 \(size 2\) has stride 0 \(strides \(0, "):
        A.flash_attn_with_kvcache(q, kc, vc, kn, vn, cs, backend=backend)
    with pytest.raises(ValueError, match=r"v_cache is written in place but its dim 0 \(size 2\) has stride 0"):
        A.flash_attn_with_kvcache(q, kc.contiguous(), vc, kn, vn, cs, backend=backend)
    assert torch.equal(base_k, before)  # refused before any write
    shared = kc.contiguous()
    with pytest.raises(ValueError, match=r"k_cache and v_cache share memory"):
        A.flash_attn_with_kvcache(q, shared, shared, kn, vn, cs, backend=backend)
    flat = torch.zeros(b * cap * hkv * d + hkv * d, dtype=dtype)
    shifted = [flat[o:o + b * cap * hkv * d].view(b, cap, hkv, d) for o in (0, hkv * d)]  # one slot apart
    with pytest.raises(ValueError, match=r"k_cache and v_cache share memory"):
        A.flash_attn_with_kvcache(q, *shifted, kn, vn, cs, backend=backend)
    # Read-only use of an expanded cache writes nothing: allowed, and the same bits as a copy.
    read = A.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=cs, backend=backend)
    assert bits_equal(read, A.flash_attn_with_kvcache(q, kc.contiguous(), vc.contiguous(), cache_seqlens=cs,
                                                      backend=backend))
    # k and v interleaved in one buffer ([B, S, 2, Hkv, D]) share storage without sharing a slot.
    stacked = torch.stack([kc, vc], dim=2).contiguous()
    k2, v2 = kc.contiguous(), vc.contiguous()
    got = A.flash_attn_with_kvcache(q, stacked[:, :, 0], stacked[:, :, 1], kn, vn, cs, backend=backend)
    assert bits_equal(got, A.flash_attn_with_kvcache(q, k2, v2, kn, vn, cs, backend=backend))
    assert torch.equal(stacked[:, :, 0], k2) and torch.equal(stacked[:, :, 1], v2)


def test_triton_refuses_bf16_on_the_interpreter(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x = torch.randn(1, 4, 2, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="rlkernels.flash_attn_func: the Triton interpreter's tl.dot is wrong on bfloat16"):
        A.flash_attn_func(x, x, x, backend="triton")
    with pytest.raises(ValueError, match="rlkernels.flash_attn_func: float64 runs on the torch backend only"):
        A.flash_attn_func(x.double(), x.double(), x.double(), backend="triton")

