"""The LM head's input checks: each error names the public op and the operands as its signature names them."""
from __future__ import annotations

import pytest
import torch

from rlkernels._env import triton_interpret
from rlkernels.ops.lm_head.validate import head_backend, validate_head, validate_targets
from rlkernels.parallel.vocab_parallel import SHARD_NAMES, VOCAB_OP


def test_whole_head_errors_name_weight_and_bias():
    h, w, b = torch.randn(3, 8), torch.randn(5, 8), torch.randn(5)
    with pytest.raises(ValueError, match=r"rlkernels.linear_sample: hidden \(3, 7\) has D=7 but weight \(5, 8\) "
                                         r"\(lm_head layout \[V, D\]\) has D=8"):
        validate_head("linear_sample", h[:, :7], w, b, 1.0)
    with pytest.raises(ValueError, match=r"rlkernels.linear_logprob: weight has an empty vocabulary \(V=0\)"):
        validate_head("linear_logprob", h, w[:0], None, 1.0)
    with pytest.raises(ValueError, match=r"rlkernels.linear_logprob: bias must have shape \(5,\) to match "
                                         r"weight's V, got \(4,\)"):
        validate_head("linear_logprob", h, w, b[:4], 1.0)
    with pytest.raises(ValueError, match=r"rlkernels.linear_logprob: target id 5 at flat position 2 is outside "
                                         r"\[0, 5\) and is not ignore_index=-100"):
        validate_targets("linear_logprob", h, w, torch.tensor([0, -100, 5]), b, -100)
    assert validate_targets("linear_logprob", h, w, torch.tensor([0, -100, 4]), b, -100) == 5


def test_shard_errors_name_the_shard_arguments_and_the_whole_vocabulary():
    h, w, b = torch.randn(3, 8), torch.randn(5, 8), torch.randn(5)
    with pytest.raises(ValueError, match=rf"rlkernels.{VOCAB_OP}: hidden \(3, 7\) has D=7 but weight_shard \(5, 8\) "
                                         r"\(lm_head layout \[V/TP, D\]\) has D=8"):
        validate_head(VOCAB_OP, h[:, :7], w, b, 1.0, SHARD_NAMES)
    with pytest.raises(ValueError, match=rf"rlkernels.{VOCAB_OP}: bias_shard must have shape \(5,\) to match "
                                         r"weight_shard's V/TP, got \(4,\)"):
        validate_head(VOCAB_OP, h, w, b[:4], 1.0, SHARD_NAMES)
    with pytest.raises(ValueError, match=rf"rlkernels.{VOCAB_OP}: tensors must share one dtype, got hidden "
                                         r"torch.float32, weight_shard torch.float16"):
        validate_head(VOCAB_OP, h, w.half(), None, 1.0, SHARD_NAMES)
    with pytest.raises(ValueError, match=rf"rlkernels.{VOCAB_OP}: target id 20 at flat position 1 is outside "
                                         r"\[0, 20\) \(V = 5 x TP 4\) and is not ignore_index=-1"):
        validate_targets(VOCAB_OP, h, w, torch.tensor([19, 20, -1]), b, -1, SHARD_NAMES, 4)
    assert validate_targets(VOCAB_OP, h, w, torch.tensor([19, 0, -1]), b, -1, SHARD_NAMES, 4) == 20


@pytest.mark.skipif(not triton_interpret(), reason="needs TRITON_INTERPRET=1")
def test_fp64_is_refused_on_triton_naming_the_op():
    with pytest.raises(ValueError, match=r"rlkernels.linear_sample: float64 runs on the torch backend only"):
        head_backend("linear_sample", "linear_sample", torch.randn(2, 4, dtype=torch.float64), "triton")
    assert head_backend("linear_logprob", "sharded_linear_logprob", torch.randn(2, 4), "torch") == "torch"
