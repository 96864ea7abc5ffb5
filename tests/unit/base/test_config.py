from __future__ import annotations

import contextlib
import enum
import math
from collections.abc import Callable
from pathlib import Path

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sglang_storage.config import (
    BYTES,
    build_config,
    instance_of,
    int_in_range,
    non_empty_str,
    non_negative_int,
    non_negative_number,
    number_in_range,
    one_of,
    optional,
    positive_int,
    positive_number,
    power_of_two,
    tuple_of,
)
from sglang_storage.errors import ConfigError, StorageError

# build_config resolves annotations with typing.get_type_hints, so every class it builds is
# defined at module level.


class Mode(enum.Enum):
    FAST = "fast"
    SAFE = "safe"


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


@attrs.frozen(kw_only=True)
class Validated:
    kind: int | str = attrs.field(default=1, validator=instance_of(int, str))
    count: int = attrs.field(default=1, validator=int_in_range(1, 10))
    floor: int = attrs.field(default=5, validator=int_in_range(low=5))
    ceiling: int = attrs.field(default=0, validator=int_in_range(high=0))
    ratio: float = attrs.field(default=0.5, validator=number_in_range(0, 1))
    rate: float = attrs.field(default=1.0, validator=number_in_range(0, 2, low_exclusive=True))
    workers: int = attrs.field(default=1, validator=positive_int)
    retries: int = attrs.field(default=0, validator=non_negative_int)
    timeout_s: float = attrs.field(default=1.0, validator=positive_number)
    delay_s: float = attrs.field(default=0.0, validator=non_negative_number)
    page_size: int = attrs.field(default=64, validator=power_of_two)
    layout: str = attrs.field(default="layer_first", validator=one_of("layer_first", "page_first"))
    name: str = attrs.field(default="x", validator=non_empty_str)
    limit: int | None = attrs.field(default=None, validator=optional(positive_int))
    names: tuple[str, ...] = attrs.field(default=(), validator=tuple_of(non_empty_str))


@attrs.frozen(kw_only=True)
class Counter:
    n: int = attrs.field(validator=positive_int)


@attrs.frozen(kw_only=True)
class Inner:
    size: int = attrs.field(default=4096, metadata=BYTES, validator=non_negative_int)
    root: Path = attrs.field(default=Path("/tmp"))


@attrs.frozen(kw_only=True)
class Outer:
    name: str = attrs.field(validator=non_empty_str)
    inner: Inner = attrs.field(factory=Inner)


@attrs.frozen(kw_only=True)
class Typed:
    count: int = 1
    ratio: float = 1.0
    label: str = "a"
    flag: bool = False
    path: Path = Path("/")
    mode: Mode = Mode.FAST
    level: Level = Level.LOW
    maybe_mode: Mode | None = None
    maybe_count: int | None = None
    either: int | str = 0
    modes: tuple[Mode, ...] = ()
    counts: tuple[int, ...] = ()
    pair: tuple[int, str] = (0, "")
    capacity: int = attrs.field(default=0, metadata=BYTES, validator=non_negative_int)
    maybe_capacity: int | None = attrs.field(default=None, metadata=BYTES)


@attrs.frozen(kw_only=True)
class Required:
    alpha: int
    beta: str
    gamma: float = 1.0


@attrs.frozen(kw_only=True)
class Private:
    _secret: int = attrs.field(default=0, validator=non_negative_int)
    derived: int = attrs.field(init=False, default=7)


@attrs.frozen(kw_only=True)
class Empty:
    pass


@attrs.frozen(kw_only=True)
class CrossField:
    low: int = attrs.field(validator=non_negative_int)
    high: int = attrs.field(validator=non_negative_int)

    def __attrs_post_init__(self) -> None:
        if self.low > self.high:
            raise ConfigError(
                owner=type(self).__name__, field="low", value=self.low, reason="must be <= high"
            )


@attrs.frozen(kw_only=True)
class HoldsCrossField:
    window: CrossField


@attrs.frozen(kw_only=True)
class Deep:
    outer: Outer


def _error(call: Callable[..., object], **kwargs: object) -> ConfigError:
    with pytest.raises(ConfigError) as excinfo:
        call(**kwargs)
    return excinfo.value


# ---------------------------------------------------------------- validators: accepted


