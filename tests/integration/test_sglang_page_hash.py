"""Our page keys and namespace seeds equal SGLang 0.5.23's own, bit for bit.

SGLang's ``get_hash_str`` runs its native extension (``cpp_utils/hash_binding.cpp``, built
on first use). Seeded random inputs cover plain and bigram (EAGLE) keys, ids at the uint32
boundary and above it (wide pages), partial pages, empty input and chains seeded by a
prior key or a request namespace; hypothesis adds a property check on top.
"""

from __future__ import annotations

import random
import types
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_storage.errors import ConfigError
from sglang_storage.storage.keys import namespace_seed, page_hashes

pytestmark = [pytest.mark.sglang, pytest.mark.usefixtures("page_key_chain")]

U32_MAX = 2**32 - 1
I64_MAX = 2**63 - 1
CASES = 300
BOUNDARY_IDS = [0, 1, U32_MAX - 1, U32_MAX, 2**32, 2**32 + 1, 2**40, I64_MAX]


class Key:
    """The parts of SGLang's ``RadixKey`` (``radix_cache.py:59``) its storage hashing reads.

    A stand-in, so the test does not pay for importing ``radix_cache`` (about 4 s, it
    pulls SGLang's memory pools): ``raw_token_ids()``, a bigram length of ``n - 1``
    for ``n`` raw ids, ``is_bigram``, ``extra_key`` and an empty salt read as ``None``.
    """

    def __init__(
        self,
        ids: list[int],
        *,
        is_bigram: bool = False,
        extra_key: str | None = None,
        cache_salt: str | None = None,
    ) -> None:
        self.token_ids = array("q", ids)
        self.is_bigram = is_bigram
        self.extra_key = extra_key
        self.cache_salt = cache_salt or None

    def raw_token_ids(self) -> array[int]:
        return self.token_ids

    def __len__(self) -> int:
        n = len(self.token_ids)
        return max(n - 1, 0) if self.is_bigram else n


class SGLang:
    """The parts of SGLang's storage hashing these tests compare against."""

    def __init__(self) -> None:
        from sglang.srt.mem_cache import utils

        self.utils: types.ModuleType = utils

    def hashes(
        self, ids: list[int], page_size: int | None, prior: str | None, *, bigram: bool = False
    ) -> Any:
        key: Any = Key(ids, is_bigram=True) if bigram else ids
        return self.utils.get_hash_str(key, prior, page_size=page_size)

    def seed(self, extra_key: str | None, cache_salt: str | None) -> Any:
        return self.utils.storage_namespace_seed(extra_key, cache_salt)

    def storage_hashes(
        self, ids: list[int], page_size: int, extra_key: str | None, cache_salt: str | None
    ) -> Any:
        key = Key(ids, extra_key=extra_key, cache_salt=cache_salt)
        return self.utils.get_storage_hash_str(key, None, page_size=page_size)


def _causes(error: BaseException) -> Iterator[BaseException]:
    current: BaseException | None = error
    seen: set[int] = set()
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


@pytest.fixture(scope="module")
def sglang() -> SGLang:
    """SGLang's hashing, with its native extension built (once per worker)."""
    found = SGLang()
    try:
        found.hashes([1], 1, None)
    except RuntimeError as error:
        failure = "\n".join(f"  {type(e).__name__}: {e}" for e in _causes(error))
    else:
        return found
    headers = Path("/usr/include/openssl/sha.h").exists()
    hint = "" if headers else " (the OpenSSL headers are missing: apt-get install libssl-dev)"
    pytest.fail(
        "SGLang's native page hash extension did not build; it needs g++, ninja and the "
        f"OpenSSL headers{hint}:\n{failure}",
        pytrace=False,
    )


def _ids(rng: random.Random, length: int) -> list[int]:
    mode = rng.randrange(4)
    if mode == 0:  # vocabulary-sized ids
        return [rng.randrange(200_000) for _ in range(length)]
    if mode == 1:  # the whole uint32 range
        return [rng.randrange(2**32) for _ in range(length)]
    # mostly narrow ids with a few at the uint32 boundary or above it
    rate = 0.002 if mode == 2 else 0.05
    return [
        rng.choice(BOUNDARY_IDS) if rng.random() < rate else rng.randrange(200_000)
        for _ in range(length)
    ]


