"""Per-instance methods: bound where a module fits and has none of its own, kept by deepcopy."""
from __future__ import annotations

import copy

import torch
from torch import nn

from rlkernels.integrations.hf import binding


def _doubled(self, x):
    return 2 * type(self).forward(self, x)


def test_bound_where_it_fits_and_not_over_a_method_of_the_instances_own():
    model = nn.Sequential(nn.Identity(), nn.ReLU(), nn.Identity())
    own = model[2].forward = lambda x: x + 1  # the user's own forward stays
    assert binding.bind_where(model, _doubled, lambda m: isinstance(m, nn.Identity)) == 1
    assert binding.is_bound(model[0], "forward", _doubled) and not binding.is_bound(model[1], "forward", _doubled)
    assert model[2].forward is own
    x = torch.tensor([-1.0, 3.0])
    assert torch.equal(model(x), torch.tensor([1.0, 7.0]))  # 2 * x, relu, + 1
    assert binding.bind_where(model, _doubled, lambda m: isinstance(m, nn.Identity)) == 0  # already bound
    twin = copy.deepcopy(model)
    assert binding.is_bound(twin[0], "forward", _doubled) and twin[0].forward.__self__ is twin[0]
    del model[0].forward  # the class's forward again
    assert not binding.is_bound(model[0], "forward", _doubled) and torch.equal(model[0](x), x)
