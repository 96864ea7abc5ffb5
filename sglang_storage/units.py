"""Byte sizes as users write them in flags and config files, and as reports print them.

- :func:`parse_bytes` - ``"64GiB"``, ``"1.5 MB"``, ``"4096"`` or an int to a byte count;
  anything else is a :class:`~sglang_storage.errors.ConfigError` that lists the units.
- :func:`format_bytes` - a byte count to the largest binary unit that keeps it >= 1.

Binary units (KiB, MiB, GiB, TiB) are powers of 1024, decimal units (KB, MB, GB, TB)
powers of 1000; a bare ``K``/``M``/``G`` is refused because users mean both.
"""

from __future__ import annotations

import re
from typing import Final

from sglang_storage.errors import ConfigError

__all__ = ["UNITS", "format_bytes", "parse_bytes"]

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
_ALLOWED: Final = "an integer byte count or a number followed by one of " + ", ".join(UNITS)
_PATTERN: Final = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*")
_BINARY_STEPS: Final = ("B", "KiB", "MiB", "GiB", "TiB")
# Far above any real size (1 TiB has 13 digits), far below int()'s 4300-digit limit.
_MAX_TEXT: Final = 64


def parse_bytes(value: int | str, *, owner: str = "size", field: str = "value") -> int:
    """Return the byte count that ``value`` denotes.

    Args:
        value: A non-negative int, or a string such as ``"512MiB"`` or ``"1.5 GB"``.
            Units are case-sensitive as written in :data:`UNITS`; a fractional size
            must come to a whole number of bytes.
        owner: Named in the error: what the size configures.
        field: Named in the error: the option that held it.

    Raises:
        ConfigError: ``value`` is negative, not a size, has an unknown unit, or a
            fraction that is not a whole number of bytes.
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
    unit: str = match.group(2) or "B"
    if unit not in UNITS:
        raise ConfigError(
            owner=owner,
            field=field,
            value=value,
            reason=f"unknown unit {unit!r}",
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
