"""Hugging Face causal LMs: ``patch_model``, ``token_logprobs``, ``generate`` and ``rollout``.

One module per job: :mod:`.patch` makes a model batch-invariant in place, with the
per-module swaps :mod:`.attention`, :mod:`.moe`, :mod:`.rotary`, :mod:`.mlp`, :mod:`.qkv`,
:mod:`.decoder_layer` and :mod:`.static_cache`; :mod:`.coverage` says what a patched forward covers and reads a
model's modules; :mod:`.scoring` is ``token_logprobs``; :mod:`.generation` is
``generate``'s host side and :mod:`.decode` its static-cache decode step and loop;
:mod:`.continuous_batching` is ``rollout``: that step over a continuously refilled batch of samples;
:mod:`.tensor_parallel` shards a patched model over a process group (imported on first use,
as ``rlkernels.tensor_parallel``: it loads ``rlkernels.parallel``); :mod:`.tp_layout` holds
the layout it records, which scoring reads without loading ``rlkernels.parallel``.
Calls go downward: generation -> decode -> coverage; continuous_batching -> decode and scoring;
scoring -> coverage and tp_layout; tensor_parallel -> coverage and tp_layout.
"""
from .coverage import is_patched
from .decode import release_decode_graphs
from .generation import generate
from .patch import patch_model
from .continuous_batching import RolloutSample, rollout
from .scoring import token_logprobs

__all__ = ["RolloutSample", "generate", "is_patched", "patch_model", "release_decode_graphs", "rollout",
           "token_logprobs"]
