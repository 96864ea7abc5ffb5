"""Storage page keys that are bit-identical to SGLang 0.5.23's.

SGLang names every KV page it writes to an L3 backend by a SHA-256 hash chain over the
page's token ids (``get_hash_str`` in ``sglang/srt/mem_cache/utils.py``, computed by the
native extension ``cpp_utils/hash_binding.cpp``), seeded per request namespace by
``storage_namespace_seed``. This module reproduces both without importing SGLang, so the
subsystem reads and writes the same keys as SGLang: plain ids are hashed by a small C
extension of ours (``_pagehash.c``, OpenSSL's SHA-256, compiled at install), everything
else, and every id where the extension was not built, by the standard library and numpy
(the same keys; :data:`NATIVE` says which runs):

- :func:`page_hashes` - one 64-character lowercase hex key per page of token ids,
  each chained on the key before it;
- :func:`namespace_seed` - the chain seed for a request's ``extra_key`` (LoRA name and
  the like) and ``cache_salt``, or ``None`` for requests without a namespace.

It also says where a page's object lives (:class:`~sglang_storage.core.Namespace`):

- :func:`model_fingerprint` - a readable, collision-safe name for everything that makes
  two deployments' stored bytes incompatible;
- :func:`kv_namespace` - the namespace of one rank's KV pages: MHA pages are split by
  heads, so each TP rank has its own; MLA's latent pages are identical on every TP rank
  and shared.

Each page's key is the SHA-256 of the previous page's 32-byte digest (for the first page:
the prior key's bytes, or nothing for an unseeded chain) followed by the page's bytes::

    key[k]      = hex(SHA256(digest[k - 1] || bytes(page k)))
    bytes(page) = the ids as uint32 little-endian             when every id <= 2**32 - 1
                = 0xff || the ids as uint64 little-endian     when some id  >  2**32 - 1

The wide form is chosen per page, for the whole page, and does not carry over to the
next page. The last page may be partial; it is hashed like the others.
"""

from __future__ import annotations

import hashlib
import importlib
import marshal
import sys
from array import array
from collections.abc import Callable, Iterable, Sequence, Sized
from types import ModuleType
from typing import Final, Protocol, cast

import numpy as np

from sglang_storage.core import DataKind, Namespace, Shard
from sglang_storage.errors import ConfigError

__all__ = [
    "DIGEST_HEX_LEN",
    "NAMESPACE_DOMAIN",
    "NATIVE",
    "WIDE_PAGE_TAG",
    "kv_namespace",
    "model_fingerprint",
    "namespace_seed",
    "page_hashes",
]

DIGEST_HEX_LEN: Final = 64
"""Length of one page key: a SHA-256 digest as lowercase hex."""

WIDE_PAGE_TAG: Final = b"\xff"
"""Byte hashed before a page's uint64 words when one of its ids does not fit uint32."""

NAMESPACE_DOMAIN: Final = b"sglang-cache-namespace-v1"
"""Domain prefix of :func:`namespace_seed`'s digest (SGLang's, unchanged)."""

_U32_MAX: Final = 2**32 - 1
_I64_MAX: Final = 2**63 - 1
_INT_TYPECODES: Final = frozenset("bBhHiIlLqQ")
_HEX_DIGITS: Final = frozenset("0123456789abcdefABCDEF")


def _typecode(size: int, candidates: str) -> str:
    for code in candidates:
        if array(code).itemsize == size:
            return code
    raise ImportError(f"no array typecode among {candidates!r} has {size}-byte items")


_U32: Final = _typecode(4, "IL")
_I64: Final = _typecode(8, "ql")
_SWAP: Final = sys.byteorder != "little"
# Which uint32 half of a native int64 holds its low 32 bits.
_LOW_HALF: Final = 1 if _SWAP else 0
# marshal's format 2 (no object references): a list or tuple is a one-byte type code and
# a 4-byte count, then each element; an exact int of the int32 range is ``i`` and its
# 4 bytes little-endian, five bytes in all. True, False and int subclasses are written
# otherwise.
_MARSHAL_VERSION: Final = 2
_MARSHAL_HEADER: Final = 5
_MARSHAL_INT: Final = ord("i")


