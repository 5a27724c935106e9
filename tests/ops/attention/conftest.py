"""The attention tests' entry points on the small chain (fixture ``attn``)."""
from __future__ import annotations

import types

import pytest

from rlkernels.ops import attention as A

from ._cases import SMALL_CHAIN, entry_points


@pytest.fixture
def attn() -> types.SimpleNamespace:
    """The entry points on the small chain (the interpreter's speed)."""
    return entry_points(A.AttnTuning(A.Chain(*SMALL_CHAIN)))

