"""One storage runtime per process: the parts every manager and adapter of it shares.

A process that serves several data kinds (HiCache KV, decode offload, sparse KV,
embeddings) must not build one budget, backend and namespace rule per kind: the host
memory check would not see the other pools, a backend's capacity cap would be enforced
once per instance, and two kinds writing the same pages would disagree on where they live.
:class:`StorageRuntime` holds those parts once:

- :class:`RuntimeConfig` - the host memory budget (a fixed total, or the host's share
  per rank), reservations per component, ``ranks_per_host``, the eviction policy of
  capped backends.
- ``StorageRuntime.host_memory(component)`` - a :class:`~sglang_storage.memory.HostMemory`
  for one component (``kv``, ``decode``, ``sparse``, ``embedding``, ``experts``,
  ``weights``, ``engram``, ``records``) charged to the one
  budget; it never takes what another component of the same data kind has reserved.
- ``StorageRuntime.backend(name, options)`` - a :class:`BackendLease` on the one shared
  instance per backend and options, built with the eviction policy its cap needs; the
  last lease released closes it.
- ``StorageRuntime.storage_pipeline(lease)`` - a host<->storage pipeline on a leased
  backend (one per component: a pipeline's completions belong to its owner).
- :func:`kv_page_namespace` - where a KV pool's pages live, from the model, the page
  format and the rank's coordinates; every writer and reader of KV pages derives it here.
- ``StorageRuntime.close()`` - closes the pipelines and backends still open.

Thread-safe. Starts no thread of its own (pipelines have their workers).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

import attrs

from sglang_storage.config import (
    BYTES,
    build_config,
    instance_of,
    non_negative_int,
    optional,
    positive_int,
    require_int,
)
from sglang_storage.core import DataKind, EvictionPolicy, Namespace, ObjectKey
from sglang_storage.errors import CapacityError, ConfigError, StateError
from sglang_storage.memory import (
    BudgetConfig,
    HostAllocator,
    HostBuffer,
    HostMemory,
    HostMemoryBudget,
    Lease,
    MemoryFacts,
    Pinning,
    make_allocator,
    read_memory_facts,
)
from sglang_storage.policy.eviction import EvictionConfig, make_eviction_policy
from sglang_storage.storage import Backend, backend_entry, create_backend
from sglang_storage.storage.keys import kv_namespace, model_fingerprint
from sglang_storage.transfer import StoragePipeline, StoragePipelineConfig
from sglang_storage.units import format_bytes

__all__ = [
    "COMPONENTS",
    "BackendLease",
    "RankLayout",
    "RuntimeConfig",
    "StorageRuntime",
    "kv_page_namespace",
]

COMPONENTS: Final = (
    "kv",
    "decode",
    "sparse",
    "embedding",
    "experts",
    "weights",
    "engram",
    "records",
)
"""The components that draw host memory from a runtime, each with its own reservation."""

_KINDS: Final[Mapping[str, DataKind]] = MappingProxyType(
    {
        "kv": DataKind.KV,
        "decode": DataKind.KV,
        "sparse": DataKind.KV,
        "embedding": DataKind.EMBEDDING,
        "experts": DataKind.WEIGHT,
        "weights": DataKind.WEIGHT,
        "engram": DataKind.WEIGHT,
        "records": DataKind.RECORD,
    }
)
_OWNER: Final = "StorageRuntime"
_RANKS: Final = (
    ("tp_rank", "tp_size"),
    ("pp_rank", "pp_size"),
    ("cp_rank", "cp_size"),
    ("dcp_rank", "dcp_size"),
)


@attrs.frozen(kw_only=True)
class RuntimeConfig:
    """How a process's storage runtime budgets host memory and caps its backends.

    Raises:
        ConfigError: a negative size, ``ranks_per_host`` < 1, or reservations that do not
            fit in ``host_memory``.
    """

    host_memory: int | None = attrs.field(
        default=None, metadata=BYTES, validator=optional(non_negative_int)
    )
    """Bytes of host memory this process's pools may use in all. ``None``: what the
    components ask for, up to this process's share of the host (available memory within
    the cgroup limit, less ``headroom``, split over ``ranks_per_host``)."""
    kv: int = attrs.field(default=0, metadata=BYTES, validator=non_negative_int)
    """Bytes reserved for the HiCache KV host pool."""
    decode: int = attrs.field(default=0, metadata=BYTES, validator=non_negative_int)
    """Bytes reserved for the decode offload host pool."""
    sparse: int = attrs.field(default=0, metadata=BYTES, validator=non_negative_int)
    """Bytes reserved for the sparse (HiSparse) host pool."""
    embedding: int = attrs.field(default=0, metadata=BYTES, validator=non_negative_int)
    """Bytes reserved for the embedding pools."""
    experts: int = attrs.field(default=0, metadata=BYTES, validator=non_negative_int)
    """Bytes reserved for the paged-experts host store (every routed expert's weights)."""
    weights: int = attrs.field(default=0, metadata=BYTES, validator=non_negative_int)
    """Bytes reserved for the elastic-EP expert backup (this node's slice of the experts)."""
    engram: int = attrs.field(default=0, metadata=BYTES, validator=non_negative_int)
    """Bytes reserved for the Engram host tables this process maps (a shared table counts on
    the rank that creates it)."""
    records: int = attrs.field(default=0, metadata=BYTES, validator=non_negative_int)
    """Bytes reserved for RL top-k capture: the capturers' host mirrors and the staging of
    finished requests' records on their way to storage."""
    headroom: int = attrs.field(default=2 << 30, metadata=BYTES, validator=non_negative_int)
    """Bytes that must stay available to the rest of the process and the system."""
    ranks_per_host: int = attrs.field(default=1, validator=positive_int)
    """Processes on this host that each hold a runtime like this one (TP ranks)."""
    eviction: EvictionConfig | None = attrs.field(
        default=None, validator=optional(instance_of(EvictionConfig))
    )
    """The eviction policy of a backend with a capacity cap (``None``: LRU)."""
    pinning: Pinning = attrs.field(default=Pinning.AUTO, validator=instance_of(Pinning))
    """Whether host buffers are page-locked."""

    def __attrs_post_init__(self) -> None:
        reserved = sum(self.reservations().values())
        if self.host_memory is not None and reserved > self.host_memory:
            raise ConfigError(
                owner=type(self).__name__,
                field=", ".join(COMPONENTS),
                value=f"{format_bytes(reserved)} reserved in all",
                reason=(
                    f"the reservations must fit in host_memory ({format_bytes(self.host_memory)})"
                ),
            )

    def reservations(self) -> Mapping[str, int]:
        """Reserved bytes per component."""
        return MappingProxyType({name: getattr(self, name) for name in COMPONENTS})


@attrs.frozen(kw_only=True)
class RankLayout:
    """Where one rank sits in the parallel layout, as far as KV page placement cares."""

    tp_rank: int = attrs.field(default=0, validator=non_negative_int)
    tp_size: int = attrs.field(default=1, validator=positive_int)
    pp_rank: int = attrs.field(default=0, validator=non_negative_int)
    pp_size: int = attrs.field(default=1, validator=positive_int)
    cp_rank: int = attrs.field(default=0, validator=non_negative_int)
    """The attention context-parallel rank."""
    cp_size: int = attrs.field(default=1, validator=positive_int)
    dcp_rank: int = attrs.field(default=0, validator=non_negative_int)
    """The decode context-parallel rank."""
    dcp_size: int = attrs.field(default=1, validator=positive_int)
    logical_page_size: int | None = attrs.field(default=None, validator=optional(positive_int))
    """Tokens of a logical page when ``dcp_size`` > 1 (SGLang's ``logical_page_size``)."""

    def __attrs_post_init__(self) -> None:
        for rank, size in _RANKS:
            if getattr(self, rank) >= getattr(self, size):
                raise ConfigError(
                    owner=type(self).__name__,
                    field=rank,
                    value=getattr(self, rank),
                    reason=f"must be below {size} ({getattr(self, size)})",
                )


def kv_page_namespace(
    model: str,
    *,
    pool: str,
    mla: bool,
    shared: bool,
    dtype: str,
    shape: tuple[int, ...],
    layout: str,
    page_size: int,
    ranks: RankLayout,
) -> Namespace:
    """The namespace of one KV pool's pages on the rank at ``ranks``.

    The model fingerprint covers the model, the pool, the attention kind and the page's
    element type, shape, layout and tokens (and, with decode context parallelism, the DCP
    shard, as SGLang's own suffix does), so a reader configured differently misses. The
    shard carries the TP, PP and attention-CP coordinates; a ``shared`` pool (MLA latent
    rows, the same on every TP rank) drops the TP ones.
    """
    facts: dict[str, object] = {
        "pool": pool,
        "attention": "mla" if mla else "mha",
        "dtype": dtype,
        "shape": shape,
        "layout": layout,
        "page_size": page_size,
    }
    if ranks.dcp_size > 1:
        facts.update(
            dcp_rank=ranks.dcp_rank,
            dcp_size=ranks.dcp_size,
            tp_size=ranks.tp_size,
            logical_page_size=ranks.logical_page_size,
        )
    return kv_namespace(
        model_fingerprint(model, **facts),
        mla=shared,
        tp_rank=ranks.tp_rank,
        tp_size=ranks.tp_size,
        pp_rank=ranks.pp_rank,
        pp_size=ranks.pp_size,
        cp_rank=ranks.cp_rank,
        cp_size=ranks.cp_size,
    )


@attrs.define(eq=False)
class BackendLease:
    """One user's hold on a runtime's shared backend; :meth:`release` ends it."""

    backend: Backend
    """The shared backend (do not close it: release the lease)."""
    _runtime: StorageRuntime = attrs.field(repr=False)
    _key: tuple[str, str] = attrs.field(repr=False)
    released: bool = attrs.field(default=False, init=False)

    def release(self) -> None:
        """Give the backend back; the last lease released closes it. Twice is a no-op."""
        if not self.released:
            self.released = True
            self._runtime._release_backend(self._key)


@attrs.define(eq=False)
class _Shared:
    backend: Backend
    users: int


class _ComponentMemory(HostMemory):
    """Host memory of one component: the runtime's budget, less other components' reservations."""

    def __init__(
        self,
        runtime: StorageRuntime,
        component: str,
        budget: HostMemoryBudget,
        allocator: HostAllocator,
    ) -> None:
        super().__init__(budget, allocator=allocator)
        self._runtime = runtime
        self._component = component

    def allocate(self, kind: DataKind, nbytes: int, *, label: str) -> HostBuffer:
        """Charge ``nbytes`` to the budget for this component and allocate them.

        Raises:
            ConfigError: ``nbytes`` is not an int >= 1.
            CapacityError: the budget, less what other components of ``kind`` have
                reserved and not yet used, has no room; nothing was allocated.
        """
        with self._runtime._lock:
            self._runtime._check_room(self._component, kind, nbytes, label)
            buffer = super().allocate(kind, nbytes, label=label)
            self._runtime._used[self._component] += buffer.nbytes
        return buffer

    def release(self, buffer: HostBuffer) -> None:
        """Free ``buffer`` and return its bytes to the budget."""
        with self._runtime._lock:
            super().release(buffer)
            self._runtime._used[self._component] -= buffer.nbytes


class StorageRuntime:
    """The process's host memory budget, shared backends and pipelines.

    Args:
        config: The budget and the eviction policy of capped backends.
        facts: The machine's memory; read from the system when omitted.
        allocator: The host allocator for every component (default: ``config.pinning``'s).

    Raises:
        CapacityError: ``config.host_memory`` exceeds this process's share of the host.
        ConfigError: the reservations exceed the host's share (no ``host_memory``).
    """

    def __init__(
        self,
        config: RuntimeConfig,
        *,
        facts: MemoryFacts | None = None,
        allocator: HostAllocator | None = None,
    ) -> None:
        self._config = config
        facts = facts if facts is not None else read_memory_facts()
        total = config.host_memory
        if total is None:  # the components' asks, checked against the host's share
            total = max(0, facts.usable - config.headroom) // config.ranks_per_host
        self._budget = HostMemoryBudget(
            BudgetConfig(
                total=total,
                kv=config.kv + config.decode + config.sparse,
                embedding=config.embedding,
                weight=config.experts + config.weights + config.engram,
                record=config.records,
                headroom=config.headroom,
                ranks_per_host=config.ranks_per_host,
            ),
            facts=facts,
        )
        self._allocator = allocator if allocator is not None else make_allocator(config.pinning)
        self._lock = threading.RLock()
        self._used = dict.fromkeys(COMPONENTS, 0)
        self._memories: dict[str, HostMemory] = {}
        self._backends: dict[tuple[str, str], _Shared] = {}
        self._pipelines: list[StoragePipeline] = []
        self._closed = False

    @property
    def config(self) -> RuntimeConfig:
        """What the runtime was built from."""
        return self._config

    @property
    def budget(self) -> HostMemoryBudget:
        """The one host memory budget every component draws from."""
        return self._budget

    def used(self, component: str) -> int:
        """Bytes of host memory ``component`` holds now."""
        _check_component(component)
        with self._lock:
            return self._used[component]

    def host_memory(self, component: str) -> HostMemory:
        """The host memory ``component`` allocates its pools from (one per component).

        Raises:
            ConfigError: ``component`` is not one of :data:`COMPONENTS`.
            StateError: the runtime is closed.
        """
        _check_component(component)
        with self._lock:
            self._check_open()
            memory = self._memories.get(component)
            if memory is None:
                memory = _ComponentMemory(self, component, self._budget, self._allocator)
                self._memories[component] = memory
            return memory

    def lease(self, component: str, nbytes: int, *, label: str) -> Lease:
        """Charge ``nbytes`` to ``component`` for memory its owner maps itself.

        For host memory no :class:`~sglang_storage.memory.HostMemory` allocates (a
        :class:`~sglang_storage.memory.MappedRegion`): counted in :meth:`used` and kept out
        of other components' reservations like an allocation; the lease's ``release()``
        gives the bytes back.

        Raises:
            ConfigError: ``component`` is not one of :data:`COMPONENTS`, or ``nbytes`` is
                not an int >= 0.
            CapacityError: the budget, less what other components of its kind have
                reserved and not yet used, has no room; nothing was charged.
            StateError: the runtime is closed.
        """
        _check_component(component)
        require_int(nbytes, owner=f"{_OWNER}.lease", field="nbytes")
        kind = _KINDS[component]
        with self._lock:
            self._check_open()
            self._check_room(component, kind, nbytes, label)
            inner = self._budget.acquire(kind, nbytes, label=label)
            self._used[component] += nbytes

        def give_back(lease: Lease) -> None:
            with self._lock:
                inner.release()  # a second release raises StateError here
                lease.released = True
                self._used[component] -= nbytes

        return Lease(
            kind=kind, nbytes=nbytes, label=label, borrowed=inner.borrowed, give_back=give_back
        )

    def backend(
        self, name: str, options: Mapping[str, object] | attrs.AttrsInstance | None = None
    ) -> BackendLease:
        """A lease on the one instance of backend ``name`` with ``options`` in this process.

        The first lease builds it, with an eviction policy (``config.eviction``, LRU when
        unset) when its options set ``capacity_bytes``; equal options share the instance,
        so one cap holds across every component writing to it.

        Raises:
            ConfigError: unknown backend, unknown or invalid options.
            BackendUnavailableError: the backend cannot start.
            StateError: the runtime is closed.
        """
        entry = backend_entry(name)
        if options is None or isinstance(options, Mapping):
            config = build_config(entry.config_type, options or {}, owner=f"{name} backend options")
        else:
            config = options
        key = (name, repr(config))
        with self._lock:
            self._check_open()
            shared = self._backends.get(key)
            if shared is None:
                eviction: EvictionPolicy[ObjectKey] | None = None
                if getattr(config, "capacity_bytes", None) is not None:
                    eviction = make_eviction_policy(self._config.eviction or EvictionConfig())
                backend = create_backend(name, config, eviction=eviction)
                shared = _Shared(backend=backend, users=0)
                self._backends[key] = shared
            shared.users += 1
            return BackendLease(backend=shared.backend, runtime=self, key=key)

    def storage_pipeline(
        self, lease: BackendLease, config: StoragePipelineConfig | None = None
    ) -> StoragePipeline:
        """A new host<->storage pipeline on ``lease``'s backend.

        Its owner closes it; :meth:`close` closes what is still open.

        Raises:
            StateError: the lease was released or the runtime is closed.
        """
        with self._lock:
            self._check_open()
            if lease.released:
                raise StateError(
                    subject=f"{_OWNER}.storage_pipeline", reason="the lease was released"
                )
            pipeline = StoragePipeline(lease.backend, config)
            self._pipelines = [p for p in self._pipelines if not p.closed]
            self._pipelines.append(pipeline)
            return pipeline

    def open_backends(self) -> int:
        """How many shared backends are open."""
        with self._lock:
            return len(self._backends)

    def close(self) -> None:
        """Close every pipeline and backend still open; later requests are refused.

        Host memory stays with the pools that hold it. Closing twice is a no-op.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pipelines, self._pipelines = self._pipelines, []
            backends, self._backends = list(self._backends.values()), {}
        for pipeline in pipelines:
            if not pipeline.closed:
                pipeline.close()
        for shared in backends:
            shared.backend.close()

    # ------------------------------------------------------------------ internals

    def _release_backend(self, key: tuple[str, str]) -> None:
        with self._lock:
            shared = self._backends.get(key)
            if shared is None:
                return  # closed with the runtime
            shared.users -= 1
            if shared.users > 0:
                return
            del self._backends[key]
        shared.backend.close()

    def _check_open(self) -> None:
        if self._closed:
            raise StateError(subject=_OWNER, reason="the storage runtime is closed")

    def _check_room(self, component: str, kind: DataKind, nbytes: int, label: str) -> None:
        """Refuse what would eat into another component's unused reservation (lock held)."""
        reservations = self._config.reservations()
        promised = sum(
            max(0, reservations[other] - self._used[other])
            for other in COMPONENTS
            if other != component and _KINDS[other] is kind
        )
        if promised == 0:
            return  # the budget's own check is the whole check
        room = self._budget.available(kind) - promised
        if nbytes > room:
            raise CapacityError(
                resource=f"host memory budget for {component} ({label})",
                requested=nbytes,
                available=max(0, room),
                hint=(
                    f"{format_bytes(promised)} of the {kind.value} budget is reserved for "
                    "other components; raise the budget or lower their reservations"
                ),
            )


def _check_component(component: str) -> None:
    if component not in COMPONENTS:
        raise ConfigError(
            owner=_OWNER,
            field="component",
            value=component,
            reason="is not a component with host memory",
            allowed=", ".join(COMPONENTS),
        )