def test_defaults_are_valid() -> None:
    config = Validated()
    assert config.page_size == 64


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("kind", 3),
        ("kind", "three"),
        ("count", 1),
        ("count", 10),
        ("floor", 5),
        ("floor", 10**20),
        ("ceiling", 0),
        ("ceiling", -(10**20)),
        ("ratio", 0),
        ("ratio", 0.0),
        ("ratio", 1),
        ("ratio", 0.25),
        ("rate", 1e-300),
        ("rate", 2),
        ("workers", 1),
        ("workers", 2**40),
        ("retries", 0),
        ("timeout_s", 1e-9),
        ("timeout_s", 5),
        ("delay_s", 0),
        ("delay_s", 0.0),
        ("page_size", 1),
        ("page_size", 2),
        ("page_size", 2**40),
        ("layout", "page_first"),
        ("name", " a "),
        ("limit", None),
        ("limit", 3),
        ("names", ()),
        ("names", ("a", "b")),
    ],
)
def test_validator_accepts(field: str, value: object) -> None:
    config = Validated(**{field: value})  # type: ignore[arg-type]
    assert getattr(config, field) == value


# ---------------------------------------------------------------- validators: rejected


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("kind", True, "must be int or str, not bool"),
        ("kind", 1.5, "must be int or str, not float"),
        ("kind", None, "must be int or str, not NoneType"),
        ("count", 0, "must be >= 1 and <= 10"),
        ("count", 11, "must be >= 1 and <= 10"),
        ("count", True, "must be an int >= 1 and <= 10"),
        ("count", 5.0, "must be an int >= 1 and <= 10"),
        ("count", "5", "must be an int >= 1 and <= 10"),
        ("floor", 4, "must be >= 5"),
        ("ceiling", 1, "must be <= 0"),
        ("ceiling", False, "must be an int <= 0"),
        ("ratio", -0.1, "must be >= 0 and <= 1"),
        ("ratio", 1.0000001, "must be >= 0 and <= 1"),
        ("ratio", True, "must be a number >= 0 and <= 1"),
        ("ratio", "0.5", "must be a number >= 0 and <= 1"),
        ("ratio", None, "must be a number >= 0 and <= 1"),
        ("ratio", math.nan, "must be finite"),
        ("ratio", math.inf, "must be finite"),
        ("rate", 0, "must be > 0 and <= 2"),
        ("rate", 0.0, "must be > 0 and <= 2"),
        ("rate", -1, "must be > 0 and <= 2"),
        ("rate", 2.5, "must be > 0 and <= 2"),
        ("workers", 0, "must be >= 1"),
        ("workers", -1, "must be >= 1"),
        ("workers", True, "must be an int >= 1"),
        ("workers", 1.0, "must be an int >= 1"),
        ("retries", -1, "must be >= 0"),
        ("retries", False, "must be an int >= 0"),
        ("timeout_s", 0, "must be > 0"),
        ("timeout_s", 0.0, "must be > 0"),
        ("timeout_s", -0.5, "must be > 0"),
        ("timeout_s", math.inf, "must be finite"),
        ("timeout_s", -math.inf, "must be finite"),
        ("timeout_s", math.nan, "must be finite"),
        ("timeout_s", True, "must be a number > 0"),
        ("delay_s", -1e-9, "must be >= 0"),
        ("delay_s", math.nan, "must be finite"),
        ("delay_s", math.inf, "must be finite"),
        ("delay_s", False, "must be a number >= 0"),
        ("page_size", 0, "must be a power of two"),
        ("page_size", 3, "must be a power of two"),
        ("page_size", 96, "must be a power of two"),
        ("page_size", -64, "must be a power of two"),
        ("page_size", True, "must be a power of two"),
        ("page_size", 64.0, "must be a power of two"),
        ("layout", "LAYER_FIRST", "is not a supported choice"),
        ("layout", None, "is not a supported choice"),
        ("name", "", "must not be empty or blank"),
        ("name", " \t\n", "must not be empty or blank"),
        ("name", 3, "must be a str, not int"),
        ("name", None, "must be a str, not NoneType"),
        ("limit", 0, "must be >= 1"),
        ("limit", True, "must be an int >= 1"),
        ("names", ["a"], "must be a tuple, not list"),
        ("names", "ab", "must be a tuple, not str"),
    ],
)
def test_validator_rejects(field: str, value: object, reason: str) -> None:
    error = _error(Validated, **{field: value})
    assert isinstance(error, StorageError)
    assert error.owner == "Validated"
    assert error.field == field
    assert error.reason == reason
    assert error.has_value is True
    if isinstance(value, float) and math.isnan(value):
        assert math.isnan(error.value)  # type: ignore[arg-type]
    else:
        assert error.value is value
    message = str(error)
    assert message.startswith(f"Validated.{field}: {reason} (got {value!r})")


