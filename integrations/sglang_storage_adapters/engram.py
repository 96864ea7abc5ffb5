"""SGLang 0.5.23's DeepSeek-V4.1 Engram host tables on sglang_storage's memory and storage.

With ``SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE=1`` every Engram layer keeps its fp8 table
(~94 GiB each for V4.1) in host memory that GPU kernels read in place, SGLang's
``_HostTable`` (``srt/layers/engram.py``): one memfd per node shared by every TP rank
(layout ``shared``) or one anonymous shard per rank (``per_rank``), outside any budget,
and read again from the checkpoint on every start.

:class:`StorageHostTable` replaces the class (HookRegistry REPLACE; ``_init_host_table``
looks the name up as a module global at call time) with the same constructor
``(layout, nbytes, name, group)``, the attributes ``layout, nbytes, bytes, device_ptr,
dirty`` (and ``group``, ``fd``) and ``finish_load(label)``:

- memory: a :class:`~sglang_storage.memory.MappedRegion` from the process's one budget
  (component ``engram``, the ``weight`` kind); ``shared``: TP rank 0 creates the memfd and
  is charged for it, broadcasts ``(pid, fd)`` through ``group.broadcast_object`` as SGLang
  does, the other ranks attach through ``/proc`` (charged nothing) and every rank waits at
  ``group.barrier()``; ``per_rank``: anonymous, pre-faulted after SGLang's page-cache drop.
  ``MADV_HUGEPAGE`` before the first touch, registered with CUDA where it is available
  (on CPU the region says it is not registered), ``device_ptr`` as SGLang computes it.
- ``finish_load``: SGLang's barrier (``shared``), the backing report from ``/proc/self/smaps``
  (SGLang's ``MADV_COLLAPSE`` retry for ``per_rank`` under 98%), the no-huge-pages warning,
  then a background persist of the rows this rank loaded to the storage backend, in
  fixed-size chunks under a fingerprint of the model's checkpoint files, the layer, the
  geometry and the row range (:mod:`sglang_storage.managers.tables`).
- restart: an AROUND hook on ``EngramEmbedding._load_rows`` (the weight loader SGLang
  installs on the table's ``weight`` and ``scale``) restores this rank's rows from storage
  at its first call; when every chunk is present and verified, that call and the other
  one return without copying, so the table's checkpoint tensors are never touched. With
  SGLang's default loader (safetensors through ``mmap``, no prefetch) those tensors are
  views of the file's mapping, so their bytes are **not read** from disk at all; with
  ``--weight-loader-prefetch-checkpoints``, ``disable_mmap`` or another load format the
  iterator reads them before the loader sees them and only the copy into the table is
  saved. A miss or a bad chunk (any other fingerprint, an absent, corrupt or unreadable
  chunk) loads from the checkpoint exactly as SGLang does.

``EngramRowStager`` (``SGLANG_OPT_DSV41_ENGRAM_HOST_STAGING``) is not replaced: its host
buffers are per-stage ``pin_memory=True`` tensors from torch's caching allocator, sized by
the batch (tokens x (n-1) x heads x 264 B per layer), not the table; it reads the table
through ``embed.weight``/``embed.scale``, which are views of our region, so it works on
top of this adapter unchanged; and its constructor needs a CUDA stream, so nothing of a
replacement could be checked here.

Without sglang_storage settings naming ``engram`` in ``--storage-managers``, constructing
the class builds SGLang's own table, and the loader hook passes every call through.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import weakref
from typing import Any, Final

import attrs

from sglang_storage.core import DataKind
from sglang_storage.errors import ConfigError, StorageError
from sglang_storage.managers.runtime import BackendLease, StorageRuntime
from sglang_storage.managers.tables import (
    HostTableConfig,
    HostTableManager,
    PersistResult,
    RestoreResult,
    TableFingerprint,
    TableSection,
    checkpoint_files,
)
from sglang_storage.memory import (
    CudaRuntime,
    Lease,
    MappedRegion,
    MappedRegionConfig,
    MappingMode,
    SharedHandle,
)
from sglang_storage.transfer import StoragePipelineConfig
from sglang_storage_adapters import require_supported_sglang
from sglang_storage_adapters.plugin import hook_registry
from sglang_storage_adapters.runtime import RuntimeSettings, process_runtime, runtime_settings

require_supported_sglang()

# After the version check: this module exists with these names in 0.5.23 only.
from sglang.srt.layers import engram as _engram  # noqa: E402

__all__ = [
    "COMPONENT",
    "LOADER_TARGET",
    "TARGET",
    "StorageHostTable",
    "install",
    "shutdown",
    "use_cuda_runtime",
    "wait_persisted",
]

log = logging.getLogger(__name__)

TARGET: Final = "sglang.srt.layers.engram._HostTable"
"""The class :func:`install` replaces."""
LOADER_TARGET: Final = "sglang.srt.layers.engram.EngramEmbedding._load_rows"
"""The weight loader :func:`install` wraps (AROUND) to skip rows restored from storage."""
COMPONENT: Final = "engram"
"""The runtime component (and ``--storage-managers`` name) the tables draw memory as."""

_OWNER: Final = "sglang_storage Engram host table"
_LAYOUTS: Final = ("shared", "per_rank")
_HUGE_ENOUGH: Final = 0.98  # SGLang's threshold for the per-rank MADV_COLLAPSE retry
_PIPELINE: Final = StoragePipelineConfig(workers=2, batch_pages=16, queue_depth=64)
_SCALE_BLOCK: Final = int(_engram.FP8_BLOCK_SIZE)


def _settings() -> RuntimeSettings | None:
    """This process's sglang_storage settings, or ``None`` (none published, or not on)."""
    from sglang.srt.runtime_context import get_server_args

    try:
        return runtime_settings(get_server_args())
    except (RuntimeError, ValueError):  # no server arguments published in this process
        return None


