"""Apply, revert and report the patches of ``patches/sglang-<version>`` on an SGLang tree.

Command line (what ``make apply-patches`` / ``make revert-patches`` run)::

    python -m sglang_storage_adapters.patching apply|revert|status
        [--sglang-dir PATH] [--patches-dir DIR]

- The target (:func:`locate_sglang`) is the ``sglang`` package this Python imports, or
  ``--sglang-dir``: an ``sglang`` package directory, or a git checkout of SGLang whose
  package is ``python/sglang``. Its release is read from the tree (``_version.py``, a
  sibling ``.dist-info``, ``python/pyproject.toml`` or the git tag at ``HEAD``) and must
  be :data:`~sglang_storage_adapters.SUPPORTED_SGLANG_VERSION`.
- Patches are unified diffs whose paths are relative to the ``sglang`` package directory
  (``--- a/srt/server_args.py``), applied in file-name order.
- :func:`apply_patches` works on the file contents in memory: every patch is first
  checked and applied there, and files are written (each atomically, by rename) only
  when all of them succeeded. A patch that is already in the tree is skipped, so
  applying twice succeeds. A hunk that fits neither way is a
  :class:`PatchConflictError` naming the patch file, the hunk and the target file, and
  nothing is written. :func:`revert_patches` is the same in reverse order.

Hunks must match exactly (no fuzz); a hunk may be found a few lines away from where the
diff says (an offset), as with GNU ``patch``. This module is pure Python on purpose: it
needs no ``patch`` binary, checks every patch before touching a file, and its errors
carry the patch file, hunk and the line that differs.
"""

from __future__ import annotations

import argparse
import base64
import csv
import enum
import hashlib
import importlib.util
import re
import shutil
import sys
import tomllib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Final

import attrs

from sglang_storage.errors import StorageError
from sglang_storage_adapters import SUPPORTED_SGLANG_VERSION

__all__ = [
    "DEFAULT_PATCHES_DIR",
    "FilePatch",
    "Hunk",
    "Patch",
    "PatchConflictError",
    "PatchError",
    "PatchFormatError",
    "PatchState",
    "PatchTargetError",
    "SGLangTree",
    "apply_patches",
    "load_patches",
    "locate_sglang",
    "main",
    "parse_patch",
    "patch_states",
    "pristine_copy",
    "record_mismatches",
    "revert_patches",
]

DEFAULT_PATCHES_DIR: Final = (
    Path(__file__).resolve().parents[2] / "patches" / f"sglang-{SUPPORTED_SGLANG_VERSION}"
)
"""``patches/sglang-<version>`` of the source checkout this module was installed from."""

