"""Old public names kept working for one release, with a DeprecationWarning that names the new one.

A module lists its renamed names and sets `__getattr__ = renamed(__name__, {...})`; an attribute that
is not found the usual way is looked up there.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable

__all__ = ["renamed"]


def renamed(module: str, names: dict[str, str]) -> Callable[[str], object]:
    """A module `__getattr__` for `names`: {old name: "package.module:new_name"}."""

    def __getattr__(name: str) -> object:
        if name not in names:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        where, _, new = names[name].partition(":")
        warnings.warn(
            f"{module}.{name} is deprecated and will be removed in the next release; use {where}.{new}.",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(where), new)

    return __getattr__
