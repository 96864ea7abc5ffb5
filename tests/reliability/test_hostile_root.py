"""A store root that another local user with write access to it has tampered with.

Links planted at an object's path, at a model directory, at a namespace's data kind
directory and in place of ``tmp/``; FIFOs in place of the store marker and of an hf3fs
``class.json``; and a crafted ``class.json`` whose geometry would allocate terabytes.
Nothing outside the root may be read, written, renamed or removed, nothing may block,
and a crafted file is a typed error (fsck: exit 4), never a ``MemoryError``.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Final

import pytest
from support.backend_conformance import get_bytes, namespace, pattern, put_bytes
from support.ledger import Ledger

from sglang_storage.cli import main
from sglang_storage.core import GetOutcome, ObjectSpec, PutOutcome
from sglang_storage.errors import BackendUnavailableError
from sglang_storage.storage import FileBackend, FileBackendConfig
from sglang_storage.storage.hf3fs import Hf3fsBackend, Hf3fsBackendConfig

LEDGER_AREA: Final = "hostile store root"

NS = namespace(model="hostile-model")
KEY = NS.key("page0")
SPEC = ObjectSpec.raw(700)
_BOUND_S: Final = 5.0


def _file(root: Path) -> FileBackend:
    return FileBackend(FileBackendConfig(root=root))


def _outside(tmp_path: Path) -> FileBackend:
    """A real store outside the victim's root, holding a valid object of KEY."""
    backend = _file(tmp_path / "outside")
    assert put_bytes(backend, KEY, SPEC, pattern(KEY, 700)).outcome is PutOutcome.STORED
    return backend


