"""``page_hashes``' vectorised packing gives the checked path's keys and errors, exactly.

Lists, tuples and integer arrays are packed without a Python-level pass over the ids
(``keys._narrow_words``); every other input, and every list the fast path cannot prove to
be plain non-negative int32 ids, takes the checked path. These cases sit on the fast
path's edges: ids around 2**31 and 2**32, bools, int subclasses, numpy integers, negative
ids, nested lists and every integer array type code.
"""

from __future__ import annotations

import enum
import random
from array import array
from collections.abc import Iterator, Sequence

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sglang_storage.errors import ConfigError
from sglang_storage.storage import keys
from sglang_storage.storage.keys import page_hashes


class Checked(Sequence[int]):
    """A sequence type the fast path does not take: the checked path's reference."""

    def __init__(self, ids: Sequence[int]) -> None:
        self._ids = list(ids)

    def __len__(self) -> int:
        return len(self._ids)

    def __getitem__(self, index):  # type: ignore[no-untyped-def]
        return self._ids[index]

    def __iter__(self) -> Iterator[int]:
        return iter(self._ids)


class Token(enum.IntEnum):
    BOS = 7


EDGES = [0, 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1]


@pytest.mark.parametrize("edge", EDGES)
@pytest.mark.parametrize("where", [0, 5, 9])
@pytest.mark.parametrize("container", [list, tuple])
def test_an_edge_id_anywhere_hashes_as_on_the_checked_path(
    edge: int, where: int, container: type
) -> None:
    ids = list(range(100, 110))
    ids[where] = edge
    for page_size in (1, 3, 10):
        expected = page_hashes(Checked(ids), page_size)
        assert page_hashes(container(ids), page_size) == expected
        assert page_hashes(container(ids), page_size, bigram=True) == page_hashes(
            Checked(ids), page_size, bigram=True
        )


@given(st.lists(st.integers(0, 2**33), max_size=200), st.integers(1, 20))
def test_random_lists_hash_as_on_the_checked_path(ids: list[int], page_size: int) -> None:
    assert page_hashes(ids, page_size) == page_hashes(Checked(ids), page_size)
    assert page_hashes(tuple(ids), page_size) == page_hashes(Checked(ids), page_size)


@pytest.mark.parametrize("code", sorted("bBhHiIlLqQ"))
def test_every_integer_array_hashes_as_its_list(code: str) -> None:
    rng = random.Random(code)
    top = min(2 ** (8 * array(code).itemsize - (code.islower())) - 1, 2**40)
    ids = [rng.randrange(top) for _ in range(50)] + [top]
    given_ids = array(code, ids)
    assert page_hashes(given_ids, 7) == page_hashes(Checked(ids), 7)
    assert page_hashes(given_ids, 7, bigram=True) == page_hashes(Checked(ids), 7, bigram=True)
    assert list(given_ids) == ids  # the caller's array is left as it was


def test_an_int_subclass_is_accepted_like_its_value() -> None:
    assert page_hashes([1, Token.BOS, 3], 2) == page_hashes([1, 7, 3], 2)


@pytest.mark.parametrize(
    ("ids", "index"),
    [
        ([5, 6, True], 2),
        ([False, 5], 0),
        ([5, np.int64(6)], 1),
        ([5, [6]], 1),
        ([5, 6.0], 1),
    ],
    ids=["true", "false", "numpy-int", "nested-list", "float"],
)
def test_what_the_checked_path_rejects_is_still_rejected(ids: list[object], index: int) -> None:
    for container in (list, tuple):
        with pytest.raises(ConfigError) as caught:
            page_hashes(container(ids), 1)  # type: ignore[arg-type]
        assert caught.value.field == f"token_ids[{index}]"


@pytest.mark.parametrize("code", ["b", "h", "i", "l", "q"])
def test_a_negative_id_in_a_signed_array_is_rejected(code: str) -> None:
    with pytest.raises(ConfigError) as caught:
        page_hashes(array(code, [3, -1, 4]), 1)
    assert caught.value.field == "token_ids[1]"


def test_the_fast_path_is_taken_for_plain_ids() -> None:
    ids = list(range(1000, 1100))
    packed = keys._narrow_words(ids)
    assert packed is not None
    assert packed.tobytes() == array("I", ids).tobytes()
    assert keys._narrow_words(array("q", ids)) == packed
    assert keys._narrow_words([*ids, True]) is None
    assert keys._narrow_words([*ids, 2**31]) is None
