"""Checking what a backend holds: per-object reports, their classification and tallies.

A backend that can enumerate its medium declares ``Capabilities.scannable`` and implements
:class:`~sglang_storage.storage.backend.Scannable`: ``scan()`` yields one
:class:`ObjectReport` per thing it finds (objects, temporary files of writers, files that
are not its own) without changing anything, and ``repair(reports)`` puts right the ones
that need it and returns one :class:`RepairResult` each. This module holds what every
backend shares:

- :class:`ObjectState` - what a thing is: ``ok``, ``corrupt``, ``wrong_version``,
  ``wrong_model``, ``orphaned_temp``, ``foreign``, and the informational ``quarantined``
  and ``in_progress``. :attr:`ObjectState.problem` says which ones an fsck must report.
- :func:`inspect_header` and :func:`inspect_object` - the classification of a stored
  object's bytes (header, size, payload checksum), the same for every backend.
- :class:`PayloadHasher` - the streamed payload checksum a scan compares.
- :class:`ScanSummary` (built with :func:`summarize`) - counts and bytes by state, and
  of the ``ok`` objects by data kind and by namespace.
- What the backends on a directory share: :func:`sorted_entries`, :func:`entry_size`,
  :func:`foreign`, and the ``tmp/`` directory of writers' temporary files named
  ``<pid>.<...>`` (:func:`scan_temp_dir`, :func:`remove_orphan`).
"""

from __future__ import annotations

import contextlib
import enum
import os
import shutil
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Final

import attrs
import xxhash

from sglang_storage.config import instance_of, optional
from sglang_storage.core import DataKind, Namespace, ObjectKey
from sglang_storage.errors import CorruptObjectError
from sglang_storage.storage.format import (
    FORMAT_VERSION,
    HEADER_SIZE,
    MAGIC,
    ObjectHeader,
    decode_header,
)
from sglang_storage.storage.posix import namespace_of, process_alive

__all__ = [
    "HeaderCheck",
    "ObjectReport",
    "ObjectState",
    "PayloadHasher",
    "RepairAction",
    "RepairResult",
    "ScanSummary",
    "Tally",
    "entry_size",
    "foreign",
    "inspect_header",
    "inspect_object",
    "namespace_dirs",
    "quarantined",
    "remove_orphan",
    "scan_temp_dir",
    "sorted_entries",
    "summarize",
]


class ObjectState(enum.Enum):
    """What a scan found at one place of a backend's medium."""

    OK = "ok"
    """A whole object whose header and (when checked) payload verify."""
    CORRUPT = "corrupt"
    """An object that fails verification: header, size or payload checksum."""
    WRONG_VERSION = "wrong_version"
    """An object of another format version: this build cannot read it."""
    WRONG_MODEL = "wrong_model"
    """A whole object of another model fingerprint than the one the scan was given."""
    ORPHANED_TEMP = "orphaned_temp"
    """A temporary file (a write in progress) of a process that no longer runs."""
    FOREIGN = "foreign"
    """Something the backend did not write; reported, never touched."""
    QUARANTINED = "quarantined"
    """An object moved aside earlier after a failed check (kept for inspection)."""
    IN_PROGRESS = "in_progress"
    """A temporary file of a process that still runs."""

    @property
    def problem(self) -> bool:
        """Whether this state is something wrong that ``repair`` can put right."""
        return self in _PROBLEMS


_PROBLEMS: Final = frozenset(
    {
        ObjectState.CORRUPT,
        ObjectState.WRONG_VERSION,
        ObjectState.WRONG_MODEL,
        ObjectState.ORPHANED_TEMP,
    }
)


