"""Byte sizes as users write them in flags and config files, and as reports print them.

- :func:`parse_bytes` - ``"64GiB"``, ``"1.5 MB"``, ``"4096"`` or an int to a byte count;
  anything else is a :class:`~sglang_storage.errors.ConfigError` that lists the units.
- :func:`format_bytes` - a byte count to the largest binary unit that keeps it >= 1.
- :func:`describe_bytes` - a byte count exactly and in binary units, for echoing what a
  size was read as.

Binary units (KiB, MiB, GiB, TiB) are powers of 1024, decimal units (KB, MB, GB, TB)
powers of 1000 (:data:`SIZE_HELP` says so in help texts); units are read without regard
to case (``10gib`` is ``10GiB``). A bare ``K``/``M``/``G`` is refused, with both
meanings suggested, because users mean both.
"""

from __future__ import annotations

import difflib
import re
from typing import Final

from sglang_storage.errors import ConfigError

__all__ = ["SIZE_HELP", "UNITS", "describe_bytes", "format_bytes", "parse_bytes"]

UNITS: Final[dict[str, int]] = {
    "B": 1,
    "KB": 1000,
    "MB": 1000**2,
    "GB": 1000**3,
    "TB": 1000**4,
    "KiB": 1024,
    "MiB": 1024**2,
    "GiB": 1024**3,
    "TiB": 1024**4,
}
SIZE_HELP: Final = (
    "decimal units KB, MB, GB, TB are powers of 1000 and binary units KiB, MiB, GiB, TiB "
    "powers of 1024 (10GB = 10^10 bytes, 10GiB = 10 x 2^30); case does not matter"
)
"""The size units in one sentence, for the help text of every option that takes a size."""
_ALLOWED: Final = "an integer byte count or a number followed by one of " + ", ".join(UNITS)
_FOLDED: Final[dict[str, str]] = {unit.lower(): unit for unit in UNITS}
_PATTERN: Final = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*")
_BINARY_STEPS: Final = ("B", "KiB", "MiB", "GiB", "TiB")
# Far above any real size (1 TiB has 13 digits), far below int()'s 4300-digit limit.
_MAX_TEXT: Final = 64


def parse_bytes(value: int | str, *, owner: str = "size", field: str = "value") -> int:
    """Return the byte count that ``value`` denotes.

    Args:
        value: A non-negative int, or a string such as ``"512MiB"`` or ``"1.5 GB"``.
            Units are those of :data:`UNITS`, in any case; a fractional size must
            come to a whole number of bytes.
        owner: Named in the error: what the size configures.
        field: Named in the error: the option that held it.

    Raises:
        ConfigError: ``value`` is negative, not a size, has an unknown unit (the
            reason suggests the nearest units), or a fraction that is not a whole number
            of bytes.
    """
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ConfigError(
            owner=owner, field=field, value=value, reason="must be a size", allowed=_ALLOWED
        )
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(owner=owner, field=field, value=value, reason="must be >= 0")
        return value
    match = _PATTERN.fullmatch(value) if len(value) <= _MAX_TEXT else None
    if match is None:
        raise ConfigError(
            owner=owner, field=field, value=value, reason="is not a size", allowed=_ALLOWED
        )
    number: str = match.group(1)
    written: str = match.group(2) or "B"
    unit = _FOLDED.get(written.lower())
    if unit is None:
        raise ConfigError(
            owner=owner,
            field=field,
            value=value,
            reason=f"unknown unit {written!r}{_suggestion(number, written)}",
            allowed=_ALLOWED,
        )
    scale = UNITS[unit]
    if "." not in number:
        return int(number) * scale
    whole, _, frac = number.partition(".")
    # Exact rational arithmetic: floats would turn "0.1KB" into 100.00000000000001.
    denominator: int = 10 ** len(frac)
    numerator = int(whole or "0") * denominator + int(frac or "0")
    total, remainder = divmod(numerator * scale, denominator)
    if remainder:
        raise ConfigError(
            owner=owner, field=field, value=value, reason="is not a whole number of bytes"
        )
    return total


def _suggestion(number: str, unit: str) -> str:
    """``"; did you mean ..."`` naming the units ``unit`` most likely stands for, or ``""``."""
    folded = unit.lower()
    # A bare prefix ("G", "Gi") or one with a stray letter ("Gb", "GiBs"): both readings.
    prefix = folded[:1]
    guesses = [u for u in UNITS if u != "B" and u[0].lower() == prefix and len(folded) <= 4]
    if folded[1:] == "i" or folded[1:3] == "ib":  # "Gi", "GiBs": binary
        guesses = [u for u in guesses if "i" in u]
    if not guesses:
        guesses = [_FOLDED[u] for u in difflib.get_close_matches(folded, _FOLDED, n=2)]
    if not guesses:
        return ""
    return "; did you mean " + " or ".join(f"{number}{u}" for u in guesses) + "?"


def describe_bytes(count: int) -> str:
    """``count`` exactly and in binary units: ``"10000000000 bytes (9.31 GiB)"``."""
    return f"{count} bytes ({format_bytes(count)})"


def format_bytes(count: int) -> str:
    """Return ``count`` bytes in the largest binary unit that keeps the number >= 1.

    Whole numbers print without decimals (``"64 GiB"``), others with two
    (``"1.50 MiB"``). Negative counts keep their sign.
    """
    step = 0
    while step + 1 < len(_BINARY_STEPS) and abs(count) >= 1024 ** (step + 1):
        step += 1
    # Rounding can reach the next unit (2**20 - 1 bytes is "1024.00 KiB"); move up then.
    if step + 1 < len(_BINARY_STEPS) and round(abs(count) / 1024**step, 2) >= 1024:
        step += 1
    scale = 1024**step
    unit = _BINARY_STEPS[step]
    if count % scale == 0:
        return f"{count // scale} {unit}"
    return f"{count / scale:.2f} {unit}"
