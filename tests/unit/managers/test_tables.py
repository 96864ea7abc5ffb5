"""HostTableManager: tables persisted in chunks to a real ``file`` backend and restored
byte for byte on the next start; any other fingerprint, a missing or a corrupted chunk is
a miss that leaves the caller to load the checkpoint, never wrong bytes served as restored.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from support.faults import PipelineCloser

from sglang_storage.core import DataKind
from sglang_storage.errors import ConfigError, StateError
from sglang_storage.managers.tables import (
    CheckpointFile,
    HostTableConfig,
    HostTableManager,
    RestoreOutcome,
    TableFingerprint,
    TableSection,
    checkpoint_files,
)
from sglang_storage.memory import (
    BudgetConfig,
    HostMemoryBudget,
    MappedRegionConfig,
    MappingMode,
    MemoryFacts,
)
from sglang_storage.storage import FileBackend, FileBackendConfig
from sglang_storage.transfer import StoragePipeline, StoragePipelineConfig

MIB = 1 << 20
CHUNK = 256 << 10
TABLE = 3 * MIB + 12345  # not a multiple of the chunk: every section ends in a short chunk
SECTIONS = (
    TableSection(offset=0, nbytes=2 * MIB + 7),
    TableSection(offset=2 * MIB + 4096, nbytes=MIB),
)
WAIT_S = 30.0

_PIPELINES = PipelineCloser()
_close_pipelines = _PIPELINES.autouse_fixture()


def budget() -> HostMemoryBudget:
    facts = MemoryFacts(physical=64 << 30, available=64 << 30)
    return HostMemoryBudget(BudgetConfig(total=64 * MIB, headroom=0), facts=facts)


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    directory = tmp_path / "model"
    directory.mkdir()
    (directory / "model-00001-of-00001.safetensors").write_bytes(b"x" * 1000)
    (directory / "model.safetensors.index.json").write_text("{}")
    (directory / "README.md").write_text("not a checkpoint file")
    return directory


def fingerprint(checkpoint: Path, **facts: str | int) -> TableFingerprint:
    return TableFingerprint(
        model=str(checkpoint),
        checkpoint=checkpoint_files(checkpoint),
        table="engram-layer-3",
        facts={"layer": 3, "row_start": 0, "row_end": 100, **facts},
    )


@pytest.fixture
def store(tmp_path: Path) -> Path:
    return tmp_path / "store"


def manager(root: Path, *, storage: bool = True) -> tuple[HostTableManager, FileBackend]:
    backend = FileBackend(FileBackendConfig(root=root))
    pipeline = None
    if storage:
        pipeline = StoragePipeline(backend, StoragePipelineConfig(workers=2, batch_pages=4))
        _PIPELINES.track(pipeline)
    return HostTableManager(HostTableConfig(chunk_bytes=CHUNK), pipeline), backend


def table(m: HostTableManager, name: str = "engram-layer-3") -> np.ndarray:
    region = m.create(
        name, MappedRegionConfig(nbytes=TABLE, mode=MappingMode.ANONYMOUS, label=name), budget()
    )
    return region.tensor.numpy()


def loaded(data: np.ndarray, seed: int = 9) -> bytes:
    """Fill the sections as a checkpoint load would; return the sections' bytes."""
    rng = np.random.default_rng(seed)
    for s in SECTIONS:
        data[s.offset : s.end] = rng.integers(0, 256, s.nbytes, dtype=np.uint8)
    return sections_of(data)


def sections_of(data: np.ndarray) -> bytes:
    return b"".join(data[s.offset : s.end].tobytes() for s in SECTIONS)


def persisted(root: Path, checkpoint: Path) -> bytes:
    """A first start: load the table, persist it, wait until it is stored; its bytes."""
    m, backend = manager(root)
    data = table(m)
    expected = loaded(data)
    assert m.persist("engram-layer-3", fingerprint(checkpoint), SECTIONS) == 13  # 9 + 4 chunks
    assert m.pending() == ("engram-layer-3",)
    (result,) = m.wait(WAIT_S)
    assert result.complete
    assert (result.chunks, result.stored, result.present) == (13, 13, 0)
    assert result.nbytes == sum(s.nbytes for s in SECTIONS)
    assert m.pending() == ()
    m.close()
    backend.close()
    return expected