def test_power_of_two_lists_allowed() -> None:
    error = _error(Validated, page_size=3)
    assert error.allowed == "1, 2, 4, 8, ..."
    assert (
        str(error)
        == "Validated.page_size: must be a power of two (got 3); allowed: 1, 2, 4, 8, ..."
    )


def test_one_of_lists_allowed_choices() -> None:
    error = _error(Validated, layout="head_first")
    assert error.allowed == "'layer_first', 'page_first'"
    assert str(error) == (
        "Validated.layout: is not a supported choice (got 'head_first'); "
        "allowed: 'layer_first', 'page_first'"
    )


@attrs.frozen(kw_only=True)
class Tier:
    level: int = attrs.field(default=1, validator=one_of(1, 2))


@pytest.mark.parametrize("value", [True, 1.0, "1"])
def test_one_of_requires_the_choice_type_too(value: object) -> None:
    with pytest.raises(ConfigError) as error:
        Tier(level=value)  # type: ignore[arg-type]
    assert error.value.field == "level"
    assert Tier(level=2).level == 2


@pytest.mark.parametrize(
    ("names", "index", "bad"),
    [(("ok", ""), 1, ""), (("", "ok"), 0, ""), (("a", "b", 3), 2, 3), ((" ",), 0, " ")],
)
def test_tuple_of_names_the_index(names: tuple[object, ...], index: int, bad: object) -> None:
    error = _error(Validated, names=names)
    assert error.owner == "Validated"
    assert error.field == f"names[{index}]"
    assert error.value == bad
    assert str(error).startswith(f"Validated.names[{index}]: ")
    assert f"(got {bad!r})" in str(error)


def test_tuple_of_reports_the_first_bad_element() -> None:
    error = _error(Validated, names=("a", "", 7))
    assert error.field == "names[1]"


def test_validators_work_when_called_directly() -> None:
    attribute = attrs.fields(Counter).n
    positive_int(Counter(n=1), attribute, 5)
    with pytest.raises(ConfigError, match=r"^Counter\.n: must be >= 1 \(got 0\)$"):
        positive_int(Counter(n=1), attribute, 0)


def test_int_in_range_message_shows_the_exact_bound() -> None:
    # The bound is 1_000_001; a message that says "<= 1e+06" states a different rule.
    check = int_in_range(0, 1_000_001)
    attribute = attrs.fields(Counter).n
    check(Counter(n=1), attribute, 1_000_001)
    with pytest.raises(ConfigError) as excinfo:
        check(Counter(n=1), attribute, 1_000_002)
    assert excinfo.value.reason == "must be >= 0 and <= 1000001"


def test_number_validator_on_huge_int_does_not_escape_config_error() -> None:
    # 10**400 is a finite number >= 0; the validator must accept it or raise ConfigError,
    # never let OverflowError (from converting it to float) escape.
    attribute = attrs.fields(Validated).delay_s
    with contextlib.suppress(ConfigError):
        non_negative_number(Validated(), attribute, 10**400)


def test_build_int_too_large_for_a_float_field_is_a_config_error() -> None:
    with pytest.raises(ConfigError) as error:
        build_config(Typed, {"ratio": 10**400})
    assert (error.value.field, error.value.reason) == ("ratio", "is too large for a float")


# ---------------------------------------------------------------- frozen


def test_instances_are_frozen() -> None:
    config = Validated()
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        config.count = 2  # type: ignore[misc]
    outer = Outer(name="o")
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        outer.inner = Inner()  # type: ignore[misc]
    assert config.count == 1


def test_instances_are_keyword_only() -> None:
    with pytest.raises(TypeError):
        Counter(3)  # type: ignore[call-arg]


# ---------------------------------------------------------------- build_config: options


def test_build_plain() -> None:
    assert build_config(Required, {"alpha": 1, "beta": "b"}) == Required(alpha=1, beta="b")
    assert build_config(Validated, {}) == Validated()


def test_build_unknown_option() -> None:
    error = _error(build_config, cls=Required, data={"alpha": 1, "beta": "b", "delta": 2})
    assert error.owner == "Required"
    assert error.field == "delta"
    assert error.reason == "unknown option"
    assert error.allowed == "alpha, beta, gamma"
    assert error.has_value is False
    assert str(error) == "Required.delta: unknown option; allowed: alpha, beta, gamma"


