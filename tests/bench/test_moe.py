"""``rlkernels bench moe`` on the CPU: tiny shapes through the CLI entry point, JSON written."""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from rlkernels import cli  # noqa: E402
from rlkernels.bench import moe as bench_moe  # noqa: E402


def test_layer_workload_on_the_cpu(tmp_path):
    path = tmp_path / "moe.json"
    assert cli.main(["bench", "moe", "--device", "cpu", "--reps", "1", "--only", "layer", "--tokens", "1,7,40",
                     "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    assert doc["benchmark"] == "moe" and doc["bench_device"] == "cpu" and doc["tokens"] == [1, 7, 40]
    rows = doc["rows"]
    assert {r["tokens"] for r in rows} == {1, 7, 40}
    ours = [r for r in rows if r["side"] == "rlkernels"]
    assert len(ours) == 3 and all(r["fwd_ms"] > 0 and r["train_ms"] > 0 and r["bitwise"] == 1.0 for r in ours)
    stock = [r for r in rows if r["side"].startswith("stock ")]
    assert {r["side"] for r in stock} >= {"stock eager"}
    timed = [r for r in stock if r.get("fwd_ms")]
    assert timed and all(r["rlkernels_fwd_ratio"] > 0 and 0.0 <= r["bitwise"] <= 1.0 for r in timed)
    assert doc["environment"]["torch"] == torch.__version__


def test_model_workloads_on_the_cpu(tmp_path):
    path = tmp_path / "moe.json"
    assert cli.main(["bench", "moe", "--device", "cpu", "--reps", "1", "--layers", "1", "--only",
                     "scoring,training,decode", "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    assert doc["model_config"]["num_hidden_layers"] == 1 and doc["model_config"]["num_local_experts"] == 16
    rows = doc["rows"]
    ours = {r["workload"]: r for r in rows if r["side"] == "rlkernels"}
    sizes = bench_moe.TINY_SIZES
    decode = {f"decode B={sizes.gen_prompts}", f"decode B={sizes.roll_prompts}"}
    assert {"scoring", "training"} | decode <= set(ours)
    for name in ("scoring", *decode):
        assert ours[name]["bitwise"] == 1.0 and ours[name]["time_ms"] > 0, ours[name]
    assert all(ours[name]["ms_per_token"] > 0 for name in decode)
    stock = [r for r in rows if r["side"] == "stock eager" and r.get("time_ms")]
    assert {r["workload"] for r in stock} >= {"scoring", "training"} | decode
    assert all(r["rlkernels_ratio"] > 0 for r in stock)


@pytest.mark.parametrize("argv, message", [
    (["--only", "layer,bogus"], "unknown workload(s) 'bogus'"),
    (["--tokens", "0,4"], "token counts >= 1"),
    (["--device", "tpu"], "expected cuda, cuda:N or cpu"),
])
def test_bad_options_are_refused_before_anything_runs(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "moe", "--device", "cpu", *argv])
    assert e.value.code == 2
    assert message in capsys.readouterr().err
