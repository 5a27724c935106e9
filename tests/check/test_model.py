"""``rlkernels check --model DIR`` on a local mixture-of-experts checkpoint (CPU, fp32)."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from rlkernels.check import model as model_check  # noqa: E402

TINY_MOE = dict(vocab_size=512, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=16, num_experts_per_tok=4)


def test_a_moe_checkpoint_checks_bitwise_and_stock_does_not(tmp_path):
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**TINY_MOE)).save_pretrained(tmp_path)
    report = model_check.run(device="cpu", model_path=str(tmp_path), seqs=4, min_len=4, max_len=12)
    stock, ours = report["results"]
    assert ours["implementation"] == "rlkernels" and ours["bitwise_equal_fraction"] == 1.0
    assert report["ok"] and report["sampler_gap"]["rlkernels_logp_bitwise_linear_logprob"]
    # The control: the stock MoE block's tokens move with the batch on the same run.
    assert stock["bitwise_equal_fraction"] < 1.0
