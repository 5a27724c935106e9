"""The examples run: examples/rl_training.py on its tiny random-weight model (CPU, fp32, no download)."""
from __future__ import annotations

import importlib.util
import pathlib

import pytest

pytest.importorskip("transformers")

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"examples_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rl_training_example_runs_and_its_claims_hold(capsys):
    example = _load("rl_training")
    # The example asserts the bitwise claims itself (first-step ratio exactly 1.0 with old
    # log-probs scored one sequence at a time, micro-batched main_grad equal to one batch's);
    # its summary says what it checked.
    summary = example.main(["--steps", "1", "--max-new-tokens", "6"])
    assert summary["ratio_first_update"] == (1.0, 1.0)
    assert summary["microbatch_grads_bitwise"] is True
    lo, hi = summary["ratio_after_update"]
    assert lo < 1.0 < hi, "the optimizer step moved the policy"
    assert summary["mean_entropy"] > 0
    assert "ratio_first_update=(1.0, 1.0)" in capsys.readouterr().out


def test_rl_training_example_refuses_a_ratio_that_is_not_one(monkeypatch):
    # The example's own bitwise check can fail: old log-probs one ulp away trip it.
    import torch
    example = _load("rl_training")
    real = example.score_one_at_a_time

    def perturbed(*args, **kwargs):
        out = real(*args, **kwargs)
        return torch.nextafter(out, torch.full_like(out, -1e9))

    monkeypatch.setattr(example, "score_one_at_a_time", perturbed)
    with pytest.raises(AssertionError, match="old and new log-probs differ"):
        example.main(["--steps", "1", "--max-new-tokens", "4"])


def test_rl_training_example_runs_on_one_cpu_thread_and_restores_torchs(monkeypatch):
    # Threaded tiny ops on a busy CPU wait on descheduled OpenMP workers: the example pins
    # torch to one thread while it runs (as `rlkernels check` does) and gives the setting back.
    import torch
    example = _load("rl_training")
    seen = []
    real = example.rollout

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(example, "rollout", spy)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        example.main(["--steps", "1", "--max-new-tokens", "2"])
        assert seen == [1]
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