def test_build_several_unknown_options_listed_together() -> None:
    error = _error(build_config, cls=Required, data={"zeta": 1, "alpha": 1, "eta": 2, "beta": "b"})
    assert error.field == "eta, zeta"
    assert error.reason == "unknown options (did you mean 'eta' -> 'beta', 'zeta' -> 'beta'?)"
    assert str(error).endswith("?); allowed: alpha, beta, gamma")


def test_build_unknown_option_is_reported_before_missing() -> None:
    error = _error(build_config, cls=Required, data={"delta": 1})
    assert error.reason == "unknown option"


def test_build_unknown_option_on_class_without_options() -> None:
    error = _error(build_config, cls=Empty, data={"x": 1})
    assert error.allowed == "no options"
    assert build_config(Empty, {}) == Empty()


def test_build_missing_required_options() -> None:
    error = _error(build_config, cls=Required, data={"gamma": 2.0})
    assert error.owner == "Required"
    assert error.field == "alpha, beta"
    assert error.reason == "is required"
    assert error.has_value is False
    assert str(error) == "Required.alpha, beta: is required"
    one = _error(build_config, cls=Required, data={"alpha": 1})
    assert one.field == "beta"


def test_build_uses_init_names_and_skips_init_false_fields() -> None:
    assert build_config(Private, {"secret": 3}) == Private(secret=3)
    unknown = _error(build_config, cls=Private, data={"_secret": 3})
    assert unknown.allowed == "secret"
    assert _error(build_config, cls=Private, data={"derived": 1}).field == "derived"


def test_build_validator_error_on_private_field_names_the_option_written() -> None:
    # The option is written "secret" ("_secret" is an unknown option), so the error must
    # name "secret", the name the user can fix.
    rejected = _error(build_config, cls=Private, data={"secret": -1})
    assert (rejected.owner, rejected.field) == ("Private", "secret")


def test_build_owner_override() -> None:
    error = _error(build_config, cls=Required, data={"alpha": 1}, owner="--storage-config")
    assert error.owner == "--storage-config"
    validator_error = _error(build_config, cls=Counter, data={"n": 0}, owner="counter")
    assert validator_error.owner == "counter"
    assert str(validator_error) == "counter.n: must be >= 1 (got 0)"


# ---------------------------------------------------------------- build_config: coercion


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("fast", Mode.FAST),
        ("safe", Mode.SAFE),
        ("FAST", Mode.FAST),
        ("Safe", Mode.SAFE),
        ("sAfE", Mode.SAFE),
        (Mode.SAFE, Mode.SAFE),
    ],
)
def test_build_enum_by_value_or_name(value: object, expected: Mode) -> None:
    config = build_config(Typed, {"mode": value})
    assert config.mode is expected


@pytest.mark.parametrize(
    ("value", "expected"), [(1, Level.LOW), (2, Level.HIGH), ("high", Level.HIGH)]
)
def test_build_int_enum(value: object, expected: Level) -> None:
    assert build_config(Typed, {"level": value}).level is expected


@pytest.mark.parametrize("value", ["turbo", "", 1, None, ["fast"]])
def test_build_enum_rejects_and_lists_values(value: object) -> None:
    error = _error(build_config, cls=Typed, data={"mode": value})
    assert error.owner == "Typed"
    assert error.field == "mode"
    assert error.reason == "is not a Mode"
    assert error.value == value
    assert error.allowed == "'fast', 'safe'"
    assert str(error) == f"Typed.mode: is not a Mode (got {value!r}); allowed: 'fast', 'safe'"


@pytest.mark.parametrize("value", [True, "1", 3, 1.0])
def test_build_int_enum_rejects_wrong_type_or_value(value: object) -> None:
    error = _error(build_config, cls=Typed, data={"level": value})
    assert error.reason == "is not a Level"
    assert error.allowed == "1, 2"


def test_build_int_to_float() -> None:
    config = build_config(Typed, {"ratio": 3})
    assert config.ratio == 3.0
    assert type(config.ratio) is float
    assert build_config(Typed, {"ratio": 0.5}).ratio == 0.5


def test_build_list_to_tuple() -> None:
    config = build_config(Typed, {"counts": [1, 2, 3], "pair": [1, "x"]})
    assert config.counts == (1, 2, 3)
    assert config.pair == (1, "x")
    assert build_config(Validated, {"names": ["a", "b"]}).names == ("a", "b")


