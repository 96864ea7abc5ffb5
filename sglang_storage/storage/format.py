"""The self-checking object format every backend stores.

An object is a fixed 512-byte header followed by the payload. The header records what
the payload is and whose it is, and checksums both itself and the payload, so a reader
can tell a good object from a torn write, a bit flip, an object of another model or
shape, or one written by a newer format version. All integers are little-endian:

======  ======  ==============================================================
offset  size    field
======  ======  ==============================================================
0       4       magic ``b"SGLS"``
4       2       format version (:data:`FORMAT_VERSION`)
6       2       header size (:data:`HEADER_SIZE`)
8       1       data kind code
9       1       number of dimensions (0-8)
10      2       flags (0)
12      4       header checksum: xxh32 of the header with this field zeroed
16      8       payload length in bytes
24      8       payload checksum: xxh3-64 of the payload
32      64      shape, 8 x uint64 (unused dimensions 0)
96      ...     five length-prefixed UTF-8 strings (1-byte length): model fingerprint,
                shard label, object name, dtype, layout; zero padding to 512
======  ======  ==============================================================

:func:`encode_header` builds a header for a :class:`~sglang_storage.core.PutRequest`;
:func:`decode_header` parses one and :func:`check_object` compares it with what a reader
expected, returning the reason an object must not be delivered. On the hot path a
:class:`HeaderTemplate` (cached per namespace and spec) builds headers and checks a read
header by comparing bytes.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Final

import attrs
import xxhash

from sglang_storage.core import (
    DataKind,
    Namespace,
    ObjectKey,
    ObjectSpec,
    Shard,
)
from sglang_storage.errors import ConfigError, CorruptObjectError, StorageError

__all__ = [
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "MAGIC",
    "HeaderTemplate",
    "ObjectHeader",
    "check_object",
    "checksum",
    "decode_header",
    "encode_header",
    "header_template",
]

MAGIC: Final = b"SGLS"
FORMAT_VERSION: Final = 1
HEADER_SIZE: Final = 512

_FIXED = struct.Struct("<4sHHBBHIQQ8Q")
_CRC_OFFSET: Final = 12
_KIND_CODES: Final[dict[DataKind, int]] = {
    DataKind.KV: 1,
    DataKind.EMBEDDING: 2,
    DataKind.RECORD: 3,
    DataKind.WEIGHT: 4,
}
_KINDS_BY_CODE: Final = {code: kind for kind, code in _KIND_CODES.items()}
_ZEROS: Final = bytes(HEADER_SIZE)


@attrs.frozen(kw_only=True)
class ObjectHeader:
    """A decoded header: which object this is and what its payload must hash to."""

    key: ObjectKey
    spec: ObjectSpec
    payload_length: int
    payload_checksum: int
    version: int = FORMAT_VERSION

    @property
    def object_size(self) -> int:
        """Header plus payload, in bytes: the size of the stored object."""
        return HEADER_SIZE + self.payload_length


def checksum(buffers: Sequence[memoryview]) -> int:
    """The payload checksum (xxh3-64) of the concatenation of ``buffers``."""
    if len(buffers) == 1:
        return int(xxhash.xxh3_64_intdigest(buffers[0]))
    state = xxhash.xxh3_64()
    for buffer in buffers:
        state.update(buffer)
    return int(state.intdigest())


class HeaderTemplate:
    """The header bytes shared by every object of one namespace and spec.

    Building a header from it, or checking a header read from storage against it, costs a
    byte copy and an xxh32 of 512 bytes; only a header that differs is decoded field by
    field (to say why). Get one with :func:`header_template`.
    """

    def __init__(self, namespace: Namespace, spec: ObjectSpec) -> None:
        self._fixed = _FIXED.pack(
            MAGIC,
            FORMAT_VERSION,
            HEADER_SIZE,
            _KIND_CODES[namespace.kind],
            len(spec.shape),
            0,
            0,
            spec.nbytes,
            0,
            *(spec.shape + (0,) * (8 - len(spec.shape))),
        )
        before = [namespace.model.encode(), namespace.shard.label.encode()]
        after = [spec.dtype.encode(), spec.layout.encode()]
        if any(len(raw) > 255 for raw in before + after):
            raise ConfigError(
                owner="object header",
                field="namespace",
                value=namespace.path,
                reason="a name is longer than 255 bytes",
                allowed="names of at most 255 bytes",
            )
        self._before = b"".join(bytes([len(raw)]) + raw for raw in before)
        self._after = b"".join(bytes([len(raw)]) + raw for raw in after)
        self._name_head = self._fixed + self._before
        """Every byte of the header before the name's length byte (checksums zero)."""
        # What a read header is compared with, field by field (see expected_checksum).
        self._head = self._fixed[:_CRC_OFFSET]
        self._lengths = self._fixed[16:24]
        self._middle = self._fixed[32:] + self._before
        """Shape and the names before the object's: bytes 32 up to the name's length."""
        self._name_at = 32 + len(self._middle)

    def header(self, name: str, payload_checksum: int) -> bytes:
        """The complete header of the object called ``name`` with that payload checksum.

        Raises:
            ConfigError: the names do not fit in the header.
        """
        raw = name.encode()
        tail = b"".join((self._before, bytes([min(len(raw), 255)]), raw, self._after))
        if _FIXED.size + len(tail) > HEADER_SIZE or len(raw) > 255:
            raise ConfigError(
                owner="object header",
                field="key",
                value=name,
                reason=f"names take {len(tail)} bytes, more than the header holds",
                allowed=f"at most {HEADER_SIZE - _FIXED.size} bytes of names in all",
            )
        header = bytearray(HEADER_SIZE)
        header[: _FIXED.size] = self._fixed
        header[24:32] = payload_checksum.to_bytes(8, "little")
        header[_FIXED.size : _FIXED.size + len(tail)] = tail
        header[_CRC_OFFSET : _CRC_OFFSET + 4] = xxhash.xxh32_intdigest(header).to_bytes(4, "little")
        return bytes(header)

    def expected(self, name: str) -> bytes:
        """The header the object called ``name`` must have, with both checksum fields zero.

        Every byte of a stored header but the two checksums must equal this one's (the
        header checksum adds nothing then; the payload checksum is checked against the
        payload). Names that do not fit give a header no stored object has.
        """
        raw = name.encode()
        header = b"".join((self._name_head, bytes([len(raw) & 0xFF]), raw, self._after))
        if len(header) > HEADER_SIZE or len(raw) > 255:
            return _ZEROS
        return header + _ZEROS[len(header) :]

    def frame(self) -> tuple[bytes, bytes]:
        """The header's bytes before the name's length byte, and those after the name.

        With both checksums zero: :meth:`expected` is ``head``, the name's length byte, the
        name and ``tail``, zero-filled to ``HEADER_SIZE`` (the file backend's C reader
        builds it so).
        """
        return self._name_head, self._after

    def expected_checksum(self, raw: bytes | bytearray | memoryview, name: str) -> int | None:
        """The payload checksum ``raw`` records, if ``raw`` is exactly the header for ``name``.

        ``None`` if it differs in any byte; then :func:`decode_header` and
        :func:`check_object` say how.
        """
        if len(raw) < HEADER_SIZE:
            return None
        # startswith/count on bytes and bytearray compare in place, with memcmp (slices
        # would copy; memoryview compares item by item).
        header = raw if isinstance(raw, (bytes, bytearray)) else bytes(raw[:HEADER_SIZE])
        encoded = name.encode()
        at = self._name_at
        after = at + 1 + len(encoded)
        end = after + len(self._after)
        # Every byte but the two checksums must be the template's. The header checksum
        # adds nothing then; the payload checksum is checked against the payload.
        if (
            end > HEADER_SIZE
            or not header.startswith(self._head)
            or not header.startswith(self._lengths, 16)
            or not header.startswith(self._middle, 32)
            or header[at] != len(encoded)
            or not header.startswith(encoded, at + 1)
            or not header.startswith(self._after, after)
            or header.count(0, end, HEADER_SIZE) != HEADER_SIZE - end
        ):
            return None
        return int.from_bytes(header[24:32], "little")


