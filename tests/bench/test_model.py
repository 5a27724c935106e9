"""``rlkernels bench model`` end to end on the CPU: the tiny Qwen3 through the CLI entry point."""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from rlkernels import cli  # noqa: E402
from rlkernels.bench import model as bench_model  # noqa: E402


def test_tiny_cpu_suite_writes_every_workload(tmp_path):
    path = tmp_path / "model.json"
    assert cli.main(["bench", "model", "--device", "cpu", "--config", "tiny", "--reps", "1",
                     "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    assert doc["benchmark"] == "model" and doc["config"] == "tiny" and doc["bench_device"] == "cpu"
    rows = doc["rows"]
    lens = bench_model.TINY.long_lens
    want = {"scoring", "training", "short scoring", "short training", "generate", "generate (graphed)", "rollout",
            "rollout (graphed)", *(f"long {n}" for n in lens)}
    for side in ("stock", "rlkernels"):
        assert {r["workload"] for r in rows if r["side"] == side} == want, side
    graphed = [r for r in rows if r["workload"].endswith("(graphed)")]
    assert all("GPU" in r["note"] and r["time_ms"] is None for r in graphed)  # CUDA graphs need a GPU
    for r in rows:
        if r in graphed:
            continue
        assert r["time_ms"] > 0 and r["tok_s"] > 0, r
        if r["side"] == "rlkernels":
            assert r["ratio"] > 0, r
            if "training" not in r["workload"] and r["bitwise"] is not None:
                # The contract, on the CPU backend: batched == alone, sampler == trainer.
                assert r["bitwise"] == 1.0, r
        else:
            assert r["ratio"] is None
        if "training" not in r["workload"] and not r["workload"].startswith("short"):
            assert 0.0 <= r["bitwise"] <= 1.0
    scoring = next(r for r in rows if r["workload"] == "scoring")
    assert scoring["shape"] == f"{bench_model.TINY.score_batch}x{bench_model.TINY.score_len}"
    short = [r for r in rows if r["workload"].startswith("short")]
    assert {(r["shape"], r["tokens"]) for r in short} == {(f"1x{bench_model.TINY.short_len}",
                                                          bench_model.TINY.short_len)}
    assert doc["environment"]["torch"] == torch.__version__


def test_only_and_graphed_on_the_cpu(tmp_path):
    path = tmp_path / "model.json"
    assert cli.main(["bench", "model", "--device", "cpu", "--config", "tiny", "--reps", "1", "--layers", "1",
                     "--only", "generate", "--graphed", "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    assert doc["layers"] == 1 and doc["model_config"]["num_hidden_layers"] == 1
    rows = doc["rows"]
    assert {r["workload"] for r in rows} == {"generate", "generate (graphed)"}
    graphed = [r for r in rows if r["workload"] == "generate (graphed)"]
    assert len(graphed) == 2 and all("GPU" in r["note"] and r["time_ms"] is None for r in graphed)


@pytest.mark.parametrize("argv, message", [
    (["--only", "scoring,bogus"], "unknown workload(s) 'bogus'"),
    (["--config", "no-such-config"], "'no-such-config' is neither one of qwen3-1.7b, qwen3-8b, tiny"),
    (["--layers", "0"], "expected an integer >= 1"),
    (["--device", "tpu"], "expected cuda, cuda:N or cpu"),
])
def test_bad_options_are_refused_before_anything_runs(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "model", "--device", "cpu", *argv])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_cuda_without_a_gpu_points_to_the_cpu_run(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "model", "--device", "cuda"])
    assert "--device cpu --config tiny" in capsys.readouterr().err


@pytest.mark.gpu
def test_tiny_suite_on_the_gpu(tmp_path):
    path = tmp_path / "model.json"
    assert cli.main(["bench", "model", "--config", "tiny", "--reps", "1", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["rows"]
    for r in rows:
        if r["side"] == "rlkernels" and r["workload"] != "training":
            assert r["bitwise"] == 1.0 and r["peak_gib"] > 0, r