@attrs.frozen(kw_only=True)
class ObjectReport:
    """One thing a scan found, and what it is."""

    state: ObjectState = attrs.field(validator=instance_of(ObjectState))
    location: str = attrs.field(validator=instance_of(str))
    """Where it is: a path, ``path@offset`` for a slot, or the key of an in-memory object."""
    nbytes: int = attrs.field(validator=instance_of(int))
    """Bytes it takes on the medium (headers included)."""
    key: ObjectKey | None = attrs.field(default=None, validator=optional(instance_of(ObjectKey)))
    """The object it is, or claims to be, when that is known."""
    reason: str = attrs.field(default="", validator=instance_of(str))
    """Why it is not ``ok`` (empty when it is)."""
    identity: int = attrs.field(default=0, validator=instance_of(int))
    """What the backend needs to tell the same thing from a replacement at repair time
    (an inode, a header checksum); opaque to everyone else."""

    @property
    def kind(self) -> DataKind | None:
        """The data kind of the object, when known."""
        return None if self.key is None else self.key.namespace.kind


class RepairAction(enum.Enum):
    """What ``repair`` did with one report."""

    QUARANTINED = "quarantined"
    """Moved aside (kept for inspection; no longer served)."""
    REMOVED = "removed"
    """Deleted."""
    GONE = "gone"
    """Already gone, or replaced by something else since the scan: nothing to do."""
    KEPT = "kept"
    """Left as it is: nothing wrong with it, or not the backend's to touch."""
    FAILED = "failed"
    """The repair was tried and failed (the reason says why)."""

    @property
    def resolved(self) -> bool:
        """Whether the problem is no longer there."""
        return self in (RepairAction.QUARANTINED, RepairAction.REMOVED, RepairAction.GONE)


@attrs.frozen(kw_only=True)
class RepairResult:
    """What ``repair`` did with one :class:`ObjectReport`."""

    report: ObjectReport = attrs.field(validator=instance_of(ObjectReport))
    action: RepairAction = attrs.field(validator=instance_of(RepairAction))
    reason: str = attrs.field(default="", validator=instance_of(str))
    """Why it was kept or failed."""


@attrs.frozen(kw_only=True)
class HeaderCheck:
    """What a stored header says: the state it puts the object in, and the header."""

    state: ObjectState
    header: ObjectHeader | None
    """The decoded header when the state is ``ok`` or ``wrong_model``."""
    reason: str = ""


def inspect_header(
    raw: bytes | bytearray | memoryview,
    *,
    where: str,
    expected: ObjectKey | None = None,
    model: str | None = None,
) -> HeaderCheck:
    """Classify a stored object by its header alone.

    Args:
        raw: The stored bytes from the object's start (fewer than a header: truncated).
        where: How to name the object in reasons.
        expected: The key the object's place says it holds (a path, a slot's set); a
            header of another key is corrupt.
        model: The model fingerprint the store should hold; a whole object of another
            one is ``wrong_model``. ``None`` accepts every model.
    """
    if len(raw) < HEADER_SIZE:
        return HeaderCheck(
            state=ObjectState.CORRUPT, header=None, reason=f"truncated header ({len(raw)} bytes)"
        )
    magic = bytes(raw[:4])
    if magic != MAGIC:
        return HeaderCheck(
            state=ObjectState.CORRUPT,
            header=None,
            reason=f"not an sglang-storage object (magic {magic!r})",
        )
    version = int.from_bytes(raw[4:6], "little")
    if version != FORMAT_VERSION:
        return HeaderCheck(
            state=ObjectState.WRONG_VERSION,
            header=None,
            reason=f"format version {version}; this build reads version {FORMAT_VERSION}",
        )
    try:
        header = decode_header(raw, where=where)
    except CorruptObjectError as error:
        return HeaderCheck(state=ObjectState.CORRUPT, header=None, reason=error.reason)
    if expected is not None and header.key != expected:
        return HeaderCheck(
            state=ObjectState.CORRUPT,
            header=header,
            reason=f"holds object {header.key}, not {expected}",
        )
    if model is not None and header.key.namespace.model != model:
        return HeaderCheck(
            state=ObjectState.WRONG_MODEL,
            header=header,
            reason=f"was written for model {header.key.namespace.model!r}, not {model!r}",
        )
    return HeaderCheck(state=ObjectState.OK, header=header)


