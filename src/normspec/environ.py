"""Settings read from environment variables, with errors that name the variable."""

from __future__ import annotations

import os

__all__ = ["positive_int"]


def positive_int(name: str, expected: str) -> int | None:
    """``$name`` as a whole number >= 1, or ``None`` where it is unset or blank.

    Raises ``ValueError`` ``"{name}: expected {expected}, got '...'"`` for any other
    value, so the message says what the variable means.
    """
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{name}: expected {expected}, got {value!r}")
    return int(value)
