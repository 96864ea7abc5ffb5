"""SGLang page keys: known answers derived here with hashlib, edge cases and rejected input.

The expected keys are built by a deliberately naive reference (one ``struct.pack`` per
token) written from SGLang's byte layout, independent of the module's bulk encoding; a few
keys are also pinned as constants that SGLang 0.5.23's native hash produced.
"""

from __future__ import annotations

import hashlib
import importlib
import struct
from array import array
from collections.abc import Callable, Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sglang_storage.errors import ConfigError
from sglang_storage.storage import keys
from sglang_storage.storage.keys import namespace_seed, page_hashes

pytestmark = pytest.mark.usefixtures("page_key_chain")  # the C chain and the Python one

U32_MAX = 2**32 - 1
I64_MAX = 2**63 - 1
SEED = "ab" * 32


def encode_page(page: Sequence[int]) -> bytes:
    if any(token > U32_MAX for token in page):
        return b"\xff" + b"".join(struct.pack("<Q", token) for token in page)
    return b"".join(struct.pack("<I", token) for token in page)


def reference(
    ids: Sequence[int], page_size: int, prior: str | None = None, *, bigram: bool = False
) -> list[str]:
    units: list[tuple[int, ...]] = (
        [(ids[i], ids[i + 1]) for i in range(len(ids) - 1)] if bigram else [(t,) for t in ids]
    )
    digest = bytes.fromhex(prior) if prior is not None else b""
    out = []
    for start in range(0, len(units), page_size):
        words = [word for unit in units[start : start + page_size] for word in unit]
        digest = hashlib.sha256(digest + encode_page(words)).digest()
        out.append(digest.hex())
    return out


def seed_reference(*parts: str | None) -> str:
    digest = hashlib.sha256(b"sglang-cache-namespace-v1")
    for part in parts:
        if part is None:
            digest.update(b"\x00")
        else:
            raw = part.encode("utf-8")
            digest.update(b"\x01" + struct.pack("<Q", len(raw)) + raw)
    return digest.hexdigest()


# ------------------------------------------------------------------ known answers


def test_first_page_is_the_sha256_of_its_uint32_le_ids() -> None:
    expected = hashlib.sha256(bytes([1, 0, 0, 0, 2, 0, 0, 0])).hexdigest()
    assert page_hashes([1, 2], 2) == [expected]


def test_each_page_chains_on_the_previous_digest() -> None:
    first = hashlib.sha256(struct.pack("<2I", 1, 2)).digest()
    second = hashlib.sha256(first + struct.pack("<I", 3)).digest()
    assert page_hashes([1, 2, 3], 2) == [first.hex(), second.hex()]


def test_prior_hash_bytes_come_before_the_first_page() -> None:
    prior = bytes.fromhex(SEED)
    assert page_hashes([9], 4, SEED) == [hashlib.sha256(prior + struct.pack("<I", 9)).hexdigest()]


def test_known_answers_from_sglang_native_hash() -> None:
    # Produced by SGLang 0.5.23's get_hash_str (hash_binding.cpp).
    assert page_hashes([1, 2, 3], 2) == [
        "34fb5c825de7ca4aea6e712f19d439c1da0c92c37b423936c5f618545ca4fa1f",
        "3ac5d352be720e428633fe34fc74591b2b80060a7764e195d8f34068203ae98f",
    ]
    assert page_hashes([7, 2**32, 9], 2) == [
        "c64c295cf84148a3b8a85ab8a0718b8eb669b6d1f1bf4076c7c6785377138061",
        "bba8849949c7e4b401c9cb5446b6f9e95b7cb135abbd400d4c2a190b9239103d",
    ]
    assert page_hashes([0, U32_MAX, I64_MAX], 3, SEED) == [
        "6d3d819c8f566feb1e3847dab5a2c1fa484605f7f5dca0010db2790a7dd06f6f"
    ]
    assert page_hashes([5, 6, 7, 8], 2, bigram=True) == [
        "815792939f86e9c6b410f2cb2741fcb34cfcaf31ea4735b0a5338c1ab8b6ef31",
        "23eb4228798e255477e7e1ef9cc40b0392adac060118604eaa56c39fc8448dab",
    ]