@attrs.frozen
class _ComponentBudget:
    """The runtime's budget as the ``engram`` component sees it (a ``BudgetCharge``)."""

    runtime: StorageRuntime

    def acquire(self, kind: DataKind, nbytes: int, *, label: str) -> Lease:
        """Charge ``nbytes`` to the ``engram`` component (its kind is ``weight``)."""
        if kind is not DataKind.WEIGHT:
            raise ConfigError(
                owner=_OWNER, field="kind", value=kind, reason="engram tables are weights"
            )
        return self.runtime.lease(COMPONENT, nbytes, label=label)


class _Process:
    """This process's table manager and its storage, built on first use."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.manager: HostTableManager | None = None
        self.lease: BackendLease | None = None
        self.cudart: CudaRuntime | None = None

    def forget(self) -> None:
        """Drop the manager without closing it: a forked child's copy has no workers."""
        self.lock = threading.RLock()
        self.manager = None
        self.lease = None

    def get(self, settings: RuntimeSettings) -> tuple[HostTableManager, StorageRuntime]:
        runtime = process_runtime(settings)
        with self.lock:
            if self.manager is None:
                lease = runtime.backend(settings.backend, settings.backend_options)
                pipeline = runtime.storage_pipeline(lease, _PIPELINE)
                self.lease = lease
                self.manager = HostTableManager(HostTableConfig(), pipeline)
            return self.manager, runtime


_PROCESS: Final = _Process()
# SGLang spawns its processes; a forked one (tests, tools) must not use the parent's
# pipeline, whose worker threads did not survive the fork.
os.register_at_fork(after_in_child=_PROCESS.forget)


def use_cuda_runtime(cudart: CudaRuntime | None) -> None:
    """Register tables through ``cudart`` from now on (``None``: torch's, where CUDA is).

    For tests on machines without CUDA, which inject a fake.
    """
    _PROCESS.cudart = cudart


