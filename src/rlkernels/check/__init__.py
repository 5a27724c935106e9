"""The checks behind ``rlkernels check``: op-level invariance and the model-level rollout/trainer check."""
