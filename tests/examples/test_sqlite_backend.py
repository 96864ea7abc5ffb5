"""The ``sqlite-example`` backend: registered by name, then the shared conformance suite.

The registry is process-global, so the tests register the backend only for their own
duration (:func:`sqlite_registered`). Processes the suite spawns start with a fresh
registry; they find the backend the way they would find any installed third-party backend:
through the ``sglang_storage.backends`` entry point group, here from a small
``.dist-info`` that the fixture puts on ``sys.path`` (which spawned children inherit).
"""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path

import pytest
from support.backend_conformance import BackendConformance, CorruptHow, OpenSpec

from examples.sqlite_backend import ENTRY, NAME, SqliteBackend, SqliteBackendConfig
from sglang_storage.core import ObjectKey
from sglang_storage.storage import (
    Backend,
    backend_names,
    create_backend,
    register_backend,
    registry,
)
from sglang_storage.storage.format import HEADER_SIZE

ENTRY_POINTS = f"""\
[sglang_storage.backends]
{NAME} = examples.sqlite_backend:ENTRY
"""


@pytest.fixture(scope="session")
def plugin_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding the metadata of an installed distribution that names the backend."""
    site = tmp_path_factory.mktemp("site")
    dist = site / "sqlite_example-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: sqlite-example\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(ENTRY_POINTS)
    return site


@pytest.fixture
def sqlite_registered(monkeypatch: pytest.MonkeyPatch, plugin_site: Path) -> None:
    """``sqlite-example`` is a backend name here and in processes spawned meanwhile."""
    backend_names()  # load this process's plug-ins now, before the site is on sys.path
    monkeypatch.setattr(registry, "_entries", dict(registry._entries))
    register_backend(ENTRY)
    monkeypatch.syspath_prepend(str(plugin_site))


@pytest.mark.usefixtures("sqlite_registered")
class TestSqliteBackend(BackendConformance[SqliteBackend]):
    def make_backend(self, tmp_path: Path) -> SqliteBackend:
        return SqliteBackend(SqliteBackendConfig(path=tmp_path / "store.db"))

    def reopen(self, backend: SqliteBackend, tmp_path: Path) -> SqliteBackend:
        backend.close()
        return self.make_backend(tmp_path)

    def open_spec(self, tmp_path: Path) -> OpenSpec:
        return NAME, {"path": str(tmp_path / "store.db")}

    def corrupt(self, backend: SqliteBackend, key: ObjectKey, how: CorruptHow) -> None:
        # The medium is the database file: edit the row through a connection of our own.
        where = (key.namespace.path, key.name)
        with contextlib.closing(sqlite3.connect(backend.path)) as db, db:
            [(data,)] = db.execute(
                "SELECT data FROM objects WHERE namespace = ? AND name = ?", where
            ).fetchall()
            damaged = bytearray(data)
            payload = len(damaged) - HEADER_SIZE
            if how == "flip":
                damaged[HEADER_SIZE + payload // 2] ^= 0x10
            elif how == "truncate":
                del damaged[HEADER_SIZE + payload // 2 :]
            else:
                damaged[40] ^= 0xFF  # a shape dimension: the header checksum no longer matches
            db.execute(
                "UPDATE objects SET data = ? WHERE namespace = ? AND name = ?",
                (bytes(damaged), *where),
            )


@pytest.mark.usefixtures("sqlite_registered")
def test_created_by_name(tmp_path: Path) -> None:
    backend: Backend = create_backend(NAME, {"path": str(tmp_path / "by-name.db")})
    try:
        assert isinstance(backend, SqliteBackend)
        assert backend.name == NAME
        caps = backend.capabilities
        assert caps.shared_across_processes
        assert caps.durable
        assert not caps.zero_copy
        assert not caps.shared_across_hosts
        assert not caps.bounded
    finally:
        backend.close()


def test_registration_left_no_trace() -> None:
    assert NAME not in backend_names()