def wait_persisted(timeout_s: float | None = None) -> list[PersistResult]:
    """Wait for this process's table persists in flight; the ones that finished (logged)."""
    with _PROCESS.lock:
        manager = _PROCESS.manager
        results = [] if manager is None else manager.wait(timeout_s)
    for result in results:
        _log_persisted(result)
    return results


def shutdown() -> None:
    """Close this process's table storage (its pipeline and backend lease).

    The tables stay mapped (they belong to the layers holding them); a later table starts
    a new manager, and a new backend instance that reads the store afresh.
    """
    with _PROCESS.lock:
        manager, _PROCESS.manager = _PROCESS.manager, None
        lease, _PROCESS.lease = _PROCESS.lease, None
    if manager is not None:
        for result in manager.wait(60.0):
            _log_persisted(result)
    if lease is not None:
        lease.release()


def _log_persisted(result: PersistResult) -> None:
    if result.complete:
        log.info(
            "engram host table %s: %d chunks (%.2f GiB) in storage (%d written, %d kept) in %.1f s",
            result.table,
            result.chunks,
            result.nbytes / 2**30,
            result.stored,
            result.present,
            result.seconds,
        )
    else:
        log.warning(
            "engram host table %s: %d of %d chunks not stored (%s); the next start reads "
            "the checkpoint for it",
            result.table,
            result.failed,
            result.chunks,
            "; ".join(result.errors),
        )


@attrs.frozen
class _Rows:
    """The part of a table this rank loads: its sections and its facts."""

    sections: tuple[TableSection, ...]
    facts: tuple[tuple[str, str | int], ...]


def _rows_of(embed: Any, layout: str, name: str) -> _Rows | None:
    """This rank's weight and scale rows inside the table, or ``None`` for an empty shard."""
    dim, start, rows = int(embed.dim), int(embed.row_start), int(embed.rows)
    if rows == 0:
        return None
    table_rows = int(embed.weight.shape[0])  # every row (shared) or this shard's (per_rank)
    base = start if layout == "shared" else 0
    blocks = dim // _SCALE_BLOCK
    match = re.search(r"(\d+)$", name)
    return _Rows(
        sections=(
            TableSection(offset=base * dim, nbytes=rows * dim),
            TableSection(offset=table_rows * dim + base * blocks, nbytes=rows * blocks),
        ),
        facts=(
            ("layer", int(match.group(1)) if match else name),
            ("dim", dim),
            ("scale_block", _SCALE_BLOCK),
            ("row_start", start),
            ("row_end", start + rows),
            ("dtypes", "float8_e4m3fn+float8_e8m0fnu"),
        ),
    )


def _fingerprint(name: str, rows: _Rows) -> TableFingerprint | None:
    """What the stored copy must match: the checkpoint files of SGLang's model path."""
    from sglang.srt.runtime_context import get_model

    try:
        model_path = str(get_model().model_path)
        files = checkpoint_files(model_path)
    except (ValueError, AttributeError, ConfigError):  # no model published / not a directory
        return None
    if not files:
        return None
    return TableFingerprint(model=model_path, checkpoint=files, table=name, facts=rows.facts)