# ------------------------------------------------------------------ wide pages


def test_a_wide_id_makes_the_whole_page_uint64_after_a_tag_byte() -> None:
    page = [1, 2, 2**32]
    expected = hashlib.sha256(b"\xff" + struct.pack("<3Q", *page)).hexdigest()
    assert page_hashes(page, 3) == [expected]


def test_the_tag_follows_the_prior_digest() -> None:
    prior = bytes.fromhex(SEED)
    expected = hashlib.sha256(prior + b"\xff" + struct.pack("<Q", 2**40)).hexdigest()
    assert page_hashes([2**40], 1, SEED) == [expected]


def test_wide_form_does_not_carry_over_to_the_next_page() -> None:
    first = hashlib.sha256(b"\xff" + struct.pack("<2Q", 2**32, 1)).digest()
    second = hashlib.sha256(first + struct.pack("<2I", 2, 3)).digest()
    third = hashlib.sha256(second + b"\xff" + struct.pack("<Q", I64_MAX)).digest()
    assert page_hashes([2**32, 1, 2, 3, I64_MAX], 2) == [first.hex(), second.hex(), third.hex()]


@pytest.mark.parametrize(
    ("token", "wide"), [(0, False), (U32_MAX, False), (2**32, True), (I64_MAX, True)]
)
def test_the_boundary_of_the_wide_form(token: int, wide: bool) -> None:
    body = struct.pack("<Q", token) if wide else struct.pack("<I", token)
    tag = b"\xff" if wide else b""
    assert page_hashes([token], 1) == [hashlib.sha256(tag + body).hexdigest()]


# ------------------------------------------------------------------ pages and inputs


def test_no_tokens_give_no_pages() -> None:
    assert page_hashes([], 1) == []
    assert page_hashes([], 64, SEED) == []
    assert page_hashes([7], 4, bigram=True) == []  # one raw id holds no bigram


@pytest.mark.parametrize(("length", "page_size", "pages"), [(1, 1, 1), (64, 64, 1), (65, 64, 2)])
def test_the_last_partial_page_is_hashed_too(length: int, page_size: int, pages: int) -> None:
    ids = list(range(100, 100 + length))
    result = page_hashes(ids, page_size)
    assert len(result) == pages
    assert result == reference(ids, page_size)


def test_a_page_larger_than_the_input_is_one_partial_page() -> None:
    assert page_hashes([4, 5, 6], 1000) == [hashlib.sha256(struct.pack("<3I", 4, 5, 6)).hexdigest()]


def test_keys_are_64_lowercase_hex_characters() -> None:
    for key in page_hashes(list(range(50)), 7, SEED.upper()):
        assert len(key) == keys.DIGEST_HEX_LEN
        assert key == key.lower()
        int(key, 16)


def test_prior_hash_case_does_not_matter() -> None:
    assert page_hashes([1, 2, 3], 2, SEED.upper()) == page_hashes([1, 2, 3], 2, SEED)


@pytest.mark.parametrize(
    "container",
    [
        list,
        tuple,
        lambda ids: array("I", ids),
        lambda ids: array("q", ids),
        lambda ids: array("Q", ids),
        lambda ids: array("H", ids),
    ],
    ids=["list", "tuple", "array-I", "array-q", "array-Q", "array-H"],
)
def test_every_int_sequence_hashes_alike(container: Callable[[list[int]], Sequence[int]]) -> None:
    ids = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
    assert page_hashes(container(ids), 4) == reference(ids, 4)
    assert page_hashes(container(ids), 4, bigram=True) == reference(ids, 4, bigram=True)


def test_range_input() -> None:
    assert page_hashes(range(10), 3) == reference(list(range(10)), 3)


def test_bigrams_hash_pairs_of_consecutive_ids() -> None:
    expected = hashlib.sha256(struct.pack("<4I", 5, 6, 6, 7)).hexdigest()
    assert page_hashes([5, 6, 7], 2, bigram=True) == [expected]


