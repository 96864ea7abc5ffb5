"""A second container on the same store: liveness of writers across PID namespaces.

Two containers that mount one host directory see each other's files but not each other's
processes: a pid in a temporary file's name means nothing in the other namespace. Here a
writer (a thread of this process) is held in the middle of a real ``put``: its temporary
file is written but not yet renamed into place (the test holds it at the backend's write
seam, ``file._writev_full``, after the bytes went to disk). Meanwhile a process started
by ``unshare --pid --fork`` (a new PID namespace, where it is pid 1 and no pid of this
namespace exists) runs an fsck scan read-only and then opens the store writable, which
cleans up orphans. The live writer's temporary file must be reported ``in_progress`` and
survive, and the ``put`` must then finish ``STORED`` and read back exactly. A temporary
file named by this same live process but whose lock nobody holds (what a writer killed
mid-write leaves) is an orphan there, and is removed.

Needs ``unshare`` and root (CPU only); skipped with the reason otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Final

import pytest
from support.backend_conformance import get_bytes, namespace, pattern, put_bytes
from support.ledger import Ledger

import sglang_storage.storage.file as file_module
from sglang_storage.core import GetOutcome, ObjectSpec, PutOutcome, PutResult
from sglang_storage.storage import FileBackend, FileBackendConfig
from sglang_storage.storage.posix import TempNames

LEDGER_AREA: Final = "PID namespaces"

TESTS_DIR: Final = Path(__file__).resolve().parents[1]
KEY = namespace().key("held-mid-write")
SPEC = ObjectSpec.raw(64 * 1024)
TIMEOUT_S: Final = 60

# Runs in the new PID namespace: an fsck scan read-only, then a writable open (clean-up).
OTHER_CONTAINER: Final = """
import json, os, sys
from pathlib import Path
from sglang_storage.storage import FileBackend, FileBackendConfig

root = Path(sys.argv[1])
with FileBackend(FileBackendConfig(root=root, read_only=True)) as backend:
    states = {Path(r.location).name: r.state.value for r in backend.scan()
              if Path(r.location).parent == root / "tmp"}
FileBackend(FileBackendConfig(root=root)).close()
left = sorted(p.name for p in (root / "tmp").iterdir())
print(json.dumps({"pid": os.getpid(), "states": states, "left": left}))
"""


@pytest.fixture(scope="module")
def unshare() -> str:
    """The ``unshare`` command, once it has been seen to make a PID namespace here."""
    found = shutil.which("unshare")
    if found is None:
        pytest.skip("needs unshare (util-linux) to make a PID namespace")
    if os.geteuid() != 0:
        pytest.skip("needs root: unshare --pid makes a PID namespace only for root here")
    probe = subprocess.run(
        [found, "--pid", "--fork", "sh", "-c", "echo $$"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    if probe.returncode != 0 or probe.stdout.strip() != "1":
        pytest.skip(f"unshare --pid --fork does not work here: {probe.stderr.strip()}")
    return found


def in_other_namespace(unshare: str, root: Path) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS_DIR), *sys.path])}
    done = subprocess.run(
        [unshare, "--pid", "--fork", sys.executable, "-c", OTHER_CONTAINER, str(root)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert isinstance(seen, dict)
    assert seen["pid"] == 1, "it did not run in a PID namespace of its own"
    return seen


def temp_names(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "tmp").iterdir())


def test_a_live_writer_seen_from_another_pid_namespace_keeps_its_temporary_file(
    tmp_path: Path, ledger: Ledger, unshare: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "store"
    written, go = threading.Event(), threading.Event()
    real_write = file_module._writev_full

    def held(fd: int, views: list[memoryview]) -> None:
        real_write(fd, views)
        written.set()  # the temporary file is whole; the rename into place is next
        go.wait(TIMEOUT_S)

    monkeypatch.setattr(file_module, "_writev_full", held)
    results: list[PutResult] = []
    with FileBackend(FileBackendConfig(root=root)) as backend:
        put = threading.Thread(
            target=lambda: results.append(put_bytes(backend, KEY, SPEC, pattern(KEY, SPEC.nbytes))),
            daemon=True,
        )
        put.start()
        try:
            assert written.wait(TIMEOUT_S), "the put never reached its write"
            [live] = temp_names(root)
            # Named by this (running) process, but nobody holds its lock: a dead writer's.
            orphan = Path(TempNames().next(root / "tmp", "tmp"))
            orphan.write_bytes(b"half an object")
            ledger.fault("pid_namespace")
            ledger.fault("dead_writer")
            ledger.operation(2)
            seen = in_other_namespace(unshare, root)
        finally:
            go.set()
            put.join(TIMEOUT_S)
        assert not put.is_alive()
        assert seen["states"] == {live: "in_progress", orphan.name: "orphaned_temp"}
        left = seen["left"]
        assert isinstance(left, Sequence)
        assert list(left) == [live], "the other namespace removed a live writer's file"

        ledger.operation()
        [result] = results
        assert result.outcome is PutOutcome.STORED, result
        got_result, got = get_bytes(backend, KEY, SPEC)
        if got_result.outcome is not GetOutcome.HIT:
            ledger.lost(1)
        assert got_result.outcome is GetOutcome.HIT
        assert got == pattern(KEY, SPEC.nbytes)
    assert temp_names(root) == []