def inspect_object(
    check: HeaderCheck, *, stored_bytes: int, payload_checksum: int | None
) -> HeaderCheck:
    """Complete :func:`inspect_header` with the object's size and payload checksum.

    Args:
        check: What the header said.
        stored_bytes: Bytes the object takes on the medium (for a slot: the bytes of it
            that were read, at most header plus payload).
        payload_checksum: The checksum of the payload as read, or ``None`` when the scan
            reads headers only.
    """
    header = check.header
    if header is None or check.state not in (ObjectState.OK, ObjectState.WRONG_MODEL):
        return check
    expected = header.object_size
    if stored_bytes < expected:
        reason = f"truncated: {stored_bytes - HEADER_SIZE} of {header.payload_length} payload bytes"
    elif stored_bytes > expected:
        reason = "has bytes after its payload"
    elif payload_checksum is not None and payload_checksum != header.payload_checksum:
        reason = "payload checksum mismatch"
    else:
        return check
    return HeaderCheck(state=ObjectState.CORRUPT, header=header, reason=reason)


class PayloadHasher:
    """The payload checksum of :mod:`.format` (xxh3-64), fed in pieces."""

    def __init__(self) -> None:
        self._state = xxhash.xxh3_64()

    def update(self, data: bytes | bytearray | memoryview) -> None:
        """Add the next piece of payload."""
        self._state.update(data)

    @property
    def value(self) -> int:
        """The checksum of everything added."""
        return int(self._state.intdigest())


@attrs.frozen(kw_only=True)
class Tally:
    """A count of things and the bytes they take."""

    count: int = 0
    bytes: int = 0

    def plus(self, nbytes: int) -> Tally:
        """This tally with one more thing of ``nbytes``."""
        return Tally(count=self.count + 1, bytes=self.bytes + nbytes)

    def as_json(self) -> dict[str, int]:
        """``{"count", "bytes"}``."""
        return {"count": self.count, "bytes": self.bytes}


@attrs.frozen(kw_only=True)
class ScanSummary:
    """Totals of a scan: by state, and of the ``ok`` objects by data kind and namespace."""

    states: Mapping[ObjectState, Tally]
    """Every state, in declaration order (zero tallies included)."""
    kinds: Mapping[DataKind, Tally]
    """``ok`` objects by data kind, every kind included."""
    namespaces: Mapping[str, Tally]
    """``ok`` objects by namespace path (``model/kind/shard``), sorted."""

    @property
    def objects(self) -> Tally:
        """The ``ok`` objects."""
        return self.states[ObjectState.OK]

    @property
    def problems(self) -> int:
        """How many things are in a problem state."""
        return sum(tally.count for state, tally in self.states.items() if state.problem)

    def as_json(self) -> dict[str, Any]:
        """The summary as JSON-ready values (enum values as keys)."""
        return {
            "objects": self.objects.as_json(),
            "problems": self.problems,
            "states": {state.value: tally.as_json() for state, tally in self.states.items()},
            "kinds": {kind.value: tally.as_json() for kind, tally in self.kinds.items()},
            "namespaces": {path: tally.as_json() for path, tally in self.namespaces.items()},
        }


def summarize(reports: Iterable[ObjectReport]) -> ScanSummary:
    """Tally ``reports`` by state, and the ``ok`` objects by kind and namespace."""
    states = dict.fromkeys(ObjectState, Tally())
    kinds = dict.fromkeys(DataKind, Tally())
    namespaces: dict[str, Tally] = {}
    for report in reports:
        states[report.state] = states[report.state].plus(report.nbytes)
        if report.state is ObjectState.OK and report.key is not None:
            namespace = report.key.namespace
            kinds[namespace.kind] = kinds[namespace.kind].plus(report.nbytes)
            namespaces[namespace.path] = namespaces.get(namespace.path, Tally()).plus(report.nbytes)
    return ScanSummary(states=states, kinds=kinds, namespaces=dict(sorted(namespaces.items())))


# ---------------------------------------------------------------------- directories


def sorted_entries(path: Path) -> list[os.DirEntry[str]]:
    """What is directly in ``path``, sorted by name (nothing when it is missing)."""
    try:
        with os.scandir(path) as entries:
            return sorted(entries, key=lambda entry: entry.name)
    except (FileNotFoundError, NotADirectoryError):
        return []


