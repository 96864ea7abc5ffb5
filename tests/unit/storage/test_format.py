"""The 512-byte object header: round trips, damage detection and the reasons it gives."""

from __future__ import annotations

import struct

import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from sglang_storage.core import DTYPE_SIZES, DataKind, Namespace, ObjectKey, ObjectSpec, Shard
from sglang_storage.errors import ConfigError, CorruptObjectError
from sglang_storage.storage.format import (
    FORMAT_VERSION,
    HEADER_SIZE,
    MAGIC,
    ObjectHeader,
    check_object,
    checksum,
    decode_header,
    encode_header,
)

NAME_CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-"


def safe_names(max_size: int) -> st.SearchStrategy[str]:
    first = st.sampled_from(NAME_CHARS[:-2].replace(".", ""))
    rest = st.text(alphabet=NAME_CHARS, max_size=max_size - 1)
    return st.builds(lambda a, b: a + b, first, rest)


@st.composite
def shards(draw: st.DrawFn) -> Shard:
    values: dict[str, int] = {}
    for axis in ("tp", "pp", "cp"):
        size = draw(st.integers(1, 64))
        values[f"{axis}_size"] = size
        values[f"{axis}_rank"] = draw(st.integers(0, size - 1))
    return Shard(**values)


@st.composite
def keys(draw: st.DrawFn) -> ObjectKey:
    namespace = Namespace(
        model=draw(safe_names(96)),
        kind=draw(st.sampled_from(list(DataKind))),
        shard=draw(shards()),
    )
    return ObjectKey(namespace=namespace, name=draw(safe_names(160)))


specs = st.builds(
    ObjectSpec,
    dtype=st.sampled_from(sorted(DTYPE_SIZES)),
    shape=st.lists(st.integers(0, 64), max_size=8).map(tuple),
    layout=st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789_", max_size=32),
)


def sample_key(name: str = "page-0001") -> ObjectKey:
    shard = Shard(tp_rank=1, tp_size=2)
    return Namespace(model="llama-fp", kind=DataKind.KV, shard=shard).key(name)


SPEC = ObjectSpec(dtype="bfloat16", shape=(2, 4, 16), layout="page_first")


def sample_header(key: ObjectKey | None = None, spec: ObjectSpec = SPEC) -> bytes:
    return encode_header(key or sample_key(), spec, payload_checksum=0x0123456789ABCDEF)


def reseal(header: bytearray) -> bytes:
    """Recompute the header checksum after an edit, as a writer of another build would."""
    header[12:16] = bytes(4)
    header[12:16] = xxhash.xxh32_intdigest(bytes(header)).to_bytes(4, "little")
    return bytes(header)


# ------------------------------------------------------------------ round trips


@given(key=keys(), spec=specs, payload_checksum=st.integers(0, 2**64 - 1))
def test_header_round_trip(key: ObjectKey, spec: ObjectSpec, payload_checksum: int) -> None:
    raw = encode_header(key, spec, payload_checksum)
    assert len(raw) == HEADER_SIZE
    assert raw[:4] == MAGIC
    header = decode_header(raw, where="test")
    assert header == ObjectHeader(
        key=key, spec=spec, payload_length=spec.nbytes, payload_checksum=payload_checksum
    )
    assert header.version == FORMAT_VERSION
    assert header.object_size == HEADER_SIZE + spec.nbytes
    assert check_object(header, key, spec) is None
    # Extra bytes after the header (the payload) do not matter to the decoder.
    assert decode_header(raw + b"payload", where="test") == header


def test_longest_names_fit() -> None:
    shard = Shard(tp_rank=999, tp_size=1000, pp_rank=999, pp_size=1000, cp_rank=9, cp_size=10)
    key = Namespace(model="m" * 96, kind=DataKind.WEIGHT, shard=shard).key("n" * 160)
    spec = ObjectSpec(dtype="float8_e4m3fnuz", shape=(1,) * 8, layout="l" * 32)
    assert decode_header(encode_header(key, spec, 7), where="x").key == key


def test_encoding_is_deterministic_and_names_the_fields() -> None:
    raw = sample_header()
    assert raw == sample_header()
    magic, version, size, kind, ndim, flags = struct.unpack_from("<4sHHBBH", raw)
    assert (magic, version, size, kind, ndim, flags) == (MAGIC, FORMAT_VERSION, 512, 1, 3, 0)
    length, payload_crc = struct.unpack_from("<QQ", raw, 16)
    assert (length, payload_crc) == (SPEC.nbytes, 0x0123456789ABCDEF)
    assert struct.unpack_from("<8Q", raw, 32) == (2, 4, 16, 0, 0, 0, 0, 0)
    assert raw[96:].startswith(b"\x08llama-fp\x06tp1of2\x09page-0001\x08bfloat16\x0apage_first")
    assert raw[96 + 46 :] == bytes(HEADER_SIZE - 96 - 46)


