"""The gated MLP's silu(gate) * up in one launch: taken only where transformers' formula and the
library's SiLU are, and the same bits as the class's own forward."""
from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import rlkernels  # noqa: E402
from rlkernels.integrations.hf import mlp  # noqa: E402

from ._models import _tiny  # noqa: E402


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
def test_patch_model_binds_every_gated_mlp_and_the_bits_stay(arch):
    model = rlkernels.patch_model(_tiny(arch))
    mlps = [m for m in model.modules() if type(m).__name__.endswith("MLP")]
    assert mlps and all(mlp.is_installed(m) for m in mlps)
    ids = torch.randint(0, 300, (3, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        bound = rlkernels.token_logprobs(model, ids)
        for m in mlps:
            del m.forward  # the class's own forward
        own = rlkernels.token_logprobs(model, ids)
    assert torch.equal(bound.view(torch.int32), own.view(torch.int32))


def test_another_activation_keeps_the_class_forward():
    model = rlkernels.patch_model(_tiny("llama", hidden_act="gelu"))
    mlps = [m for m in model.modules() if type(m).__name__.endswith("MLP")]
    assert mlps and not any(mlp.is_installed(m) for m in mlps)


def test_a_deep_copy_runs_its_own_weights():
    model = rlkernels.patch_model(_tiny("qwen3"))
    twin = copy.deepcopy(model)
    mlp, twin_mlp = model.model.layers[0].mlp, twin.model.layers[0].mlp
    assert twin_mlp.forward.__self__ is twin_mlp
    with torch.no_grad():
        twin_mlp.up_proj.weight.mul_(2)
        x = torch.randn(2, 5, model.config.hidden_size)
        assert not torch.equal(mlp(x), twin_mlp(x))
