"""Old public names kept working for one release, with a DeprecationWarning that names the new one.

A module lists its renamed names and sets `__getattr__ = renamed(__name__, {...})`; an attribute that
is not found the usual way is looked up there. A class keeps a renamed attribute as
`old = renamed_attribute("Class.old", "new")`.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable

__all__ = ["renamed", "renamed_attribute"]


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


def renamed_attribute(old: str, new: str, why: str = "") -> property:
    """A property `old` ("Class.name") that reads and writes the attribute `new`, with a DeprecationWarning."""
    message = f"{old} is deprecated and will be removed in the next release; use .{new}{f' ({why})' if why else ''}."

    def get(self):
        warnings.warn(message, DeprecationWarning, stacklevel=2)
        return getattr(self, new)

    def set(self, value):
        warnings.warn(message, DeprecationWarning, stacklevel=2)
        setattr(self, new, value)

    return property(get, set, doc=f"Deprecated: {new}.")
