"""The gloo worlds of the tensor-parallel tests: TP = 1, 2, 4, 8 processes, run once per session."""
from __future__ import annotations

import pytest

from . import _workers as W


@pytest.fixture(scope="package")
def results() -> dict[int, list[dict]]:
    return {world: W.run_world(world, W.worker) for world in W.SIZES}
