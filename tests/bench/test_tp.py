"""``rlkernels bench tp --device cpu``: gloo processes, tiny shapes; every TP size gives the TP = 1 bits."""
from __future__ import annotations

import json

from rlkernels.bench import tp, tp_model
from rlkernels.bench.__main__ import main


def test_bench_tp_cpu_rows_and_json(tmp_path, monkeypatch):
    # fork: the worker processes inherit these small shapes
    monkeypatch.setattr(tp, "CPU_LINEARS", (("linear", 64, 24),))
    monkeypatch.setattr(tp, "CPU_MS", (5,))
    monkeypatch.setattr(tp, "CPU_HEAD", (7, 16, 64))
    monkeypatch.setattr(tp, "WARMUP", 1)
    monkeypatch.setattr(tp, "REPS", 2)
    monkeypatch.setattr(tp_model, "CPU_WORK", dict(score=(2, 9), batch=3, prompt=5, new=(1, 5)))
    monkeypatch.setattr(tp_model, "REPS", 3)
    path = tmp_path / "tp.json"
    assert main(["tp", "--device", "cpu", "--world", "2", "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    rows = doc["rows"]
    assert doc["benchmark"] == "tp" and doc["backend"] == "gloo"
    assert {(r["layer"], r["tp"], r["pass"]) for r in rows} == {
        ("linear M=5", 1, "fwd"), ("linear M=5", 2, "fwd"), ("lm head logp+entropy", 1, "fwd"),
        ("lm head logp+entropy", 1, "fwd+bwd"), ("lm head logp+entropy", 2, "fwd"),
        ("lm head logp+entropy", 2, "fwd+bwd"), ("qwen3 (tiny) score", 1, "fwd"), ("qwen3 (tiny) score", 2, "fwd"),
        ("qwen3 (tiny) decode step", 1, "fwd"), ("qwen3 (tiny) decode step", 2, "fwd")}
    assert all(r["bitwise_tp1"] is True and r["rlkernels_ms"] > 0 for r in rows)
    # Stock at every layer row and at TP = 1; transformers' own TP where it loads, else a note saying why.
    # A decode step is a difference of two wall times: at this size, on a loaded CPU (the suite's
    # other worker), noise can exceed it, so it is checked to be there, not to be positive.
    timed = [r for r in rows if r["tp"] == 1 or "qwen3" not in r["layer"]]
    assert all(r["stock_ms"] > 0 for r in timed if "decode step" not in r["layer"])
    assert all(isinstance(r["stock_ms"], float) for r in timed)
    assert all(r["stock_ms"] or "did not run" in r["note"] for r in rows if "qwen3" in r["layer"])
    assert all(r["rlkernels_linear_ms"] > 0 for r in rows if "qwen3" in r["layer"] and r["tp"] == 1)
