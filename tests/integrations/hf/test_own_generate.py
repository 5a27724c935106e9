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
    assert "_prepare_static_cache" in vars(model) and "_prepare_static_cache" in vars(copy.deepcopy(model))
    for plain in (rlkernels.patch_model(_tiny("llama")), rlkernels.patch_model(_tiny("mistral", sliding_window=None))):
        assert not own_generate.has_windows(plain) and not own_generate.is_installed(plain)
        assert "_prepare_static_cache" not in vars(plain)


def test_past_the_window_it_serves_what_the_class_generate_refuses():
    model = _windowed()
    ids = torch.randint(3, 300, (2, 12), generator=torch.Generator().manual_seed(2))
    kw = dict(max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=0)
    greedy, _ = rlkernels.generate(model, ids, max_new_tokens=5, do_sample=False, eos_token_id=[])
    assert torch.equal(model.generate(ids, **kw), greedy)
    # The static cache implementation: full layers of the cache's length where transformers' slide.
    assert torch.equal(model.generate(ids, cache_implementation="static", **kw), greedy)
    config = copy.deepcopy(model.generation_config)
    config.cache_implementation = "static"
    assert torch.equal(model.generate(ids, generation_config=config, **kw), greedy)
    # A rolling cache the call brings is its own, and refused.
    rolling = transformers.StaticCache(config=model.config, max_cache_len=17)
    with pytest.raises(ValueError, match="the cache has dropped its first"):
        model.generate(ids, past_key_values=rolling, **kw)
    del model.generate, model._prepare_static_cache  # the class's: transformers' rolling caches
    for call in (kw, dict(kw, cache_implementation="static")):
        with pytest.raises(ValueError, match="the cache has dropped its first"):
            model.generate(ids, **call)


def test_a_static_cache_keeps_a_longer_length_from_an_earlier_call():
    model = _windowed()
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0, cache_implementation="static")
    g = torch.Generator().manual_seed(5)
    long_ids, short_ids = torch.randint(3, 300, (1, 14), generator=g), torch.randint(3, 300, (3, 10), generator=g)
    for ids, new in ((long_ids, 6), (short_ids, 4)):  # the second call's cache keeps the first's 20 slots
        greedy, _ = rlkernels.generate(model, ids, max_new_tokens=new, do_sample=False, eos_token_id=[])
        assert torch.equal(model.generate(ids, max_new_tokens=new, **kw), greedy)


@pytest.mark.parametrize("call", [dict(use_cache=False), dict(cache_implementation="static"),
                                  dict(past_key_values="given"), dict(cache="given"),
                                  dict(generation_config="no cache")])
def test_a_call_that_chooses_its_cache_keeps_its_choice(call):
    model = _windowed()
    if call.get("generation_config"):
        call = dict(generation_config=transformers.GenerationConfig(use_cache=False))
    assert own_generate._keeps_its_own_cache(model, call)
    assert not own_generate._keeps_its_own_cache(model, dict(max_new_tokens=3))
