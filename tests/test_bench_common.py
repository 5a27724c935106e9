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
