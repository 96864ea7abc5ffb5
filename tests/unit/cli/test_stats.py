"""``sglang-storage stats``: what a backend holds, as a table and as JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from support.backend_conformance import namespace, pattern, put_bytes

from sglang_storage.cli import main
from sglang_storage.core import DataKind, ObjectKey, ObjectSpec, PutOutcome, Shard
from sglang_storage.storage import Backend, FileBackend, FileBackendConfig, create_backend
from sglang_storage.storage.format import HEADER_SIZE
from sglang_storage.storage.posix import TempNames

STATS_KEYS = {"schema", "command", "backend", "options", "scanned", "contents", "backend_stats"}
CONTENTS = {
    namespace(): 3,
    namespace(shard=Shard(tp_rank=1, tp_size=2)): 2,
    namespace(kind=DataKind.EMBEDDING): 1,
    namespace(model="model-b", kind=DataKind.WEIGHT): 1,
}


def fill(backend: Backend, nbytes: int = 1000) -> list[ObjectKey]:
    keys = [ns.key(f"o{i}") for ns, count in CONTENTS.items() for i in range(count)]
    for key in keys:
        data = pattern(key, nbytes)
        assert put_bytes(backend, key, ObjectSpec.raw(nbytes), data).outcome is PutOutcome.STORED
    return keys


def stats_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, Any]:
    status = main(["stats", "--json", *argv])
    return status, json.loads(capsys.readouterr().out)


def test_help_has_examples(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["stats", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for needle in ("--backend NAME", "--dir PATH", "--json", "sglang-storage stats --dir"):
        assert needle in text, needle


def test_json_by_namespace_and_kind(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with FileBackend(FileBackendConfig(root=tmp_path)) as backend:
        keys = fill(backend)
    orphan = Path(TempNames().next(tmp_path / "tmp", "tmp"))
    orphan.write_bytes(b"torn")
    status, document = stats_json(capsys, "--dir", str(tmp_path))
    assert status == 0
    assert set(document) == STATS_KEYS
    assert (document["schema"], document["command"], document["backend"]) == (1, "stats", "file")
    assert document["scanned"] is True
    size = HEADER_SIZE + 1000
    contents = document["contents"]
    assert contents["objects"] == {"count": len(keys), "bytes": len(keys) * size}
    assert contents["namespaces"] == {
        ns.path: {"count": count, "bytes": count * size} for ns, count in CONTENTS.items()
    }
    assert contents["kinds"] == {
        "kv": {"count": 5, "bytes": 5 * size},
        "embedding": {"count": 1, "bytes": size},
        "record": {"count": 0, "bytes": 0},
        "weight": {"count": 1, "bytes": size},
    }
    assert contents["states"]["orphaned_temp"] == {"count": 1, "bytes": 4}
    backend_stats = document["backend_stats"]
    assert backend_stats["objects"] == len(keys)
    assert backend_stats["bytes"] == len(keys) * size
    assert backend_stats["capacity_bytes"] is None
    assert orphan.exists(), "stats changes nothing"


def test_human_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with FileBackend(FileBackendConfig(root=tmp_path)) as backend:
        fill(backend)
    assert main(["stats", "--dir", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"file backend at {tmp_path}"
    assert lines[1].startswith("objects: 7  (")
    assert lines[2] == "namespaces: 4"
    assert lines[3].split() == ["model-a/embedding/all", "1", "1.48", "KiB"]
    assert "by data kind:" in lines
    assert any(line.split()[:2] == ["weight", "1"] for line in lines)
    assert lines[-1].split()[:3] == ["indexed", "objects", "7,"]


def test_hf3fs_backend(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    options = {"root": str(tmp_path), "allow_non_3fs": True, "data_file_size": "1MiB"}
    backend = create_backend("hf3fs", options)
    try:
        keys = fill(backend, nbytes=3000)
    finally:
        backend.close()
    status, document = stats_json(
        capsys, "--backend", "hf3fs", "--backend-config", json.dumps(options)
    )
    assert status == 0
    assert document["contents"]["objects"]["count"] == len(keys)
    assert document["contents"]["kinds"]["weight"]["count"] == 1


def test_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["stats", "--backend-config", "nope"]) == 2
    assert "--backend-config is not valid JSON" in capsys.readouterr().err
    assert main(["stats"]) == 2
    assert "needs its root directory" in capsys.readouterr().err
    status, document = stats_json(capsys, "--dir", str(tmp_path / "missing"))
    assert status == 8
    assert "is not a directory" in document["error"]
    assert not (tmp_path / "missing").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    status, document = stats_json(capsys, "--dir", str(empty))
    assert (status, document["contents"]["objects"]["count"]) == (0, 0)
    assert list(empty.iterdir()) == [], "a read-only open creates nothing"
