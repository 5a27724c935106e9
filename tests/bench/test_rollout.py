"""``rlkernels bench rollout`` end to end on the CPU: the tiny Qwen3 through the CLI entry point."""
from __future__ import annotations

import json

import pytest
import torch

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


def test_the_decode_floor_counts_the_longest_samples_steps_and_each_tokens_context():
    from rlkernels.bench import model as whole
    from rlkernels.bench.rollout import decode_floor_s, step_bytes

    model = whole.build_models(whole.model_config("tiny", None), torch.device("cpu"), torch.float32)[1]
    params, kv = step_bytes(model)
    cfg = model.config
    assert params == sum(p.numel() * 4 for p in model.parameters())
    assert kv == 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4
    # (L, l): 4 steps (the longest's l - 1); contexts 7+1..7+4, 2+1, none for l = 1.
    samples = [(7, 5), (2, 2), (9, 1)]
    keys = (8 + 9 + 10 + 11) + 3
    assert decode_floor_s(model, samples, 2.0) == pytest.approx((4 * params + keys * kv) / 2e9)
    assert decode_floor_s(model, [], 2.0) == 0.0
    # Samples 0 and 1 share a prompt of 7 keys, read once at steps 1..4 (sample 0's); sample 2 alone.
    samples = [(7, 5), (7, 3), (2, 2)]
    own = (1 + 2 + 3 + 4) + (1 + 2) + (2 + 1)
    assert decode_floor_s(model, samples, 2.0, [0, 0, 1]) == pytest.approx((4 * params + (4 * 7 + own) * kv) / 2e9)
    assert decode_floor_s(model, samples, 2.0, [0, 1, 2]) == pytest.approx(decode_floor_s(model, samples, 2.0))


def test_phases_time_every_decode_step_the_kernels_and_own_prompt_reads_are_reported(tmp_path):
    path = tmp_path / "rollout.json"
    assert cli.main(["bench", "rollout", "--device", "cpu", "--config", "tiny", "--peers", "none",
                     "--prompts", "2", "--n", "2", "--prompt-lens", "4,8", "--max-new", "8", "--mean-len", "4",
                     "--phases", "--kernels", "400", "--own-prompt-reads", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["rows"]
    _check_kernel_rows(rows)
    own = [r for r in rows if r["engine"] == "rollout, own prompt reads"]
    assert len(own) == 1 and own[0]["shared_prompt_reads"] is False
    assert own[0]["new_tokens"] == rows[0]["new_tokens"]  # the same samples
    groups = [r for r in rows if r["engine"] == "rollout step"]
    total = [r for r in rows if r["engine"] == "rollout steps"]
    assert groups and len(total) == 1 and total[0]["batch"] is None
    assert sum(r["steps"] for r in groups) == total[0]["steps"] > 0
    assert abs(sum(r["total_ms"] for r in groups) - total[0]["total_ms"]) < 0.05 * len(groups)
    rollout = rows[0]
    # Every sample's first token comes from its prefill; each decode step runs its longest
    # sample one token further, so the steps number at least the longest sample's tokens - 1.
    assert total[0]["steps"] >= max(1, rollout["new_tokens"] // rollout["samples"]) - 1
    for r in groups:
        assert 0 < r["rows_in_use"] <= r["batch"] and "floor_ms" not in r  # no bandwidth on the CPU


def _check_kernel_rows(rows: list[dict]) -> None:
    """--kernels' rows: the top kernels by time, descending, and one total row."""
    top = [r for r in rows if r["engine"] == "rollout kernel"]
    total = [r for r in rows if r["engine"] == "rollout kernels"]
    assert 5 <= len(top) <= 400 and len(total) == 1
    times = [r["total_ms"] for r in top]
    assert times == sorted(times, reverse=True) and all(t > 0 for t in times)
    # (each time rounded to a microsecond: the sum may pass the total by half of one per row)
    assert sum(times) <= total[0]["total_ms"] + 5e-4 * (len(top) + 1)
    assert 0 < sum(r["share"] for r in top) <= 1 + 5e-5 * len(top)
    assert any("RMSNorm" in r["kernel"] for r in top)  # run by every layer of a decode step