class _Hash(Protocol):
    def digest(self) -> bytes: ...


def _small_input_sha256() -> Callable[[bytes], _Hash]:
    # CPython's own SHA-256 (``_sha2`` from 3.12, ``_sha256`` before) has far less
    # per-call overhead than OpenSSL's for inputs of a few dozen bytes; both give the
    # same digest. Fall back to hashlib's where neither module is built in.
    for name in ("_sha2", "_sha256"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        constructor = getattr(module, "sha256", None)
        if callable(constructor):
            return cast(Callable[[bytes], _Hash], constructor)
    return hashlib.sha256


_SMALL_SHA256: Final = _small_input_sha256()
# Page payloads up to this many bytes (plus the 32-byte prior digest) hash faster with
# _SMALL_SHA256; larger ones with OpenSSL.
_SMALL_PAGE_BYTES: Final = 32


def page_hashes(
    token_ids: Sequence[int],
    page_size: int,
    prior_hash: str | None = None,
    *,
    bigram: bool = False,
) -> list[str]:
    """Return SGLang's storage key of every page of ``token_ids``.

    Equal to SGLang 0.5.23's ``get_hash_str(token_ids, prior_hash, page_size=page_size)``
    for a list of int token ids (and, with ``bigram=True``, for a bigram ``RadixKey``
    over the same raw ids), and to ``get_storage_hash_str`` when ``prior_hash`` is
    :func:`namespace_seed`'s result for a new chain.

    Covered: plain token ids, the wide (uint64) page form for ids above ``2**32 - 1``,
    a partial last page, chaining from a previous page's key, and EAGLE's bigram keys.
    Not covered, each rejected with :class:`ConfigError` rather than hashed differently:
    tokens given as tuples (SGLang flattens each tuple into consecutive words; pass
    ``bigram=True`` for EAGLE's pairs instead), ``page_size=None`` (SGLang's single hash
    over the whole input; for a non-empty input it equals
    ``page_hashes(ids, len(ids), prior_hash)[0]``), and an empty ``prior_hash`` string
    (SGLang reads it as "no prior"; pass ``None``).

    Args:
        token_ids: Non-negative int token ids, each at most ``2**63 - 1``; ``bool`` is
            not accepted. With ``bigram=True`` these are the raw ids: ``n + 1`` ids hash
            ``n`` bigrams ``(ids[i], ids[i + 1])``, and ``page_size`` counts bigrams.
        page_size: Tokens (or bigrams) per page; at least 1.
        prior_hash: The key of the page just before the first one (64 hex characters),
            a namespace seed, or ``None`` to start an unseeded chain.
        bigram: Hash EAGLE bigrams of consecutive ids instead of single ids.

    Returns:
        One 64-character lowercase hex key per page, ``ceil(n / page_size)`` of them
        (``[]`` for no tokens); each page's key also covers every page before it.

    Raises:
        ConfigError: ``page_size`` is not an int of at least 1, ``prior_hash`` is not
            64 hex characters, a token id is not an int, is negative or exceeds
            ``2**63 - 1``, or ``token_ids`` is text, bytes or tuples.
    """
    owner = "page_hashes"
    if type(page_size) is not int or page_size < 1:
        raise ConfigError(
            owner=owner,
            field="page_size",
            reason="must be an int of at least 1",
            value=page_size,
        )
    prior = _prior_digest(prior_hash, owner)
    if _NATIVE_KEYS is not None and not bigram and not _SWAP:
        kind = type(token_ids)
        if (
            kind is list
            or kind is tuple
            or (kind is array and cast("array[int]", token_ids).typecode in _INT_TYPECODES)
        ):
            keys = _NATIVE_KEYS(token_ids, page_size, prior)
            if keys is not None:
                return keys  # else ids the checks below accept or reject
    low, full = _words(token_ids, owner)
    units = max(len(low) - 1, 0) if bigram else len(low)
    if units == 0:
        return []
    if bigram:
        low = _pairs(low, units)
        full = None if full is None else _pairs(full, units)
    if _SWAP:
        low.byteswap()
    stride = page_size * (2 if bigram else 1) * 4  # bytes of one page's uint32 words
    if full is None:
        return _chain(low.tobytes(), stride, prior)
    return _chain_pages(_mixed_pages(low, full, stride), prior)


def namespace_seed(extra_key: str | None, cache_salt: str | None) -> str | None:
    """Return the chain seed SGLang uses for a request's storage namespace.

    Equal to SGLang 0.5.23's ``storage_namespace_seed(extra_key, cache_salt)``: ``None``
    when both are ``None`` (such requests keep the unseeded keys), otherwise a 64-character
    lowercase hex digest that tells an absent part, an empty part and differently split
    parts apart. Note that SGLang's ``RadixKey`` turns an empty ``cache_salt`` into
    ``None`` before its seed is taken; this function, like SGLang's, does not.

    Args:
        extra_key: The request's extra key (its LoRA name and the like), or ``None``.
        cache_salt: The request's cache salt, or ``None``.

    Returns:
        The seed, to pass as ``prior_hash`` to :func:`page_hashes` for a new chain, or
        ``None``.

    Raises:
        ConfigError: A part is neither a ``str`` nor ``None``, or is not encodable as
            UTF-8 (a lone surrogate).
    """
    if extra_key is None and cache_salt is None:
        return None
    digest = hashlib.sha256(NAMESPACE_DOMAIN)
    for field, part in (("extra_key", extra_key), ("cache_salt", cache_salt)):
        if part is None:
            digest.update(b"\x00")
            continue
        if not isinstance(part, str):
            raise ConfigError(
                owner="namespace_seed", field=field, reason="must be a str or None", value=part
            )
        try:
            encoded = part.encode("utf-8")
        except UnicodeEncodeError as error:
            raise ConfigError(
                owner="namespace_seed",
                field=field,
                reason=f"must be encodable as UTF-8 ({error.reason})",
                value=part,
            ) from None
        digest.update(b"\x01" + len(encoded).to_bytes(8, "little") + encoded)
    return digest.hexdigest()


def _prior_digest(prior_hash: str | None, owner: str) -> bytes:
    if prior_hash is None:
        return b""
    if not _is_hex_digest(prior_hash):
        raise ConfigError(
            owner=owner,
            field="prior_hash",
            reason=f"must be {DIGEST_HEX_LEN} hex characters (a page key) or None",
            value=prior_hash,
        )
    return bytes.fromhex(prior_hash)


def _is_hex_digest(value: object) -> bool:
    return isinstance(value, str) and len(value) == DIGEST_HEX_LEN and _HEX_DIGITS.issuperset(value)


def _narrow_words(token_ids: object) -> array[int] | None:
    """The ids as native uint32 words, found without a Python-level pass; else ``None``.

    Two cases, each proven in C and vectorised code, never per id in Python: an exact
    ``list`` or ``tuple`` whose every element is an exact ``int`` in ``[0, 2**31)`` (read
    off its marshal encoding: every element slot must be the 5-byte int form, and every
    high byte below 0x80), and an integer ``array.array`` whose every id is in
    ``[0, 2**32)``. Anything else (bools, int subclasses, larger or negative ids, other
    containers, a big-endian machine) returns ``None`` for the checked path, which
    accepts or rejects it exactly as before.
    """
    if _SWAP:
        return None
    kind = type(token_ids)
    if kind is list or kind is tuple:
        n = len(cast(Sized, token_ids))
        if n == 0:
            return array(_U32)
        try:
            encoded = marshal.dumps(cast("list[int]", token_ids), _MARSHAL_VERSION)
        except (ValueError, RecursionError):  # an element marshal cannot write
            return None
        # The first element starts at the header; while every slot holds the int form
        # the next starts 5 bytes on, so n int slots and the exact length mean n ints.
        if (
            len(encoded) != _MARSHAL_HEADER + 5 * n
            or encoded[_MARSHAL_HEADER::5].count(_MARSHAL_INT) != n
            or not encoded[_MARSHAL_HEADER + 4 :: 5].isascii()  # every id >= 0
        ):
            return None
        words = np.ndarray(
            (n,), dtype="<u4", buffer=encoded, offset=_MARSHAL_HEADER + 1, strides=(5,)
        )
        packed = array(_U32)
        packed.frombytes(words.tobytes())
        return packed
    if kind is array:
        given = cast("array[int]", token_ids)
        if given.typecode not in _INT_TYPECODES:
            return None
        packed = array(_U32)
        if len(given):
            values = np.frombuffer(given, dtype=np.dtype(given.typecode))
            if values.min() < 0 or values.max() > _U32_MAX:
                return None
            packed.frombytes(values.astype("<u4").tobytes())
        return packed
    return None


def _words(token_ids: Sequence[int], owner: str) -> tuple[array[int], array[int] | None]:
    """Check every id; return their low uint32 words and, if one needs more, all 64 bits."""
    narrow = _narrow_words(token_ids)
    if narrow is not None:
        return narrow, None
    if isinstance(token_ids, str | bytes | bytearray | memoryview):
        # An array built from bytes would read them as raw memory, not as ids.
        raise ConfigError(
            owner=owner,
            field="token_ids",
            reason="must be a sequence of int token ids, not text or bytes",
            value=token_ids,
        )
    given: object = token_ids  # typed as a Sequence, but callers pass what they have
    if not isinstance(given, Sized) or not isinstance(given, Iterable):
        # An iterator would be used up by the checks below and hash as no tokens at all.
        raise ConfigError(
            owner=owner,
            field="token_ids",
            reason="must be a sized sequence of int token ids (a list, tuple or array.array), "
            "not an iterator or a non-sequence",
            value=type(token_ids).__name__,
        )
    if isinstance(token_ids, array):
        if token_ids.typecode not in _INT_TYPECODES:
            raise ConfigError(
                owner=owner,
                field="token_ids",
                reason="must hold integers",
                value=f"array of typecode {token_ids.typecode!r}",
            )
    else:
        for kind in set(map(type, token_ids)):
            if kind is bool or not issubclass(kind, int):
                index, value = next((i, v) for i, v in enumerate(token_ids) if type(v) is kind)
                raise ConfigError(
                    owner=owner,
                    field=f"token_ids[{index}]",
                    reason="must be an int token id (not bool, float or tuple)",
                    value=value,
                )
    try:
        return array(_U32, token_ids), None
    except OverflowError:
        pass
    try:
        full = array(_I64, token_ids)
    except OverflowError:
        full = array(_I64)  # some id is out of the int64 range; found below
    if len(full) != len(token_ids) or min(full) < 0:
        index, value = next((i, v) for i, v in enumerate(token_ids) if not 0 <= v <= _I64_MAX)
        raise ConfigError(
            owner=owner,
            field=f"token_ids[{index}]",
            reason="must be a non-negative token id of at most 2**63 - 1",
            value=value,
        )
    halves = array(_U32, full.tobytes())
    return halves[_LOW_HALF::2], full


def _pairs(words: array[int], units: int) -> array[int]:
    """Interleave ``words`` into the bigrams ``(w[i], w[i + 1])`` for ``i < units``."""
    pairs = array(words.typecode, bytes(2 * units * words.itemsize))
    pairs[0::2] = words[:units]
    pairs[1::2] = words[1 : units + 1]
    return pairs


def _mixed_pages(low: array[int], full: array[int], stride: int) -> list[bytes]:
    """Encode each page as uint32 words, or as the wide tag and uint64 words.

    ``low`` holds the ids' low halves as little-endian bytes, ``full`` the whole ids, and
    ``stride`` is the size in bytes of one page of ``low``.
    """
    high = array(_U32, full.tobytes())[1 - _LOW_HALF :: 2].tobytes()
    if _SWAP:
        full.byteswap()
    narrow, wide = low.tobytes(), full.tobytes()
    pages = []
    for start in range(0, len(narrow), stride):
        end = min(start + stride, len(narrow))
        if high.count(0, start, end) == end - start:  # every id fits uint32
            pages.append(narrow[start:end])
        else:
            pages.append(WIDE_PAGE_TAG + wide[2 * start : 2 * end])
    return pages


def _native() -> ModuleType | None:
    # The C chain (_pagehash.c), where the package was installed with it compiled.
    try:
        return importlib.import_module("sglang_storage.storage._pagehash")
    except ImportError:
        return None


_NATIVE_MODULE: Final = _native()
_NATIVE_CHAIN: Final = cast(
    "Callable[[bytes, int, bytes], list[str]] | None", getattr(_NATIVE_MODULE, "chain", None)
)
_NATIVE_KEYS: Final = cast(
    "Callable[[object, int, bytes], list[str] | None] | None",
    getattr(_NATIVE_MODULE, "page_keys", None),
)

NATIVE: Final = _NATIVE_MODULE is not None
"""Whether page keys are computed in C here (else in Python: the same keys, slower)."""


def _chain(data: bytes, stride: int, prior: bytes) -> list[str]:
    """Hash ``data`` in ``stride``-byte pages, each on top of the previous digest."""
    if _NATIVE_CHAIN is not None:
        return _NATIVE_CHAIN(data, stride, prior)
    return _python_chain(data, stride, prior)


def _python_chain(data: bytes, stride: int, prior: bytes) -> list[str]:
    """:func:`_chain` in Python."""
    sha256 = _SMALL_SHA256 if stride <= _SMALL_PAGE_BYTES else hashlib.sha256
    keys: list[str] = []
    append = keys.append
    for start in range(0, len(data), stride):
        prior = sha256(prior + data[start : start + stride]).digest()
        append(prior.hex())
    return keys


def _chain_pages(pages: list[bytes], prior: bytes) -> list[str]:
    """Hash each encoded page on top of the previous digest."""
    keys: list[str] = []
    for page in pages:
        sha256 = _SMALL_SHA256 if len(page) <= _SMALL_PAGE_BYTES else hashlib.sha256
        prior = sha256(prior + page).digest()
        keys.append(prior.hex())
    return keys


_SLUG_MAX: Final = 60


def model_fingerprint(model: object, **facts: object) -> str:
    """A namespace model name: a readable slug of ``model`` plus a digest of everything.

    ``facts`` are whatever else makes stored bytes incompatible (``dtype="bfloat16"``,
    ``page_size=64``, ``layout="page_first"``, a quantisation tag); they are hashed in
    name order with their ``repr``, so the same facts always give the same fingerprint
    and any difference gives another. Example:
    ``model_fingerprint("meta-llama/Llama-3.1-8B", dtype="bfloat16", page_size=64)``
    gives ``"meta-llama-Llama-3.1-8B-"`` followed by 16 hex digits.

    Raises:
        ConfigError: ``model`` is empty.
    """
    if not isinstance(model, str) or not model.strip():
        raise ConfigError(
            owner="model_fingerprint", field="model", value=model, reason="must be a non-empty str"
        )
    described = repr((model, sorted((name, repr(value)) for name, value in facts.items())))
    digest = hashlib.sha256(described.encode()).hexdigest()[:16]
    safe = (c if c.isascii() and (c.isalnum() or c in "._-") else "-" for c in model)
    slug = "".join(safe).lstrip(".-")[:_SLUG_MAX].rstrip(".-") or "model"
    return f"{slug}-{digest}"


def kv_namespace(
    fingerprint: str,
    *,
    mla: bool,
    tp_rank: int = 0,
    tp_size: int = 1,
    pp_rank: int = 0,
    pp_size: int = 1,
    cp_rank: int = 0,
    cp_size: int = 1,
) -> Namespace:
    """The namespace of one rank's KV pages.

    MHA (and GQA) pages hold this TP rank's heads only, so the TP coordinates are part of
    the namespace. MLA pages hold the same latent rows on every TP rank, so the TP
    coordinates are dropped and one stored page serves them all. Pipeline and context
    parallel ranks hold different layers or tokens and always stay apart.

    Raises:
        ConfigError: a rank is out of range for its size.
    """
    shard = Shard(
        tp_rank=0 if mla else tp_rank,
        tp_size=1 if mla else tp_size,
        pp_rank=pp_rank,
        pp_size=pp_size,
        cp_rank=cp_rank,
        cp_size=cp_size,
    )
    if mla:
        # Still validate the TP coordinates the caller gave.
        Shard(tp_rank=tp_rank, tp_size=tp_size)
    return Namespace(model=fingerprint, kind=DataKind.KV, shard=shard)