def test_build_list_of_enums_to_tuple_of_members() -> None:
    config = build_config(Typed, {"modes": ["fast", "SAFE", Mode.FAST]})
    assert config.modes == (Mode.FAST, Mode.SAFE, Mode.FAST)
    assert all(isinstance(m, Mode) for m in config.modes)


def test_build_tuple_element_errors_name_the_index() -> None:
    error = _error(build_config, cls=Typed, data={"modes": ["fast", "turbo"]})
    assert error.field == "modes[1]"
    assert error.value == "turbo"
    assert str(error).startswith("Typed.modes[1]: is not a Mode (got 'turbo')")
    wrong_int = _error(build_config, cls=Typed, data={"counts": [1, "2"]})
    assert wrong_int.field == "counts[1]"
    assert wrong_int.reason == "must be int, not str"
    validated = _error(build_config, cls=Validated, data={"names": ["a", ""]})
    assert (validated.owner, validated.field) == ("Validated", "names[1]")


def test_build_str_to_path() -> None:
    config = build_config(Typed, {"path": "/var/cache/kv"})
    assert config.path == Path("/var/cache/kv")
    assert isinstance(config.path, Path)
    assert build_config(Typed, {"path": Path("/x")}).path == Path("/x")


def test_build_optional_fields() -> None:
    config = build_config(Typed, {"maybe_mode": None, "maybe_count": None})
    assert config.maybe_mode is None
    assert config.maybe_count is None
    filled = build_config(Typed, {"maybe_mode": "safe", "maybe_count": 4})
    assert filled.maybe_mode is Mode.SAFE
    assert filled.maybe_count == 4
    assert build_config(Validated, {"limit": None}).limit is None
    error = _error(build_config, cls=Typed, data={"maybe_count": "4"})
    assert error.reason == "must be int, not str"


def test_build_union_of_several_types_passes_value_through() -> None:
    assert build_config(Typed, {"either": "x"}).either == "x"
    assert build_config(Typed, {"either": 3}).either == 3


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("count", "3", "must be int, not str"),
        ("count", True, "must be int, not bool"),
        ("count", 3.0, "must be int, not float"),
        ("ratio", "1.5", "must be float, not str"),
        ("ratio", True, "must be float, not bool"),
        ("label", 3, "must be str, not int"),
        ("label", None, "must be str, not NoneType"),
        ("flag", 1, "must be bool, not int"),
        ("flag", "true", "must be bool, not str"),
        ("path", 3, "must be Path, not int"),
        ("capacity", True, "must be int, not bool"),
        ("capacity", 1.5, "must be int, not float"),
    ],
)
def test_build_rejects_wrong_simple_types(field: str, value: object, reason: str) -> None:
    error = _error(build_config, cls=Typed, data={field: value})
    assert error.owner == "Typed"
    assert error.field == field
    assert error.reason == reason
    assert error.value is value
    assert str(error) == f"Typed.{field}: {reason} (got {value!r})"


def test_build_accepts_right_simple_types() -> None:
    config = build_config(Typed, {"count": 3, "label": "b", "flag": True})
    assert (config.count, config.label, config.flag) == (3, "b", True)


@pytest.mark.parametrize(
    ("value", "expected"),
    [("64MiB", 64 * 2**20), ("1.5 KiB", 1536), ("4096", 4096), (4096, 4096), ("2GB", 2 * 10**9)],
)
def test_build_bytes_field(value: object, expected: int) -> None:
    config = build_config(Typed, {"capacity": value, "maybe_capacity": value})
    assert config.capacity == expected
    assert config.maybe_capacity == expected


@pytest.mark.parametrize(
    ("value", "reason"),
    [("64G", "unknown unit 'G'"), ("lots", "is not a size"), ("0.5B", "is not a whole number")],
)
def test_build_bytes_field_rejects(value: str, reason: str) -> None:
    error = _error(build_config, cls=Typed, data={"capacity": value})
    assert error.owner == "Typed"
    assert error.field == "capacity"
    assert error.value == value
    assert error.reason.startswith(reason)
    assert str(error).startswith(f"Typed.capacity: {reason}")


def test_build_bytes_field_runs_the_validator() -> None:
    error = _error(build_config, cls=Typed, data={"capacity": -1})
    assert (error.owner, error.field, error.reason) == ("Typed", "capacity", "must be >= 0")
    assert build_config(Typed, {"maybe_capacity": None}).maybe_capacity is None


def test_build_str_for_non_bytes_int_field_is_not_parsed() -> None:
    error = _error(build_config, cls=Typed, data={"count": "64MiB"})
    assert error.reason == "must be int, not str"


