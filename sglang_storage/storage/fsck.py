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
- :func:`planned_action` - what ``repair`` does with a report, for showing it first.
- What the backends on a directory share: :func:`sorted_entries`, :func:`entry_size`,
  :func:`foreign`, the writers' temporary files, named ``.sgs-<pid>-<token>-<serial>.<kind>``
  and locked by their writer (:func:`scan_temp_dir`, :func:`temp_report`,
  :func:`remove_orphan`; anything else there is foreign), and permissions: a report is
  ``exposed`` when its file lets group or others do more than the store's file mode allows
  (:func:`restrict` narrows it).
"""

from __future__ import annotations

import contextlib
import enum
import os
import stat
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
from sglang_storage.storage.posix import (
    TempState,
    exposed,
    namespace_of,
    narrowed,
    probe_temp,
    remove_dead_temp,
    temp_writer,
)

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
    "exposure",
    "foreign",
    "inspect_header",
    "inspect_object",
    "namespace_dirs",
    "planned_action",
    "quarantined",
    "remove_orphan",
    "restrict",
    "scan_temp_dir",
    "sorted_entries",
    "summarize",
    "temp_report",
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
    """A temporary file of ours (``.sgs-`` name) whose writer no longer holds its lock."""
    FOREIGN = "foreign"
    """Something the backend did not write; reported, never touched."""
    QUARANTINED = "quarantined"
    """An object moved aside earlier after a failed check (kept for inspection)."""
    IN_PROGRESS = "in_progress"
    """A temporary file whose writer holds its lock (or whose writer cannot be told)."""

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
    exposed: bool = attrs.field(default=False, validator=instance_of(bool))
    """Its file lets group or other users read or write more than the store's file mode
    allows (``repair`` narrows it)."""

    @property
    def kind(self) -> DataKind | None:
        """The data kind of the object, when known."""
        return None if self.key is None else self.key.namespace.kind

    @property
    def problem(self) -> bool:
        """Whether an fsck must report it: its state is a problem, or it is exposed."""
        return self.state.problem or self.exposed


class RepairAction(enum.Enum):
    """What ``repair`` did with one report."""

    QUARANTINED = "quarantined"
    """Moved aside (kept for inspection; no longer served)."""
    REMOVED = "removed"
    """Deleted."""
    GONE = "gone"
    """Already gone, or replaced by something else since the scan: nothing to do."""
    RESTRICTED = "restricted"
    """Its permissions were narrowed to the store's file mode (it is kept)."""
    KEPT = "kept"
    """Left as it is: nothing wrong with it, or not the backend's to touch."""
    FAILED = "failed"
    """The repair was tried and failed (the reason says why)."""

    @property
    def resolved(self) -> bool:
        """Whether the problem is no longer there."""
        return self in (
            RepairAction.QUARANTINED,
            RepairAction.REMOVED,
            RepairAction.RESTRICTED,
            RepairAction.GONE,
        )


def planned_action(report: ObjectReport) -> RepairAction:
    """What ``repair`` does with ``report`` unless it changed since the scan.

    Damaged and other-version objects are quarantined, other models' objects and orphaned
    temporary files removed, exposed files restricted; anything else is kept.
    """
    state = report.state
    if state in (ObjectState.CORRUPT, ObjectState.WRONG_VERSION):
        return RepairAction.QUARANTINED
    if state in (ObjectState.WRONG_MODEL, ObjectState.ORPHANED_TEMP):
        return RepairAction.REMOVED
    if report.exposed:
        return RepairAction.RESTRICTED
    return RepairAction.KEPT


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
    exposed: Tally = attrs.field(factory=Tally)
    """Things (in any state) whose files allow more than the store's file mode."""
    exposed_only: int = 0
    """How many of those are in no problem state: each is a problem by its exposure."""

    @property
    def objects(self) -> Tally:
        """The ``ok`` objects."""
        return self.states[ObjectState.OK]

    @property
    def problems(self) -> int:
        """How many things are in a problem state or exposed."""
        in_state = sum(tally.count for state, tally in self.states.items() if state.problem)
        return in_state + self.exposed_only

    def as_json(self) -> dict[str, Any]:
        """The summary as JSON-ready values (enum values as keys)."""
        return {
            "objects": self.objects.as_json(),
            "problems": self.problems,
            "exposed": self.exposed.as_json(),
            "states": {state.value: tally.as_json() for state, tally in self.states.items()},
            "kinds": {kind.value: tally.as_json() for kind, tally in self.kinds.items()},
            "namespaces": {path: tally.as_json() for path, tally in self.namespaces.items()},
        }