_HUNK_HEADER: Final = re.compile(rb"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
_VERSION_ASSIGNMENT: Final = re.compile(
    r"^__version__\s*=\s*(?:version\s*=\s*)?['\"]([^'\"]+)['\"]", re.MULTILINE
)
_TMP_SUFFIX: Final = ".sglang-storage-tmp"


# ---------------------------------------------------------------------------- errors


class PatchError(StorageError):
    """Base of the errors of this module; nothing was changed when one is raised."""


class PatchTargetError(PatchError):
    """The SGLang tree cannot be patched: not found, not SGLang, or another release.

    Args:
        target: The path that was given or found.
        reason: What is wrong with it and what would be accepted.
    """

    def __init__(self, *, target: Path | str, reason: str) -> None:
        self.target = str(target)
        self.reason = reason
        super().__init__(f"{target}: {reason}; nothing was changed")


class PatchFormatError(PatchError):
    """A patch file is not a unified diff this module can apply.

    Args:
        patch: The patch file.
        line: The 1-based line of the patch file where the problem is.
        reason: What is wrong.
    """

    def __init__(self, *, patch: Path, line: int, reason: str) -> None:
        self.patch = patch
        self.line = line
        self.reason = reason
        super().__init__(f"{patch}:{line}: {reason}")


class PatchConflictError(PatchError):
    """A hunk fits the target neither as "not applied yet" nor as "already applied".

    Args:
        patch: The patch file.
        hunk: The hunk: its number within the file section, its header and patch line.
        target: The file the hunk is for.
        reason: Where the target differs from what the hunk expects.
    """

    def __init__(self, *, patch: Path, hunk: str, target: Path, reason: str) -> None:
        self.patch = patch
        self.hunk = hunk
        self.target = target
        self.reason = reason
        super().__init__(
            f"{patch.name}: {hunk} does not apply to {target}: {reason}. "
            "The target was left unchanged (no file was written)"
        )


# ---------------------------------------------------------------------------- patch files


@attrs.frozen(kw_only=True)
class Hunk:
    """One ``@@`` block of a unified diff; lines are bytes without their newline."""

    number: int
    """1-based, within its file section (as GNU patch counts)."""
    header: str
    line: int
    """The 1-based line of the patch file holding the header."""
    old_start: int
    new_start: int
    old_lines: tuple[bytes, ...]
    new_lines: tuple[bytes, ...]

    def describe(self, path: str) -> str:
        """``hunk #2 of srt/x.py (patch line 22, @@ -698,6 +702,10 @@)``."""
        return f"hunk #{self.number} of {path} (patch line {self.line}, {self.header})"


@attrs.frozen(kw_only=True)
class FilePatch:
    """The hunks of one patch file for one target file."""

    path: str
    """Relative to the ``sglang`` package directory, ``a/``/``b/`` prefixes removed."""
    hunks: tuple[Hunk, ...]


@attrs.frozen(kw_only=True)
class Patch:
    """A parsed patch file."""

    source: Path
    files: tuple[FilePatch, ...]

    @property
    def name(self) -> str:
        """The patch file's name (``0001-add-storage-flag-group.patch``)."""
        return self.source.name

    @property
    def hunk_count(self) -> int:
        """How many hunks the patch holds."""
        return sum(len(section.hunks) for section in self.files)


def _strip_path(raw: bytes, *, patch: Path, line: int) -> str:
    text = raw.split(b"\t", 1)[0].decode().strip()
    if text == "/dev/null":
        raise PatchFormatError(
            patch=patch, line=line, reason="creating or deleting files is not supported"
        )
    if text.startswith(("a/", "b/")):
        text = text[2:]
    if not text or text.startswith("/") or ".." in Path(text).parts:
        raise PatchFormatError(
            patch=patch,
            line=line,
            reason=f"{text!r} is not a path relative to the sglang package directory",
        )
    return text


def parse_patch(path: Path) -> Patch:
    """Parse the unified diff in ``path``; text before the first ``---`` is a description.

    Raises:
        PatchFormatError: the file cannot be read, holds no hunk, or a hunk's line counts
            disagree with its header.
    """
    try:
        data = path.read_bytes()
    except OSError as error:
        raise PatchFormatError(patch=path, line=0, reason=f"cannot be read: {error}") from None
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    files: list[FilePatch] = []
    index = 0
    while index < len(lines):
        if not (lines[index].startswith(b"--- ") and index + 1 < len(lines)):
            index += 1
            continue
        if not lines[index + 1].startswith(b"+++ "):
            index += 1
            continue
        target = _strip_path(lines[index + 1][4:], patch=path, line=index + 2)
        _strip_path(lines[index][4:], patch=path, line=index + 1)
        index += 2
        hunks: list[Hunk] = []
        while index < len(lines) and lines[index].startswith(b"@@"):
            hunk, index = _parse_hunk(lines, index, len(hunks) + 1, patch=path)
            hunks.append(hunk)
        if not hunks:
            raise PatchFormatError(patch=path, line=index + 1, reason=f"no hunk for {target}")
        files.append(FilePatch(path=target, hunks=tuple(hunks)))
    if not files:
        raise PatchFormatError(patch=path, line=1, reason="holds no unified diff")
    return Patch(source=path, files=tuple(files))


def _parse_hunk(lines: list[bytes], index: int, number: int, *, patch: Path) -> tuple[Hunk, int]:
    header = lines[index]
    match = _HUNK_HEADER.match(header)
    if match is None:
        raise PatchFormatError(patch=patch, line=index + 1, reason="malformed @@ header")
    old_start, new_start = int(match[1]), int(match[3])
    old_count = 1 if match[2] is None else int(match[2])
    new_count = 1 if match[4] is None else int(match[4])
    old: list[bytes] = []
    new: list[bytes] = []
    body = index + 1
    while len(old) < old_count or len(new) < new_count:
        if body >= len(lines):
            raise PatchFormatError(
                patch=patch, line=index + 1, reason="hunk ends before its line counts are met"
            )
        line = lines[body]
        kind, text = line[:1], line[1:]
        if kind == b" " or line == b"":
            old.append(text)
            new.append(text)
        elif kind == b"-":
            old.append(text)
        elif kind == b"+":
            new.append(text)
        elif kind == b"\\":
            raise PatchFormatError(
                patch=patch, line=body + 1, reason='"\\ No newline at end of file" is not supported'
            )
        else:
            raise PatchFormatError(
                patch=patch, line=body + 1, reason=f"unexpected line in a hunk: {line[:40]!r}"
            )
        body += 1
    if len(old) != old_count or len(new) != new_count or not old:
        raise PatchFormatError(
            patch=patch,
            line=index + 1,
            reason="hunk lines disagree with its header, or the hunk has no context lines",
        )
    hunk = Hunk(
        number=number,
        header=header.decode(errors="replace").strip(),
        line=index + 1,
        old_start=old_start,
        new_start=new_start,
        old_lines=tuple(old),
        new_lines=tuple(new),
    )
    return hunk, body


def load_patches(directory: Path) -> list[Patch]:
    """Parse every ``*.patch`` in ``directory``, in file-name order.

    Raises:
        PatchFormatError: the directory holds no patch, or one is malformed.
    """
    files = sorted(directory.glob("*.patch")) if directory.is_dir() else []
    if not files:
        raise PatchFormatError(
            patch=directory, line=0, reason="no *.patch files here (pass --patches-dir)"
        )
    return [parse_patch(path) for path in files]


# ---------------------------------------------------------------------------- the target


@attrs.frozen(kw_only=True)
class SGLangTree:
    """An SGLang package directory and the release found in it."""

    package_dir: Path
    """The ``sglang`` package directory (holds ``__init__.py`` and ``srt/``)."""
    version: str
    version_source: str
    """Where the version was read (a file, or ``git tag v0.5.23 at HEAD``)."""
    kind: str
    """``"installed package"``, ``"package directory"`` or ``"git checkout"``."""

    def describe(self) -> str:
        """One line: release, place and how it was found."""
        return (
            f"SGLang {self.version} at {self.package_dir} "
            f"({self.kind}; version from {self.version_source})"
        )


def _is_package(path: Path) -> bool:
    return (path / "__init__.py").is_file() and (path / "srt").is_dir()


def locate_sglang(sglang_dir: Path | None = None, *, check_version: bool = True) -> SGLangTree:
    """Find the SGLang tree to patch and read its release.

    Args:
        sglang_dir: An ``sglang`` package directory, or a git checkout of SGLang with the
            package under ``python/sglang``; ``None`` for the ``sglang`` package this
            Python imports (found without importing it).
        check_version: Refuse any release but the supported one.

    Raises:
        PatchTargetError: nothing usable at the path, the release cannot be read, or it
            is not :data:`~sglang_storage_adapters.SUPPORTED_SGLANG_VERSION`.
    """
    if sglang_dir is None:
        spec = importlib.util.find_spec("sglang")
        locations = list(spec.submodule_search_locations or []) if spec is not None else []
        if not locations:
            raise PatchTargetError(
                target=sys.executable,
                reason="this Python has no sglang package (run `make setup`, or pass "
                "--sglang-dir / SGLANG_DIR=<sglang package dir or SGLang checkout>)",
            )
        package_dir = Path(locations[0]).resolve()
        kind = "installed package"
    else:
        given = sglang_dir.expanduser().resolve()
        if _is_package(given):
            package_dir, kind = given, "package directory"
        elif _is_package(given / "python" / "sglang"):
            package_dir, kind = given / "python" / "sglang", "git checkout"
        elif _is_package(given / "sglang"):
            package_dir, kind = given / "sglang", "package directory"
        else:
            raise PatchTargetError(
                target=given,
                reason="is neither an sglang package directory (with __init__.py and srt/) "
                "nor a git checkout of SGLang (with python/sglang/)",
            )
        if _dist_info(package_dir) is not None:
            kind = "installed package"
    version, source = _read_version(package_dir)
    tree = SGLangTree(package_dir=package_dir, version=version, version_source=source, kind=kind)
    if check_version and version != SUPPORTED_SGLANG_VERSION:
        raise PatchTargetError(
            target=package_dir,
            reason=f"is SGLang {version} (read from {source}), but these patches are for "
            f"SGLang {SUPPORTED_SGLANG_VERSION}",
        )
    return tree


def _dist_info(package_dir: Path) -> Path | None:
    candidates = sorted(package_dir.parent.glob("sglang-*.dist-info"))
    return candidates[0] if len(candidates) == 1 else None


def _read_version(package_dir: Path) -> tuple[str, str]:
    for name in ("_version.py", "version.py"):
        path = package_dir / name
        if path.is_file():
            match = _VERSION_ASSIGNMENT.search(path.read_text(errors="replace"))
            if match is not None:
                return match[1], str(path)
    dist_info = _dist_info(package_dir)
    if dist_info is not None and (dist_info / "METADATA").is_file():
        for line in (dist_info / "METADATA").read_text(errors="replace").splitlines():
            if line.startswith("Version:"):
                return line.partition(":")[2].strip(), str(dist_info / "METADATA")
    pyproject = package_dir.parent / "pyproject.toml"
    if pyproject.is_file():
        try:
            project = tomllib.loads(pyproject.read_text()).get("project", {})
        except tomllib.TOMLDecodeError:
            project = {}
        if isinstance(project.get("version"), str):
            return project["version"], str(pyproject)
    tag = _git_tag_at_head(package_dir.parent.parent / ".git")
    if tag is not None:
        return tag.removeprefix("v"), f"git tag {tag} at HEAD"
    raise PatchTargetError(
        target=package_dir,
        reason="cannot tell which SGLang release this is (no _version.py, .dist-info, "
        "static version in pyproject.toml or version tag at git HEAD)",
    )


def _git_tag_at_head(git_dir: Path) -> str | None:
    """The ``v*`` tag naming the commit at ``HEAD``, read from the files (no git call)."""
    if not (git_dir / "HEAD").is_file():
        return None
    head = (git_dir / "HEAD").read_text().strip()
    refs: dict[str, str] = {}
    packed = git_dir / "packed-refs"
    if packed.is_file():
        last = ""
        for line in packed.read_text().splitlines():
            if line.startswith("^") and last:
                refs[last] = line[1:].strip()  # the commit an annotated tag points to
            elif " " in line and not line.startswith("#"):
                sha, last = line.split(" ", 1)
                refs[last] = sha
    for ref_file in (git_dir / "refs").rglob("*") if (git_dir / "refs").is_dir() else []:
        if ref_file.is_file():
            refs[ref_file.relative_to(git_dir).as_posix()] = ref_file.read_text().strip()
    commit = refs.get(head[5:].strip()) if head.startswith("ref:") else head
    tags = sorted(
        name.removeprefix("refs/tags/")
        for name, sha in refs.items()
        if name.startswith("refs/tags/v") and sha == commit
    )
    return tags[0] if tags else None


def record_mismatches(
    tree: SGLangTree, paths: Iterable[str] | None = None, *, files_in: Path | None = None
) -> list[str] | None:
    """The package files whose bytes differ from the wheel's ``.dist-info/RECORD``.

    Args:
        tree: An installed SGLang.
        paths: Files relative to the package directory; ``None`` for every hashed file.
        files_in: Read the files from this package directory (a copy of ``tree``'s)
            instead of ``tree``'s own, still checking them against ``tree``'s RECORD.

    Returns:
        The differing (or missing) files, relative to the package directory; ``None``
        when the tree has no RECORD (not an installed wheel).
    """
    dist_info = _dist_info(tree.package_dir)
    if dist_info is None or not (dist_info / "RECORD").is_file():
        return None
    prefix = tree.package_dir.name + "/"
    wanted = None if paths is None else {prefix + path for path in paths}
    mismatched: list[str] = []
    with (dist_info / "RECORD").open(newline="") as record:
        for row in csv.reader(record):
            if len(row) < 2 or not row[1].startswith("sha256=") or not row[0].startswith(prefix):
                continue
            if wanted is not None and row[0] not in wanted:
                continue
            file = (tree.package_dir if files_in is None else files_in) / row[0][len(prefix) :]
            try:
                digest = hashlib.sha256(file.read_bytes()).digest()
            except OSError:
                mismatched.append(row[0].removeprefix(prefix))
                continue
            if base64.urlsafe_b64encode(digest).rstrip(b"=").decode() != row[1][7:]:
                mismatched.append(row[0].removeprefix(prefix))
    return mismatched


def pristine_copy(
    tree: SGLangTree,
    dest: Path,
    patches: Sequence[Patch],
    paths: Iterable[str] | None = None,
) -> SGLangTree:
    """A copy of ``tree``'s package at ``dest`` as the wheel ships it, patched or not.

    The files (``paths``, relative to the package directory, or the whole package) are
    copied, ``patches`` are reverted in the copy where applied, and every copied file the
    wheel's RECORD hashes is checked against it; ``tree`` itself is only read, so this
    works whether or not ``make apply-patches`` ran.

    Raises:
        PatchTargetError: ``tree`` has no RECORD, or a copied file still differs from
            the wheel after reverting (edited by other means); the copy is left as is.
        PatchConflictError: a patch fits the copy neither way.
    """
    wanted = None if paths is None else list(paths)
    if wanted is None:
        shutil.copytree(tree.package_dir, dest, symlinks=True)
    else:
        for path in wanted:
            (dest / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(tree.package_dir / path, dest / path)
    copy = locate_sglang(dest)
    revert_patches(copy, patches)
    mismatched = record_mismatches(tree, wanted, files_in=dest)
    if mismatched is None:
        raise PatchTargetError(
            target=tree.package_dir, reason="has no .dist-info/RECORD to check a copy against"
        )
    if mismatched:
        raise PatchTargetError(
            target=dest,
            reason=f"still differs from the SGLang {tree.version} wheel (RECORD sha256) after "
            f"reverting the patches, in {', '.join(mismatched[:5])}",
        )
    return copy


# ---------------------------------------------------------------------------- applying


class PatchState(enum.Enum):
    """Whether a patch is in a tree."""

    APPLIED = "applied"
    NOT_APPLIED = "not applied"


@attrs.define
class _Failure:
    hunk: Hunk
    reason: str


class _Workspace:
    """The target's files in memory, as lists of lines without their newlines."""

    def __init__(self, tree: SGLangTree) -> None:
        self.tree = tree
        self.original: dict[str, bytes] = {}
        self.lines: dict[str, list[bytes]] = {}

    def file_lines(self, patch: Patch, section: FilePatch) -> list[bytes]:
        if section.path not in self.lines:
            path = self.tree.package_dir / section.path
            try:
                data = path.read_bytes()
            except OSError as error:
                raise PatchConflictError(
                    patch=patch.source,
                    hunk=section.hunks[0].describe(section.path),
                    target=path,
                    reason=f"the file cannot be read ({error})",
                ) from None
            self.original[section.path] = data
            self.lines[section.path] = data.split(b"\n")
        return self.lines[section.path]

    def changed(self) -> dict[Path, bytes]:
        out = {}
        for path, lines in self.lines.items():
            data = b"\n".join(lines)
            if data != self.original[path]:
                out[self.tree.package_dir / path] = data
        return out


def _find(lines: list[bytes], block: Sequence[bytes], expected: int, lowest: int) -> int | None:
    size = len(block)
    last = len(lines) - size
    first = block[0]
    for distance in range(max(expected - lowest, last - expected, 0) + 1):
        for position in (expected - distance, expected + distance):
            if (
                lowest <= position <= last
                and lines[position] == first
                and all(lines[position + i] == block[i] for i in range(1, size))
            ):
                return position
    return None


def _mismatch(lines: list[bytes], block: Sequence[bytes], expected: int) -> str:
    for i, want in enumerate(block):
        at = expected + i
        have = lines[at] if 0 <= at < len(lines) else None
        if have != want:
            found = "the file ends" if have is None else f"the file has {have.decode()!r}"
            return (
                f"its lines are not in the file; at line {at + 1} the patch expects "
                f"{want.decode()!r}, {found}"
            )
    return "its lines are not in the file where the earlier hunks left off"


def _apply_section(
    lines: list[bytes], section: FilePatch, *, reverse: bool
) -> list[bytes] | _Failure:
    """``lines`` with every hunk applied (or reverted), or the first hunk that does not fit."""
    out = list(lines)
    shift = 0
    lowest = 0
    for hunk in section.hunks:
        old, new = (hunk.new_lines, hunk.old_lines) if reverse else (hunk.old_lines, hunk.new_lines)
        start = (hunk.new_start if reverse else hunk.old_start) - 1
        expected = max(start + shift, 0)
        position = _find(out, old, expected, lowest)
        if position is None:
            return _Failure(hunk, _mismatch(out, old, expected))
        out[position : position + len(old)] = new
        shift = position - start + len(new) - len(old)
        lowest = position + len(new)
    return out


def _try(workspace: _Workspace, patch: Patch, *, reverse: bool) -> _Failure | None:
    """Apply ``patch`` to the workspace if it fits completely; else the first misfit."""
    results: dict[str, list[bytes]] = {}
    for section in patch.files:
        if section.path in results:
            current = results[section.path]
        else:
            current = workspace.file_lines(patch, section)
        result = _apply_section(current, section, reverse=reverse)
        if isinstance(result, _Failure):
            return _Failure(result.hunk, f"{section.path}: {result.reason}")
        results[section.path] = result
    workspace.lines.update(results)
    return None


def _conflict(
    workspace: _Workspace, patch: Patch, failure: _Failure, *, applying: bool
) -> PatchError:
    tree = workspace.tree
    path, _, reason = failure.reason.partition(": ")
    target = tree.package_dir / path
    if b"\n".join(workspace.lines[path]) != workspace.original[path]:
        # Line numbers are those of the file with the earlier patches applied in memory.
        reason += f" (line numbers count the lines the earlier patches add or remove in {path})"
    verb, done = ("applies", "applied") if applying else ("reverts", "reverted")
    note = (
        f"; the patch neither {verb} cleanly nor is already {done}: "
        "the file was edited, or holds a partly applied patch"
    )
    mismatched = record_mismatches(tree, [path])
    if mismatched:
        note += f" ({path} differs from the SGLang {tree.version} wheel's RECORD)"
    return PatchConflictError(
        patch=patch.source, hunk=failure.hunk.describe(path), target=target, reason=reason + note
    )


def patch_states(tree: SGLangTree, patches: Sequence[Patch]) -> list[PatchState]:
    """Whether each patch is in the tree (evaluated in order, as applying would).

    Raises:
        PatchConflictError: a patch fits neither way.
    """
    workspace = _Workspace(tree)
    states = []
    for patch in patches:
        if _try(workspace, patch, reverse=True) is None:
            # Put it back: later patches are judged on the tree as it is.
            _try(workspace, patch, reverse=False)
            states.append(PatchState.APPLIED)
            continue
        failure = _try(workspace, patch, reverse=False)
        if failure is not None:
            raise _conflict(workspace, patch, failure, applying=True)
        states.append(PatchState.NOT_APPLIED)
    return states


@attrs.frozen(kw_only=True)
class Outcome:
    """What :func:`apply_patches` or :func:`revert_patches` did."""

    changed: tuple[str, ...]
    """Patch files applied (or reverted) now."""
    unchanged: tuple[str, ...]
    """Patch files that were already applied (or already absent)."""
    files: tuple[Path, ...]
    """Target files written."""


def apply_patches(tree: SGLangTree, patches: Sequence[Patch]) -> Outcome:
    """Apply the patches not yet in the tree; all of them or none.

    Raises:
        PatchConflictError: a hunk fits neither way (nothing was written).
        PatchTargetError: a file could not be written (nothing was changed).
    """
    workspace = _Workspace(tree)
    changed, unchanged = [], []
    for patch in patches:
        if _try(workspace, patch, reverse=True) is None:
            _try(workspace, patch, reverse=False)
            unchanged.append(patch.name)
            continue
        failure = _try(workspace, patch, reverse=False)
        if failure is not None:
            raise _conflict(workspace, patch, failure, applying=True)
        changed.append(patch.name)
    files = _write(tree, workspace.changed())
    return Outcome(changed=tuple(changed), unchanged=tuple(unchanged), files=files)


def revert_patches(tree: SGLangTree, patches: Sequence[Patch]) -> Outcome:
    """Revert the patches that are in the tree, last first; all of them or none.

    Raises:
        PatchConflictError: a hunk fits neither way (nothing was written).
        PatchTargetError: a file could not be written (nothing was changed).
    """
    workspace = _Workspace(tree)
    changed, unchanged = [], []
    for patch in reversed(patches):
        if _try(workspace, patch, reverse=False) is None:
            _try(workspace, patch, reverse=True)
            unchanged.append(patch.name)
            continue
        failure = _try(workspace, patch, reverse=True)
        if failure is not None:
            raise _conflict(workspace, patch, failure, applying=False)
        changed.append(patch.name)
    files = _write(tree, workspace.changed())
    return Outcome(changed=tuple(changed), unchanged=tuple(unchanged), files=files)


def _write(tree: SGLangTree, contents: dict[Path, bytes]) -> tuple[Path, ...]:
    """Write every file, or none: all temp files first, then one rename each."""
    temps: list[tuple[Path, Path]] = []
    for path, data in contents.items():
        temp = path.with_name(f".{path.name}{_TMP_SUFFIX}")
        try:
            temp.write_bytes(data)
            temp.chmod(path.stat().st_mode & 0o7777)
        except OSError as error:
            temp.unlink(missing_ok=True)
            for written, _ in temps:
                written.unlink(missing_ok=True)
            raise PatchTargetError(
                target=tree.package_dir, reason=f"cannot write {path}: {error}"
            ) from None
        temps.append((temp, path))
    for temp, path in temps:
        temp.replace(path)
    return tuple(path for _, path in temps)


# ---------------------------------------------------------------------------- command line


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``apply``, ``revert`` or ``status``; return the exit status (0 on success)."""
    parser = argparse.ArgumentParser(
        prog="python -m sglang_storage_adapters.patching",
        description=f"Apply, revert or show sglang_storage's patches for SGLang "
        f"{SUPPORTED_SGLANG_VERSION}.",
    )
    parser.add_argument("command", choices=["apply", "revert", "status"])
    parser.add_argument(
        "--sglang-dir",
        type=Path,
        default=None,
        help="an sglang package directory, or a git checkout of SGLang (python/sglang); "
        "default: the sglang package this Python imports",
    )
    parser.add_argument(
        "--patches-dir",
        type=Path,
        default=DEFAULT_PATCHES_DIR,
        help=f"the directory of *.patch files (default: {DEFAULT_PATCHES_DIR})",
    )
    args = parser.parse_args(argv)
    out = sys.stdout
    try:
        patches = load_patches(args.patches_dir)
        tree = locate_sglang(args.sglang_dir)
        total = sum(patch.hunk_count for patch in patches)
        out.write(f"{tree.describe()}\n")
        if args.command == "status":
            for patch, state in zip(patches, patch_states(tree, patches), strict=True):
                out.write(f"  {patch.name}: {state.value}\n")
            return 0
        outcome = (apply_patches if args.command == "apply" else revert_patches)(tree, patches)
    except PatchError as error:
        sys.stderr.write(f"error: {error}\n")
        return 1
    done = "applied" if args.command == "apply" else "reverted"
    for name in outcome.changed:
        out.write(f"  {name}: {done}\n")
    for name in outcome.unchanged:
        out.write(f"  {name}: already {done if done == 'applied' else 'absent'}, skipped\n")
    if not outcome.changed:
        out.write(f"nothing to do: all {len(patches)} patches are already {done}\n")
    else:
        out.write(
            f"{done} {len(outcome.changed)} of {len(patches)} patches ({total} hunks in all); "
            f"wrote {', '.join(str(f) for f in outcome.files)}\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
