"""The batch-invariant mode: stock torch calls routed to the invariant kernels by ATen
overrides (:mod:`.mode`), each making stock's own argument checks first (:mod:`.checks`)."""
from .mode import COVERED_OPS, is_batch_invariant_mode_enabled, set_batch_invariant_mode

__all__ = ["COVERED_OPS", "is_batch_invariant_mode_enabled", "set_batch_invariant_mode"]
