"""Per-instance methods: how the library gives one module its own ``forward`` (or a model
its own ``generate``) without touching the class, which other instances and models share.

A bound method lives in the instance's ``__dict__``, so ``copy.deepcopy`` rebinds it to the
copy, and deleting the attribute gives the class's method back.
"""
from __future__ import annotations

import types
from typing import Callable

from torch import nn


def bind(module: nn.Module, name: str, function: Callable) -> None:
    """Make ``function`` ``module``'s own method ``name``."""
    setattr(module, name, types.MethodType(function, module))


def is_bound(module: nn.Module, name: str, function: Callable) -> bool:
    """Whether ``module``'s own method ``name`` is ``function``."""
    return getattr(vars(module).get(name), "__func__", None) is function


def bind_where(model: nn.Module, function: Callable, fits: Callable[[nn.Module], bool], name: str = "forward") -> int:
    """Bind ``function`` as ``name`` to every module of ``model`` that ``fits`` and has no method
    of that name of its own (one bound before, by the library or the user, stays); returns
    how many were bound."""
    count = 0
    for module in model.modules():
        if name not in vars(module) and fits(module):
            bind(module, name, function)
            count += 1
    return count