def test_a_wide_bigram_page_is_uint64_pairs() -> None:
    page = hashlib.sha256(b"\xff" + struct.pack("<4Q", 5, 2**33, 2**33, 7)).hexdigest()
    assert page_hashes([5, 2**33, 7], 4, bigram=True) == [page]


def test_the_small_input_sha256_matches_hashlib() -> None:
    for data in (b"", b"abcd", bytes(range(200)) * 3):
        assert keys._SMALL_SHA256(data).digest() == hashlib.sha256(data).digest()


# ------------------------------------------------------------------ properties

token = st.one_of(
    st.integers(0, 200_000),
    st.integers(U32_MAX - 2, 2**32 + 2),
    st.integers(0, I64_MAX),
)
tokens = st.lists(token, max_size=300)
narrow_tokens = st.lists(st.integers(0, U32_MAX), max_size=300)
priors = st.none() | st.binary(min_size=32, max_size=32).map(bytes.hex)


@given(ids=tokens, page_size=st.integers(1, 40), prior=priors, bigram=st.booleans())
def test_page_hashes_match_the_reference(
    ids: list[int], page_size: int, prior: str | None, bigram: bool
) -> None:
    assert page_hashes(ids, page_size, prior, bigram=bigram) == reference(
        ids, page_size, prior, bigram=bigram
    )


