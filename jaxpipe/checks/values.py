"""Pure-Python value checks shared by every layer (no JAX: the schedule IR imports this too)."""

from __future__ import annotations

import os
from typing import Optional


def is_int(value, minimum: Optional[int] = None) -> bool:
    """``value`` is an int (not a bool) and, if ``minimum`` is given, at least ``minimum``."""
    return isinstance(value, int) and not isinstance(value, bool) and (minimum is None or value >= minimum)


def file_in_the_way(path: str) -> Optional[str]:
    """The file that keeps ``path`` from being (or being made) a directory or a file in one: ``path`` itself's
    nearest existing ancestor where that is a regular file, else None."""
    parent = os.path.dirname(os.path.abspath(os.fspath(path)))
    while parent and not os.path.exists(parent):
        parent = os.path.dirname(parent)
    return parent if parent and not os.path.isdir(parent) else None
