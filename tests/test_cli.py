"""``rlkernels info``: versions, backends and the dispatch table, on any machine."""
from __future__ import annotations

import torch

from rlkernels import cli
from rlkernels._versions import installed_version
from rlkernels.ops import gemm


def test_installed_version():
    assert installed_version("torch").split("+")[0] == torch.__version__.split("+")[0]
    assert installed_version("rich")  # a distribution without a __version__ attribute
    assert installed_version("surely_not_a_module_rlkernels") is None


def test_info_lists_versions_backends_and_the_table(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert installed_version("rich") in out and "not installed" not in out.split("transformers")[0]
    assert "linear_logprob" in out and "matmul" in out
    for _, _, cfg in gemm.GEMM_TABLE_16BIT:
        assert cfg.short() in out
    assert "RLKERNELS_L2_STREAMING" in out and "L2 streaming window" in out
