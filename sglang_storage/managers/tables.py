"""Host tables read in place by GPU kernels, kept in storage so a restart skips the checkpoint.

DeepSeek-V4.1's Engram tables (~94 GiB each in FP8) live in mapped host memory that kernels
read through a host pointer; they are loaded once from the checkpoint and never change. A
:class:`HostTableManager` owns one :class:`~sglang_storage.memory.MappedRegion` per table
and, with a storage pipeline, keeps a copy of the part of each table this process loaded
(its *sections*: byte ranges of the region) in fixed-size chunks, so that the next start
restores those bytes from storage instead of reading the checkpoint. Contract, one line each:

- ``create(name, config, budget)`` / ``attach(name, handle)`` - the table's region
  (creator-charged; an attacher of a shared table charges nothing).
- :class:`TableFingerprint` - everything that makes a stored copy valid: the model, its
  checkpoint files (names, sizes, modification times), the table's own facts (layer,
  geometry, row range), the sections' sizes, the chunk size and :data:`FORMAT_VERSION`.
  Its digest names the storage namespace, so a copy of any other fingerprint is a miss.
- ``restore(name, fingerprint, sections)`` - read every chunk of the sections into the
  region (synchronous). :attr:`RestoreOutcome.RESTORED` only when every chunk was present
  and verified (the object format checksums every read); anything else is a
  :attr:`~RestoreOutcome.MISS` (or :attr:`~RestoreOutcome.NO_STORAGE`), after which the
  sections' bytes are undefined and the caller loads them from the checkpoint, which
  writes every one of them: a miss or a bad chunk never leaves wrong bytes in use.
- ``persist(name, fingerprint, sections)`` - queue a put of every chunk and return; the
  region must not change until its :class:`PersistResult` arrives from ``poll``/``wait``.
- ``poll()`` / ``wait(timeout_s)`` - finished persists as :class:`PersistResult` values.
- ``release(name)`` / ``close()`` - close one table's region / every one; the pipeline is
  the owner's to close.

Not thread-safe: one owner (or the owner's lock) calls every method. The manager drains
its pipeline's completions, so the pipeline must not be shared.
"""

from __future__ import annotations

import enum
import itertools
import json
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import attrs

from sglang_storage.config import (
    BYTES,
    instance_of,
    non_empty_str,
    non_negative_int,
    positive_int,
    positive_number,
    tuple_of,
)
from sglang_storage.core import (
    DataKind,
    GetOutcome,
    GetRequest,
    Namespace,
    ObjectKey,
    ObjectSpec,
    PutOutcome,
    PutRequest,
)
from sglang_storage.errors import ConfigError, StateError, StorageError
from sglang_storage.memory import (
    BudgetCharge,
    CudaRuntime,
    MappedRegion,
    MappedRegionConfig,
    Pinning,
    SharedHandle,
)
from sglang_storage.storage.keys import model_fingerprint
from sglang_storage.transfer import Priority, PutHandle, StoragePipeline

__all__ = [
    "FORMAT_VERSION",
    "CheckpointFile",
    "HostTableConfig",
    "HostTableManager",
    "PersistResult",
    "RestoreOutcome",
    "RestoreResult",
    "TableFingerprint",
    "TableSection",
    "checkpoint_files",
]

FORMAT_VERSION: Final = 1
"""The stored chunk format; part of every fingerprint, so a new format misses the old."""

CHECKPOINT_PATTERNS: Final = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.pt")
"""The files of a checkpoint directory a fingerprint covers."""

_OWNER: Final = "HostTableManager"
_FACT_TYPES: Final = (str, int)


@attrs.frozen(kw_only=True)
class CheckpointFile:
    """One checkpoint file as a fingerprint sees it: any change to it invalidates copies."""

    name: str = attrs.field(validator=non_empty_str)
    """The file name, relative to the checkpoint directory."""
    size: int = attrs.field(metadata=BYTES, validator=non_negative_int)
    mtime_ns: int = attrs.field(validator=non_negative_int)