def _case(rng: random.Random) -> tuple[list[int], int, str | None, bool]:
    length = rng.choice([0, 1, rng.randrange(2001), rng.randrange(2001)])
    page_size = rng.choice([1, 16, 64, rng.randrange(1, 129)])
    prior = rng.choice([None, rng.randbytes(32).hex()])
    return _ids(rng, length), page_size, prior, rng.random() < 0.25


@pytest.mark.parametrize("seed", range(3))
def test_page_hashes_equal_sglangs_on_random_inputs(sglang: SGLang, seed: int) -> None:
    rng = random.Random(seed)
    wide = 0
    for _ in range(CASES // 3):
        ids, page_size, prior, bigram = _case(rng)
        ours = page_hashes(ids, page_size, prior, bigram=bigram)
        theirs = sglang.hashes(ids, page_size, prior, bigram=bigram)
        assert ours == theirs, (len(ids), page_size, prior, bigram)
        wide += any(token > U32_MAX for token in ids)
    assert wide > 10  # the wide form was exercised, not only the narrow one


@pytest.mark.parametrize("page_size", [1, 2, 3, 64])
@pytest.mark.parametrize("bigram", [False, True])
def test_boundary_ids_in_every_position(sglang: SGLang, page_size: int, bigram: bool) -> None:
    for token in BOUNDARY_IDS:
        for position in range(4):
            ids = [5, 6, 7, 8]
            ids[position] = token
            for prior in (None, "cd" * 32):
                assert page_hashes(ids, page_size, prior, bigram=bigram) == sglang.hashes(
                    ids, page_size, prior, bigram=bigram
                )


def test_empty_input(sglang: SGLang) -> None:
    for page_size in (1, 64):
        assert page_hashes([], page_size) == sglang.hashes([], page_size, None) == []
        assert page_hashes([], page_size, "ef" * 32) == sglang.hashes([], page_size, "ef" * 32)
        assert page_hashes([3], page_size, bigram=True) == []
        assert sglang.hashes([3], page_size, None, bigram=True) == []


def test_sglangs_single_hash_is_one_page_of_everything(sglang: SGLang) -> None:
    rng = random.Random(7)
    for _ in range(20):
        ids = _ids(rng, rng.randrange(1, 300))
        prior = rng.choice([None, rng.randbytes(32).hex()])
        assert sglang.hashes(ids, None, prior) == page_hashes(ids, len(ids), prior)[0]


@pytest.mark.parametrize("ids", [[1, -1], [-(2**40)], [2**63], [3, 2**64]])
def test_ids_sglang_refuses_are_refused(sglang: SGLang, ids: list[int]) -> None:
    with pytest.raises((IndexError, OverflowError)):
        sglang.hashes(ids, 1, None)
    with pytest.raises(ConfigError):
        page_hashes(ids, 1)


def test_namespace_seed_equals_sglangs(sglang: SGLang) -> None:
    rng = random.Random(11)
    alphabet = "ab-_/:é日\x00 "
    parts: list[str | None] = [None, "", "a", "ab", "lora-adapter", "日本語", "\x00"]
    parts += ["".join(rng.choices(alphabet, k=rng.randrange(40))) for _ in range(30)]
    for extra_key in parts:
        for cache_salt in [*rng.sample(parts, 8), None, ""]:
            assert namespace_seed(extra_key, cache_salt) == sglang.seed(extra_key, cache_salt)


def test_namespaced_chains_equal_get_storage_hash_str(sglang: SGLang) -> None:
    rng = random.Random(13)
    for extra_key, cache_salt in [("lora-a", None), (None, "salt"), ("lora-b", "s"), (None, None)]:
        ids = _ids(rng, rng.randrange(1, 500))
        page_size = rng.randrange(1, 65)
        seed = namespace_seed(extra_key, cache_salt)
        assert page_hashes(ids, page_size, seed) == sglang.storage_hashes(
            ids, page_size, extra_key, cache_salt
        )


@settings(max_examples=60)
@given(
    ids=st.lists(
        st.integers(0, 200_000) | st.sampled_from(BOUNDARY_IDS) | st.integers(0, I64_MAX),
        max_size=200,
    ),
    page_size=st.integers(1, 70),
    prior=st.none() | st.binary(min_size=32, max_size=32).map(bytes.hex),
    bigram=st.booleans(),
)
def test_property_equal_to_sglang(
    sglang: SGLang, ids: list[int], page_size: int, prior: str | None, bigram: bool
) -> None:
    assert page_hashes(ids, page_size, prior, bigram=bigram) == sglang.hashes(
        ids, page_size, prior, bigram=bigram
    )