class StorageHostTable(_engram._HostTable):  # type: ignore[misc]  # SGLang is untyped
    """SGLang's ``_HostTable`` in a budgeted mapped region, persisted and restored.

    Constructed as SGLang constructs its table; see the module docstring.

    Raises:
        ConfigError: a layout other than ``shared`` or ``per_rank`` (a ``ValueError``, as
            SGLang's), or no sglang_storage settings.
        CapacityError: the host memory budget cannot hold the table.
        BackendUnavailableError: a rank cannot open rank 0's memfd (another PID namespace),
            or ``cudaHostRegister`` failed.
    """

    region: MappedRegion
    """The mapped region behind ``bytes``."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        """This table when sglang_storage serves ``engram``, else SGLang's own."""
        settings = _settings()
        if cls is StorageHostTable and (settings is None or not settings.enabled(COMPONENT)):
            # SGLang's class through the base (HookRegistry rebinds every other name).
            original: Any = object.__new__(StorageHostTable.__bases__[0])
            original.__init__(*args, **kwargs)
            return original
        return object.__new__(cls)

    def __init__(self, layout: str, nbytes: int, name: str, group: Any) -> None:
        if layout not in _LAYOUTS:
            raise ConfigError(
                owner=_OWNER,
                field="SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT",
                value=layout,
                reason="is not a host table layout",
                allowed="'shared' or 'per_rank'",
            )
        settings = _settings()
        if settings is None:
            raise ConfigError(
                owner=_OWNER,
                field="settings",
                reason="no sglang_storage settings are published in this process",
                allowed="--storage-backend with --storage-managers including engram",
            )
        self.layout = layout
        self.nbytes = int(nbytes)
        self.group = group
        self.dirty = False
        self.name = name
        self._lock = threading.Lock()
        self._rows: _Rows | None = None
        self._fingerprint: TableFingerprint | None = None
        self._restore: RestoreResult | None = None
        self._checked = False
        manager, runtime = _PROCESS.get(settings)
        self._manager = manager
        self._key = self._unique(name)
        if layout == "shared":
            self.region = self._map_shared(runtime)
        else:
            # Cached checkpoint pages make the huge-page faults fall back (SGLang's note).
            _engram._drop_page_cache_once("before pre-faulting the per-rank shard")
            self.region = manager.create(
                self._key,
                MappedRegionConfig(
                    nbytes=self.nbytes, mode=MappingMode.ANONYMOUS, label=name, prefault=True
                ),
                _ComponentBudget(runtime),
                cudart=_PROCESS.cudart,
            )
        # A table SGLang drops gives its memory back to the budget.
        weakref.finalize(self, manager.release, self._key)
        self.fd = self.region.share_handle().fd if layout == "shared" else None
        self.mm = None  # no Python mmap object: the region owns the mapping
        self.bytes = self.region.tensor
        address = self.region.address
        self.device_ptr = (
            _engram._registered_device_ptr(address) if self.region.page_locked else address
        )
        state = self.region.state()
        log.info(
            "engram host table %s: layout=%s, %.2f GiB mapped (%s), %d bytes charged here; %s",
            name,
            layout,
            self.nbytes / 2**30,
            "attached" if state.shared_from is not None else "created",
            state.charged_bytes,
            state.registration_note,
        )

    # ---------------------------------------------------------------- SGLang's contract

    def finish_load(self, label: str) -> None:
        """End the load as SGLang does, then persist this rank's rows in the background.

        SGLang's part: the barrier (``shared``), the backing report and its warning. The
        persist is skipped for rows restored from storage.
        """
        if not self.dirty:
            return
        self.dirty = False
        if self.layout == "shared":
            self.group.barrier()
        report = self.region.backing()
        if self.layout == "per_rank" and report.huge_kb < report.mapped_kb * _HUGE_ENOUGH:
            _engram.drop_checkpoint_page_cache()  # the loader's reads refilled it
            self.region.collapse()
            report = self.region.backing()
        message = f"engram host table {label}: layout={self.layout}, {report.describe()}"
        if report.huge_kb == 0:
            log.warning(
                "%s. No huge pages: expect ~10x slower lookups (one TLB miss per row)", message
            )
        else:
            log.info("%s", message)
        self._persist(label)

    # ---------------------------------------------------------------- restore / persist

    def restored_for(self, embed: Any) -> bool:
        """Whether this rank's rows were restored from storage (tried at the first call)."""
        with self._lock:
            if not self._checked:
                self._checked = True
                self._rows = _rows_of(embed, self.layout, self.name)
                if self._rows is not None:
                    self._fingerprint = _fingerprint(self.name, self._rows)
                self._restore = self._try_restore()
            return self._restore is not None and self._restore.restored

    def _try_restore(self) -> RestoreResult | None:
        if self._rows is None or self._fingerprint is None or not self._manager.has_storage:
            if self._rows is not None and self._fingerprint is None:
                log.info(
                    "engram host table %s: no checkpoint files at the model path to "
                    "fingerprint; not restored or persisted",
                    self.name,
                )
            return None
        try:
            result = self._manager.restore(self._key, self._fingerprint, self._rows.sections)
        except StorageError as error:
            log.warning("engram host table %s: restore refused (%s)", self.name, error)
            return None
        if result.restored:
            log.info(
                "engram host table %s: rows %s restored from storage (%d chunks, %.2f GiB) in "
                "%.1f s; the checkpoint's copy of them is not loaded",
                self.name,
                dict(self._rows.facts).get("row_start"),
                result.chunks,
                result.nbytes / 2**30,
                result.seconds,
            )
        else:
            log.info(
                "engram host table %s: not restored (%s); loading from the checkpoint",
                self.name,
                result.reason,
            )
        return result

    @property
    def restore_result(self) -> RestoreResult | None:
        """How this table's restore ended (``None``: not tried, or nothing to restore)."""
        return self._restore

    def _persist(self, label: str) -> None:
        for finished in self._manager.poll():
            _log_persisted(finished)
        if self._restore is not None and self._restore.restored:
            return  # the stored copy is this one
        if self._rows is None or self._fingerprint is None or not self._manager.has_storage:
            return
        try:
            chunks = self._manager.persist(self._key, self._fingerprint, self._rows.sections)
        except StorageError as error:  # a full queue, a closed pipeline: serve without it
            log.warning("engram host table %s: not persisted (%s)", label, error)
            return
        log.info("engram host table %s: persisting %d chunks in the background", label, chunks)

    # ---------------------------------------------------------------- mapping

    def _unique(self, name: str) -> str:
        key, n = name, 1
        while self._manager.region(key) is not None:  # e.g. a draft model's same layer ids
            n += 1
            key = f"{name}.{n}"
        return key

    def _map_shared(self, runtime: StorageRuntime) -> MappedRegion:
        group = self.group
        creator = int(group.rank_in_group) == 0
        region: MappedRegion | None = None
        owner = None
        if creator:
            region = self._manager.create(
                self._key,
                MappedRegionConfig(nbytes=self.nbytes, mode=MappingMode.MEMFD, label=self.name),
                _ComponentBudget(runtime),
                cudart=_PROCESS.cudart,
            )
            handle = region.share_handle()
            owner = (handle.pid, handle.fd)
        pid, fd = group.broadcast_object(owner, src=0)
        if region is None:
            region = self._manager.attach(
                self._key,
                SharedHandle(pid=int(pid), fd=int(fd), nbytes=self.nbytes),
                cudart=_PROCESS.cudart,
            )
        # Every rank holds the memfd before rank 0 continues (SGLang's barrier).
        group.barrier()
        return region


def _load_rows(original: Any, embed: Any, param: Any, loaded_weight: Any) -> Any:
    """SGLang's ``_load_rows``, skipped for a table whose rows were restored from storage."""
    table = getattr(embed, "host_table", None)
    if isinstance(table, StorageHostTable) and table.restored_for(embed):
        table.dirty = True  # loaded (from storage): finish_load runs as after a load
        return None
    return original(embed, param, loaded_weight)


def install(registry: Any = None) -> None:
    """Register :class:`StorageHostTable` as SGLang's Engram host table, and the loader hook.

    Call from the ``sglang.srt.plugins`` entry point (SGLang applies the hooks after the
    plug-ins ran). ``registry`` defaults to SGLang's ``HookRegistry``.
    """
    registry, hook_type = hook_registry(registry)
    registry.register(TARGET, StorageHostTable, hook_type.REPLACE)
    registry.register(LOADER_TARGET, _load_rows, hook_type.AROUND)
