"""Pure-Python value checks shared by every layer (no JAX: the schedule IR imports this too)."""
from __future__ import annotations

from typing import Optional


def is_int(value, minimum: Optional[int] = None) -> bool:
    """``value`` is an int (not a bool) and, if ``minimum`` is given, at least ``minimum``."""
    return isinstance(value, int) and not isinstance(value, bool) and (minimum is None or value >= minimum)