@given(head=tokens, tail=tokens, page_size=st.integers(1, 16), prior=priors)
def test_a_chain_continues_from_its_last_key(
    head: list[int], tail: list[int], page_size: int, prior: str | None
) -> None:
    head = head[: len(head) // page_size * page_size]  # whole pages only
    first = page_hashes(head, page_size, prior)
    rest = page_hashes(tail, page_size, first[-1] if first else prior)
    assert page_hashes(head + tail, page_size, prior) == first + rest


@given(ids=narrow_tokens.filter(lambda ids: len(ids) >= 2), page_size=st.integers(1, 16))
def test_bigram_keys_are_keys_of_the_flattened_pairs(ids: list[int], page_size: int) -> None:
    pairs = [word for i in range(len(ids) - 1) for word in (ids[i], ids[i + 1])]
    assert page_hashes(ids, page_size, bigram=True) == page_hashes(pairs, 2 * page_size)


# ------------------------------------------------------------------ rejected input


@pytest.mark.parametrize("page_size", [0, -1, True, 1.5, None, "4"])
def test_page_size_must_be_a_positive_int(page_size: object) -> None:
    with pytest.raises(ConfigError) as caught:
        page_hashes([1, 2], page_size)  # type: ignore[arg-type]
    assert caught.value.field == "page_size"
    assert caught.value.value == page_size
    assert isinstance(caught.value, ValueError)


@pytest.mark.parametrize(
    "prior",
    ["", "ab" * 31, "ab" * 33, "zz" * 32, " " + "a" * 63, b"\xab" * 32, 0],
    ids=["empty", "short", "long", "not-hex", "space", "bytes", "int"],
)
def test_prior_hash_must_be_64_hex_characters(prior: object) -> None:
    with pytest.raises(ConfigError) as caught:
        page_hashes([1], 1, prior)  # type: ignore[arg-type]
    assert caught.value.field == "prior_hash"


@pytest.mark.parametrize(
    ("ids", "index", "value"),
    [
        ([1, -1, 2], 1, -1),
        ([-(2**40)], 0, -(2**40)),
        ([1, 2, 2**63], 2, 2**63),
        ([2**64], 0, 2**64),
    ],
)
def test_ids_outside_non_negative_int64_are_rejected(
    ids: list[int], index: int, value: int
) -> None:
    with pytest.raises(ConfigError) as caught:
        page_hashes(ids, 2)
    assert caught.value.field == f"token_ids[{index}]"
    assert caught.value.value == value
    with pytest.raises(ConfigError):
        page_hashes(ids, 2, bigram=True)


@pytest.mark.parametrize(
    ("ids", "index"),
    [
        ([1, True], 1),
        ([False], 0),
        ([1, 2, 3.0], 2),
        ([None], 0),
        (["7"], 0),
        ([(1, 2), (3, 4)], 0),
    ],
    ids=["true", "false", "float", "none", "str", "tuple"],
)
def test_non_int_ids_are_rejected(ids: list[object], index: int) -> None:
    with pytest.raises(ConfigError) as caught:
        page_hashes(ids, 1)  # type: ignore[arg-type]
    assert caught.value.field == f"token_ids[{index}]"
    assert caught.value.value is ids[index]


@pytest.mark.parametrize(
    "ids", ["123", b"\x01\x02", bytearray(b"\x01"), memoryview(b"\x01"), array("d", [1.0])]
)
def test_text_bytes_and_float_arrays_are_rejected(ids: object) -> None:
    with pytest.raises(ConfigError) as caught:
        page_hashes(ids, 1)  # type: ignore[arg-type]
    assert caught.value.field == "token_ids"


@pytest.mark.parametrize(
    ("ids", "index"),
    [
        (array("q", [5, -3, 7]), 1),
        (array("i", [-1]), 0),
        (array("b", [1, 2, -128]), 2),
        (array("Q", [1, 2**63]), 1),
        (array("Q", [2**64 - 1]), 0),
    ],
    ids=["q-negative", "i-negative", "b-negative", "Q-2**63", "Q-max"],
)
def test_array_ids_outside_non_negative_int64_are_rejected(ids: array[int], index: int) -> None:
    with pytest.raises(ConfigError) as caught:
        page_hashes(ids, 2)
    assert caught.value.field == f"token_ids[{index}]"
    assert caught.value.value == ids[index]


@pytest.mark.parametrize(
    "container",
    [list, tuple, lambda ids: array("q", ids), lambda ids: array("Q", ids)],
    ids=["list", "tuple", "array-q", "array-Q"],
)
def test_wide_pages_in_every_container(container: Callable[[list[int]], Sequence[int]]) -> None:
    ids = [7, 2**32, 9, 1, 2, 3, 2**63 - 1, 4, 5]  # pages 0 and 2 wide, page 1 narrow
    assert page_hashes(container(ids), 3) == reference(ids, 3)
    assert page_hashes(container(ids), 3, "ab" * 32) == reference(ids, 3, "ab" * 32)
    assert page_hashes(container(ids), 100) == reference(ids, 100)


class _Token(int):
    """An int subclass: hashed by its value, like a plain int."""


def test_int_subclasses_hash_as_their_values() -> None:
    ids = [_Token(4), 8, _Token(15), 16, 23]
    assert page_hashes(ids, 2) == reference([4, 8, 15, 16, 23], 2)


def test_the_array_of_a_caller_is_not_changed() -> None:
    ids = array("I", [1, 2, 3, 4, 5])
    page_hashes(ids, 2, bigram=True)
    page_hashes(ids, 2)
    assert ids == array("I", [1, 2, 3, 4, 5])


# ------------------------------------------------------------------ namespace seed


def test_no_namespace_gives_no_seed() -> None:
    assert namespace_seed(None, None) is None


@pytest.mark.parametrize(
    ("extra_key", "cache_salt"),
    [("lora-a", None), (None, "salt"), ("", None), (None, ""), ("", ""), ("ünï", "日本")],
)
def test_seed_known_answers(extra_key: str | None, cache_salt: str | None) -> None:
    assert namespace_seed(extra_key, cache_salt) == seed_reference(extra_key, cache_salt)


def test_seed_known_answers_from_sglang() -> None:
    # Produced by SGLang 0.5.23's storage_namespace_seed.
    assert namespace_seed("lora-a", None) == (
        "407c773a7c02b33bd4a62af6bf5fc77997c2c8067811ecf2b39e3839c3f4284b"
    )
    assert namespace_seed(None, "") == (
        "906782eeabf820a68eef4455ab98e5e86e311f658f7d7721723a97a90b81427e"
    )


def test_seeds_tell_absent_empty_and_split_parts_apart() -> None:
    pairs: list[tuple[str | None, str | None]] = [
        ("", None),
        (None, ""),
        ("", ""),
        ("ab", ""),
        ("a", "b"),
        ("", "ab"),
        ("b", "a"),
    ]
    seeds = [namespace_seed(*pair) for pair in pairs]
    assert len(set(seeds)) == len(pairs)


def test_a_seed_is_a_valid_prior_hash() -> None:
    seed = namespace_seed("lora", "salt")
    assert seed is not None
    assert page_hashes([1, 2, 3], 2, seed) == reference([1, 2, 3], 2, seed)


@given(extra_key=st.none() | st.text(max_size=20), cache_salt=st.none() | st.text(max_size=20))
def test_seed_matches_the_reference(extra_key: str | None, cache_salt: str | None) -> None:
    expected = (
        None if extra_key is None and cache_salt is None else seed_reference(extra_key, cache_salt)
    )
    assert namespace_seed(extra_key, cache_salt) == expected


@pytest.mark.parametrize(
    ("extra_key", "cache_salt", "field"),
    [(b"lora", None, "extra_key"), (None, 3, "cache_salt"), ("\ud800", None, "extra_key")],
)
def test_seed_parts_must_be_utf8_text(extra_key: object, cache_salt: object, field: str) -> None:
    with pytest.raises(ConfigError) as caught:
        namespace_seed(extra_key, cache_salt)  # type: ignore[arg-type]
    assert caught.value.field == field
    assert caught.value.owner == "namespace_seed"


def test_hashlib_is_the_fallback_without_a_builtin_sha256(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> object:
        raise ImportError(name)

    monkeypatch.setattr(importlib, "import_module", missing)
    assert keys._small_input_sha256() is hashlib.sha256


# ---------------------------------------------------------------- namespaces


def test_model_fingerprint_is_readable_stable_and_fact_sensitive() -> None:
    from sglang_storage.core import DataKind, Namespace
    from sglang_storage.storage.keys import model_fingerprint

    a = model_fingerprint("meta-llama/Llama-3.1-8B", dtype="bfloat16", page_size=64)
    assert a.startswith("meta-llama-Llama-3.1-8B-")
    assert len(a.rsplit("-", 1)[1]) == 16
    assert a == model_fingerprint("meta-llama/Llama-3.1-8B", page_size=64, dtype="bfloat16")
    assert a != model_fingerprint("meta-llama/Llama-3.1-8B", dtype="float16", page_size=64)
    assert a != model_fingerprint("meta-llama/Llama-3.1-8B", dtype="bfloat16", page_size=32)
    # Names differing only in characters the slug drops still differ.
    assert model_fingerprint("a/b") != model_fingerprint("a:b")
    for odd in ("/", "...", "x" * 500, "模型/名"):
        Namespace(model=model_fingerprint(odd), kind=DataKind.KV)  # a valid model name
    with pytest.raises(ConfigError):
        model_fingerprint("  ")


def test_kv_namespace_shares_mla_pages_across_tp_ranks() -> None:
    from sglang_storage.storage.keys import kv_namespace

    mha = [kv_namespace("m", mla=False, tp_rank=r, tp_size=4) for r in range(4)]
    assert len(set(mha)) == 4
    assert mha[1].shard.label == "tp1of4"
    mla = [
        kv_namespace("m", mla=True, tp_rank=r, tp_size=4, pp_rank=1, pp_size=2) for r in range(4)
    ]
    assert len(set(mla)) == 1
    assert mla[0].shard.label == "pp1of2"
    assert kv_namespace("m", mla=True, pp_rank=0, pp_size=2) != mla[0]
    with pytest.raises(ConfigError):
        kv_namespace("m", mla=True, tp_rank=4, tp_size=4)
    with pytest.raises(ConfigError):
        kv_namespace("m", mla=False, cp_rank=2, cp_size=2)
