from __future__ import annotations

import numpy as np
import pytest

from sglang_storage.core import (
    DataKind,
    GetOutcome,
    GetRequest,
    GetResult,
    Namespace,
    ObjectSpec,
    PutOutcome,
    PutRequest,
    PutResult,
    Shard,
    as_byte_view,
)
from sglang_storage.errors import ConfigError

KEY = Namespace(model="m", kind=DataKind.KV).key("k")
SPEC = ObjectSpec.raw(8)


def test_fast_results_equal_validated_ones() -> None:
    get = GetRequest(key=KEY, spec=SPEC, buffers=(bytearray(8),))
    put = PutRequest(key=KEY, spec=SPEC, buffers=(b"12345678",))
    pairs = [
        (GetResult.hit_of(get), GetResult(key=KEY, outcome=GetOutcome.HIT, nbytes=8)),
        (GetResult.miss_of(KEY), GetResult(key=KEY, outcome=GetOutcome.MISS)),
        (PutResult.stored_of(put), PutResult(key=KEY, outcome=PutOutcome.STORED, nbytes=8)),
        (PutResult.present_of(KEY), PutResult(key=KEY, outcome=PutOutcome.PRESENT)),
    ]
    for fast, checked in pairs:
        assert fast == checked
        assert hash(fast) == hash(checked)
        assert repr(fast) == repr(checked)
    assert GetResult.hit_of(get).hit
    assert PutResult.present_of(KEY).ok


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "shard",
    [
        Shard(),
        Shard(tp_rank=3, tp_size=4),
        Shard(pp_rank=1, pp_size=2, cp_rank=0, cp_size=3),
        Shard(tp_rank=0, tp_size=8, pp_rank=3, pp_size=4, cp_rank=1, cp_size=2),
    ],
)
def test_shard_labels_round_trip(shard: Shard) -> None:
    assert Shard.from_label(shard.label) == shard


@pytest.mark.parametrize("label", ["", "tp1", "tp4of4", "tp0of2-tp1of2", "xx0of2", "all-tp0of2"])
def test_bad_shard_labels_are_config_errors(label: str) -> None:
    with pytest.raises(ConfigError):
        Shard.from_label(label)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"tp_rank": 2, "tp_size": 2},
        {"tp_size": 0},
        {"pp_rank": -1, "pp_size": 2},
        {"cp_size": True},
    ],
)
def test_bad_ranks_are_config_errors(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        Shard(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["", ".hidden", "-x", "a/b", "a b", "x" * 161, "é"])
def test_unsafe_names_are_refused(name: str) -> None:
    namespace = Namespace(model="m", kind=DataKind.KV)
    with pytest.raises(ConfigError):
        namespace.key(name)
    with pytest.raises(ConfigError):
        Namespace(model=name or ".", kind=DataKind.KV)


def test_specs_validate_and_size() -> None:
    assert ObjectSpec(dtype="bfloat16", shape=[2, 3]).nbytes == 12
    assert ObjectSpec(dtype="float8_e4m3fn", shape=(0, 5)).nbytes == 0
    for bad in (
        {"dtype": "complex64", "shape": (1,)},
        {"dtype": "uint8", "shape": (-1,)},
        {"dtype": "uint8", "shape": (1,) * 9},
        {"dtype": "uint8", "shape": (1,), "layout": "Page-First"},
    ):
        with pytest.raises(ConfigError):
            ObjectSpec(**bad)  # type: ignore[arg-type]


def test_requests_check_their_buffers() -> None:
    spec = ObjectSpec.raw(8)
    two = (bytearray(3), np.zeros(5, dtype=np.uint8))
    request = GetRequest(key=KEY, spec=spec, buffers=two)
    assert [b.nbytes for b in request.buffers] == [3, 5]
    with pytest.raises(ConfigError, match="hold 7 bytes"):
        GetRequest(key=KEY, spec=spec, buffers=(bytearray(7),))
    with pytest.raises(ConfigError, match="read-only"):
        GetRequest(key=KEY, spec=spec, buffers=(b"12345678",))
    PutRequest(key=KEY, spec=spec, buffers=(b"12345678",))  # a put may read read-only memory
    with pytest.raises(ConfigError, match="contiguous"):
        as_byte_view(np.zeros((4, 4), dtype=np.uint8)[:, ::2])
    with pytest.raises(ConfigError, match="buffer protocol"):
        as_byte_view(12)
    wide = as_byte_view(np.zeros(2, dtype=np.float32))
    assert (wide.format, wide.nbytes) == ("B", 8)
