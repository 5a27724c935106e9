"""The decode weight's streaming L2 access-policy window (runtime.l2_window).

CPU: the byte span, the switch, and set/restore against a stand-in driver (no GPU).
GPU: the bits with and without the window, the caller's stream window unchanged after a
call, also inside CUDA-graph capture (whose kernel keeps the window for its replays).
"""
from __future__ import annotations

import ctypes

import pytest
import torch

from rlkernels.runtime import l2_window


@pytest.mark.parametrize("make,want", [
    (lambda: torch.empty(3, 5), 15 * 4),
    (lambda: torch.empty(5, 3).t(), 15 * 4),
    (lambda: torch.empty(4, 10, dtype=torch.bfloat16)[:, 2:7], (3 * 10 + 4 + 1) * 2),
    (lambda: torch.empty(0, 7), 0),
    (lambda: torch.empty(6, dtype=torch.float16)[::2], (2 * 2 + 1) * 2),
])
def test_span_bytes(make, want):
    assert l2_window.span_bytes(make()) == want


def test_no_window_for_cpu_tensors_or_when_switched_off(monkeypatch):
    t = torch.randn(4, 4)
    assert not l2_window.window_applies(t)
    assert l2_window.set_streaming(t, 0) is None
    for value, on in (("0", False), ("false", False), ("1", True), ("", True)):
        monkeypatch.setenv(l2_window.L2_WINDOW_ENV, value)
        assert l2_window._enabled_from_env() is on


class _FakeDriver:
    """cuStreamGet/SetAttribute over a dict of streams: what the context manager does."""

    def __init__(self, initial: l2_window._StreamAttr, fail_set: bool = False) -> None:
        self.state = {7: initial}
        self.calls = []
        self.fail_set = fail_set

    def get(self, handle, attr, ref):
        assert attr == l2_window._ACCESS_POLICY_WINDOW
        ref = getattr(ref, "_obj", ref)  # byref(...) or the structure itself
        ctypes.memmove(ctypes.addressof(ref), ctypes.addressof(self.state[handle.value]),
                       ctypes.sizeof(l2_window._StreamAttr))
        self.calls.append("get")
        return 0

    def set(self, handle, attr, ref):
        assert attr == l2_window._ACCESS_POLICY_WINDOW
        if self.fail_set:
            return 1
        value = l2_window._StreamAttr()
        ctypes.memmove(ctypes.addressof(value), ctypes.addressof(getattr(ref, "_obj", ref)), ctypes.sizeof(value))
        self.state[handle.value] = value
        self.calls.append(("set", value.window.base_ptr, value.window.num_bytes, value.window.hit_prop))
        return 0


def _any_size_window(t, span=None):
    """window_bytes without the device's size limit (CPU tensors stand in for weights)."""
    return l2_window.span_bytes(t) if span is None else span


def _user_window(base: int = 0x1000) -> l2_window._StreamAttr:
    v = l2_window._StreamAttr()
    v.window = l2_window._Window(base, 4096, 0.5, l2_window._NORMAL, l2_window._NORMAL)  # a caller's own window
    return v


def _window_of(v: l2_window._StreamAttr) -> tuple:
    w = v.window
    return w.base_ptr, w.num_bytes, round(w.hit_ratio, 3), w.hit_prop, w.miss_prop


@pytest.mark.parametrize("raise_inside", [False, True])
def test_window_set_around_the_block_and_the_callers_restored(monkeypatch, raise_inside):
    fake = _FakeDriver(_user_window())
    monkeypatch.setattr(l2_window, "_driver", lambda: fake)
    monkeypatch.setattr(l2_window, "window_bytes", _any_size_window)
    weight = torch.randn(9, 4)
    before = _window_of(fake.state[7])
    with pytest.raises(RuntimeError) if raise_inside else _null():
        with l2_window.streaming_window(weight, 7) as applied:
            assert applied
            inside = fake.state[7].window
            assert (inside.base_ptr, inside.num_bytes) == (weight.data_ptr(), 9 * 4 * 4)
            assert inside.hit_prop == l2_window._STREAMING and inside.miss_prop == l2_window._NORMAL
            assert inside.hit_ratio == 1.0
            if raise_inside:
                raise RuntimeError("the launch failed")
    assert _window_of(fake.state[7]) == before
    assert fake.calls[0] == "get" and len(fake.calls) == 3
    _assert_lock_free()


def _assert_lock_free() -> None:
    """Another thread can take the set-to-restore lock (nothing left it held)."""
    import threading

    taken = []

    def take():
        taken.append(l2_window._LOCK.acquire(timeout=5))
        if taken[-1]:
            l2_window._LOCK.release()

    t = threading.Thread(target=take)
    t.start()
    t.join()
    assert taken == [True]


def test_no_window_when_the_driver_refuses(monkeypatch):
    fake = _FakeDriver(_user_window(), fail_set=True)
    monkeypatch.setattr(l2_window, "_driver", lambda: fake)
    monkeypatch.setattr(l2_window, "window_bytes", _any_size_window)
    with l2_window.streaming_window(torch.randn(3), 7) as applied:
        assert not applied
    assert _window_of(fake.state[7]) == _window_of(_user_window())
    _assert_lock_free()


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _current_window() -> tuple:
    drv = l2_window._driver()
    v = l2_window._StreamAttr()
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    assert drv.get(stream, l2_window._ACCESS_POLICY_WINDOW, ctypes.byref(v)) == 0
    return _window_of(v)


@pytest.mark.gpu
@pytest.mark.parametrize("k,n", [(4096, 4096), (4096, 12288), (12288, 4096), (1000, 4103)])
def test_window_keeps_the_bits_and_the_callers_stream_state(monkeypatch, k, n):
    import rlkernels
    from rlkernels.gemm import triton as gemm

    assert l2_window._driver() is not None and l2_window.max_window_bytes(0) > 0
    g = torch.Generator(device="cuda").manual_seed(k + n)
    w = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).bfloat16()
    assert l2_window.window_applies(w)
    side = torch.cuda.Stream()
    drv = l2_window._driver()
    buf = torch.empty(1024, device="cuda")
    with torch.cuda.stream(side):
        user = _user_window(buf.data_ptr())
        assert drv.set(ctypes.c_void_p(side.cuda_stream), l2_window._ACCESS_POLICY_WINDOW, ctypes.byref(user)) == 0
        before = _current_window()
        for m in (1, 5, 16, 32, 64):
            x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
            monkeypatch.setattr(l2_window, "ENABLED", False)
            want = rlkernels.linear(x, w)
            plain = gemm.triton_gemm(x, w, b_transposed=True)
            monkeypatch.setattr(l2_window, "ENABLED", True)
            got = rlkernels.linear(x, w)
            windowed = gemm.triton_gemm(x, w, b_transposed=True)
            torch.cuda.synchronize()
            assert torch.equal(got, want) and torch.equal(windowed, plain), (k, n, m)
            assert _current_window() == before
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_window_inside_graph_capture_same_bits_and_the_stream_restored():
    import rlkernels

    g = torch.Generator(device="cuda").manual_seed(3)
    w = (torch.randn(4096, 4096, device="cuda", generator=g) / 64).bfloat16()
    x = torch.randn(3, 4096, device="cuda", generator=g).bfloat16()
    want = rlkernels.linear(x, w)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        rlkernels.linear(x, w)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        before = _current_window()
        assert l2_window.window_applies(w)
        out = rlkernels.linear(x, w)
        after = _current_window()
    assert after == before
    for _ in range(3):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)