def _tree(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


def test_a_link_at_an_object_path_is_never_read_through(tmp_path: Path, ledger: Ledger) -> None:
    outside = _outside(tmp_path)
    with _file(tmp_path / "store") as store:
        path = store.path_of(KEY)
        path.parent.mkdir(parents=True)
        path.symlink_to(outside.path_of(KEY))
        ledger.fault("symlink")
        ledger.operation(2)
        assert store.exists([KEY]) == [False]
        result, data = get_bytes(store, KEY, SPEC)
        assert result.outcome is not GetOutcome.HIT
        assert data != pattern(KEY, 700)
        # The link itself was moved aside, never its target.
        assert not path.is_symlink()
        assert outside.path_of(KEY).read_bytes()[-700:] == pattern(KEY, 700)
    outside.close()


def test_a_linked_model_directory_takes_no_put_outside_the_root(
    tmp_path: Path, ledger: Ledger
) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    with _file(tmp_path / "store") as store:
        (store.root / "objects" / NS.model).symlink_to(elsewhere, target_is_directory=True)
        ledger.fault("symlink")
        ledger.operation(2)
        result = put_bytes(store, KEY, SPEC, pattern(KEY, 700))
        assert result.outcome is PutOutcome.ERROR
        assert "link" in str(result.error)
        assert list(elsewhere.iterdir()) == []
        got, _ = get_bytes(store, KEY, SPEC)
        assert got.outcome is not GetOutcome.HIT


def test_clear_through_a_linked_kind_directory_leaves_its_target(
    tmp_path: Path, ledger: Ledger
) -> None:
    outside = _outside(tmp_path)
    before = _tree(outside.root)
    target = outside.root / "objects" / NS.model / NS.kind.value
    with _file(tmp_path / "store") as store:
        model_dir = store.root / "objects" / NS.model
        model_dir.mkdir(parents=True)
        (model_dir / NS.kind.value).symlink_to(target, target_is_directory=True)
        ledger.fault("symlink")
        ledger.operation(2)
        store.clear(NS)
        store.delete([KEY])
    assert _tree(outside.root) == before
    got, data = get_bytes(outside, KEY, SPEC)
    assert got.outcome is GetOutcome.HIT
    assert data == pattern(KEY, 700)
    outside.close()


def test_a_linked_tmp_directory_is_refused_and_its_target_kept(
    tmp_path: Path, ledger: Ledger
) -> None:
    root = tmp_path / "store"
    _file(root).close()
    victim = tmp_path / "victim"
    victim.mkdir()
    # Named exactly like an orphaned temporary file of ours: an open would remove it.
    planted = victim / ".sgs-999999-0123456789abcdef-0.tmp"
    planted.write_bytes(b"someone else's")
    (root / "tmp").rmdir()
    (root / "tmp").symlink_to(victim, target_is_directory=True)
    ledger.fault("symlink")
    ledger.operation()
    with pytest.raises(BackendUnavailableError, match="symbolic link"):
        _file(root)
    assert planted.read_bytes() == b"someone else's"


def _bounded(call: Callable[[], object], unblock: Path) -> object:
    """``call``'s result or exception, failing (not hanging) if it blocks past the bound.

    A call still blocked on FIFO ``unblock`` is released by opening its other end.
    """
    outcome: list[object] = []

    def run() -> None:
        try:
            outcome.append(call())
        except Exception as error:  # noqa: BLE001 - handed to the test
            outcome.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(_BOUND_S)
    if thread.is_alive():
        fd = os.open(unblock, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        thread.join(_BOUND_S)
        pytest.fail(f"blocked on the FIFO at {unblock} for more than {_BOUND_S} s")
    return outcome[0]


def test_a_fifo_as_the_store_marker_does_not_block_open_or_fsck(
    tmp_path: Path, ledger: Ledger, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "store"
    _file(root).close()
    marker = root / "sglang-storage.json"
    marker.unlink()
    os.mkfifo(marker, 0o600)
    ledger.fault("fifo")
    ledger.operation(2)
    opened = _bounded(lambda: _file(root), marker)
    assert isinstance(opened, BackendUnavailableError)
    assert "not a regular file" in str(opened)
    status = _bounded(lambda: main(["fsck", "--dir", str(root)]), marker)
    assert status == 8
    capsys.readouterr()


def _hf3fs(root: Path) -> Hf3fsBackend:
    return Hf3fsBackend(
        Hf3fsBackendConfig(
            root=root, allow_non_3fs=True, data_file_size=1 << 20, data_files=2, client="posix"
        )
    )


def _hf3fs_class(tmp_path: Path) -> tuple[Path, Path]:
    root = tmp_path / "hf3fs"
    root.mkdir()
    with _hf3fs(root) as backend:
        assert put_bytes(backend, KEY, SPEC, pattern(KEY, 700)).outcome is PutOutcome.STORED
    [class_file] = root.glob("classes/**/class.json")
    return root, class_file


def test_a_fifo_as_an_hf3fs_class_file_does_not_block(tmp_path: Path, ledger: Ledger) -> None:
    root, class_file = _hf3fs_class(tmp_path)
    class_file.unlink()
    os.mkfifo(class_file, 0o600)
    ledger.fault("fifo")
    ledger.operation(2)

    def open_and_read() -> object:
        with _hf3fs(root) as backend:
            return get_bytes(backend, KEY, SPEC)[0].outcome

    assert _bounded(open_and_read, class_file) is GetOutcome.MISS


@pytest.mark.parametrize(
    "geometry",
    [
        {"slot_size": 4096, "slots_per_file": 256, "ways": 8, "data_files": 10**12},
        {"slot_size": 4096, "slots_per_file": 2**60, "ways": 8, "data_files": 2},
    ],
    ids=["data_files", "slots_per_file"],
)
def test_a_crafted_hf3fs_class_file_is_a_typed_error_and_fsck_exit_4(
    tmp_path: Path,
    ledger: Ledger,
    capsys: pytest.CaptureFixture[str],
    geometry: dict[str, int],
) -> None:
    root, class_file = _hf3fs_class(tmp_path)
    slot_size = int(class_file.parent.name[1:])
    class_file.write_text(json.dumps({**geometry, "slot_size": slot_size}))
    ledger.fault("bad_class_file")
    ledger.operation(3)
    with _hf3fs(root) as backend:  # the class is ignored, not allocated
        assert get_bytes(backend, KEY, SPEC)[0].outcome is GetOutcome.MISS
    config = json.dumps({"root": str(root), "allow_non_3fs": True, "client": "posix"})
    assert main(["fsck", "--backend", "hf3fs", "--backend-config", config]) == 4
    assert (
        main(["fsck", "--backend", "hf3fs", "--backend-config", config, "--repair", "--yes"]) == 4
    )
    assert "slot class without a usable class.json" in capsys.readouterr().out
