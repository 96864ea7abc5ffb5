"""Stored objects as values: where they live, what they hold, and what an operation did.

These are the types every storage operation speaks, shared by the host<->storage pipeline
(:mod:`sglang_storage.transfer`) and the backends (:mod:`sglang_storage.storage`):

- :class:`Shard` and :class:`Namespace` - whose data an object is: model fingerprint,
  data kind, and the rank coordinates where the data is rank-local.
- :class:`ObjectKey` - a namespace plus a content name (a page hash, a multimodal hash).
- :class:`ObjectSpec` - what the payload is (element type, shape, layout); a backend
  records it with the object and checks it on every read.
- :class:`GetRequest` / :class:`PutRequest` - one object and the host buffers it is read
  into or written from (zero copy: the backend moves bytes straight between its medium
  and these buffers).
- :class:`GetResult` / :class:`PutResult` - what happened to one key, typed.

Buffers are ``memoryview``s of bytes: the host pools hand out views of their own memory,
and a backend never needs to know which pool or device they came from.
"""

from __future__ import annotations

import enum
import functools
import math
import re
from collections.abc import Iterable, Sequence
from typing import Any, Final, NoReturn, TypeVar

import attrs

from sglang_storage.config import instance_of
from sglang_storage.core.kinds import DataKind
from sglang_storage.errors import ConfigError, StorageError

__all__ = [
    "DTYPE_SIZES",
    "GetOutcome",
    "GetRequest",
    "GetResult",
    "Namespace",
    "ObjectKey",
    "ObjectSpec",
    "PutOutcome",
    "PutRequest",
    "PutResult",
    "Shard",
    "as_byte_view",
    "keys_of",
    "valid_names",
]

DTYPE_SIZES: Final[dict[str, int]] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}
"""Element types an object may declare (torch's names), with their size in bytes."""

_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")
_LAYOUT = re.compile(r"[a-z0-9_]*")
MODEL_MAX: Final = 96
NAME_MAX: Final = 160
LAYOUT_MAX: Final = 32
NDIM_MAX: Final = 8


def _fail(
    instance: Any, attribute: attrs.Attribute[Any], value: Any, reason: str, allowed: str
) -> None:
    raise ConfigError(
        owner=type(instance).__name__,
        field=attribute.name,
        value=value,
        reason=reason,
        allowed=allowed,
    )


