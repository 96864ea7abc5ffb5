from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sglang_storage.errors import ConfigError, StorageError
from sglang_storage.units import UNITS, describe_bytes, format_bytes, parse_bytes

ALL_UNIT_NAMES = ", ".join(UNITS)
BINARY = {"B": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3, "TiB": 1024**4}


# ---------------------------------------------------------------- UNITS


def test_units_table() -> None:
    assert UNITS == {
        "B": 1,
        "KB": 10**3,
        "MB": 10**6,
        "GB": 10**9,
        "TB": 10**12,
        "KiB": 2**10,
        "MiB": 2**20,
        "GiB": 2**30,
        "TiB": 2**40,
    }


# ---------------------------------------------------------------- parse_bytes: accepted


@pytest.mark.parametrize("value", [0, 1, 4096, 2**40, 10**30])
def test_parse_int(value: int) -> None:
    assert parse_bytes(value) == value


@pytest.mark.parametrize(("text", "expected"), [("0", 0), ("4096", 4096), ("007", 7)])
def test_parse_bare_digits(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize(("unit", "scale"), list(UNITS.items()))
def test_parse_every_unit(unit: str, scale: int) -> None:
    assert parse_bytes(f"1{unit}") == scale
    assert parse_bytes(f"64{unit}") == 64 * scale
    assert parse_bytes(f"64 {unit}") == 64 * scale
    assert parse_bytes(f"0{unit}") == 0


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("  64GiB  ", 64 * 2**30),
        ("64 GiB", 64 * 2**30),
        ("64\tGiB", 64 * 2**30),
        ("\n512 MiB\n", 512 * 2**20),
        (" 4096 ", 4096),
    ],
)
def test_parse_whitespace(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1.5KiB", 1536),
        ("1.5 MB", 1_500_000),
        ("0.1KB", 100),
        (".5KiB", 512),
        ("1.KiB", 1024),
        ("1.0", 1),
        ("2.50GiB", 5 * 2**29),
        ("0.001KB", 1),
        ("0.5B", None),
        ("1.5", None),
        ("0.0001KB", None),
        ("1.0001KiB", None),
    ],
)
def test_parse_fractions(text: str, expected: int | None) -> None:
    if expected is not None:
        result = parse_bytes(text)
        assert result == expected
        assert type(result) is int
        return
    with pytest.raises(ConfigError, match="is not a whole number of bytes") as excinfo:
        parse_bytes(text)
    assert excinfo.value.value == text
    assert excinfo.value.reason == "is not a whole number of bytes"


def test_parse_fraction_is_exact_not_float() -> None:
    # 0.1 * 1000 is 100.00000000000001 in floating point.
    assert parse_bytes("0.1KB") == 100
    assert parse_bytes("0.3GB") == 300_000_000
    assert parse_bytes("1.1TB") == 1_100_000_000_000


# ---------------------------------------------------------------- parse_bytes: rejected


@pytest.mark.parametrize("value", [-1, -4096])
def test_parse_negative_int(value: int) -> None:
    with pytest.raises(ConfigError) as excinfo:
        parse_bytes(value)
    error = excinfo.value
    assert error.reason == "must be >= 0"
    assert error.value == value
    assert error.has_value is True
    assert str(error) == f"size.value: must be >= 0 (got {value})"


@pytest.mark.parametrize("value", [True, False, 1.0, 1.5, float("nan"), None, b"64", [64], {}])
def test_parse_non_size_types(value: object) -> None:
    with pytest.raises(ConfigError, match="must be a size") as excinfo:
        parse_bytes(value)  # type: ignore[arg-type]
    error = excinfo.value
    assert error.reason == "must be a size"
    assert error.value is value
    assert error.has_value is True
    assert error.allowed is not None
    assert ALL_UNIT_NAMES in error.allowed


@pytest.mark.parametrize("text", ["4G", "4k", "4 bytes", "4M", "4Gi", "4Q", "4GiBs"])
def test_parse_unknown_unit(text: str) -> None:
    with pytest.raises(ConfigError, match="unknown unit") as excinfo:
        parse_bytes(text)
    error = excinfo.value
    unit = text.lstrip("4 ")
    assert error.reason.startswith(f"unknown unit {unit!r}")
    assert error.value == text
    assert error.allowed == f"an integer byte count or a number followed by one of {ALL_UNIT_NAMES}"
    assert ALL_UNIT_NAMES in str(error)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "   ",
        "abc",
        "GiB",
        "-1",
        "-1KiB",
        "+1KiB",
        "1e9",
        "1,024",
        "1 2",
        "1..5KiB",
        ".",
        "1GiB!",
    ],
)
def test_parse_garbage(text: str) -> None:
    with pytest.raises(ConfigError, match="is not a size") as excinfo:
        parse_bytes(text)
    error = excinfo.value
    assert error.reason == "is not a size"
    assert error.value == text
    assert error.allowed is not None
    assert ALL_UNIT_NAMES in error.allowed


