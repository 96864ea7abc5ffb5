"""Worked example: a storage backend that keeps self-checking objects in one SQLite file.

``docs/extending.md`` walks through this file. It shows everything a backend owes the
rest of the subsystem:

- it satisfies the :class:`~sglang_storage.storage.Backend` protocol structurally (no base
  class; mypy checks it where the test assigns it to a ``Backend`` variable);
- it stores the object format of :mod:`sglang_storage.storage.format` (a 512-byte header,
  then the payload) and verifies every read, so a damaged or foreign row is a ``CORRUPT``
  result and is quarantined, never delivered;
- it declares honest :class:`~sglang_storage.storage.Capabilities`: SQLite in WAL mode lets
  the processes of one host share the file, and rows survive a restart; payloads are copied
  through ``bytes`` (not zero copy) and the store has no capacity cap of its own;
- it maps ``sqlite3`` errors once, here, into :mod:`sglang_storage.errors`;
- it is thread-safe: one connection, serialised by a lock (SQLite writes one at a time
  anyway).

:data:`ENTRY` describes it for :func:`~sglang_storage.storage.register_backend` and for the
``sglang_storage.backends`` entry point group.
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import attrs

from sglang_storage.config import instance_of, positive_number
from sglang_storage.core import (
    GetRequest,
    GetResult,
    Namespace,
    ObjectKey,
    PutRequest,
    PutResult,
)
from sglang_storage.errors import BackendIOError, BackendUnavailableError, CorruptObjectError
from sglang_storage.storage import Backend, BackendContext, BackendEntry, BackendStats, Capabilities
from sglang_storage.storage.backend import StatsRecorder, count_prefix, scrub
from sglang_storage.storage.format import (
    HEADER_SIZE,
    check_object,
    checksum,
    decode_header,
    encode_header,
)

__all__ = ["ENTRY", "NAME", "SqliteBackend", "SqliteBackendConfig"]

NAME = "sqlite-example"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS objects (
    namespace TEXT NOT NULL,
    name TEXT NOT NULL,
    data BLOB NOT NULL,
    PRIMARY KEY (namespace, name)
) WITHOUT ROWID
"""


@attrs.frozen(kw_only=True)
class SqliteBackendConfig:
    """Options of the ``sqlite-example`` backend."""

    path: Path = attrs.field(converter=Path, validator=instance_of(Path))
    """The database file; created (with its directory) when missing."""
    busy_timeout_s: float = attrs.field(default=30.0, validator=positive_number)
    """How long a call waits for another process's write to finish."""


