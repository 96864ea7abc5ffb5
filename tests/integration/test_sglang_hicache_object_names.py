"""The adapter names a batch of SGLang keys exactly as it names each key alone.

``_object_names`` checks a batch of safe keys at once; ``_object_name`` (one key) keeps a
safe key and turns any other key, and any key starting with the digest prefix, into
``sha256-<hex>``, so distinct keys always get distinct names.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

pytestmark = pytest.mark.sglang

SAFE = st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,170}", fullmatch=True)
TRICKY = st.sampled_from(["", "a/b", "sha256-x", "sha256-", "x/sha256-y", "-a", ".a", "a\n", "é"])


@given(st.lists(SAFE | TRICKY | st.text(max_size=8), max_size=30))
def test_a_batch_is_named_as_its_keys_one_by_one(keys: list[str]) -> None:
    from sglang_storage_adapters.hicache_storage import _object_name, _object_names

    assert _object_names(keys) == [_object_name(k) for k in keys]


@pytest.mark.parametrize(
    "keys",
    [
        [],
        ["a" * 160],
        ["a" * 161],
        ["ok", "sha256-" + "0" * 64],
        ["sha256-" + "0" * 64, "ok"],
        ["ok/sha256-1", "x"],
        [f"{i:064x}" for i in range(100)],
    ],
)
def test_edges(keys: list[str]) -> None:
    from sglang_storage_adapters.hicache_storage import _object_name, _object_names

    assert _object_names(keys) == [_object_name(k) for k in keys]
