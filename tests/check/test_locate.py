"""``rlkernels check --locate`` (check/locate.py): the drift locator, stock vs rlkernels, on the check's model (CPU, fp32)."""
from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from rlkernels import cli  # noqa: E402


def test_cli_check_locate(capsys):
    assert cli.main(["check", "--model-only", "--locate", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    stock = next(line for line in out.splitlines() if line.strip().startswith("stock torch:"))
    ours = next(line for line in out.splitlines() if line.strip().startswith("rlkernels:") and "none" in line)
    assert "model." in stock and "tokens, max |Δ|" in stock
    assert ours.split() == ["rlkernels:", "none"]


def test_cli_locate_not_with_ops_only(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["check", "--ops-only", "--locate"])
    assert e.value.code == 2 and "--locate: not allowed with --ops-only" in capsys.readouterr().err