class SqliteBackend:
    """Self-checking objects as rows of one SQLite database, shared by local processes.

    Args:
        config: Its options.

    Raises:
        BackendUnavailableError: the database cannot be opened or initialised.
    """

    name = NAME

    def __init__(self, config: SqliteBackendConfig) -> None:
        self._config = config
        self._lock = threading.Lock()
        self._stats = StatsRecorder()
        try:
            config.path.parent.mkdir(parents=True, exist_ok=True)
            # Autocommit (isolation_level=None): every statement is its own transaction.
            self._db: sqlite3.Connection | None = sqlite3.connect(
                config.path,
                timeout=config.busy_timeout_s,
                isolation_level=None,
                check_same_thread=False,
            )
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute(_SCHEMA)
        except (OSError, sqlite3.Error) as error:
            raise BackendUnavailableError(backend=NAME, reason=f"{config.path}: {error}") from None

    @property
    def path(self) -> Path:
        """The database file."""
        return self._config.path

    @property
    def capabilities(self) -> Capabilities:
        """Shared by the processes of one host and durable; copies; unbounded."""
        return Capabilities(
            zero_copy=False,
            shared_across_processes=True,
            shared_across_hosts=False,
            durable=True,
            bounded=False,
        )

    # ------------------------------------------------------------------ reads

    def exists(self, keys: Sequence[ObjectKey]) -> list[bool]:
        """Whether each key is stored."""
        self._check_open()
        return [self._has(key) for key in keys]

    def prefix_hits(self, keys: Sequence[ObjectKey]) -> int:
        """How many leading keys are stored."""
        self._check_open()
        return count_prefix(self._has(key) for key in keys)

    def get_into(self, requests: Sequence[GetRequest]) -> list[GetResult]:
        """Verify each requested object and copy its payload into the request's buffers."""
        self._check_open()
        results = [self._get(request) for request in requests]
        self._stats.record_gets(results)
        return results

    def _get(self, request: GetRequest) -> GetResult:
        try:
            stored = self._row(request.key)
        except BackendIOError as error:
            return GetResult.error_of(request.key, error)
        if stored is None:
            return GetResult.miss_of(request.key)
        try:
            _verify(stored, request)
        except CorruptObjectError as error:
            scrub(request.buffers)
            self._quarantine(request.key, stored)
            return GetResult.corrupt_of(request.key, error)
        payload, offset = memoryview(stored), HEADER_SIZE
        for buffer in request.buffers:
            buffer[:] = payload[offset : offset + buffer.nbytes]
            offset += buffer.nbytes
        return GetResult.hit_of(request)

    # ------------------------------------------------------------------ writes

    def put_from(self, requests: Sequence[PutRequest]) -> list[PutResult]:
        """Store each request's buffers as a self-checking row; existing keys are kept."""
        self._check_open()
        results = [self._put(request) for request in requests]
        self._stats.record_puts(results)
        return results

    def _put(self, request: PutRequest) -> PutResult:
        header = encode_header(request.key, request.spec, checksum(request.buffers))
        data = b"".join((header, *request.buffers))
        sql = "INSERT OR IGNORE INTO objects (namespace, name, data) VALUES (?, ?, ?)"
        try:
            inserted = self._change(sql, (*_where(request.key), data))
        except BackendIOError as error:
            return PutResult.error_of(request.key, error)
        return PutResult.stored_of(request) if inserted else PutResult.present_of(request.key)

    def delete(self, keys: Sequence[ObjectKey]) -> None:
        """Remove the stored ones of ``keys``."""
        self._check_open()
        sql = "DELETE FROM objects WHERE namespace = ? AND name = ?"
        removed = sum(self._change(sql, _where(key)) for key in keys)
        self._stats.record_deleted(removed)

    def clear(self, namespace: Namespace) -> None:
        """Remove every object of ``namespace``."""
        self._check_open()
        self._change("DELETE FROM objects WHERE namespace = ?", (namespace.path,))

    # ------------------------------------------------------------------ life cycle

    def stats(self) -> BackendStats:
        """Contents (of the whole shared file) and this instance's counters."""
        self._check_open()
        sql = "SELECT COUNT(*), COALESCE(SUM(LENGTH(data)), 0) FROM objects"
        [(objects, nbytes)] = self._query(sql, ())
        assert isinstance(objects, int)
        assert isinstance(nbytes, int)
        return self._stats.snapshot(objects=objects, nbytes=nbytes, capacity_bytes=None)

    def close(self) -> None:
        """Close the database; later calls raise ``BackendUnavailableError``."""
        with self._lock:
            db, self._db = self._db, None
        if db is not None:
            db.close()

    # ------------------------------------------------------------------ helpers

    def _has(self, key: ObjectKey) -> bool:
        sql = "SELECT 1 FROM objects WHERE namespace = ? AND name = ?"
        return bool(self._query(sql, _where(key)))

    def _row(self, key: ObjectKey) -> bytes | None:
        sql = "SELECT data FROM objects WHERE namespace = ? AND name = ?"
        rows = self._query(sql, _where(key))
        if not rows:
            return None
        data = rows[0][0]
        assert isinstance(data, bytes)
        return data

    def _quarantine(self, key: ObjectKey, stored: bytes) -> None:
        """Delete ``key``'s row if it still holds ``stored`` (another process may have
        replaced it since)."""
        sql = "DELETE FROM objects WHERE namespace = ? AND name = ? AND data = ?"
        with contextlib.suppress(BackendIOError):  # best effort: the read failed anyway
            self._change(sql, (*_where(key), stored))

    def _query(self, sql: str, args: tuple[object, ...]) -> list[tuple[object, ...]]:
        """Run one statement and return its rows."""
        with self._lock, self._translated(sql):
            return self._check_open().execute(sql, args).fetchall()

    def _change(self, sql: str, args: tuple[object, ...]) -> int:
        """Run one statement and return how many rows it changed."""
        with self._lock, self._translated(sql):
            return self._check_open().execute(sql, args).rowcount

    @contextlib.contextmanager
    def _translated(self, sql: str) -> Iterator[None]:
        """SQLite's errors become this subsystem's, here and nowhere else."""
        try:
            yield
        except sqlite3.Error as error:
            operation = sql.split()[0].lower()
            raise BackendIOError(backend=NAME, operation=operation, reason=str(error)) from None

    def _check_open(self) -> sqlite3.Connection:
        db = self._db
        if db is None:
            raise BackendUnavailableError(backend=NAME, reason="the backend was closed")
        return db


def _where(key: ObjectKey) -> tuple[str, str]:
    return key.namespace.path, key.name


def _verify(stored: bytes, request: GetRequest) -> None:
    """Raise CorruptObjectError unless ``stored`` is exactly the object ``request`` wants."""
    where = str(request.key)
    header = decode_header(stored, where=where)
    payload = memoryview(stored)[HEADER_SIZE:]
    reason = check_object(header, request.key, request.spec)
    if reason is None and payload.nbytes != header.payload_length:
        reason = f"holds {payload.nbytes} payload bytes, header says {header.payload_length}"
    if reason is None and checksum([payload]) != header.payload_checksum:
        reason = "payload checksum mismatch"
    if reason is not None:
        raise CorruptObjectError(key=where, reason=reason)


def _open(config: SqliteBackendConfig, context: BackendContext) -> Backend:
    return SqliteBackend(config)


ENTRY = BackendEntry(
    name=NAME,
    config_type=SqliteBackendConfig,
    factory=_open,
    summary="self-checking objects as rows of one SQLite file (worked example)",
)
"""What ``register_backend`` takes, and what an entry point names."""