def summarize(reports: Iterable[ObjectReport]) -> ScanSummary:
    """Tally ``reports`` by state, and the ``ok`` objects by kind and namespace."""
    states = dict.fromkeys(ObjectState, Tally())
    kinds = dict.fromkeys(DataKind, Tally())
    namespaces: dict[str, Tally] = {}
    exposed_tally, exposed_only = Tally(), 0
    for report in reports:
        states[report.state] = states[report.state].plus(report.nbytes)
        if report.exposed:
            exposed_tally = exposed_tally.plus(report.nbytes)
            exposed_only += not report.state.problem
        if report.state is ObjectState.OK and report.key is not None:
            namespace = report.key.namespace
            kinds[namespace.kind] = kinds[namespace.kind].plus(report.nbytes)
            namespaces[namespace.path] = namespaces.get(namespace.path, Tally()).plus(report.nbytes)
    return ScanSummary(
        states=states,
        kinds=kinds,
        namespaces=dict(sorted(namespaces.items())),
        exposed=exposed_tally,
        exposed_only=exposed_only,
    )


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


def quarantined(directory: Path, reason: str, *, allowed: int) -> Iterator[ObjectReport]:
    """A report for each item a backend moved aside into ``directory``.

    Args:
        directory: The quarantine directory.
        reason: Why its items are there.
        allowed: The store's file permission bits; an item allowing more is ``exposed``.
    """
    for item in sorted_entries(directory):
        try:
            status = item.stat(follow_symlinks=False)
        except OSError:
            continue
        regular = stat.S_ISREG(status.st_mode)
        yield ObjectReport(
            state=ObjectState.QUARANTINED,
            location=item.path,
            nbytes=entry_size(item),
            reason=reason,
            identity=status.st_ino,
            exposed=regular and exposed(status.st_mode, allowed),
        )


def exposure(mode: int, allowed: int) -> str:
    """Why permission bits ``mode`` are a problem where ``allowed`` are the store's."""
    return f"mode {mode & 0o777:04o} lets other users in beyond the store's {allowed:04o}"


def restrict(report: ObjectReport, path: str, allowed: int, *, inode: int | None) -> RepairResult:
    """Narrow the permissions of file ``path`` (``report``'s) to ``allowed``.

    The file is opened without following links and changed through its descriptor, so a
    link planted in its place is never followed.

    Args:
        report: What the scan found.
        path: The file to change.
        allowed: The store's file permission bits.
        inode: The inode the scan saw, when the file must still be that one.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return RepairResult(report=report, action=RepairAction.GONE, reason="no longer there")
    except OSError as error:
        return RepairResult(report=report, action=RepairAction.FAILED, reason=str(error))
    try:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode):
            return RepairResult(
                report=report, action=RepairAction.KEPT, reason="not a regular file"
            )
        if inode is not None and status.st_ino != inode:
            return RepairResult(
                report=report, action=RepairAction.GONE, reason="replaced since the scan"
            )
        if exposed(status.st_mode, allowed):
            os.fchmod(fd, narrowed(status.st_mode, allowed))
    except OSError as error:
        return RepairResult(report=report, action=RepairAction.FAILED, reason=str(error))
    finally:
        os.close(fd)
    return RepairResult(report=report, action=RepairAction.RESTRICTED)


def temp_report(entry: os.DirEntry[str]) -> ObjectReport:
    """The report of one entry where temporary files live: ours (``.sgs-``) or foreign.

    A temporary file whose writer holds its lock is ``in_progress``, one whose lock
    nobody holds ``orphaned_temp``; one whose writer cannot be told is ``in_progress``
    (kept), anything not named and shaped like ours ``foreign``. Changes nothing.
    """
    pid = temp_writer(entry.name)
    if pid is None:
        return foreign(entry, "not a temporary file of sglang-storage (those are .sgs-...)")
    state, why = probe_temp(entry.path)
    if state is TempState.NOT_TEMP:
        return foreign(entry, f"named like a temporary file but {why}")
    if state is TempState.DEAD:
        return ObjectReport(
            state=ObjectState.ORPHANED_TEMP,
            location=entry.path,
            nbytes=entry_size(entry),
            reason=f"{why} (it was process {pid} where it started)",
        )
    return ObjectReport(
        state=ObjectState.IN_PROGRESS,
        location=entry.path,
        nbytes=entry_size(entry),
        reason=f"being written: {why}" if state is TempState.LIVE else f"kept: {why}",
    )


def scan_temp_dir(directory: Path) -> Iterator[ObjectReport]:
    """Report every entry of a ``tmp/`` directory (see :func:`temp_report`)."""
    for entry in sorted_entries(directory):
        yield temp_report(entry)


def remove_orphan(report: ObjectReport, *directories: Path) -> RepairResult:
    """Remove ``report``'s orphaned temporary file, in one of ``directories``.

    Only a file named like ours whose lock nobody holds now is removed.
    """
    path = Path(report.location)
    if path.parent not in directories or temp_writer(path.name) is None:
        return RepairResult(
            report=report,
            action=RepairAction.KEPT,
            reason="not a temporary file of sglang-storage where those live",
        )
    try:
        state, why = remove_dead_temp(str(path))
    except OSError as error:
        return RepairResult(report=report, action=RepairAction.FAILED, reason=str(error))
    if state is TempState.DEAD:
        return RepairResult(report=report, action=RepairAction.REMOVED)
    if state is TempState.GONE:
        return RepairResult(report=report, action=RepairAction.GONE, reason=why)
    return RepairResult(report=report, action=RepairAction.KEPT, reason=why)
