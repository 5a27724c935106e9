"""``rlkernels bench tp --device cpu``: gloo processes, tiny shapes; every TP size gives the TP = 1 bits."""
from __future__ import annotations

import json

from rlkernels.bench import tp
from rlkernels.bench.__main__ import main


def test_bench_tp_cpu_rows_and_json(tmp_path, monkeypatch):
    # fork: the worker processes inherit these small shapes
    monkeypatch.setattr(tp, "CPU_LINEARS", (("linear", 64, 24),))
    monkeypatch.setattr(tp, "CPU_MS", (5,))
    monkeypatch.setattr(tp, "CPU_HEAD", (7, 16, 64))
    monkeypatch.setattr(tp, "WARMUP", 1)
    monkeypatch.setattr(tp, "REPS", 2)
    path = tmp_path / "tp.json"
    assert main(["tp", "--device", "cpu", "--world", "2", "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    rows = doc["rows"]
    assert doc["benchmark"] == "tp" and doc["backend"] == "gloo"
    assert {(r["layer"], r["tp"], r["pass"]) for r in rows} == {
        ("linear M=5", 1, "fwd"), ("linear M=5", 2, "fwd"), ("lm head logp+entropy", 1, "fwd"),
        ("lm head logp+entropy", 1, "fwd+bwd"), ("lm head logp+entropy", 2, "fwd"),
        ("lm head logp+entropy", 2, "fwd+bwd")}
    assert all(r["bitwise_tp1"] is True and r["stock_ms"] > 0 and r["rlkernels_ms"] > 0 for r in rows)