def test_a_persisted_table_is_restored_byte_for_byte_on_the_next_start(
    store: Path, checkpoint: Path
) -> None:
    expected = persisted(store, checkpoint)
    m, _ = manager(store)  # the next start: a new manager and a new backend on the same root
    data = table(m)
    data[:] = 0xEE  # whatever the fresh mapping held, restore must overwrite the sections
    result = m.restore("engram-layer-3", fingerprint(checkpoint), SECTIONS)
    assert result.outcome is RestoreOutcome.RESTORED
    assert result.restored
    assert (result.chunks, result.reason) == (13, "")
    assert sections_of(data) == expected
    assert (data[2 * MIB + 7 : 2 * MIB + 4096] == 0xEE).all()  # outside the sections: untouched


def test_a_second_persist_of_the_same_fingerprint_keeps_what_is_stored(
    store: Path, checkpoint: Path
) -> None:
    persisted(store, checkpoint)
    m, _ = manager(store)
    loaded(table(m))
    m.persist("engram-layer-3", fingerprint(checkpoint), SECTIONS)
    (result,) = m.wait(WAIT_S)
    assert (result.stored, result.present, result.failed) == (0, 13, 0)


@pytest.mark.parametrize(
    "change",
    ["checkpoint file", "row range", "chunk size", "format version", "section size"],
)
def test_any_other_fingerprint_is_a_miss(store: Path, checkpoint: Path, change: str) -> None:
    persisted(store, checkpoint)
    m, _ = manager(store)
    data = table(m)
    fp, sections = fingerprint(checkpoint), SECTIONS
    if change == "checkpoint file":
        (checkpoint / "model-00001-of-00001.safetensors").write_bytes(b"y" * 1001)
        fp = fingerprint(checkpoint)
    elif change == "row range":
        fp = fingerprint(checkpoint, row_end=101)
    elif change == "chunk size":
        m = HostTableManager(HostTableConfig(chunk_bytes=CHUNK * 2), m._storage)
        data = table(m)
    elif change == "format version":
        fp = TableFingerprint(
            model=fp.model,
            checkpoint=fp.checkpoint,
            table=fp.table,
            facts=fp.facts,
            format_version=2,
        )
    else:
        sections = (SECTIONS[0], TableSection(offset=SECTIONS[1].offset, nbytes=MIB - 1))
    data[:] = 0
    result = m.restore("engram-layer-3", fp, sections)
    assert result.outcome is RestoreOutcome.MISS
    assert "not stored" in result.reason
    assert not data.any()  # a miss by exists: nothing was read into the table


def test_a_corrupted_chunk_is_a_miss_and_never_restored_bytes(
    store: Path, checkpoint: Path
) -> None:
    expected = persisted(store, checkpoint)
    m, backend = manager(store)
    keys = m._keys(
        "engram-layer-3",
        fingerprint(checkpoint),
        SECTIONS,
        [(0, i, 0, 0) for i in range(9)],
    )
    path = backend.path_of(keys[4])
    raw = bytearray(path.read_bytes())
    raw[-100] ^= 0x10  # one payload bit, as a bad disk sector would
    path.write_bytes(bytes(raw))
    data = table(m)
    data[:] = 0xEE
    result = m.restore("engram-layer-3", fingerprint(checkpoint), SECTIONS)
    assert result.outcome is RestoreOutcome.MISS
    assert "1 corrupt of 13 chunks" in result.reason
    chunk = data[4 * CHUNK : 5 * CHUNK]
    # The damaged chunk delivered none of its bytes: the buffer holds one fill value.
    assert np.unique(chunk).size == 1
    assert chunk.tobytes() != expected[4 * CHUNK : 5 * CHUNK]
    assert backend.stats().corrupt == 1  # found by the read, and quarantined
    # The caller loads the checkpoint (every section byte) and persists again: the damaged
    # chunk was quarantined by the read, so it is stored afresh and the rest are kept.
    data[:] = 0
    for s, b in zip(
        SECTIONS, (expected[: SECTIONS[0].nbytes], expected[SECTIONS[0].nbytes :]), strict=True
    ):
        data[s.offset : s.end] = np.frombuffer(b, dtype=np.uint8)
    m.persist("engram-layer-3", fingerprint(checkpoint), SECTIONS)
    (again,) = m.wait(WAIT_S)
    assert (again.stored, again.present) == (1, 12)
    fresh, _ = manager(store)
    restored = table(fresh)
    assert fresh.restore("engram-layer-3", fingerprint(checkpoint), SECTIONS).restored
    assert sections_of(restored) == expected


