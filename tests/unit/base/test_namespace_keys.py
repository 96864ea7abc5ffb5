"""``Namespace.keys`` builds the keys ``Namespace.key`` builds, and rejects what it rejects."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sglang_storage.core import DataKind, Namespace, ObjectKey
from sglang_storage.core.objects import NAME_MAX
from sglang_storage.errors import ConfigError

NS = Namespace(model="m", kind=DataKind.KV)
SAFE = st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,40}", fullmatch=True)


def one_by_one(names: list[object]) -> list[ObjectKey] | str:
    try:
        return [NS.key(name) for name in names]  # type: ignore[arg-type]
    except ConfigError as error:
        return f"{error.field}={error.value!r}"


def batch(names: list[object]) -> list[ObjectKey] | str:
    try:
        return NS.keys(names)  # type: ignore[arg-type]
    except ConfigError as error:
        return f"{error.field}={error.value!r}"


@given(st.lists(SAFE | st.text(max_size=6) | st.none(), max_size=20))
def test_a_batch_is_keyed_exactly_as_one_key_at_a_time(names: list[object]) -> None:
    assert batch(names) == one_by_one(names)


@pytest.mark.parametrize(
    "names",
    [
        [],
        ["a" * NAME_MAX],
        ["ok", "a" * (NAME_MAX + 1)],
        ["ok", "a/b"],
        ["a/b/c", "d"],
        ["", "x"],
        ["x", "-y"],
        ["x", ".y"],
        ["x", "y\n"],
        ["x", 7],
        ["sha256-" + "0" * 64],
    ],
)
def test_edges_match_one_key_at_a_time(names: list[object]) -> None:
    assert batch(names) == one_by_one(names)


def test_batch_keys_hash_and_compare_like_ordinary_keys() -> None:
    names = [f"{i:064x}" for i in range(50)]
    built = NS.keys(names)
    assert built == [NS.key(name) for name in names]
    assert {hash(k) for k in built} == {hash(NS.key(name)) for name in names}
    assert {*built} == {NS.key(name) for name in names}
    assert str(built[3]) == str(NS.key(names[3]))
    with pytest.raises(AttributeError):
        built[0].name = "other"  # type: ignore[misc]