_TEMPLATES: dict[tuple[Namespace, ObjectSpec], HeaderTemplate] = {}
_TEMPLATES_MAX: Final = 4096


def header_template(namespace: Namespace, spec: ObjectSpec) -> HeaderTemplate:
    """The (cached) header template of ``namespace`` and ``spec``.

    Raises:
        ConfigError: a name does not fit in the header.
    """
    # A plain dict: functools.lru_cache reorders its list on every hit, and measured here
    # that stopped two reader threads from overlapping at all.
    template = _TEMPLATES.get((namespace, spec))
    if template is None:
        template = HeaderTemplate(namespace, spec)
        if len(_TEMPLATES) >= _TEMPLATES_MAX:
            _TEMPLATES.clear()
        _TEMPLATES[(namespace, spec)] = template
    return template


def encode_header(key: ObjectKey, spec: ObjectSpec, payload_checksum: int) -> bytes:
    """The 512-byte header for ``key`` holding a payload described by ``spec``.

    Raises:
        ConfigError: the names do not fit in the header (they are validated short enough
            by their own types; only an extreme shard label can exceed it).
    """
    return header_template(key.namespace, spec).header(key.name, payload_checksum)


def decode_header(raw: bytes | bytearray | memoryview, *, where: str) -> ObjectHeader:
    """Parse a header read from storage.

    Args:
        raw: At least the first :data:`HEADER_SIZE` bytes of a stored object.
        where: How to name the object in errors (its key or path).

    Raises:
        CorruptObjectError: the bytes are not a valid header of this format version
            (short, wrong magic, other version, header checksum mismatch, bad fields).
    """
    if len(raw) < HEADER_SIZE:
        raise CorruptObjectError(key=where, reason=f"truncated header ({len(raw)} bytes)")
    header = bytearray(raw[:HEADER_SIZE])
    magic, version, size, kind_code, ndim, _flags, crc, length, payload_crc, *shape = (
        _FIXED.unpack_from(header)
    )
    if magic != MAGIC:
        raise CorruptObjectError(
            key=where, reason=f"not an sglang-storage object (magic {magic!r})"
        )
    if version != FORMAT_VERSION or size != HEADER_SIZE:
        raise CorruptObjectError(
            key=where,
            reason=f"format version {version} (header {size} bytes); this build reads "
            f"version {FORMAT_VERSION}",
        )
    header[_CRC_OFFSET : _CRC_OFFSET + 4] = bytes(4)
    if xxhash.xxh32_intdigest(header) != crc:
        raise CorruptObjectError(key=where, reason="header checksum mismatch")
    try:
        strings = _strings(header, _FIXED.size)
        model, shard, name, dtype, layout = strings
        kind = _KINDS_BY_CODE[kind_code]
        if ndim > 8 or any(shape[ndim:]):
            raise ValueError(f"bad dimension count {ndim}")
        namespace = Namespace(model=model, kind=kind, shard=Shard.from_label(shard))
        decoded = ObjectHeader(
            key=ObjectKey(namespace=namespace, name=name),
            spec=ObjectSpec(dtype=dtype, shape=tuple(shape[:ndim]), layout=layout),
            payload_length=length,
            payload_checksum=payload_crc,
        )
    except (ValueError, KeyError, UnicodeDecodeError, StorageError) as error:
        # A header that passed its checksum but holds invalid fields was written wrongly.
        raise CorruptObjectError(key=where, reason=f"invalid header field: {error}") from None
    if decoded.spec.nbytes != length:
        raise CorruptObjectError(
            key=where,
            reason=f"header says {length} payload bytes but its shape needs {decoded.spec.nbytes}",
        )
    return decoded