def test_a_missing_chunk_is_a_miss(store: Path, checkpoint: Path) -> None:
    persisted(store, checkpoint)
    m, backend = manager(store)
    keys = m._keys("engram-layer-3", fingerprint(checkpoint), SECTIONS, [(1, 2, 0, 0)])
    backend.delete(keys)
    table(m)
    result = m.restore("engram-layer-3", fingerprint(checkpoint), SECTIONS)
    assert result.outcome is RestoreOutcome.MISS
    assert result.reason == "1 of 13 chunks are not stored"


def test_without_storage_there_is_nothing_to_restore_or_persist(
    store: Path, checkpoint: Path
) -> None:
    m, _ = manager(store, storage=False)
    table(m)
    assert not m.has_storage
    result = m.restore("engram-layer-3", fingerprint(checkpoint), SECTIONS)
    assert result.outcome is RestoreOutcome.NO_STORAGE
    with pytest.raises(StateError, match="no storage"):
        m.persist("engram-layer-3", fingerprint(checkpoint), SECTIONS)


def test_the_manager_owns_the_regions_and_charges_them_once(store: Path) -> None:
    m, _ = manager(store, storage=False)
    b = budget()
    region = m.create("t", MappedRegionConfig(nbytes=MIB, mode=MappingMode.MEMFD, label="t"), b)
    assert m.region("t") is region
    assert b.stats().kinds[DataKind.WEIGHT].used == MIB
    with pytest.raises(StateError, match="already open"):
        m.create("t", MappedRegionConfig(nbytes=MIB, mode=MappingMode.MEMFD, label="t"), b)
    m.close()
    assert b.stats().kinds[DataKind.WEIGHT].used == 0
    assert m.region("t") is None


def test_bad_sections_names_and_fingerprints_are_refused(store: Path, checkpoint: Path) -> None:
    m, _ = manager(store)
    table(m)
    fp = fingerprint(checkpoint)
    for sections in ((), (TableSection(offset=TABLE - 10, nbytes=11),), (SECTIONS[0], SECTIONS[0])):
        with pytest.raises(ConfigError):
            m.restore("engram-layer-3", fp, sections)
    with pytest.raises(StateError, match="no table"):
        m.restore("other", fp, SECTIONS)
    with pytest.raises(ConfigError):
        TableSection(offset=0, nbytes=0)
    with pytest.raises(ConfigError):
        TableFingerprint(model="", checkpoint=(), table="t")
    with pytest.raises(ConfigError):
        TableFingerprint(model="m", checkpoint=(), table="t", facts=(("layer", 1.5),))
    with pytest.raises(ConfigError):
        HostTableConfig(chunk_bytes=0)
    with pytest.raises(ConfigError):
        checkpoint_files(checkpoint / "missing")


def test_checkpoint_files_cover_weights_and_index_only(checkpoint: Path) -> None:
    files = checkpoint_files(checkpoint)
    assert [f.name for f in files] == [
        "model-00001-of-00001.safetensors",
        "model.safetensors.index.json",
    ]
    assert files[0] == CheckpointFile(name=files[0].name, size=1000, mtime_ns=files[0].mtime_ns)


def test_release_closes_one_table_and_returns_its_charge(store: Path) -> None:
    m, _ = manager(store, storage=False)
    b = budget()
    for name in ("a", "b"):
        m.create(name, MappedRegionConfig(nbytes=MIB, mode=MappingMode.ANONYMOUS, label=name), b)
    m.release("a")
    m.release("a")  # absent is fine
    assert m.region("a") is None
    assert m.region("b") is not None
    assert b.stats().kinds[DataKind.WEIGHT].used == MIB
