"""Benchmark helpers whose correctness the published numbers rely on."""
from __future__ import annotations

import torch

from rlkernels.bench.common import cycling, l2_cold_copies


def test_l2_cold_copies_cover_the_budget_with_distinct_equal_tensors():
    w = torch.randn(1000, 33)  # 132 kB, not a divisor of the budget
    budget = 1 << 20
    copies = l2_cold_copies(w, total_bytes=budget)
    assert copies[0] is w
    assert sum(c.numel() * c.element_size() for c in copies) >= budget
    assert sum(c.numel() * c.element_size() for c in copies[:-1]) < budget  # no more than needed
    assert len({c.data_ptr() for c in copies}) == len(copies)
    assert all(torch.equal(c, w) for c in copies)


def test_l2_cold_copies_of_a_large_tensor_is_itself():
    w = torch.randn(300, 1000)
    copies = l2_cold_copies(w, total_bytes=1000)
    assert len(copies) == 1 and copies[0] is w


def test_cycling_takes_the_next_item_each_call():
    seen = []
    fn = cycling(seen.append, ["a", "b", "c"])
    for _ in range(7):
        fn()
    assert seen == ["a", "b", "c", "a", "b", "c", "a"]


def test_interleaved_rounds_rotate_and_take_the_median(monkeypatch):
    from rlkernels.bench import common

    calls = []
    # Each variant's time drifts upward from call to call (a warming GPU): round-robin
    # visits share the drift, and the reported value is the median round.
    clock = iter(range(1000))

    def fake_median_ms(fn, warmup_ms, rep_ms):
        calls.append(fn())
        return float(next(clock))

    monkeypatch.setattr(common, "median_ms", fake_median_ms)
    out = common.interleaved_median_ms({"a": lambda: "a", "b": lambda: "b", "c": lambda: "c"}, rounds=3)
    assert calls == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    # a was timed at t = 0, 5, 7; b at 1, 3, 8; c at 2, 4, 6 -> the medians.
    assert out == {"a": 5.0, "b": 3.0, "c": 4.0}


def test_interleaved_rounds_put_every_variant_in_every_place_equally_often(monkeypatch):
    from rlkernels.bench import common

    calls = []
    monkeypatch.setattr(common, "median_ms", lambda fn, warmup_ms, rep_ms: calls.append(fn()) or 1.0)
    names = ["stock", "nosplit", "rlk", "triton"]
    common.interleaved_median_ms({name: (lambda name=name: name) for name in names}, rounds=5)
    # 5 rounds of 4 variants round up to 8: each variant twice in each of the 4 places.
    assert len(calls) == 32
    places = {name: sorted(i % 4 for i, c in enumerate(calls) if c == name) for name in names}
    assert all(p == [0, 0, 1, 1, 2, 2, 3, 3] for p in places.values()), places


def test_host_median_is_the_median_burst_per_call(monkeypatch):
    import time

    from rlkernels.bench import common

    # A fake clock that each call of fn advances by (burst index + 1) us: burst i costs
    # (i + 1) us per call, so the median of 21 bursts is 11 us; the 3 warm-up calls
    # and the synchronizes between bursts must not count.
    now = [0.0]
    burst = [-1]
    calls = []
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(common.torch.cuda, "synchronize", lambda: burst.__setitem__(0, burst[0] + 1))

    def fn():
        calls.append(burst[0])
        now[0] += (burst[0] + 1) * 1e-6 if burst[0] >= 0 else 1.0

    got = common.host_median_us(fn, calls=5, trials=21)
    assert abs(got - 11.0) < 1e-6
    assert len(calls) == 3 + 5 * 21


def test_write_json_records_suite_command_and_environment(tmp_path, monkeypatch):
    import json
    import sys

    from rlkernels.bench import common

    monkeypatch.setattr(sys, "argv", ["rlkernels", "bench", "gemm", "--quick"])
    path = tmp_path / "out.json"
    common.write_json(str(path), "gemm", [{"M": 1}], {"summary": {}})
    doc = json.loads(path.read_text())
    assert list(doc)[:4] == ["benchmark", "command", "environment", "rows"]
    assert doc["command"] == "rlkernels bench gemm --quick" and doc["rows"] == [{"M": 1}]
    for key in ("date", "device", "torch", "triton", "rlkernels"):
        assert key in doc["environment"]
    common.write_json(None, "gemm", [])  # no path: nothing written