def _strings(header: bytearray, offset: int) -> list[str]:
    out: list[str] = []
    for _ in range(5):
        length = header[offset]
        end = offset + 1 + length
        if end > HEADER_SIZE:
            raise ValueError("names run past the header")
        out.append(header[offset + 1 : end].decode())
        offset = end
    return out


def check_object(header: ObjectHeader, key: ObjectKey, spec: ObjectSpec) -> str | None:
    """Why an object with ``header`` must not be delivered as ``key`` with ``spec``, or None.

    Names the first difference: another object's name, another model, another data kind
    or shard, or another element type, shape or layout.
    """
    stored, wanted = header.key.namespace, key.namespace
    if header.key.name != key.name:
        return f"holds object {header.key.name!r}, not {key.name!r}"
    if stored.model != wanted.model:
        return f"was written for model {stored.model!r}, not {wanted.model!r}"
    if stored.kind is not wanted.kind:
        return f"holds {stored.kind.value} data, not {wanted.kind.value}"
    if stored.shard != wanted.shard:
        return f"belongs to shard {stored.shard.label!r}, not {wanted.shard.label!r}"
    if header.spec != spec:
        have, want = header.spec, spec
        return (
            f"is {have.dtype}{list(have.shape)} layout {have.layout!r}, "
            f"not the expected {want.dtype}{list(want.shape)} layout {want.layout!r}"
        )
    return None
