"""The key blocking that defines the attention's chain: key block and split size (:class:`Chain`)."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Chain:
    """The chain-defining constants: key block and split size, both in keys from key 0.

    Everything else (query tiles, warps, stages, which kernel) is launch detail that
    leaves a row's bits unchanged; these two change them.
    """

    block_n: int = 64
    split: int = 1024

    def __post_init__(self) -> None:
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ValueError(f"rlkernels.attention: block_n must be a power of two >= 16, got {self.block_n}")
        if self.split < self.block_n or self.split % self.block_n:
            raise ValueError(f"rlkernels.attention: split ({self.split}) must be a positive multiple of "
                             f"block_n ({self.block_n})")


DEFAULT_CHAIN = Chain()
