"""Checks of the settings the public entry points take, shared so that each kind of setting is
refused the same way everywhere: ``PageCompError`` (a ``ValueError``) naming the setting and
what it must be, raised when it is given rather than when a later call trips over it."""

from __future__ import annotations

import math
import numbers
import operator

from .format import PageCompError


def check_int(name: str, value, least: int | None = None, none_ok: bool = False) -> None:
    """``value`` is an int (not a bool) of at least ``least`` (None: any), or None where
    ``none_ok``."""
    if value is None and none_ok:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or (
            least is not None and value < least):
        want = "an int" + (f" >= {least}" if least is not None else "")
        raise PageCompError(
            f"{name} must be {want}{' or None' if none_ok else ''}, got {value!r}")


def as_int(name: str, value) -> int:
    """``value`` as an ``int`` (anything with ``__index__``: numpy ints, 0-d int tensors); a
    float (``2.0``) or a bool is an error, not silently taken."""
    if isinstance(value, bool):
        raise PageCompError(f"{name} must be an int, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise PageCompError(
            f"{name} must be an int, got {type(value).__name__} {value!r}"
        ) from None


def check_flag(name: str, value) -> None:
    """``value`` is True or False (not merely truthy)."""
    if not isinstance(value, bool):
        raise PageCompError(f"{name} must be True or False, got {value!r}")


def check_number(name: str, value, least: float = 0.0, most: float = math.inf) -> None:
    """``value`` is a real number (not a bool) in ``[least, most]``, finite (nan fails)."""
    if (isinstance(value, bool) or not isinstance(value, numbers.Real)
            or not least <= value <= most or not math.isfinite(value)):
        want = (f"a finite number >= {least:g}" if math.isinf(most)
                else f"a number in [{least:g}, {most:g}]")
        raise PageCompError(f"{name} must be {want}, got {value!r}")
