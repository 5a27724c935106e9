"""Static KV cache writes at a device-held slot: index_copy_'s result, in one launch."""
from __future__ import annotations

import pytest
import torch

from rlkernels._env import triton_interpret
from rlkernels.ops import kv_cache
from rlkernels.testing import _bits_equal


def _case(B, H, S, L, D, start, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.full((B, H, S, D), float("nan"), dtype=dtype)  # unused slots hold NaN
    v_cache = torch.randn(B, H, S, D, generator=g).to(dtype)
    # New rows as the attention layers hand them over: [B, L, H, D] projections seen as [B, H, L, D].
    k_new = torch.randn(B, L, H, D, generator=g).to(dtype).transpose(1, 2)
    v_new = torch.randn(B, L, H, D, generator=g).to(dtype).transpose(1, 2)
    return [t.to(device) for t in (k_cache, v_cache, k_new, v_new)] + [torch.tensor(start, device=device)]


def _reference(k_cache, v_cache, k_new, v_new, start):
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    slots = torch.arange(k_new.shape[2], device=k_cache.device) + start
    return k_ref.index_copy_(2, slots, k_new), v_ref.index_copy_(2, slots, v_new)


CASES = [(2, 3, 11, 1, 64, 4), (1, 1, 5, 5, 2, 0), (3, 2, 40, 17, 96, 23), (2, 4, 64, 33, 128, 31)]


@pytest.mark.skipif(not (torch.cuda.is_available() or triton_interpret()),
                    reason="the Triton kernel needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_the_kernel_writes_index_copys_slots(case, dtype):
    k_cache, v_cache, k_new, v_new, start = _case(*case, dtype)
    assert kv_cache._kernel_takes(k_cache, v_cache, k_new, v_new)
    want = _reference(k_cache, v_cache, k_new, v_new, start)
    kv_cache.write_kv_slots(k_cache, v_cache, k_new, v_new, start)
    assert _bits_equal(k_cache, want[0]) and _bits_equal(v_cache, want[1])


def test_the_torch_backend_is_index_copy(monkeypatch):
    monkeypatch.setenv("RLKERNELS_BACKEND", "torch")
    k_cache, v_cache, k_new, v_new, start = _case(2, 3, 40, 17, 96, 23, torch.float32)
    want = _reference(k_cache, v_cache, k_new, v_new, start)
    kv_cache.write_kv_slots(k_cache, v_cache, k_new, v_new, start)
    assert _bits_equal(k_cache, want[0]) and _bits_equal(v_cache, want[1])


@pytest.mark.parametrize("bad, match", [
    ("heads", r"\[B, H, L, D\]"), ("dtype", "the cache"), ("rows", "value rows"), ("start", "int64"),
])
def test_mismatched_inputs_are_refused_before_any_write(bad, match):
    k_cache, v_cache, k_new, v_new, start = _case(2, 3, 11, 2, 8, 0, torch.float32)
    before = k_cache.clone()
    if bad == "heads":
        k_new = k_new[:, :2]
    elif bad == "dtype":
        v_new = v_new.double()
    elif bad == "rows":
        v_new = v_new[:, :, :1]
    else:
        start = start.int()
    with pytest.raises(ValueError, match=match):
        kv_cache.write_kv_slots(k_cache, v_cache, k_new, v_new, start)
    assert _bits_equal(k_cache, before)


@pytest.mark.gpu
def test_the_kernel_writes_index_copys_slots_gpu():
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for case in CASES + [(16, 8, 4160, 4096, 128, 0), (16, 8, 4160, 1, 128, 4100)]:
            k_cache, v_cache, k_new, v_new, start = _case(*case, dtype, device="cuda")
            want = _reference(k_cache, v_cache, k_new, v_new, start)
            kv_cache.write_kv_slots(k_cache, v_cache, k_new, v_new, start)
            assert _bits_equal(k_cache, want[0]) and _bits_equal(v_cache, want[1]), (case, dtype)