def test_shard_label_too_long_for_the_header_is_a_config_error() -> None:
    shard = Shard(tp_rank=0, tp_size=10**150, pp_rank=0, pp_size=10**150)
    assert len(shard.label) > 255
    key = Namespace(model="m", kind=DataKind.KV, shard=shard).key("n")
    with pytest.raises(ConfigError):
        encode_header(key, SPEC, 0)


def test_names_too_long_for_the_header_are_a_config_error() -> None:
    big = 10**70  # each part of the label stays under 255 bytes, the whole does not fit
    shard = Shard(tp_rank=0, tp_size=big, pp_rank=0, pp_size=big, cp_rank=0, cp_size=big)
    assert len(shard.label) < 256
    key = Namespace(model="m" * 96, kind=DataKind.KV, shard=shard).key("n" * 160)
    with pytest.raises(ConfigError) as caught:
        encode_header(key, SPEC, 0)
    assert caught.value.field == "key"


# ------------------------------------------------------------------ damage


@pytest.mark.parametrize("mask", [0x01, 0x80, 0xFF])
def test_every_single_byte_change_is_detected(mask: int) -> None:
    raw = sample_header()
    missed: list[int] = []
    misnamed: list[int] = []
    for offset in range(HEADER_SIZE):
        damaged = bytearray(raw)
        damaged[offset] ^= mask
        try:
            decode_header(damaged, where="k")
        except CorruptObjectError as error:
            if error.key != "k":
                misnamed.append(offset)
        else:
            missed.append(offset)
    assert missed == []
    assert misnamed == []


def test_truncated_header() -> None:
    raw = sample_header()
    for length in (0, 1, 95, 511):
        with pytest.raises(CorruptObjectError) as caught:
            decode_header(raw[:length], where="k")
        assert caught.value.reason == f"truncated header ({length} bytes)"


def test_wrong_magic() -> None:
    damaged = bytearray(sample_header())
    damaged[:4] = b"GGUF"
    with pytest.raises(CorruptObjectError) as caught:
        decode_header(reseal(damaged), where="k")
    assert "not an sglang-storage object" in caught.value.reason
    assert "GGUF" in caught.value.reason


@pytest.mark.parametrize(("version", "size"), [(FORMAT_VERSION + 1, 512), (0, 512), (1, 1024)])
def test_other_format_version_or_header_size(version: int, size: int) -> None:
    damaged = bytearray(sample_header())
    struct.pack_into("<HH", damaged, 4, version, size)
    with pytest.raises(CorruptObjectError) as caught:
        decode_header(reseal(damaged), where="k")
    assert f"format version {version} (header {size} bytes)" in caught.value.reason


def test_header_checksum_mismatch() -> None:
    damaged = bytearray(sample_header())
    damaged[300] ^= 1  # zero padding: only the checksum covers it
    with pytest.raises(CorruptObjectError) as caught:
        decode_header(damaged, where="k")
    assert caught.value.reason == "header checksum mismatch"


@pytest.mark.parametrize(
    ("offset", "fmt", "value", "reason"),
    [
        pytest.param(8, "<B", 9, "invalid header field", id="kind-code"),
        pytest.param(9, "<B", 9, "invalid header field", id="ndim-over-8"),
        pytest.param(9, "<B", 2, "invalid header field", id="ndim-hides-a-dimension"),
        pytest.param(32 + 8 * 7, "<Q", 5, "invalid header field", id="dimension-past-ndim"),
        pytest.param(16, "<Q", 7, "header says 7 payload bytes", id="length-vs-shape"),
        pytest.param(96, "<B", 200, "invalid header field", id="string-runs-past-header"),
        pytest.param(97, "<B", 0x2F, "invalid header field", id="model-not-a-safe-name"),
        pytest.param(97, "<B", 0xFF, "invalid header field", id="model-not-utf8"),
    ],
)
def test_sealed_header_with_invalid_fields(offset: int, fmt: str, value: int, reason: str) -> None:
    """A header with a valid checksum but impossible fields was written wrongly."""
    damaged = bytearray(sample_header())
    struct.pack_into(fmt, damaged, offset, value)
    with pytest.raises(CorruptObjectError) as caught:
        decode_header(reseal(damaged), where="k")
    assert reason in caught.value.reason


