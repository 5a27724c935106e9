"""Functions that ``torch.compile`` runs eagerly, without importing dynamo at ``import rlkernels``.

``torch.compiler.disable`` imports dynamo (over a second) the moment it wraps a function.
:func:`opaque_to_compile` wraps nothing until dynamo looks at the call: an eager call
(``torch.compiler.is_compiling()`` False, which is all there is while dynamo has not been
imported) runs the function itself; a call dynamo traces takes the ``torch.compiler.disable``
wrapper, made then, so dynamo runs the function eagerly (a graph break) and traces none of
its frames.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])


def opaque_to_compile(fn: F) -> F:
    """``fn``, run eagerly under ``torch.compile``: ``torch.compiler.disable(fn)``, applied
    where dynamo traces a call (module docstring). Eager calls cost one flag read."""
    disabled: list[Callable[..., Any]] = []

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        if not disabled:
            disabled.append(torch.compiler.disable(fn))
        return disabled[0](*args, **kwargs)

    return run  # type: ignore[return-value]
