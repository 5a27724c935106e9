"""The checks behind ``rlkernels check``: op-level invariance and the model-level rollout/trainer check."""
from __future__ import annotations

import contextlib
from typing import Any, ContextManager


def status(console: Any, text: str) -> ContextManager[Any]:
    """A rich spinner with ``text`` while the block runs -- on a terminal only.

    In a file or a pipe (CI logs, ``| tee``) a live display has nothing to redraw
    into: only the tables are written there.
    """
    return console.status(text) if console.is_terminal else contextlib.nullcontext()