# ------------------------------------------------------------------ check_object


def test_check_object_names_the_first_difference() -> None:
    key = sample_key()
    header = decode_header(sample_header(key), where="k")
    ns = key.namespace
    assert check_object(header, key, SPEC) is None
    cases: list[tuple[ObjectKey, ObjectSpec, str]] = [
        (ns.key("page-0002"), SPEC, "holds object 'page-0001', not 'page-0002'"),
        (
            Namespace(model="other", kind=ns.kind, shard=ns.shard).key(key.name),
            SPEC,
            "was written for model 'llama-fp', not 'other'",
        ),
        (
            Namespace(model=ns.model, kind=DataKind.RECORD, shard=ns.shard).key(key.name),
            SPEC,
            "holds kv data, not record",
        ),
        (
            Namespace(model=ns.model, kind=ns.kind, shard=Shard()).key(key.name),
            SPEC,
            "belongs to shard 'tp1of2', not 'all'",
        ),
        (
            key,
            ObjectSpec(dtype="float16", shape=(2, 4, 16), layout="page_first"),
            "is bfloat16[2, 4, 16] layout 'page_first', not the expected "
            "float16[2, 4, 16] layout 'page_first'",
        ),
        (
            key,
            ObjectSpec(dtype="bfloat16", shape=(4, 2, 16), layout="page_first"),
            "not the expected bfloat16[4, 2, 16]",
        ),
        (
            key,
            ObjectSpec(dtype="bfloat16", shape=(2, 4, 16)),
            "not the expected bfloat16[2, 4, 16] layout ''",
        ),
    ]
    for wanted_key, wanted_spec, reason in cases:
        found = check_object(header, wanted_key, wanted_spec)
        assert found is not None
        assert reason in found, (found, reason)


# ------------------------------------------------------------------ checksum


@given(data=st.binary(max_size=4096), cuts=st.lists(st.integers(0, 4096), max_size=8))
def test_checksum_ignores_how_the_payload_is_split(data: bytes, cuts: list[int]) -> None:
    bounds = [0, *sorted(min(c, len(data)) for c in cuts), len(data)]
    parts = [memoryview(data)[bounds[i] : bounds[i + 1]] for i in range(len(bounds) - 1)]
    whole = checksum([memoryview(data)])
    assert checksum(parts) == whole == xxhash.xxh3_64_intdigest(data)


def test_checksum_of_nothing() -> None:
    assert checksum([]) == checksum([memoryview(b"")]) == xxhash.xxh3_64_intdigest(b"")


# ------------------------------------------------------------------ the hot-path template


def test_template_check_accepts_only_the_exact_header() -> None:
    from sglang_storage.storage.format import header_template

    key = sample_key()
    template = header_template(key.namespace, SPEC)
    raw = sample_header(key)
    assert template.header(key.name, 0x0123456789ABCDEF) == raw
    assert template.expected_checksum(raw, key.name) == 0x0123456789ABCDEF
    assert template.expected_checksum(bytearray(raw), key.name) == 0x0123456789ABCDEF
    assert template.expected_checksum(memoryview(raw), key.name) == 0x0123456789ABCDEF
    assert template.expected_checksum(raw, key.name + "x") is None
    assert template.expected_checksum(raw[:-1], key.name) is None
    for offset in range(len(raw)):
        damaged = bytearray(raw)
        damaged[offset] ^= 0x01
        found = template.expected_checksum(damaged, key.name)
        if 12 <= offset < 16:
            # The header checksum alone: every other byte matched, nothing is misread.
            assert found == 0x0123456789ABCDEF
        elif 24 <= offset < 32:
            # The payload checksum: caught when the payload is checked against it.
            assert found is not None
            assert found != 0x0123456789ABCDEF
        else:
            assert found is None, f"offset {offset}"


def test_template_refuses_other_specs_and_namespaces() -> None:
    from sglang_storage.storage.format import header_template

    key = sample_key()
    raw = sample_header(key)
    other_spec = ObjectSpec(dtype="float16", shape=SPEC.shape, layout=SPEC.layout)
    assert header_template(key.namespace, other_spec).expected_checksum(raw, key.name) is None
    other_ns = Namespace(model="other", kind=key.namespace.kind, shard=key.namespace.shard)
    assert header_template(other_ns, SPEC).expected_checksum(raw, key.name) is None
