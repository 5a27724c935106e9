"""The checks behind ``rlkernels check``: op-level invariance, the model-level rollout/trainer check,
and the drift locator (:func:`locate_divergence`: the first module whose output for a token changes bits).
"""
from __future__ import annotations

import contextlib
from typing import Any, ContextManager

from .drift import DivergenceReport, ModuleDrift, Way, locate_divergence

__all__ = ["locate_divergence", "Way", "ModuleDrift", "DivergenceReport", "status"]


def status(console: Any, text: str) -> ContextManager[Any]:
    """A rich spinner with ``text`` while the block runs -- on a terminal only.

    In a file or a pipe (CI logs, ``| tee``) a live display has nothing to redraw
    into: only the tables are written there.
    """
    return console.status(text) if console.is_terminal else contextlib.nullcontext()
