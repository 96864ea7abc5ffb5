"""Frozen, validated configuration and value types.

Config and value types across sglang_storage are ``@attrs.frozen(kw_only=True)`` classes.
They validate on construction, so an instance that exists is a valid one. This module
holds what they share:

- Field validators (``validator=`` of ``attrs.field``): :func:`instance_of`,
  :func:`int_in_range`, :func:`number_in_range`, :data:`positive_int`,
  :data:`non_negative_int`, :data:`positive_number`, :data:`non_negative_number`,
  :data:`power_of_two`, :func:`one_of`, :data:`non_empty_str`, :func:`optional`,
  :func:`tuple_of`. Each raises :class:`~sglang_storage.errors.ConfigError` naming the
  class, the field, the value and the rule it broke. Cross-field rules go in
  ``__attrs_post_init__`` and raise the same error.
- :data:`BYTES` - field metadata marking an ``int`` field as a byte size, so
  :func:`build_config` accepts ``"64GiB"`` for it.
- :func:`build_config` - build a config class from a mapping (JSON extra config, parsed
  flags): unknown and missing options are errors that list what is allowed, and JSON
  shapes are brought to the field's declared type (str to Enum, int to float, list to
  tuple, str to Path, mapping to a nested config) before the validators run.
"""

from __future__ import annotations

import difflib
import enum
import math
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Final, TypeVar

import attrs

from sglang_storage.errors import ConfigError
from sglang_storage.units import parse_bytes

__all__ = [
    "BYTES",
    "Validator",
    "build_config",
    "instance_of",
    "int_in_range",
    "non_empty_str",
    "non_negative_int",
    "non_negative_number",
    "number_in_range",
    "one_of",
    "optional",
    "positive_int",
    "positive_number",
    "power_of_two",
    "require_int",
    "tuple_of",
]

Validator = Callable[[Any, "attrs.Attribute[Any]", Any], None]
"""The shape of an attrs field validator: ``(instance, attribute, value) -> None``."""

T = TypeVar("T", bound=attrs.AttrsInstance)

_UNIT_KEY: Final = "sglang_storage.unit"
BYTES: Final[Mapping[str, str]] = types.MappingProxyType({_UNIT_KEY: "bytes"})
"""Field metadata for an ``int`` byte count: ``attrs.field(metadata=BYTES, ...)``."""


def _fail(
    instance: object,
    attribute: attrs.Attribute[Any],
    value: object,
    reason: str,
    allowed: str | None = None,
) -> typing.NoReturn:
    raise ConfigError(
        owner=type(instance).__name__,
        # The alias is the keyword users pass ("secret" for a private "_secret" field).
        field=attribute.alias or attribute.name,
        value=value,
        reason=reason,
        allowed=allowed,
    )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _type_name(kind: type) -> str:
    return kind.__qualname__


