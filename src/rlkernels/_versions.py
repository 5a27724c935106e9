"""Installed versions for reports (``rlkernels info``, benchmark JSON)."""
from __future__ import annotations

import importlib
from importlib import metadata


def installed_version(module: str) -> str | None:
    """The distribution's version (rich, for one, has no ``__version__``), or None."""
    try:
        return metadata.version(module)
    except metadata.PackageNotFoundError:
        pass
    try:
        return getattr(importlib.import_module(module), "__version__", "installed")
    except Exception:
        return None