def entry_size(entry: os.DirEntry[str]) -> int:
    """Bytes of a file, or of every file under a directory (links not followed)."""
    try:
        if not entry.is_dir(follow_symlinks=False):
            return entry.stat(follow_symlinks=False).st_size
        total = 0
        for directory, _, files in os.walk(entry.path):
            for name in files:
                with contextlib.suppress(OSError):
                    total += (Path(directory) / name).lstat().st_size
        return total
    except OSError:
        return 0


def foreign(entry: os.DirEntry[str], reason: str) -> ObjectReport:
    """The report of something under a store's root that the backend did not write."""
    what = "directory" if entry.is_dir(follow_symlinks=False) else "file"
    return ObjectReport(
        state=ObjectState.FOREIGN,
        location=entry.path,
        nbytes=entry_size(entry),
        reason=f"{what} not written by sglang-storage: {reason}",
    )


def namespace_dirs(root: Path) -> Iterator[ObjectReport | tuple[Namespace, Path]]:
    """Walk ``root``'s ``model/kind/shard`` directories, as file and hf3fs lay them out.

    Yields each namespace directory with its namespace, and a foreign report for anything
    else found at those three levels.
    """
    for model_dir in sorted_entries(root):
        if not model_dir.is_dir(follow_symlinks=False):
            yield foreign(model_dir, "a file where model directories belong")
            continue
        for kind_dir in sorted_entries(Path(model_dir.path)):
            if not kind_dir.is_dir(follow_symlinks=False):
                yield foreign(kind_dir, "a file where data kind directories belong")
                continue
            for shard_dir in sorted_entries(Path(kind_dir.path)):
                namespace = (
                    namespace_of(model_dir.name, kind_dir.name, shard_dir.name)
                    if shard_dir.is_dir(follow_symlinks=False)
                    else None
                )
                if namespace is None or namespace.shard.label != shard_dir.name:
                    yield foreign(shard_dir, "does not name a namespace (model/kind/shard)")
                    continue
                yield namespace, Path(shard_dir.path)


def quarantined(directory: Path, reason: str) -> Iterator[ObjectReport]:
    """A report for each item a backend moved aside into ``directory``."""
    for item in sorted_entries(directory):
        yield ObjectReport(
            state=ObjectState.QUARANTINED,
            location=item.path,
            nbytes=entry_size(item),
            reason=reason,
        )


def _writer_pid(name: str) -> int | None:
    pid_text, dot, _ = name.partition(".")
    return int(pid_text) if dot and pid_text.isdigit() else None


def scan_temp_dir(directory: Path) -> Iterator[ObjectReport]:
    """Report the entries of a ``tmp/`` directory of writers' ``<pid>.<...>`` files.

    A dead writer's entry is ``orphaned_temp``, a running one's ``in_progress``, anything
    else ``foreign``.
    """
    for entry in sorted_entries(directory):
        pid = _writer_pid(entry.name)
        if pid is None:
            yield foreign(entry, "not a temporary file of a writer")
        elif process_alive(pid):
            yield ObjectReport(
                state=ObjectState.IN_PROGRESS,
                location=entry.path,
                nbytes=entry_size(entry),
                reason=f"being written by running process {pid}",
            )
        else:
            yield ObjectReport(
                state=ObjectState.ORPHANED_TEMP,
                location=entry.path,
                nbytes=entry_size(entry),
                reason=f"left by process {pid}, which no longer runs",
            )


def remove_orphan(report: ObjectReport, directory: Path) -> RepairResult:
    """Remove ``report``'s orphaned temporary file (in ``directory``; writer still dead)."""
    path = Path(report.location)
    pid = _writer_pid(path.name)
    if path.parent != directory or pid is None:
        return RepairResult(
            report=report, action=RepairAction.KEPT, reason=f"not a temporary file in {directory}"
        )
    if process_alive(pid):
        return RepairResult(report=report, action=RepairAction.KEPT, reason="its writer runs")
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    except FileNotFoundError:
        return RepairResult(report=report, action=RepairAction.GONE, reason="no longer there")
    except OSError as error:
        return RepairResult(report=report, action=RepairAction.FAILED, reason=str(error))
    return RepairResult(report=report, action=RepairAction.REMOVED)