def instance_of(*kinds: type) -> Validator:
    """Require a value of one of ``kinds``; ``bool`` does not count as ``int`` unless listed."""
    allowed = " or ".join(_type_name(k) for k in kinds)

    def check(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if isinstance(value, bool) and bool not in kinds:
            _fail(instance, attribute, value, f"must be {allowed}, not bool")
        if not isinstance(value, kinds):
            _fail(instance, attribute, value, f"must be {allowed}, not {type(value).__name__}")

    return check


def _bound(value: float) -> str:
    # Exact: ":g" would print 1000001 as 1e+06 and state a rule the check does not apply.
    return str(value) if isinstance(value, int) else repr(value)


def _range_text(low: float | None, high: float | None, low_exclusive: bool) -> str:
    low_text = f"{'>' if low_exclusive else '>='} {_bound(low)}" if low is not None else None
    high_text = f"<= {_bound(high)}" if high is not None else None
    parts = [part for part in (low_text, high_text) if part is not None]
    return " and ".join(parts) if parts else "any value"


def int_in_range(low: int | None = None, high: int | None = None) -> Validator:
    """Require an ``int`` (not ``bool``) with ``low <= value <= high``.

    ``None`` for a bound leaves that side open.
    """
    rule = _range_text(low, high, low_exclusive=False)

    def check(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if not _is_int(value):
            _fail(instance, attribute, value, f"must be an int {rule}")
        if (low is not None and value < low) or (high is not None and value > high):
            _fail(instance, attribute, value, f"must be {rule}")

    return check


def number_in_range(
    low: float | None = None, high: float | None = None, *, low_exclusive: bool = False
) -> Validator:
    """Require a finite ``int`` or ``float`` (not ``bool``) within the bounds.

    ``None`` for a bound leaves that side open; ``low_exclusive`` makes ``low`` itself invalid.
    """
    rule = _range_text(low, high, low_exclusive)

    def check(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int | float):
            _fail(instance, attribute, value, f"must be a number {rule}")
        # Ints are always finite, and too large ones overflow math.isfinite.
        if isinstance(value, float) and not math.isfinite(value):
            _fail(instance, attribute, value, "must be finite")
        below = low is not None and (value <= low if low_exclusive else value < low)
        if below or (high is not None and value > high):
            _fail(instance, attribute, value, f"must be {rule}")

    return check


positive_int: Final = int_in_range(low=1)
"""An ``int`` >= 1."""
non_negative_int: Final = int_in_range(low=0)
"""An ``int`` >= 0."""
positive_number: Final = number_in_range(low=0, low_exclusive=True)
"""A finite number > 0."""
non_negative_number: Final = number_in_range(low=0)
"""A finite number >= 0."""


def _power_of_two(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not _is_int(value) or value < 1 or value & (value - 1):
        _fail(instance, attribute, value, "must be a power of two", allowed="1, 2, 4, 8, ...")


power_of_two: Final[Validator] = _power_of_two
"""An ``int`` that is a power of two (1, 2, 4, ...)."""


def one_of(*choices: object) -> Validator:
    """Require one of ``choices``: equal to it and of the same type (``True`` is not ``1``)."""
    allowed = ", ".join(repr(c) for c in choices)

    def check(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if not any(value == c and type(value) is type(c) for c in choices):
            _fail(instance, attribute, value, "is not a supported choice", allowed=allowed)

    return check


def _non_empty_str(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, str):
        _fail(instance, attribute, value, f"must be a str, not {type(value).__name__}")
    if not value.strip():
        _fail(instance, attribute, value, "must not be empty or blank")


non_empty_str: Final[Validator] = _non_empty_str
"""A ``str`` with at least one non-blank character."""


def optional(validator: Validator) -> Validator:
    """Accept ``None``; otherwise apply ``validator``."""

    def check(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value is not None:
            validator(instance, attribute, value)

    return check


def tuple_of(validator: Validator) -> Validator:
    """Require a ``tuple`` whose every element passes ``validator``; errors name the index."""

    def check(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if not isinstance(value, tuple):
            _fail(instance, attribute, value, f"must be a tuple, not {type(value).__name__}")
        for index, element in enumerate(value):
            try:
                validator(instance, attribute, element)
            except ConfigError as error:
                raise error.renamed(field=f"{attribute.name}[{index}]") from None

    return check


def require_int(value: object, *, owner: str, field: str, low: int = 0) -> int:
    """Return ``value`` if it is an ``int`` (not ``bool``) >= ``low``, else raise ConfigError.

    For checking call arguments (counts, sizes) where there is no attrs field.
    """
    if not _is_int(value) or typing.cast(int, value) < low:
        raise ConfigError(owner=owner, field=field, value=value, reason=f"must be an int >= {low}")
    return typing.cast(int, value)


def build_config(cls: type[T], data: Mapping[str, object], *, owner: str | None = None) -> T:
    """Build ``cls`` from ``data``, an option-name to value mapping (JSON, parsed flags).

    Keys are the ``__init__`` argument names of ``cls``. Values are brought to each
    field's declared type where the JSON shape differs: ``str`` to an ``Enum`` member
    (by value, then by name), ``int`` to ``float``, ``list`` to ``tuple``, ``str`` to
    ``Path``, a mapping to a nested attrs config, and a size string to bytes for
    fields marked with :data:`BYTES`. Simple declared types (``int``, ``float``, ``str``,
    ``bool``, ``Path``, enums, attrs classes) are then checked, and ``cls``'s own
    validators run on construction.

    Args:
        cls: An attrs class.
        data: The options.
        owner: The name errors give the config (default: ``cls.__name__``).

    Raises:
        ConfigError: An option is unknown, a required one is missing, or a value is
            of the wrong type or breaks a field's rule.
    """
    name = owner or cls.__name__
    fields = {field.alias: field for field in attrs.fields(cls) if field.init}
    if not isinstance(data, Mapping):
        raise ConfigError(
            owner=name,
            field="options",
            value=type(data).__name__,
            reason="must be a mapping of option names to values",
            allowed=", ".join(sorted(fields)) or "no options",
        )
    # JSON gives str keys; a mapping built in code may not.
    odd = [key for key in typing.cast(Mapping[object, object], data) if not isinstance(key, str)]
    if odd:
        raise ConfigError(
            owner=name,
            field=repr(odd[0]),
            value=odd[0],
            reason=f"an option name must be a str, not {type(odd[0]).__name__}",
            allowed=", ".join(sorted(fields)) or "no options",
        )
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(data) - set(fields))
    if unknown:
        near = {key: difflib.get_close_matches(key, fields, n=1, cutoff=0.75) for key in unknown}
        suggested = [f"{key!r} -> {match[0]!r}" for key, match in near.items() if match]
        raise ConfigError(
            owner=name,
            field=", ".join(unknown),
            reason=f"unknown option{'s' if len(unknown) > 1 else ''}"
            + (f" (did you mean {', '.join(suggested)}?)" if suggested else ""),
            allowed=", ".join(sorted(fields)) or "no options",
        )
    missing = sorted(
        alias
        for alias, field in fields.items()
        if field.default is attrs.NOTHING and alias not in data
    )
    if missing:
        raise ConfigError(owner=name, field=", ".join(missing), reason="is required")
    kwargs: dict[str, object] = {}
    for alias, value in data.items():
        field = fields[alias]
        declared = hints.get(field.name, object)
        if field.metadata.get(_UNIT_KEY) == "bytes" and isinstance(value, str):
            value = parse_bytes(value, owner=name, field=alias)
        kwargs[alias] = _coerce(value, declared, owner=name, field=alias)
    try:
        return cls(**kwargs)
    except ConfigError as error:
        if owner is None or error.owner != cls.__name__:
            raise
        # A nested build: report the path the user wrote, not the inner class name.
        raise error.renamed(owner=name) from None


def _coerce(value: object, declared: Any, *, owner: str, field: str) -> object:
    origin = typing.get_origin(declared)
    if origin in (typing.Union, types.UnionType):
        members = typing.get_args(declared)
        if value is None and type(None) in members:
            return None
        concrete = [m for m in members if m is not type(None)]
        if len(concrete) == 1:
            return _coerce(value, concrete[0], owner=owner, field=field)
        return value
    if origin is tuple and isinstance(value, list | tuple):
        args = typing.get_args(declared)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(
                _coerce(v, args[0], owner=owner, field=f"{field}[{i}]") for i, v in enumerate(value)
            )
        return tuple(value)
    if not isinstance(declared, type):
        return value
    if issubclass(declared, enum.Enum):
        return _to_enum(value, declared, owner=owner, field=field)
    if attrs.has(declared) and isinstance(value, Mapping):
        return build_config(declared, value, owner=f"{owner}.{field}")
    if declared is float and _is_int(value):
        try:
            return float(typing.cast(int, value))
        except OverflowError:
            raise ConfigError(
                owner=owner, field=field, value=value, reason="is too large for a float"
            ) from None
    if declared is Path and isinstance(value, str):
        if not value.strip():  # Path("") is ".": an empty option must not mean "here"
            raise ConfigError(
                owner=owner,
                field=field,
                value=value,
                reason="must not be empty (it would name the current directory)",
                allowed="a directory path; write '.' for the current directory",
            )
        return Path(value)
    checked = declared in (int, float, str, bool, Path) or attrs.has(declared)
    wrong_bool = isinstance(value, bool) and declared is not bool
    if checked and (wrong_bool or not isinstance(value, declared)):
        raise ConfigError(
            owner=owner,
            field=field,
            value=value,
            reason=f"must be {declared.__name__}, not {type(value).__name__}",
        )
    return value


def _to_enum(value: object, kind: type[enum.Enum], *, owner: str, field: str) -> enum.Enum:
    if isinstance(value, kind):
        return value
    for member in kind:
        if member.value == value and type(member.value) is type(value):
            return member
    if isinstance(value, str):
        for member in kind:
            if member.name.lower() == value.lower():
                return member
    raise ConfigError(
        owner=owner,
        field=field,
        value=value,
        reason=f"is not a {kind.__name__}",
        allowed=", ".join(repr(m.value) for m in kind),
    )
