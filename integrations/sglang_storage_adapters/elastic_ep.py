"""SGLang 0.5.23's elastic-EP expert backup on sglang_storage's ``WeightBackupManager``.

With ``--enable-elastic-expert-backup`` SGLang keeps this node's slice of the routed experts
in host memory so that, after a rank fault, EPLB restores the experts no surviving peer
holds from DRAM instead of from disk (``srt/elastic_ep``): the engine process of every node
starts a holder process (``run_expert_backup_manager``), and every scheduler builds an
``ExpertBackupClient`` whose ``update_weights(weight_name_filter)`` reads the named experts
over Mooncake's TransferEngine into every local replica.

Two replacements, installed through SGLang's HookRegistry:

- :func:`run_expert_backup_manager` (function REPLACE; the engine imports it by name) -
  spawns :func:`run_holder_process`: one :class:`ExpertHolder` per node. It loads the
  node's slice through SGLang's own checkpoint loader into a
  :class:`~sglang_storage.managers.weights.WeightBackupManager` whose host copies are one
  :class:`~sglang_storage.memory.BlobPool` of the process budget (component ``weights``),
  keyed by (layer, expert, tensor); when the configured backend is shared across hosts
  (Mooncake Store) every shard is also put there. Only then does it register the pool with
  the TransferEngine and answer catalogue requests (ZMQ ROUTER on SGLang's port,
  ``SGLANG_BACKUP_PORT_BASE + 2 * node_rank``). The last node also holds the
  ``n_routed_experts % nnodes`` experts SGLang's slicing gives to no node.
- :class:`StorageExpertBackupClient` (class REPLACE of ``ExpertBackupClient``; the model
  runner imports it by name) - the same constructor (including SGLang's collective
  ``all_gather_object`` of the ranks' addresses), ``use_backup`` and
  ``update_weights(weight_name_filter=None)``. A background thread asks every node's holder
  for its catalogue and registers the expert parameters with the TransferEngine;
  ``use_backup`` turns true only after all of that succeeded (SGLang sets it before the
  registration, ``expert_backup_client.py:84-85``). ``update_weights`` maps the checkpoint
  names to SGLang's parameter views (``w13`` halves, ``w2``; every local physical replica)
  and restores them through the manager: TransferEngine reads from the holders, and from
  the shared store where a holder's read fails.

Without sglang_storage settings naming ``weights`` in ``--storage-managers``, both build
SGLang's own.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Final

import msgspec
import torch
import zmq

from sglang_storage.core import ObjectSpec
from sglang_storage.errors import (
    BackendIOError,
    BackendUnavailableError,
    ConfigError,
    OperationCancelledError,
    OperationTimeoutError,
    StateError,
    StorageError,
)
from sglang_storage.managers.runtime import BackendLease
from sglang_storage.managers.weights import (
    ExpertId,
    ExpertKey,
    PeerRead,
    RestoreState,
    WeightBackupConfig,
    WeightBackupManager,
)
from sglang_storage.memory import BlobPool, BlobPoolConfig, tensor_spec
from sglang_storage.memory.records import BLOB_ALIGNMENT
from sglang_storage.policy import LRUPolicy
from sglang_storage.storage.keys import model_fingerprint
from sglang_storage.transfer import StoragePipeline
from sglang_storage_adapters import require_supported_sglang
from sglang_storage_adapters.plugin import hook_registry
from sglang_storage_adapters.runtime import RuntimeSettings, process_runtime, runtime_settings

require_supported_sglang()

# After the version check: these modules exist with these names in 0.5.23 only.
from sglang.srt.elastic_ep import expert_backup_manager as _sglang_manager  # noqa: E402
from sglang.srt.elastic_ep.expert_backup_client import ExpertBackupClient  # noqa: E402

__all__ = [
    "CLIENT_TARGET",
    "COMPONENT",
    "MANAGER_TARGET",
    "Catalogue",
    "ExpertHolder",
    "ShardEntry",
    "StorageExpertBackupClient",
    "install",
    "node_slice",
    "run_expert_backup_manager",
    "run_holder_process",
]

log = logging.getLogger(__name__)

MANAGER_TARGET: Final = "sglang.srt.elastic_ep.expert_backup_manager.run_expert_backup_manager"
"""The function :func:`install` replaces (called once per node by the engine)."""
CLIENT_TARGET: Final = "sglang.srt.elastic_ep.expert_backup_client.ExpertBackupClient"
"""The class :func:`install` replaces (built by every scheduler's model runner)."""
COMPONENT: Final = "weights"
"""The runtime component (and ``--storage-managers`` name) of the expert backup."""

_OWNER: Final = "sglang_storage elastic-EP expert backup"
_SGLANG_RUN: Final = _sglang_manager.run_expert_backup_manager
_CATALOGUE_TIMEOUT_S: Final = 3600.0
"""How long a client waits for every holder to load its slice and answer."""
_BACKUP_TIMEOUT_S: Final = 1800.0
"""How long a holder waits for the shared store to acknowledge its shards."""
_RESTORE_TIMEOUT_S: Final = 600.0
"""How long ``update_weights`` waits for reads from the shared store."""
_NAME: Final = re.compile(r"layers\.(\d+)\.mlp\.experts\.(\d+)\.(.+)$")
_PROJECTIONS: Final[Mapping[str, tuple[str, int | None]]] = {
    # checkpoint projection -> (SGLang's fused parameter prefix, half of its rows or None)
    "gate_proj": ("experts.w13_", 0),
    "up_proj": ("experts.w13_", 1),
    "down_proj": ("experts.w2_", None),
}


# ---------------------------------------------------------------------- wire messages


class CatalogueRequest(msgspec.Struct, tag=True):
    """A client asks a holder what it holds."""


class ShardEntry(msgspec.Struct, array_like=True):
    """One checkpoint tensor a holder keeps: where its bytes are and what they are."""

    name: str
    """The checkpoint name (``model.layers.3.mlp.experts.5.gate_proj.weight``)."""
    layer: int
    expert: int
    shard: str
    """The name within the expert (``gate_proj.weight``)."""
    dtype: str
    shape: list[int]
    address: int
    """Its address in the holder's registered host memory."""
    nbytes: int


class Catalogue(msgspec.Struct, tag=True):
    """A holder's answer: its TransferEngine session and every shard it holds."""

    node_rank: int
    session_id: str
    model: str
    """The storage namespace's model fingerprint."""
    stored: bool
    """Every shard is also in the shared store."""
    entries: list[ShardEntry]


_ENCODER: Final = msgspec.msgpack.Encoder()
_REQUESTS: Final = msgspec.msgpack.Decoder(CatalogueRequest)
_CATALOGUES: Final = msgspec.msgpack.Decoder(Catalogue)


def _settings() -> RuntimeSettings | None:
    """This process's sglang_storage settings, or ``None`` (none published, or not on)."""
    from sglang.srt.runtime_context import get_server_args

    try:
        return runtime_settings(get_server_args())
    except (RuntimeError, ValueError):  # no server arguments published in this process
        return None


def _enabled(settings: RuntimeSettings | None) -> bool:
    return settings is not None and settings.enabled(COMPONENT)


def _port_base() -> int:
    from sglang.srt.environ import envs

    return int(envs.SGLANG_BACKUP_PORT_BASE.get())


def node_slice(num_experts: int, nnodes: int, node_rank: int) -> range:
    """The logical experts node ``node_rank`` holds.

    SGLang's ``E // nnodes`` each, and the remainder on the last node (SGLang's slicing
    leaves it on none).
    """
    share = num_experts // nnodes
    end = num_experts if node_rank == nnodes - 1 else share * (node_rank + 1)
    return range(share * node_rank, end)


def _fingerprint(model_config: Any) -> str:
    return model_fingerprint(
        str(model_config.model_path),
        purpose="elastic-ep expert backup",
        revision=getattr(model_config, "revision", None),
        dtype=str(model_config.dtype),
        quantization=getattr(model_config, "quantization", None),
    )


def _shared_store(settings: RuntimeSettings) -> tuple[BackendLease, StoragePipeline] | None:
    """A pipeline on the configured backend when every host sees its objects, else None."""
    runtime = process_runtime(settings, ranks_per_host=1)
    lease = runtime.backend(settings.backend, settings.backend_options)
    if not lease.backend.capabilities.shared_across_hosts:
        lease.release()
        return None
    return lease, runtime.storage_pipeline(lease)


# ---------------------------------------------------------------------- the holder


class ExpertHolder:
    """This node's slice of the routed experts in budgeted host memory, served to EP ranks.

    Args:
        settings: The sglang_storage settings (budget, backend).
        engine: SGLang's ``MooncakeTransferEngine`` of this process.
        model: The storage namespace's model fingerprint.
        node_rank: This node.
        nnodes: Nodes in the deployment.
        num_experts: Routed experts per MoE layer (``n_routed_experts``).
        weights: ``(checkpoint name, tensor)`` pairs, e.g. SGLang's loader iterator; only
            routed-expert tensors of this node's slice are kept.

    Raises:
        CapacityError: the host memory budget cannot hold the slice.
        BackendUnavailableError: the TransferEngine refused to register the memory.
    """

    def __init__(
        self,
        settings: RuntimeSettings,
        *,
        engine: Any,
        model: str,
        node_rank: int,
        nnodes: int,
        num_experts: int,
        weights: Iterable[tuple[str, torch.Tensor]],
    ) -> None:
        self._engine = engine
        self.node_rank = node_rank
        held = node_slice(num_experts, nnodes, node_rank)
        experts: dict[ExpertKey, dict[str, torch.Tensor]] = {}
        names: dict[tuple[ExpertKey, str], str] = {}
        for name, tensor in weights:
            match = _NAME.search(name)
            if match is None or int(match.group(2)) not in held:
                continue
            key = ExpertKey(int(match.group(1)), int(match.group(2)))
            experts.setdefault(key, {})[match.group(3)] = tensor
            names[(key, match.group(3))] = name
        blocks = sum(
            -(-t.numel() * t.element_size() // BLOB_ALIGNMENT)
            for shards in experts.values()
            for t in shards.values()
        )
        runtime = process_runtime(settings, ranks_per_host=1)
        self.pool = BlobPool(
            BlobPoolConfig(
                capacity=max(1, blocks) * BLOB_ALIGNMENT,
                label=f"elastic-EP expert backup (node {node_rank})",
            ),
            runtime.host_memory(COMPONENT),
        )
        store = _shared_store(settings)
        self._lease = None if store is None else store[0]
        self.manager = WeightBackupManager(
            WeightBackupConfig(model=model),
            self.pool,
            LRUPolicy(),
            None if store is None else store[1],
        )
        for key in sorted(experts):
            self.manager.backup(key, experts[key])
        self.stored = store is not None and self._await_store(len(experts))
        buffer = self.pool.buffer.tensor
        try:
            engine.register(buffer.data_ptr(), buffer.numel())
        except RuntimeError as error:  # SGLang's wrapper raises on a non-zero return
            raise BackendUnavailableError(
                backend="mooncake-transfer-engine", reason=f"registering the backup: {error}"
            ) from None
        entries = []
        for (key, shard), name in sorted(names.items(), key=lambda item: item[1]):
            view = self.manager.host_view(key, shard)
            tensor = experts[key][shard]
            assert view is not None  # every shard was just backed up
            entries.append(
                ShardEntry(
                    name=name,
                    layer=key.layer,
                    expert=key.expert,
                    shard=shard,
                    dtype=tensor_spec(tensor.dtype, tuple(tensor.shape)).dtype,
                    shape=list(tensor.shape),
                    address=view.data_ptr(),
                    nbytes=view.numel(),
                )
            )
        self.catalogue = Catalogue(
            node_rank=node_rank,
            session_id=str(engine.session_id),
            model=model,
            stored=self.stored,
            entries=entries,
        )
        log.info(
            "sglang_storage expert holder: node %d holds experts [%d, %d): %d tensors, "
            "%d bytes in the budget%s",
            node_rank,
            held.start,
            held.stop,
            len(entries),
            self.pool.stats().capacity_bytes,
            ", also in the shared store" if self.stored else "",
        )

    def _await_store(self, count: int) -> bool:
        """Whether the shared store acknowledged every expert in time."""
        deadline, acked, ok = time.monotonic() + _BACKUP_TIMEOUT_S, 0, True
        while acked < count and time.monotonic() < deadline:
            for event in self.manager.poll(timeout_s=0.5):
                acked += 1
                if not getattr(event, "ok", False):
                    ok = False
                    log.warning(
                        "sglang_storage expert holder: %s not stored: %s",
                        event.expert_id,
                        getattr(event, "error", None),
                    )
        return ok and acked == count

    def serve(self, endpoint: str, stop: Callable[[], bool]) -> None:
        """Answer catalogue requests at ``endpoint`` (a ZMQ ROUTER) until ``stop()``."""
        context = zmq.Context()
        socket = context.socket(zmq.ROUTER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.bind(endpoint)
        reply = _ENCODER.encode(self.catalogue)
        try:
            while not stop():
                if socket.poll(100):
                    identity, payload = socket.recv_multipart()
                    try:
                        _REQUESTS.decode(payload)
                    except msgspec.DecodeError:
                        log.warning("sglang_storage expert holder: ignored a bad request")
                        continue
                    socket.send_multipart([identity, reply])
        finally:
            socket.close()
            context.term()

    def close(self) -> None:
        """Deregister the memory and give the pool and the store back."""
        buffer = self.pool.buffer.tensor
        try:
            self._engine.deregister(buffer.data_ptr())
        except RuntimeError as error:
            log.warning("sglang_storage expert holder: deregistering failed: %s", error)
        if self._lease is not None:
            self._lease.release()
        self.pool.close()


def run_holder_process(server_args: Any, port_args: Any) -> None:
    """The holder process: SGLang's context and TransferEngine, then :class:`ExpertHolder`.

    Serves until SIGTERM or until its parent (the engine) is gone.
    """
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
        init_mooncake_transfer_engine,
    )
    from sglang.srt.model_loader.loader import DefaultModelLoader, get_model_loader
    from sglang.srt.model_loader.utils import set_default_torch_dtype
    from sglang.srt.runtime_context import get_disagg, get_exec, get_model, get_parallel, publish
    from sglang.srt.utils.network import get_local_ip_auto

    parent = os.getppid()
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    publish(server_args, role="expert_backup")
    settings = runtime_settings(server_args)
    if settings is None:
        raise ConfigError(owner=_OWNER, field="settings", reason="sglang_storage is not set")
    local_ip = get_local_ip_auto()
    engine = init_mooncake_transfer_engine(
        hostname=local_ip,
        gpu_id=0,
        ib_device=get_disagg().disaggregation_ib_device or get_exec().moe.mooncake_ib_device,
    )
    model_config = ModelConfig.from_server_args(server_args)
    loader = get_model_loader(LoadConfig(load_format=get_model().load_format), model_config)
    parallel = get_parallel()
    with set_default_torch_dtype(model_config.dtype):
        weights = loader._get_weights_iterator(
            DefaultModelLoader.Source.init_new(model_config, None)
        )
        holder = ExpertHolder(
            settings,
            engine=engine,
            model=_fingerprint(model_config),
            node_rank=int(parallel.node_rank),
            nnodes=int(parallel.nnodes),
            num_experts=int(model_config.hf_config.n_routed_experts),
            weights=weights,
        )
    endpoint = f"tcp://{local_ip}:{_port_base() + 2 * holder.node_rank}"
    try:
        holder.serve(endpoint, lambda: stopping.is_set() or os.getppid() != parent)
    finally:
        holder.close()


def run_expert_backup_manager(server_args: Any, port_args: Any) -> Any:
    """Start this node's expert holder: ours when ``weights`` is on, else SGLang's."""
    if not _enabled(runtime_settings(server_args)):
        return _SGLANG_RUN(server_args, port_args)
    process = multiprocessing.get_context("spawn").Process(
        target=run_holder_process,
        args=(server_args, port_args),
        name="sglang-storage-expert-holder",
    )
    process.start()
    return process


# ---------------------------------------------------------------------- the client


class _TransferEnginePeers:
    """The holders' shards, read with Mooncake TransferEngine batch reads (one per node)."""

    def __init__(self, engine: Any, catalogues: Sequence[Catalogue]) -> None:
        self._engine = engine
        self._where: dict[tuple[ExpertId, str], tuple[str, int, int]] = {
            (ExpertKey(e.layer, e.expert), e.shard): (c.session_id, e.address, e.nbytes)
            for c in catalogues
            for e in c.entries
        }

    def holds(self, expert_id: ExpertId, shard: str) -> bool:
        """Whether a holder has ``shard`` of ``expert_id``."""
        return (expert_id, shard) in self._where

    def read(self, reads: Sequence[PeerRead]) -> None:
        """Read every shard into its (contiguous, registered) destination.

        Raises:
            ConfigError: a destination is not contiguous or has another byte size.
            BackendIOError: a node's batch read failed.
        """
        batches: dict[str, tuple[list[int], list[int], list[int]]] = {}
        for read in reads:
            session, address, nbytes = self._where[(read.expert_id, read.shard)]
            into = read.into
            if not into.is_contiguous() or into.numel() * into.element_size() != nbytes:
                raise ConfigError(
                    owner=_OWNER,
                    field=f"destination of {read.expert_id} {read.shard}",
                    value=f"{into.dtype} {tuple(into.shape)}",
                    reason=f"must be contiguous and hold {nbytes} bytes",
                )
            local, remote, sizes = batches.setdefault(session, ([], [], []))
            local.append(into.data_ptr())
            remote.append(address)
            sizes.append(nbytes)
        for session, (local, remote, sizes) in batches.items():
            try:
                code = int(
                    self._engine.engine.batch_transfer_sync_read(session, local, remote, sizes)
                )
                reason = f"batch_transfer_sync_read returned {code}"
            except Exception as error:  # noqa: BLE001  # the vendor binding's own types
                code, reason = -1, f"{type(error).__name__}: {error}"
            if code != 0:
                raise BackendIOError(
                    backend="mooncake-transfer-engine",
                    operation=f"read of {len(local)} expert shards from {session}",
                    reason=reason,
                    code=code,
                )


class StorageExpertBackupClient(ExpertBackupClient):  # type: ignore[misc]  # SGLang is untyped
    """SGLang's ``ExpertBackupClient`` restoring through a ``WeightBackupManager``.

    Constructed as SGLang constructs its client; see the module docstring.

    Raises:
        ConfigError: no sglang_storage settings are published in this process.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        """This client when sglang_storage serves ``weights``, else SGLang's own."""
        if cls is StorageExpertBackupClient and not _enabled(_settings()):
            # SGLang's class through the base (HookRegistry rebinds every other name).
            original: Any = object.__new__(StorageExpertBackupClient.__bases__[0])
            original.__init__(*args, **kwargs)
            return original
        return object.__new__(cls)

    def __init__(self, *, model_config: Any, get_model: Callable[[], Any]) -> None:
        from sglang.srt.runtime_context import get_parallel
        from sglang.srt.utils.network import get_local_ip_auto

        settings = _settings()
        if settings is None:
            raise ConfigError(
                owner=_OWNER,
                field="settings",
                reason="no sglang_storage settings are published in this process",
                allowed="--storage-backend with --storage-managers including weights",
            )
        parallel = get_parallel()
        self.model_config = model_config
        self._get_model = get_model
        self.engine_num = int(parallel.nnodes)
        self.engine_rank = int(parallel.node_rank)
        self.moe_ep_size = int(parallel.moe_ep_size)
        self.moe_ep_rank = int(parallel.moe_ep_rank)
        self.error: StorageError | None = None
        """Why the backup is not in use, once the connecting thread gave up."""
        self.last_restore: dict[ExpertId, RestoreState] = {}
        """Where each expert of the last ``update_weights`` came from."""
        self._ready = threading.Event()
        self._closed = threading.Event()
        self._manager: WeightBackupManager | None = None
        self._catalogues: list[Catalogue] = []
        self._params: dict[str, torch.Tensor] = {}
        self._registered: list[int] = []
        self._store: tuple[BackendLease, StoragePipeline] | None = None
        world = int(parallel.launch_world_size)
        addresses: list[Any] = [None] * world
        torch.distributed.all_gather_object(  # SGLang's collective, kept on every rank
            addresses, get_local_ip_auto(), group=parallel.world_group.cpu_group
        )
        base = _port_base()
        self.endpoints = [
            f"tcp://{addresses[i * world // self.engine_num]}:{base + 2 * i}"
            for i in range(self.engine_num)
        ]
        self._thread = threading.Thread(
            target=self._connect, args=(settings,), name="sglang-storage-expert-backup", daemon=True
        )
        self._thread.start()

    @property
    def use_backup(self) -> bool:
        """Whether every holder answered and the destinations are registered."""
        return self._ready.is_set()

    def wait_ready(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for ``use_backup``; return it."""
        return self._ready.wait(timeout_s)

    def update_weights(self, weight_name_filter: Callable[[str], bool] | None = None) -> None:
        """Restore the backed-up expert tensors whose checkpoint names pass the filter.

        Each goes into every local physical replica; without a filter, every tensor.

        Raises:
            StateError: the backup is not in use yet (``use_backup`` is false), or an
                expert has no copy left.
            ConfigError: a checkpoint tensor has no parameter of the model to go to.
            StorageError: a read failed on every tier (its own type).
        """
        manager = self._manager
        if not self._ready.is_set() or manager is None:
            raise StateError(
                subject=f"{_OWNER}.update_weights",
                reason="the backup is not in use yet (use_backup is False)",
            )
        targets = self._targets(weight_name_filter)
        started = time.monotonic()
        self.last_restore = manager.restore_sync(targets, timeout_s=_RESTORE_TIMEOUT_S)
        log.info(
            "sglang_storage expert backup: restored %d experts in %.3f s",
            len(targets),
            time.monotonic() - started,
        )

    def close(self) -> None:
        """Stop connecting, deregister the destinations and give the store back."""
        self._closed.set()
        self._thread.join(timeout=5.0)
        self._ready.clear()
        from sglang.srt.distributed.parallel_state import get_mooncake_transfer_engine

        engine = get_mooncake_transfer_engine()
        for address in self._registered:
            try:
                engine.deregister(address)
            except RuntimeError as error:
                log.warning("sglang_storage expert backup: deregistering failed: %s", error)
        self._registered.clear()
        if self._store is not None:
            lease, pipeline = self._store
            pipeline.close(drain=False)
            lease.release()
            self._store = None

    # ------------------------------------------------------------------ internals

    def _connect(self, settings: RuntimeSettings) -> None:
        try:
            deadline = time.monotonic() + _CATALOGUE_TIMEOUT_S
            catalogues = [self._catalogue(endpoint, deadline) for endpoint in self.endpoints]
            self._manager = self._build(settings, catalogues)
            self._catalogues = catalogues
        except StorageError as error:
            self.error = error
            log.warning("sglang_storage expert backup is off on this rank: %s", error)
            return
        self._ready.set()  # only now: every holder answered, every destination registered

    def _catalogue(self, endpoint: str, deadline: float) -> Catalogue:
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        socket = context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(endpoint)
        try:
            socket.send(_ENCODER.encode(CatalogueRequest()))
            while True:
                if self._closed.is_set():
                    raise OperationCancelledError(
                        operation=f"catalogue request to {endpoint}", reason="client closed"
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    raise OperationTimeoutError(
                        operation=f"catalogue request to the expert holder at {endpoint}",
                        timeout_s=_CATALOGUE_TIMEOUT_S,
                    )
                if socket.poll(int(min(left, 0.2) * 1000)):
                    try:
                        return _CATALOGUES.decode(socket.recv())
                    except msgspec.DecodeError as error:
                        raise BackendIOError(
                            backend="expert holder",
                            operation=f"catalogue from {endpoint}",
                            reason=str(error),
                        ) from None
        finally:
            socket.close()

    def _build(
        self, settings: RuntimeSettings, catalogues: Sequence[Catalogue]
    ) -> WeightBackupManager:
        from sglang.srt.distributed.parallel_state import get_mooncake_transfer_engine

        engine = get_mooncake_transfer_engine()
        if engine is None:
            raise BackendUnavailableError(
                backend="mooncake-transfer-engine", reason="SGLang started none in this process"
            )
        params = {
            name: param.data
            for name, param in self._get_model().named_parameters()
            if ".experts.w13_" in name or ".experts.w2_" in name
        }
        for tensor in params.values():  # only the destinations, not every parameter
            try:
                engine.register(tensor.data_ptr(), tensor.numel() * tensor.element_size())
            except RuntimeError as error:
                raise BackendUnavailableError(
                    backend="mooncake-transfer-engine", reason=f"registering experts: {error}"
                ) from None
            self._registered.append(tensor.data_ptr())
        self._params = params
        if all(c.stored for c in catalogues):
            self._store = _shared_store(settings)
        manager = WeightBackupManager(
            WeightBackupConfig(model=catalogues[0].model if catalogues else "none"),
            None,
            LRUPolicy(),
            None if self._store is None else self._store[1],
            peers=_TransferEnginePeers(engine, catalogues),
        )
        specs: dict[ExpertKey, dict[str, ObjectSpec]] = {}
        for catalogue in catalogues:
            for entry in catalogue.entries:
                spec = ObjectSpec(dtype=entry.dtype, shape=tuple(entry.shape))
                specs.setdefault(ExpertKey(entry.layer, entry.expert), {})[entry.shard] = spec
        for key, shards in specs.items():
            manager.track(key, shards)
        return manager

    def _targets(
        self, weight_name_filter: Callable[[str], bool] | None
    ) -> dict[ExpertId, dict[str, list[torch.Tensor]]]:
        """Each passing checkpoint tensor's views in SGLang's parameters, per local replica."""
        from sglang.srt.eplb.expert_location import get_global_expert_location_metadata
        from sglang.srt.runtime_context import get_exec

        metadata = get_global_expert_location_metadata()
        hf_config = self.model_config.hf_config
        experts = int(hf_config.n_routed_experts) + int(get_exec().moe.ep_num_redundant_experts)
        per_rank = experts // self.moe_ep_size
        local = range(per_rank * self.moe_ep_rank, per_rank * (self.moe_ep_rank + 1))
        targets: dict[ExpertId, dict[str, list[torch.Tensor]]] = {}
        for catalogue in self._catalogues:
            for entry in catalogue.entries:
                if weight_name_filter is not None and not weight_name_filter(entry.name):
                    continue
                if entry.layer >= int(hf_config.num_hidden_layers):  # e.g. the MTP layer
                    continue
                projection = entry.shard.split(".", 1)[0]
                if projection not in _PROJECTIONS:
                    raise ConfigError(
                        owner=_OWNER,
                        field="checkpoint tensor",
                        value=entry.name,
                        reason="is no expert projection SGLang's fused MoE parameters hold",
                        allowed=", ".join(_PROJECTIONS),
                    )
                prefix, half = _PROJECTIONS[projection]
                name = entry.name.replace(f"experts.{entry.expert}.{projection}.", prefix)
                param = self._params.get(name)
                if param is None:
                    raise ConfigError(
                        owner=_OWNER,
                        field="checkpoint tensor",
                        value=entry.name,
                        reason=f"has no parameter {name!r} in the model",
                    )
                for physical in metadata.logical_to_all_physical(entry.layer, entry.expert):
                    if physical not in local:
                        continue
                    view = param[physical % per_rank]
                    if half is not None:
                        rows = view.shape[0] // 2
                        view = view.narrow(0, half * rows, rows)
                    key = ExpertKey(entry.layer, entry.expert)
                    targets.setdefault(key, {}).setdefault(entry.shard, []).append(view)
        return targets


def install(registry: Any = None) -> None:
    """Register :func:`run_expert_backup_manager` and :class:`StorageExpertBackupClient`.

    Call from the ``sglang.srt.plugins`` entry point (SGLang applies the hooks after the
    plug-ins ran). ``registry`` defaults to SGLang's ``HookRegistry``.
    """
    registry, hook_type = hook_registry(registry)
    registry.register(MANAGER_TARGET, run_expert_backup_manager, hook_type.REPLACE)
    registry.register(CLIENT_TARGET, StorageExpertBackupClient, hook_type.REPLACE)