@pytest.mark.parametrize("value", [-1, "4G", "abc", None, "0.5B"])
def test_parse_errors_name_owner_and_field(value: object) -> None:
    with pytest.raises(ConfigError) as excinfo:
        parse_bytes(value, owner="FileConfig", field="max_bytes")  # type: ignore[arg-type]
    error = excinfo.value
    assert error.owner == "FileConfig"
    assert error.field == "max_bytes"
    assert str(error).startswith("FileConfig.max_bytes: ")
    assert f"(got {value!r})" in str(error)


def test_parse_error_default_owner_and_field() -> None:
    with pytest.raises(ConfigError) as excinfo:
        parse_bytes("4G")
    assert (excinfo.value.owner, excinfo.value.field) == ("size", "value")


def test_parse_huge_digit_string_raises_config_error() -> None:
    # Python refuses int() of strings over 4300 digits with a plain ValueError; every failure
    # of the subsystem must be a StorageError (ConfigError), not a bare ValueError.
    with pytest.raises(StorageError):
        parse_bytes("9" * 5000)


# ---------------------------------------------------------------- format_bytes


@pytest.mark.parametrize(
    ("count", "expected"),
    [
        (0, "0 B"),
        (1, "1 B"),
        (1023, "1023 B"),
        (1024, "1 KiB"),
        (1536, "1.50 KiB"),
        (1025, "1.00 KiB"),
        (2**20, "1 MiB"),
        (3 * 2**19, "1.50 MiB"),
        (64 * 2**30, "64 GiB"),
        (2**30, "1 GiB"),
        (2**40, "1 TiB"),
        (1023 * 2**40, "1023 TiB"),
        (2**50, "1024 TiB"),
        (2**60, "1048576 TiB"),
        (2**50 + 2**39, "1024.50 TiB"),
        (2**20 - 1, "1.00 MiB"),
        (2**30 - 1, "1.00 GiB"),
        (1023 * 1024 + 1000, "1023.98 KiB"),
        (-1, "-1 B"),
        (-1024, "-1 KiB"),
        (-1536, "-1.50 KiB"),
        (-(64 * 2**30), "-64 GiB"),
    ],
)
def test_format_bytes(count: int, expected: str) -> None:
    assert format_bytes(count) == expected


# ---------------------------------------------------------------- properties


@given(n=st.integers(min_value=0, max_value=10**30), unit=st.sampled_from(list(UNITS)))
def test_property_parse_number_and_unit(n: int, unit: str) -> None:
    assert parse_bytes(f"{n}{unit}") == n * UNITS[unit]
    assert parse_bytes(f"{n} {unit}") == n * UNITS[unit]


@given(n=st.integers(min_value=0, max_value=10**30))
def test_property_parse_int_and_digits(n: int) -> None:
    assert parse_bytes(n) == n
    assert parse_bytes(str(n)) == n


@given(
    mantissa=st.integers(min_value=1, max_value=1023),
    unit=st.sampled_from(list(BINARY)),
)
def test_property_format_exact_multiple_round_trips(mantissa: int, unit: str) -> None:
    count = mantissa * BINARY[unit]
    text = format_bytes(count)
    assert text == f"{mantissa} {unit}"
    assert parse_bytes(text) == count


@given(n=st.integers(min_value=0, max_value=2**70))
def test_property_format_whole_output_parses_back(n: int) -> None:
    text = format_bytes(n)
    number, unit = text.split(" ")
    assert unit in BINARY
    if "." in number:
        # Rounded to two decimals (not always a whole number of bytes, so not parsed back).
        assert abs(float(number) * BINARY[unit] - n) <= BINARY[unit] * 0.005 * (1 + 1e-9)
        assert n % BINARY[unit] != 0
    else:
        assert parse_bytes(text) == n
        # The largest unit that keeps the number >= 1 (TiB is the largest there is).
        assert int(number) >= 1 or n == 0
        assert unit == "TiB" or int(number) < 1024


@given(n=st.integers(min_value=1, max_value=2**70))
def test_property_format_negative_mirrors_positive(n: int) -> None:
    assert format_bytes(-n) == "-" + format_bytes(n)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4gib", 4 * 2**30),
        ("4GIB", 4 * 2**30),
        ("4kb", 4000),
        ("4Kb", 4000),
        ("4b", 4),
        ("1.5 mib", 3 * 2**19),
        ("10gb", 10**10),
    ],
)
def test_units_are_read_in_any_case(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize(
    ("text", "suggestion"),
    [
        ("10G", "did you mean 10GB or 10GiB?"),
        ("10Gi", "did you mean 10GiB?"),
        ("2k", "did you mean 2KB or 2KiB?"),
        ("3GiBs", "did you mean 3GiB?"),
    ],
)
def test_an_unknown_unit_suggests_the_units_it_may_mean(text: str, suggestion: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        parse_bytes(text)
    assert excinfo.value.reason.endswith(suggestion)


def test_an_unknown_unit_unlike_any_suggests_nothing() -> None:
    with pytest.raises(ConfigError) as excinfo:
        parse_bytes("4Q")
    assert "did you mean" not in excinfo.value.reason


def test_describe_bytes_gives_the_exact_count_and_binary_units() -> None:
    assert describe_bytes(10**10) == "10000000000 bytes (9.31 GiB)"
    assert describe_bytes(2**30) == "1073741824 bytes (1 GiB)"