def checkpoint_files(
    directory: str | Path, patterns: Iterable[str] = CHECKPOINT_PATTERNS
) -> tuple[CheckpointFile, ...]:
    """The checkpoint files in ``directory``, sorted by name (``()`` when there are none).

    Raises:
        ConfigError: ``directory`` is not a directory.
    """
    root = Path(directory)
    if not root.is_dir():
        raise ConfigError(
            owner="checkpoint_files",
            field="directory",
            value=str(directory),
            reason="is not a directory",
        )
    found: dict[str, CheckpointFile] = {}
    for pattern in patterns:
        for path in root.glob(pattern):
            if path.is_file():
                stat = path.stat()
                found[path.name] = CheckpointFile(
                    name=path.name, size=stat.st_size, mtime_ns=stat.st_mtime_ns
                )
    return tuple(found[name] for name in sorted(found))


def _facts(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    ok = isinstance(value, tuple) and all(
        isinstance(item, tuple)
        and len(item) == 2
        and isinstance(item[0], str)
        and item[0]
        and isinstance(item[1], _FACT_TYPES)
        and not isinstance(item[1], bool)
        for item in value
    )
    if not ok:
        raise ConfigError(
            owner=type(instance).__name__,
            field=attribute.name,
            value=value,
            reason="must be (name, str or int) pairs",
            allowed='e.g. (("layer", 3), ("dim", 256))',
        )


def _sorted_facts(value: object) -> object:
    if isinstance(value, Mapping):
        return tuple(sorted(value.items()))
    if isinstance(value, tuple):
        return tuple(sorted(value, key=repr))
    return value


@attrs.frozen(kw_only=True)
class TableSection:
    """A byte range of a table's region that this process owns (loads, stores, restores)."""

    offset: int = attrs.field(metadata=BYTES, validator=non_negative_int)
    nbytes: int = attrs.field(metadata=BYTES, validator=positive_int)

    @property
    def end(self) -> int:
        """One past the last byte."""
        return self.offset + self.nbytes


@attrs.frozen(kw_only=True)
class TableFingerprint:
    """What makes a stored copy of a table's sections valid for this process.

    Raises:
        ConfigError: an empty model or table name, a fact that is not ``(str, str|int)``.
    """

    model: str = attrs.field(validator=non_empty_str)
    """The model (its path or name)."""
    checkpoint: tuple[CheckpointFile, ...] = attrs.field(
        validator=tuple_of(instance_of(CheckpointFile))
    )
    """The checkpoint's files; a copy made from other files is never used."""
    table: str = attrs.field(validator=non_empty_str)
    """The table's name ("engram-layer-3")."""
    facts: tuple[tuple[str, str | int], ...] = attrs.field(
        default=(), converter=_sorted_facts, validator=_facts
    )
    """The table's own facts (layer, row range, dim, element types), name-sorted."""
    format_version: int = attrs.field(default=FORMAT_VERSION, validator=positive_int)

    def describe(self, sections: Sequence[TableSection], chunk_bytes: int) -> str:
        """Everything the fingerprint covers for these sections, as canonical JSON."""
        return json.dumps(
            {
                "model": self.model,
                "checkpoint": [[f.name, f.size, f.mtime_ns] for f in self.checkpoint],
                "table": self.table,
                "facts": [list(f) for f in self.facts],
                "sections": [s.nbytes for s in sections],
                "chunk_bytes": chunk_bytes,
                "format_version": self.format_version,
            },
            sort_keys=True,
            separators=(",", ":"),
        )

    def namespace(self, sections: Sequence[TableSection], chunk_bytes: int) -> Namespace:
        """Where these sections' chunks are stored (one namespace per fingerprint)."""
        model = Path(self.model.rstrip("/")).name or self.model
        return Namespace(
            model=model_fingerprint(model, fingerprint=self.describe(sections, chunk_bytes)),
            kind=DataKind.WEIGHT,
        )


@attrs.frozen(kw_only=True)
class HostTableConfig:
    """How a host table manager stores and restores tables."""

    chunk_bytes: int = attrs.field(default=64 << 20, metadata=BYTES, validator=positive_int)
    """The size of one stored chunk (the last chunk of a section may be shorter)."""
    restore_timeout_s: float = attrs.field(default=3600.0, validator=positive_number)
    """How long a restore waits for storage before it counts as a miss."""
    put_priority: Priority = attrs.field(
        default=Priority.BACKGROUND, validator=instance_of(Priority)
    )
    get_priority: Priority = attrs.field(default=Priority.URGENT, validator=instance_of(Priority))


class RestoreOutcome(enum.Enum):
    """What a restore did."""

    RESTORED = "restored"
    """Every chunk was present and verified; the sections hold the stored bytes."""
    MISS = "miss"
    """Some chunk was absent, corrupt or unreadable; load the sections from the checkpoint."""
    NO_STORAGE = "no_storage"
    """The manager has no storage; load the sections from the checkpoint."""


@attrs.frozen(kw_only=True)
class RestoreResult:
    """How a restore of one table's sections ended."""

    table: str
    outcome: RestoreOutcome
    chunks: int
    """Chunks the sections are stored in."""
    nbytes: int
    """Bytes of the sections."""
    reason: str
    """Why it missed ("3 of 12 chunks are not stored", ...), or "" when restored."""
    seconds: float

    @property
    def restored(self) -> bool:
        """Whether the sections hold the stored bytes."""
        return self.outcome is RestoreOutcome.RESTORED


@attrs.frozen(kw_only=True)
class PersistResult:
    """How a persist of one table's sections ended."""

    table: str
    chunks: int
    stored: int
    """Chunks written now."""
    present: int
    """Chunks already stored under this fingerprint (kept)."""
    failed: int
    errors: tuple[str, ...]
    """The distinct errors of the failed chunks."""
    nbytes: int
    seconds: float

    @property
    def complete(self) -> bool:
        """Whether every chunk is in storage now."""
        return self.failed == 0


@attrs.define(eq=False)
class _Persist:
    table: str
    handle: PutHandle
    chunks: int
    nbytes: int
    started: float


def _chunks(sections: Sequence[TableSection], chunk_bytes: int) -> list[tuple[int, int, int, int]]:
    """``(section, index, offset, nbytes)`` of every chunk, in order."""
    out = []
    for number, section in enumerate(sections):
        for index in range(math.ceil(section.nbytes / chunk_bytes)):
            start = section.offset + index * chunk_bytes
            out.append((number, index, start, min(chunk_bytes, section.end - start)))
    return out


class HostTableManager:
    """Host tables in mapped regions, optionally kept in storage; see the module docstring.

    Args:
        config: Chunking, timeouts, priorities.
        storage: The pipeline to the storage backend (``None``: no persist, no restore).
    """

    def __init__(self, config: HostTableConfig, storage: StoragePipeline | None = None) -> None:
        if not isinstance(config, HostTableConfig):
            raise ConfigError(owner=_OWNER, field="config", reason="must be a HostTableConfig")
        self._config = config
        self._storage = storage
        self._regions: dict[str, MappedRegion] = {}
        self._persists: list[_Persist] = []

    @property
    def config(self) -> HostTableConfig:
        """The manager's configuration."""
        return self._config

    @property
    def has_storage(self) -> bool:
        """Whether tables can be persisted and restored."""
        return self._storage is not None

    def region(self, name: str) -> MappedRegion | None:
        """Table ``name``'s region, or ``None``."""
        return self._regions.get(name)

    def create(
        self,
        name: str,
        config: MappedRegionConfig,
        budget: BudgetCharge,
        *,
        cudart: CudaRuntime | None = None,
    ) -> MappedRegion:
        """Map table ``name``'s region, charged to ``budget``.

        Raises:
            StateError: a table of that name is open here.
            CapacityError, BackendIOError, BackendUnavailableError: as
                :meth:`MappedRegion.create`.
        """
        self._check_new(name)
        region = MappedRegion.create(config, budget, cudart=cudart)
        self._regions[name] = region
        return region

    def attach(
        self,
        name: str,
        handle: SharedHandle,
        *,
        huge_pages: bool = True,
        pinning: Pinning = Pinning.AUTO,
        cudart: CudaRuntime | None = None,
    ) -> MappedRegion:
        """Map table ``name``'s shared region that another process created; nothing is charged.

        Raises:
            StateError: a table of that name is open here.
            BackendUnavailableError: as :meth:`MappedRegion.attach`.
        """
        self._check_new(name)
        region = MappedRegion.attach(
            handle, label=name, huge_pages=huge_pages, pinning=pinning, cudart=cudart
        )
        self._regions[name] = region
        return region

    def restore(
        self, name: str, fingerprint: TableFingerprint, sections: Sequence[TableSection]
    ) -> RestoreResult:
        """Read the stored copy of ``sections`` of table ``name`` into its region.

        Raises:
            StateError: no table of that name, or a persist of it is still in flight.
            ConfigError: a section outside the region, or overlapping another.
        """
        region = self._table(name)
        sections = self._checked(region, sections)
        if any(p.table == name for p in self._persists):
            raise StateError(subject=f"{_OWNER}.restore", reason=f"{name!r} is being persisted")
        started = time.monotonic()
        chunks = _chunks(sections, self._config.chunk_bytes)
        nbytes = sum(s.nbytes for s in sections)

        def result(outcome: RestoreOutcome, reason: str = "") -> RestoreResult:
            return RestoreResult(
                table=name,
                outcome=outcome,
                chunks=len(chunks),
                nbytes=nbytes,
                reason=reason,
                seconds=time.monotonic() - started,
            )

        if self._storage is None:
            return result(RestoreOutcome.NO_STORAGE, "no storage backend")
        keys = self._keys(name, fingerprint, sections, chunks)
        timeout = self._config.restore_timeout_s
        priority = self._config.get_priority
        try:
            present = self._storage.submit_exists(keys, priority=priority).result(timeout)
            absent = sum(not p for p in present)
            if absent:
                return result(RestoreOutcome.MISS, f"{absent} of {len(keys)} chunks are not stored")
            data = region.tensor.numpy()
            requests = [
                GetRequest(key=key, spec=ObjectSpec.raw(size), buffers=[data[start : start + size]])
                for key, (_, _, start, size) in zip(keys, chunks, strict=True)
            ]
            got = self._storage.submit_get(requests, priority=priority).result(timeout)
        except StorageError as error:
            return result(RestoreOutcome.MISS, f"storage failed: {error}")
        finally:
            self._drain()
        bad = dict.fromkeys(GetOutcome, 0)
        for item in got:
            bad[item.outcome] += 1
        if bad[GetOutcome.HIT] == len(chunks):
            return result(RestoreOutcome.RESTORED)
        reason = ", ".join(
            f"{count} {outcome.value}"
            for outcome, count in bad.items()
            if count and outcome is not GetOutcome.HIT
        )
        return result(RestoreOutcome.MISS, f"{reason} of {len(chunks)} chunks")

    def persist(
        self, name: str, fingerprint: TableFingerprint, sections: Sequence[TableSection]
    ) -> int:
        """Queue storing ``sections`` of table ``name``; returns the number of chunks.

        A :class:`PersistResult` follows from :meth:`poll` / :meth:`wait`; keep the
        sections unchanged until then.

        Raises:
            StateError: no table of that name, no storage, or a persist of it in flight.
            ConfigError: a bad section.
            CapacityError, StateError: the pipeline refused the work (full, closed).
        """
        region = self._table(name)
        sections = self._checked(region, sections)
        if self._storage is None:
            raise StateError(subject=f"{_OWNER}.persist", reason="the manager has no storage")
        if any(p.table == name for p in self._persists):
            raise StateError(
                subject=f"{_OWNER}.persist", reason=f"{name!r} is already being persisted"
            )
        chunks = _chunks(sections, self._config.chunk_bytes)
        keys = self._keys(name, fingerprint, sections, chunks)
        data = region.tensor.numpy()
        requests = [
            PutRequest(key=key, spec=ObjectSpec.raw(size), buffers=[data[start : start + size]])
            for key, (_, _, start, size) in zip(keys, chunks, strict=True)
        ]
        handle = self._storage.submit_put(requests, priority=self._config.put_priority)
        self._persists.append(
            _Persist(
                table=name,
                handle=handle,
                chunks=len(chunks),
                nbytes=sum(s.nbytes for s in sections),
                started=time.monotonic(),
            )
        )
        return len(chunks)

    def pending(self) -> tuple[str, ...]:
        """The tables whose persist has not been reported yet."""
        return tuple(p.table for p in self._persists)

    def poll(self) -> list[PersistResult]:
        """Persists that finished since the last call."""
        done = [p for p in self._persists if p.handle.done()]
        self._persists = [p for p in self._persists if not p.handle.done()]
        self._drain()
        return [self._finished(p) for p in done]

    def wait(self, timeout_s: float | None = None) -> list[PersistResult]:
        """Wait up to ``timeout_s`` for every persist in flight; those that finished."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for persist in self._persists:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            persist.handle.wait(left)
        return self.poll()

    def release(self, name: str) -> None:
        """Close table ``name``'s region and forget it (absent is fine).

        Its charge goes back to the budget; the mapping goes with the last view of it.
        """
        region = self._regions.pop(name, None)
        if region is not None:
            region.close()

    def close(self) -> None:
        """Close every table's region (their memory goes with the last view of it)."""
        regions, self._regions = list(self._regions.values()), {}
        for region in regions:
            region.close()

    # ------------------------------------------------------------------ internals

    def _check_new(self, name: str) -> None:
        if not name.strip():
            raise ConfigError(owner=_OWNER, field="name", value=name, reason="must be a name")
        if name in self._regions:
            raise StateError(subject=_OWNER, reason=f"table {name!r} is already open")

    def _table(self, name: str) -> MappedRegion:
        region = self._regions.get(name)
        if region is None:
            raise StateError(subject=_OWNER, reason=f"no table {name!r} is open here")
        return region

    def _checked(
        self, region: MappedRegion, sections: Sequence[TableSection]
    ) -> tuple[TableSection, ...]:
        given = tuple(sections)
        if not given or not all(isinstance(s, TableSection) for s in given):
            raise ConfigError(
                owner=_OWNER,
                field="sections",
                value=sections,
                reason="must be one or more TableSection",
            )
        ordered = sorted(given, key=lambda s: s.offset)
        for before, after in itertools.pairwise(ordered):
            if after.offset < before.end:
                raise ConfigError(
                    owner=_OWNER, field="sections", value=given, reason="must not overlap"
                )
        if ordered[-1].end > region.nbytes:
            raise ConfigError(
                owner=_OWNER,
                field="sections",
                value=given,
                reason=f"must lie inside the table's {region.nbytes} bytes",
            )
        return given

    def _keys(
        self,
        name: str,
        fingerprint: TableFingerprint,
        sections: Sequence[TableSection],
        chunks: Sequence[tuple[int, int, int, int]],
    ) -> list[ObjectKey]:
        namespace = fingerprint.namespace(sections, self._config.chunk_bytes)
        stem = "".join(c if c.isascii() and (c.isalnum() or c in "._-") else "-" for c in name)
        stem = stem.lstrip(".-")[:100] or "table"
        return namespace.keys([f"{stem}-s{s}-c{i:06d}" for s, i, _, _ in chunks])

    def _drain(self) -> None:
        if self._storage is not None and self._storage.config.track_completions:
            self._storage.completions(0.0)

    def _finished(self, persist: _Persist) -> PersistResult:
        counts = dict.fromkeys(PutOutcome, 0)
        errors: dict[str, None] = {}
        for item in persist.handle.partial():
            counts[item.outcome] += 1
            if item.error is not None:
                errors[str(item.error)] = None
        return PersistResult(
            table=persist.table,
            chunks=persist.chunks,
            stored=counts[PutOutcome.STORED],
            present=counts[PutOutcome.PRESENT],
            failed=counts[PutOutcome.ERROR],
            errors=tuple(errors),
            nbytes=persist.nbytes,
            seconds=time.monotonic() - persist.started,
        )