def _safe_name(limit: int) -> Any:
    allowed = (
        f"1-{limit} characters from A-Z a-z 0-9 . _ -, not starting with '.' or '-' "
        "(safe as a file name and a Mooncake key)"
    )

    def check(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if not isinstance(value, str) or len(value) > limit or not _NAME.fullmatch(value):
            _fail(instance, attribute, value, "is not a safe name", allowed)

    return check


def _rank_pair(rank_field: str) -> Any:
    def check(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if type(value) is not int or value < 1:
            _fail(instance, attribute, value, "must be an int >= 1", "1, 2, 3, ...")
        rank = getattr(instance, rank_field)
        if type(rank) is not int or not 0 <= rank < value:
            raise ConfigError(
                owner=type(instance).__name__,
                field=rank_field,
                value=rank,
                reason=f"must be an int in [0, {attribute.name})",
                allowed=f"0..{value - 1}",
            )

    return check


@attrs.frozen(kw_only=True, cache_hash=True)
class Shard:
    """The rank coordinates of rank-local data; all sizes 1 means "shared by every rank".

    KV of MHA models is split by heads across tensor-parallel ranks, so each TP rank owns
    its own objects; MLA's latent KV is the same on every TP rank, so its shard leaves the
    TP coordinate at ``0 of 1`` and one object serves all ranks. Pipeline and context
    parallel ranks hold different layers or tokens and always stay apart.
    """

    tp_rank: int = 0
    tp_size: int = attrs.field(default=1, validator=_rank_pair("tp_rank"))
    pp_rank: int = 0
    pp_size: int = attrs.field(default=1, validator=_rank_pair("pp_rank"))
    cp_rank: int = 0
    cp_size: int = attrs.field(default=1, validator=_rank_pair("cp_rank"))

    @functools.cached_property
    def label(self) -> str:
        """A path-safe name: ``"all"``, or the split dimensions such as ``"tp1of4-pp0of2"``."""
        parts = [
            f"{name}{rank}of{size}"
            for name, rank, size in (
                ("tp", self.tp_rank, self.tp_size),
                ("pp", self.pp_rank, self.pp_size),
                ("cp", self.cp_rank, self.cp_size),
            )
            if size > 1
        ]
        return "-".join(parts) or "all"

    @classmethod
    def from_label(cls, label: str) -> Shard:
        """Parse :attr:`label` back; raises :class:`ConfigError` for anything else."""
        if label == "all":
            return cls()
        values: dict[str, int] = {}
        for part in label.split("-"):
            match = re.fullmatch(r"(tp|pp|cp)(\d+)of(\d+)", part)
            if match is None or f"{match[1]}_size" in values:
                raise ConfigError(
                    owner="Shard",
                    field="label",
                    value=label,
                    reason="is not a shard label",
                    allowed="'all' or parts like 'tp1of4', 'pp0of2', 'cp0of2' joined by '-'",
                )
            values[f"{match[1]}_rank"] = int(match[2])
            values[f"{match[1]}_size"] = int(match[3])
        return cls(**values)


@attrs.frozen(kw_only=True, cache_hash=True)
class Namespace:
    """Whose data an object is; objects of different namespaces never meet.

    ``model`` is a fingerprint of everything that makes two deployments' bytes
    incompatible (model, dtype, page size, layout); backends store it with every object
    and refuse to return an object under another fingerprint.
    """

    model: str = attrs.field(validator=_safe_name(MODEL_MAX))
    kind: DataKind = attrs.field(validator=instance_of(DataKind))
    shard: Shard = attrs.field(factory=Shard, validator=instance_of(Shard))

    @functools.cached_property
    def path(self) -> str:
        """``model/kind/shard``: the namespace as a relative path (file backend, key prefix)."""
        return f"{self.model}/{self.kind.value}/{self.shard.label}"

    def key(self, name: str) -> ObjectKey:
        """The key of the object called ``name`` in this namespace."""
        return ObjectKey(namespace=self, name=name)

    def keys(self, names: Sequence[str]) -> list[ObjectKey]:
        """``[self.key(name) for name in names]``, checked and built for the whole batch.

        Every name is validated exactly as :meth:`key` does, in one regular-expression
        match over the joined names (``/`` is in no valid name, so the pieces between
        the separators are the names); a batch that does not match is built name by
        name, which raises the same :class:`~sglang_storage.errors.ConfigError` for
        the first invalid name.
        """
        if not valid_names(names):
            return [ObjectKey(namespace=self, name=name) for name in names]
        return [_checked_key(self, name) for name in names]


@attrs.frozen(kw_only=True, cache_hash=True)
class ObjectKey:
    """One object: a namespace plus a content name (a page hash, a multimodal hash)."""

    namespace: Namespace = attrs.field(validator=instance_of(Namespace))
    name: str = attrs.field(validator=_safe_name(NAME_MAX))

    def __str__(self) -> str:
        return f"{self.namespace.path}/{self.name}"


_NAME_BATCH: Final = re.compile(
    rf"[A-Za-z0-9_][A-Za-z0-9._-]{{0,{NAME_MAX - 1}}}"
    rf"(?:/[A-Za-z0-9_][A-Za-z0-9._-]{{0,{NAME_MAX - 1}}})*"
)


def valid_names(names: Sequence[str]) -> bool:
    """Whether there are names and every one passes :class:`ObjectKey`'s name check."""
    if not names:
        return False
    try:
        joined = "/".join(names)
    except TypeError:  # a name that is not a str
        return False
    # n - 1 separators: no name holds a "/" of its own, so the pieces are the names.
    return joined.count("/") == len(names) - 1 and _NAME_BATCH.fullmatch(joined) is not None


def _key_builder() -> Any:
    """Build an :class:`ObjectKey` from a namespace and a checked name, without attrs' init.

    Sets the same slots attrs' generated ``__init__`` sets (the fields and the empty hash
    cache); checked once here against a key built the ordinary way, and the ordinary
    constructor is used instead if attrs lays the class out differently.
    """
    new, setattr_ = object.__new__, object.__setattr__
    cache = "_attrs_cached_hash"

    def build(namespace: Namespace, name: str) -> ObjectKey:
        key: ObjectKey = new(ObjectKey)
        setattr_(key, "namespace", namespace)
        setattr_(key, "name", name)
        setattr_(key, cache, None)
        return key

    def ordinary(namespace: Namespace, name: str) -> ObjectKey:
        return ObjectKey(namespace=namespace, name=name)

    probe = Namespace(model="probe", kind=DataKind.KV)
    try:
        built, expected = build(probe, "page"), ordinary(probe, "page")
        same = attrs.asdict(built, recurse=False) == attrs.asdict(expected, recurse=False)
        if same and built == expected and hash(built) == hash(expected):
            return build
    except (AttributeError, TypeError):
        pass
    return ordinary


_checked_key: Final = _key_builder()


def _dtype(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value not in DTYPE_SIZES or not isinstance(value, str):
        _fail(instance, attribute, value, "is not a known element type", ", ".join(DTYPE_SIZES))


def _shape(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    allowed = f"a tuple of 0-{NDIM_MAX} ints >= 0"
    if not isinstance(value, tuple) or len(value) > NDIM_MAX:
        _fail(instance, attribute, value, "is not a shape", allowed)
    if not all(type(d) is int and 0 <= d < 2**63 for d in value):
        _fail(instance, attribute, value, "is not a shape", allowed)


def _to_tuple(value: object) -> object:
    """Lists and other iterables become tuples; anything else is left for the validator."""
    if isinstance(value, (list, range)):
        return tuple(value)
    return value


def _layout(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, str) or len(value) > LAYOUT_MAX or not _LAYOUT.fullmatch(value):
        _fail(instance, attribute, value, "is not a layout name", f"0-{LAYOUT_MAX} of a-z 0-9 _")


@attrs.frozen(kw_only=True, cache_hash=True)
class ObjectSpec:
    """What an object's payload is: element type, shape and layout name.

    ``layout`` names how the payload's bytes are ordered (``"page_first"``, ...; empty when
    the shape says it all). A read whose expected spec differs from the stored one is a
    corrupt result, never a reinterpretation of the bytes.
    """

    dtype: str = attrs.field(validator=_dtype)
    shape: tuple[int, ...] = attrs.field(converter=_to_tuple, validator=_shape)
    layout: str = attrs.field(default="", validator=_layout)

    @functools.cached_property
    def nbytes(self) -> int:
        """The payload size in bytes."""
        return math.prod(self.shape) * DTYPE_SIZES[self.dtype]

    @classmethod
    def raw(cls, nbytes: int) -> ObjectSpec:
        """A spec for ``nbytes`` of untyped bytes."""
        return cls(dtype="uint8", shape=(nbytes,))


def as_byte_view(buffer: object, *, writable: bool = False, owner: str = "buffer") -> memoryview:
    """``buffer`` as a flat, C-contiguous ``memoryview`` of bytes.

    Accepts anything with the buffer protocol (``bytearray``, ``memoryview``, a numpy array,
    ``tensor.numpy()`` of a CPU tensor). Raises :class:`ConfigError` when it is not
    contiguous, or is read-only and ``writable`` is asked for.
    """
    if (
        type(buffer) is memoryview
        and buffer.format == "B"
        and buffer.ndim == 1
        and buffer.c_contiguous
        and not (writable and buffer.readonly)
    ):
        return buffer
    try:
        view = memoryview(buffer)  # type: ignore[arg-type]
    except TypeError:
        raise ConfigError(
            owner=owner,
            field="buffers",
            value=type(buffer).__name__,
            reason="does not support the buffer protocol",
            allowed="bytes-like objects: bytearray, memoryview, numpy arrays",
        ) from None
    if not view.c_contiguous:
        raise ConfigError(
            owner=owner, field="buffers", reason="a buffer is not C-contiguous", value=view.shape
        )
    if writable and view.readonly:
        raise ConfigError(owner=owner, field="buffers", reason="a buffer is read-only")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def _byte_views(owner: str, buffers: object, *, writable: bool) -> tuple[memoryview, ...]:
    """``buffers`` (a sequence of bytes-like objects) as flat byte views, each checked."""
    if type(buffers) is tuple or type(buffers) is list:
        items: Sequence[object] = buffers
    elif isinstance(buffers, (bytes, bytearray, memoryview, str)) or not isinstance(
        buffers, Iterable
    ):
        raise ConfigError(
            owner=owner,
            field="buffers",
            value=type(buffers).__name__,
            reason="must be a sequence of buffers, not a single buffer or a non-sequence",
            allowed="a list or tuple of bytes-like objects, e.g. [bytearray(n)]",
        )
    else:
        items = tuple(buffers)
    return tuple([as_byte_view(buffer, writable=writable, owner=owner) for buffer in items])


def _init_request(
    instance: GetRequest | PutRequest, key: object, spec: object, buffers: object
) -> None:
    """Validate and set a request's fields (attrs' generated ``__init__``, made cheaper)."""
    cls = type(instance)
    if not isinstance(key, ObjectKey) or not isinstance(spec, ObjectSpec):
        _reject_fields(instance, key, spec)
    views = _byte_views(cls.__name__, buffers, writable=cls is GetRequest)
    total = views[0].nbytes if len(views) == 1 else sum(v.nbytes for v in views)
    if total != spec.nbytes:
        raise ConfigError(
            owner=cls.__name__,
            field="buffers",
            value=total,
            reason=f"hold {total} bytes in all, but {key} is {spec.nbytes} bytes",
            allowed=f"buffers totalling exactly {spec.nbytes} bytes",
        )
    setattr = object.__setattr__
    setattr(instance, "key", key)
    setattr(instance, "spec", spec)
    setattr(instance, "buffers", views)


def _reject_fields(instance: GetRequest | PutRequest, key: object, spec: object) -> NoReturn:
    """Raise the fields' validators' error for a request given a wrong key or spec."""
    fields = attrs.fields(type(instance))
    fields.key.validator(instance, fields.key, key)
    fields.spec.validator(instance, fields.spec, spec)
    raise AssertionError("unreachable: a validator rejects the key or the spec")


@attrs.frozen(kw_only=True, eq=False, init=False)
class GetRequest:
    """Read ``key`` into ``buffers``, which together must be exactly ``spec.nbytes`` long.

    The payload fills the buffers in order. ``spec`` is what the caller expects; an object
    stored under another spec is reported corrupt and its bytes are not delivered.
    ``buffers`` is a list or tuple of writable, C-contiguous bytes-like objects.
    """

    key: ObjectKey = attrs.field(validator=instance_of(ObjectKey))
    spec: ObjectSpec = attrs.field(validator=instance_of(ObjectSpec))
    buffers: tuple[memoryview, ...]

    def __init__(self, *, key: ObjectKey, spec: ObjectSpec, buffers: Iterable[object]) -> None:
        _init_request(self, key, spec, buffers)

    @property
    def nbytes(self) -> int:
        """The payload size in bytes."""
        return self.spec.nbytes


@attrs.frozen(kw_only=True, eq=False, init=False)
class PutRequest:
    """Store the concatenation of ``buffers`` as ``key``, described by ``spec``.

    ``buffers`` is a list or tuple of C-contiguous bytes-like objects.
    """

    key: ObjectKey = attrs.field(validator=instance_of(ObjectKey))
    spec: ObjectSpec = attrs.field(validator=instance_of(ObjectSpec))
    buffers: tuple[memoryview, ...]

    def __init__(self, *, key: ObjectKey, spec: ObjectSpec, buffers: Iterable[object]) -> None:
        _init_request(self, key, spec, buffers)

    @property
    def nbytes(self) -> int:
        """The payload size in bytes."""
        return self.spec.nbytes


class GetOutcome(enum.Enum):
    """What a read of one key found."""

    HIT = "hit"
    """The object was there and verified; the buffers hold its payload."""
    MISS = "miss"
    """No such object."""
    CORRUPT = "corrupt"
    """An object was there but failed verification (or was asked for with another spec);
    nothing was delivered. A damaged object is quarantined; one asked for with the wrong spec
    stays (the caller's mistake)."""
    ERROR = "error"
    """The read failed (I/O error, timeout, backend down); ``error`` says why."""


class PutOutcome(enum.Enum):
    """What a write of one key did."""

    STORED = "stored"
    """The object is now stored."""
    PRESENT = "present"
    """An object with this key was already stored and was kept (keys name content)."""
    ERROR = "error"
    """The write failed (no space, I/O error, backend down); ``error`` says why."""


def _error_matches(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    wants_error = instance.outcome in (GetOutcome.ERROR, GetOutcome.CORRUPT, PutOutcome.ERROR)
    if wants_error != isinstance(value, StorageError):
        need = "a StorageError" if wants_error else "None"
        _fail(instance, attribute, value, f"must be {need} for outcome {instance.outcome}", need)


@attrs.frozen(kw_only=True)
class GetResult:
    """The outcome of reading one key; ``nbytes`` is the payload delivered (0 unless a hit)."""

    key: ObjectKey
    outcome: GetOutcome = attrs.field(validator=instance_of(GetOutcome))
    nbytes: int = 0
    error: StorageError | None = attrs.field(default=None, validator=_error_matches)

    @property
    def hit(self) -> bool:
        """Whether the buffers now hold the object's verified payload."""
        return self.outcome is GetOutcome.HIT

    @classmethod
    def hit_of(cls, request: GetRequest) -> GetResult:
        """A hit for ``request``."""
        return _trusted(cls, request.key, GetOutcome.HIT, request.nbytes)

    @classmethod
    def miss_of(cls, key: ObjectKey) -> GetResult:
        """A miss for ``key``."""
        return _trusted(cls, key, GetOutcome.MISS, 0)

    @classmethod
    def corrupt_of(cls, key: ObjectKey, error: StorageError) -> GetResult:
        """A corrupt object at ``key``; ``error`` is usually a ``CorruptObjectError``."""
        return cls(key=key, outcome=GetOutcome.CORRUPT, error=error)

    @classmethod
    def error_of(cls, key: ObjectKey, error: StorageError) -> GetResult:
        """A failed read of ``key``."""
        return cls(key=key, outcome=GetOutcome.ERROR, error=error)


@attrs.frozen(kw_only=True)
class PutResult:
    """The outcome of writing one key; ``nbytes`` is the payload written (0 unless stored)."""

    key: ObjectKey
    outcome: PutOutcome = attrs.field(validator=instance_of(PutOutcome))
    nbytes: int = 0
    error: StorageError | None = attrs.field(default=None, validator=_error_matches)

    @property
    def ok(self) -> bool:
        """Whether the object is stored now (written by this call or already there)."""
        return self.outcome is not PutOutcome.ERROR

    @classmethod
    def stored_of(cls, request: PutRequest) -> PutResult:
        """``request``'s object was written."""
        return _trusted(cls, request.key, PutOutcome.STORED, request.nbytes)

    @classmethod
    def present_of(cls, key: ObjectKey) -> PutResult:
        """``key`` was already stored and kept."""
        return _trusted(cls, key, PutOutcome.PRESENT, 0)

    @classmethod
    def error_of(cls, key: ObjectKey, error: StorageError) -> PutResult:
        """A failed write of ``key``."""
        return cls(key=key, outcome=PutOutcome.ERROR, error=error)


R = TypeVar("R", GetResult, PutResult)


def _trusted(cls: type[R], key: ObjectKey, outcome: GetOutcome | PutOutcome, nbytes: int) -> R:
    """A result without an error, built without re-running the validators.

    For the per-key hot path of backends (a few microseconds each otherwise): the
    arguments come from an already validated request and a fixed outcome.
    """
    result = object.__new__(cls)
    object.__setattr__(result, "key", key)
    object.__setattr__(result, "outcome", outcome)
    object.__setattr__(result, "nbytes", nbytes)
    object.__setattr__(result, "error", None)
    return result


def keys_of(requests: Sequence[GetRequest] | Sequence[PutRequest]) -> list[ObjectKey]:
    """The keys of ``requests``, in order."""
    return [r.key for r in requests]
