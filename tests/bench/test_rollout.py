"""``rlkernels bench rollout`` end to end on the CPU: the tiny Qwen3 through the CLI entry point."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from rlkernels import cli  # noqa: E402


def test_tiny_cpu_suite_scales_eos_and_draws_the_same_samples_both_ways(tmp_path):
    path = tmp_path / "rollout.json"
    assert cli.main(["bench", "rollout", "--device", "cpu", "--config", "tiny", "--peers", "none",
                     "--prompts", "4", "--n", "3", "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    assert doc["benchmark"] == "rollout" and doc["config"] == "tiny" and doc["n"] == 3
    rollout, static = doc["rows"]
    assert rollout["engine"] == "rollout" and static["engine"] == "generate"
    assert rollout["samples"] == static["samples"] == 12
    # The same samples (each is its prompt's decode alone), kept up to their EOS either way.
    assert rollout["new_tokens"] == static["new_tokens"]
    # The scaled EOS row ends responses early: well under max_new_tokens on average.
    assert 0 < rollout["finished"] and rollout["new_tokens"] / 12 < 0.8 * doc["max_new_tokens"]
    assert rollout["tok_per_s"] > 0 and static["tok_per_s"] > 0


def test_unknown_peer_is_refused(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "rollout", "--device", "cpu", "--peers", "vllm"])
    assert "unknown workload(s) 'vllm'" in capsys.readouterr().err
