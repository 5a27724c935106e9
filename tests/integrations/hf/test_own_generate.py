"""Hugging Face's own generate on a patched model with sliding-window layers: a cache that keeps
every key where the call brings none, the call's own choices kept, and models without windows
left alone."""
from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import rlkernels  # noqa: E402
from rlkernels.integrations.hf import own_generate  # noqa: E402

from ._models import _tiny  # noqa: E402


def _windowed():
    model = _tiny("mistral", tie_word_embeddings=False, sliding_window=8)
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)  # a trained head's logit scale
    return rlkernels.patch_model(model)


def test_bound_only_where_a_layer_has_a_window():
    model = _windowed()
    assert own_generate.is_installed(model) and own_generate.install(model)
    assert own_generate.is_installed(copy.deepcopy(model))
    for plain in (rlkernels.patch_model(_tiny("llama")), rlkernels.patch_model(_tiny("mistral", sliding_window=None))):
        assert not own_generate.has_windows(plain) and not own_generate.is_installed(plain)


def test_past_the_window_it_serves_what_the_class_generate_refuses():
    model = _windowed()
    ids = torch.randint(3, 300, (2, 12), generator=torch.Generator().manual_seed(2))
    kw = dict(max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=0)
    served = model.generate(ids, **kw)
    greedy, _ = rlkernels.generate(model, ids, max_new_tokens=5, do_sample=False, eos_token_id=[])
    assert torch.equal(served, greedy)
    with pytest.raises(ValueError, match="the cache has dropped its first"):  # the call's own choice: rolling
        model.generate(ids, cache_implementation="static", **kw)
    del model.generate  # the class's generate: transformers' rolling cache
    with pytest.raises(ValueError, match="the cache has dropped its first"):
        model.generate(ids, **kw)


@pytest.mark.parametrize("call", [dict(use_cache=False), dict(cache_implementation="static"),
                                  dict(past_key_values="given"), dict(cache="given"),
                                  dict(generation_config="no cache")])
def test_a_call_that_chooses_its_cache_keeps_its_choice(call):
    model = _windowed()
    if call.get("generation_config"):
        call = dict(generation_config=transformers.GenerationConfig(use_cache=False))
    assert own_generate._keeps_its_own_cache(model, call)
    assert not own_generate._keeps_its_own_cache(model, dict(max_new_tokens=3))
