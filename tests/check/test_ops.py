"""The op table of ``rlkernels check``: rows, dtypes a backend refuses, the compile warm-up."""
from __future__ import annotations

import pytest
import torch

from rlkernels.check import ops as check_ops

from ..conftest import interpreter_only


@interpreter_only
def test_a_dtype_the_backend_refuses_is_a_skipped_row_with_the_reason(monkeypatch):
    # bfloat16 on the Triton backend under TRITON_INTERPRET=1 is refused by design.
    monkeypatch.setenv("RLKERNELS_BACKEND", "triton")
    monkeypatch.setattr(check_ops, "registered_ops", lambda: {"matmul": ["triton", "torch"]})
    (row,) = check_ops.op_check_rows(torch.device("cpu"), (torch.bfloat16,))
    assert row["backend"] == "triton" and row["dtype"] == "bfloat16"
    assert row["error"].startswith("skipped:") and "TRITON_INTERPRET=1" in row["error"], row
    assert check_ops.rows_ok([row])


def test_warm_up_has_nothing_to_compile_on_the_cpu():
    assert check_ops.warm_up(torch.device("cpu"), (torch.float32,), workers=4) == 0


@pytest.mark.gpu
def test_warm_up_on_gpu_leaves_the_table_as_it_was():
    device = torch.device("cuda")
    dtypes = (torch.float32, torch.bfloat16)
    assert check_ops.warm_up(device, dtypes, workers=8) > 0
    warm = check_ops.op_check_rows(device, dtypes)
    assert check_ops.rows_ok(warm), warm
    assert warm == check_ops.op_check_rows(device, dtypes)
