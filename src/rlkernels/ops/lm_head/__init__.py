"""The LM head's shared core: what every op over ``softmax((h W^T + b) / T)`` runs the same way.

``linear_logprob`` (log-probs and entropy, differentiable), ``linear_sample`` (a token
drawn per row) and the vocab-parallel log-probs (``parallel.vocab_parallel``) each build
on this package and on nothing of each other's. Modules, lowest first:

* ``lse``: the LSE order on the torch backend (tile masses, the split merge) and
  ``log_softmax_rows``, the log-softmax of stored logits in that order;
* ``config``: the fused kernels' tile configs (:func:`~.config.fused_config`), their
  operands, the temperature step (:func:`~.config.temperature_scaling`) and a model's logit
  transform (:class:`~.config.LogitTransform`, whose ``launch_args`` every logits kernel takes);
* ``validate``: the head's input checks, naming the public op the user called;
* ``statistics``: the forward statistics pass (per-row max, mass, entropy sum, target
  logit), torch and Triton, with its sampler variant that records every tile's mass;
* ``backward_schedule``: how the log-prob backward walks the vocabulary in chunks.
"""
