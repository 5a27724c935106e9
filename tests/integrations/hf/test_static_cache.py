"""The decode loop's StaticCache: one write launch per layer and one shared counter, with
transformers' own cache contents and lengths."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import StaticCache  # noqa: E402

import rlkernels  # noqa: E402
from rlkernels.integrations.hf import static_cache  # noqa: E402
from rlkernels.integrations.hf.coverage import cache_kwargs, decoder_of  # noqa: E402
from rlkernels.testing import _bits_equal  # noqa: E402

from ._models import _tiny  # noqa: E402


def _fill(model, cache, ids, steps, slots=12):
    """A prefill of ``ids`` and ``steps`` decode steps, as the decode loop feeds them."""
    decoder = decoder_of(model)
    B, L = ids.shape
    mask = torch.zeros(B, slots, dtype=torch.long)
    mask[:, :L] = 1
    with torch.no_grad():
        decoder(input_ids=ids, attention_mask=mask, position_ids=torch.arange(L)[None].expand_as(ids),
                use_cache=True, **cache_kwargs(decoder, cache))
        for t in range(steps):
            mask[:, L + t] = 1
            decoder(input_ids=ids[:, t:t + 1], attention_mask=mask, position_ids=torch.full((B, 1), L + t),
                    use_cache=True, **cache_kwargs(decoder, cache))


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_one_counter_gives_transformers_cache_contents_and_lengths(arch):
    model = rlkernels.patch_model(_tiny(arch))
    ids = torch.randint(1, 300, (3, 7), generator=torch.Generator().manual_seed(0))
    theirs = StaticCache(config=model.config, max_cache_len=12)
    ours = StaticCache(config=model.config, max_cache_len=12)
    assert static_cache.count_once(ours)
    _fill(model, theirs, ids, 3)
    _fill(model, ours, ids, 3)
    counters = {id(layer.cumulative_length) for layer in ours.layers}
    assert len(counters) == 1 and int(ours.layers[0].cumulative_length) == 10
    assert ours.get_seq_length() == theirs.get_seq_length()
    for a, b in zip(ours.layers, theirs.layers):
        assert _bits_equal(a.keys, b.keys) and _bits_equal(a.values, b.values)


def test_a_cache_already_written_or_of_another_kind_is_left_alone():
    model = rlkernels.patch_model(_tiny("qwen3"))
    written = StaticCache(config=model.config, max_cache_len=12)
    _fill(model, written, torch.randint(1, 300, (2, 4), generator=torch.Generator().manual_seed(1)), 0)
    assert not static_cache.count_once(written)
    assert not static_cache.count_once(transformers.DynamicCache())
    assert all("update" not in vars(layer) for layer in written.layers)