# ---------------------------------------------------------------- build_config: nesting


def test_build_nested_from_mapping() -> None:
    config = build_config(Outer, {"name": "o", "inner": {"size": "1KiB", "root": "/data"}})
    assert config == Outer(name="o", inner=Inner(size=1024, root=Path("/data")))
    assert build_config(Outer, {"name": "o", "inner": {}}).inner == Inner()
    assert build_config(Outer, {"name": "o"}).inner == Inner()
    instance = Inner(size=1)
    assert build_config(Outer, {"name": "o", "inner": instance}).inner is instance


def test_build_nested_coercion_error_names_the_path() -> None:
    error = _error(build_config, cls=Outer, data={"name": "o", "inner": {"size": "64G"}})
    assert error.owner == "Outer.inner"
    assert error.field == "size"
    assert str(error).startswith("Outer.inner.size: unknown unit 'G'; did you mean 64GB or 64GiB?")


def test_build_nested_unknown_option_names_the_path() -> None:
    error = _error(build_config, cls=Outer, data={"name": "o", "inner": {"sise": 1}})
    assert error.owner == "Outer.inner"
    assert error.field == "sise"
    assert error.allowed == "root, size"
    assert str(error) == (
        "Outer.inner.sise: unknown option (did you mean 'sise' -> 'size'?); allowed: root, size"
    )


def test_build_nested_validator_error_names_the_path() -> None:
    error = _error(build_config, cls=Outer, data={"name": "o", "inner": {"size": -5}})
    assert error.owner == "Outer.inner"
    assert error.field == "size"
    assert error.value == -5
    assert str(error) == "Outer.inner.size: must be >= 0 (got -5)"


def test_build_nested_post_init_error_names_the_path() -> None:
    error = _error(build_config, cls=HoldsCrossField, data={"window": {"low": 5, "high": 1}})
    assert error.owner == "HoldsCrossField.window"
    assert error.field == "low"
    assert str(error) == "HoldsCrossField.window.low: must be <= high (got 5)"


def test_build_nested_missing_option_names_the_path() -> None:
    error = _error(build_config, cls=HoldsCrossField, data={"window": {"low": 1}})
    assert str(error) == "HoldsCrossField.window.high: is required"


def test_build_two_levels_deep() -> None:
    config = build_config(Deep, {"outer": {"name": "n", "inner": {"size": "2KiB"}}})
    assert config.outer.inner.size == 2048
    error = _error(build_config, cls=Deep, data={"outer": {"name": "n", "inner": {"size": -1}}})
    assert error.owner == "Deep.outer.inner"
    outer_error = _error(build_config, cls=Deep, data={"outer": {"name": " "}})
    assert (outer_error.owner, outer_error.field) == ("Deep.outer", "name")


def test_build_nested_wrong_shape() -> None:
    error = _error(build_config, cls=Outer, data={"name": "o", "inner": 3})
    assert (error.owner, error.field) == ("Outer", "inner")
    assert error.reason == "must be Inner, not int"


# ---------------------------------------------------------------- build_config: own validators


def test_build_runs_class_validators() -> None:
    error = _error(build_config, cls=Validated, data={"page_size": 96})
    assert (error.owner, error.field, error.value) == ("Validated", "page_size", 96)
    assert error.reason == "must be a power of two"
    cross = _error(build_config, cls=CrossField, data={"low": 2, "high": 1})
    assert str(cross) == "CrossField.low: must be <= high (got 2)"
    assert build_config(CrossField, {"low": 1, "high": 2}) == CrossField(low=1, high=2)


def test_build_runs_validators_after_coercion() -> None:
    # Coerced to float, then number_in_range(0, 1) rejects it.
    error = _error(build_config, cls=Validated, data={"ratio": 2})
    assert error.value == 2.0
    assert type(error.value) is float


# ---------------------------------------------------------------- properties


@given(v=st.integers(min_value=1))
def test_property_build_valid_int(v: int) -> None:
    assert build_config(Counter, {"n": v}) == Counter(n=v)


@given(v=st.integers(max_value=0))
def test_property_positive_int_rejects_below_one(v: int) -> None:
    with pytest.raises(ConfigError) as excinfo:
        build_config(Counter, {"n": v})
    assert (excinfo.value.owner, excinfo.value.field, excinfo.value.value) == ("Counter", "n", v)
    assert excinfo.value.reason == "must be >= 1"
