"""Expert weight backup for elastic EP: expert shards on host and in storage, restored on demand.

SGLang 0.5.23's ``ExpertBackupManager`` (``srt/elastic_ep``) loads this node's experts from
disk into one host buffer in a separate process and serves them over Mooncake's transfer
engine; ``ExpertBackupClient.update_weights`` copies them back into the expert parameters
when EP ranks change. Here the same job is a composition: a
:class:`~sglang_storage.memory.BlobPool` (host copies), an optional
:class:`~sglang_storage.transfer.StoragePipeline` (durable or remote copies) and an eviction
policy over experts. Contract, one line each:

- ``backup(expert_id, {name: tensor})`` - copy an expert's named shards (any device) to host
  and queue their storage put; an :class:`ExpertBackedUp` follows from ``poll``.
- ``restore(expert_ids, into={name: tensor})`` - fill ``into[name][k]`` with expert
  ``expert_ids[k]``'s shard, per expert: RESTORED (from host, now), PENDING (from storage; an
  :class:`ExpertRestored` follows; ``into`` is untouched unless every shard arrived intact)
  or MISSING.
- ``release_host(nbytes)`` - drop host copies, least recently restored first, but only of
  experts whose storage copy is acknowledged; ``backup`` does the same to make room.
- ``poll(timeout_s)`` - finished storage work as values.
- ``track(expert_id, specs)`` - an expert backed up by another process (a peer holder's
  host memory, the shared storage tier): restorable from there.
- ``restore_to({expert: {shard: [views]}})`` - each shard's bytes into every view (one per
  replica, any dtype of the same byte size): from host, from a peer holder
  (:class:`PeerShards`, synchronous), or from storage (PENDING, as ``restore``).
- ``restore_sync(targets, timeout_s)`` - ``restore_to`` that returns once every shard is in
  place, or raises; an expert with no copy anywhere is refused before anything is copied.

Experts are identified by an ``int`` or by an :class:`ExpertKey` (MoE layer, expert);
shards by their tensor name within the expert (``"gate_proj.weight"``).

Not thread-safe: one owner thread calls every method. The manager drains its pipeline's
completions, so the pipeline must not be shared.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Mapping, Sequence
from typing import Protocol, TypeAlias

import attrs
import torch

from sglang_storage.config import instance_of, non_negative_int, require_int
from sglang_storage.core import (
    DataKind,
    EvictionPolicy,
    GetOutcome,
    GetRequest,
    GetResult,
    Namespace,
    ObjectSpec,
    PutRequest,
)
from sglang_storage.errors import (
    CapacityError,
    ConfigError,
    OperationTimeoutError,
    StateError,
    StorageError,
)
from sglang_storage.memory import BlobPool, tensor_bytes, tensor_spec
from sglang_storage.memory.records import BLOB_ALIGNMENT
from sglang_storage.transfer import Priority, StoragePipeline

__all__ = [
    "ExpertBackedUp",
    "ExpertId",
    "ExpertKey",
    "ExpertRestored",
    "PeerRead",
    "PeerShards",
    "RestoreState",
    "WeightBackupConfig",
    "WeightBackupManager",
    "WeightEvent",
    "shard_name",
]


@attrs.frozen(order=True)
class ExpertKey:
    """One routed expert of one MoE layer."""

    layer: int = attrs.field(validator=non_negative_int)
    expert: int = attrs.field(validator=non_negative_int)


ExpertId: TypeAlias = int | ExpertKey
"""How the manager names an expert: a plain id, or its (layer, expert)."""


def shard_name(expert_id: ExpertId, shard: str) -> str:
    """The object name of one shard (in the host pool and under the storage namespace)."""
    if isinstance(expert_id, ExpertKey):
        return f"layer{expert_id.layer}.expert{expert_id.expert}.{shard}"
    return f"expert{expert_id}.{shard}"


@attrs.frozen(kw_only=True, eq=False)
class PeerRead:
    """Read one shard a peer holds into ``into`` (its bytes, whatever ``into``'s dtype)."""

    expert_id: ExpertId
    shard: str
    into: torch.Tensor


class PeerShards(Protocol):
    """Shards other processes hold in their host memory, read straight into local tensors.

    - ``holds(expert_id, shard)`` - whether some peer holds that shard.
    - ``read(reads)`` - every read done when it returns; a failure raises a
      :class:`~sglang_storage.errors.StorageError` and may leave destinations partly
      written.
    """

    def holds(self, expert_id: ExpertId, shard: str) -> bool:
        """Whether a peer holds ``shard`` of ``expert_id``."""
        ...

    def read(self, reads: Sequence[PeerRead]) -> None:
        """Read every shard of ``reads`` into its destination."""
        ...


class RestoreState(enum.Enum):
    """What ``restore`` did for one expert."""

    RESTORED = "restored"
    """Copied from this process's host memory."""
    PEER = "peer"
    """Read from a peer holder's host memory (done)."""
    PENDING = "pending"
    MISSING = "missing"


@attrs.frozen(kw_only=True)
class ExpertBackedUp:
    """The storage put of an expert's shards finished; ``error`` is the first failure."""

    expert_id: ExpertId
    ok: bool
    error: StorageError | None = None


@attrs.frozen(kw_only=True)
class ExpertRestored:
    """A restore from storage finished: HIT, or the first shard's failure (``into`` untouched)."""

    expert_id: ExpertId
    outcome: GetOutcome
    error: StorageError | None = None


WeightEvent = ExpertBackedUp | ExpertRestored
"""What ``poll`` returns."""


@attrs.frozen(kw_only=True)
class WeightBackupConfig:
    """How the weight backup runs."""

    model: str = attrs.field(validator=instance_of(str))
    """The model fingerprint naming the storage namespace (one per EP layout of the weights)."""
    put_priority: Priority = attrs.field(
        default=Priority.BACKGROUND, validator=instance_of(Priority)
    )
    get_priority: Priority = attrs.field(default=Priority.URGENT, validator=instance_of(Priority))

    @property
    def namespace(self) -> Namespace:
        """Where the shards are stored."""
        return Namespace(model=self.model, kind=DataKind.WEIGHT)

    def __attrs_post_init__(self) -> None:
        try:
            Namespace(model=self.model, kind=DataKind.WEIGHT)
        except ConfigError as error:
            raise error.renamed(owner="WeightBackupConfig", field="model") from None


@attrs.define
class _Expert:
    specs: dict[str, ObjectSpec]
    host_bytes: int
    on_host: bool = True
    stored: bool = False


_name = shard_name


class WeightBackupManager:
    """Expert weight shards kept on host and optionally in storage, restored on demand.

    Args:
        config: Namespace and priorities.
        pool: Host copies of the shards; ``None`` for a manager that only restores what
            others hold (``track``), e.g. an EP rank restoring from its node's holder.
        eviction: Chooses experts whose host copies to drop (weights are bytes); it only
            ever tracks experts with an acknowledged storage copy.
        storage: The pipeline to the backend; ``None`` keeps every shard on host.
        peers: Shards other processes hold (read before storage); ``None`` for none.
    """

    def __init__(
        self,
        config: WeightBackupConfig,
        pool: BlobPool | None,
        eviction: EvictionPolicy[ExpertId],
        storage: StoragePipeline | None = None,
        *,
        peers: PeerShards | None = None,
    ) -> None:
        self._config = config
        self._pool = pool
        self._eviction = eviction
        self._storage = storage
        self._peers = peers
        self._namespace = config.namespace
        self._experts: dict[ExpertId, _Expert] = {}
        self._puts: dict[int, ExpertId] = {}  # op id -> expert
        self._gets: dict[int, tuple[ExpertId, list[tuple[torch.Tensor, torch.Tensor]]]] = {}
        self._early: list[WeightEvent] = []

    def on_host(self, expert_id: ExpertId) -> bool:
        """Whether ``expert_id``'s shards are on host."""
        expert = self._experts.get(expert_id)
        return expert is not None and expert.on_host

    def experts(self) -> list[ExpertId]:
        """Every expert backed up or tracked here."""
        return list(self._experts)

    def specs(self, expert_id: ExpertId) -> Mapping[str, ObjectSpec] | None:
        """What each shard of ``expert_id`` is, or ``None`` for an unknown expert."""
        expert = self._experts.get(expert_id)
        return None if expert is None else dict(expert.specs)

    def host_view(self, expert_id: ExpertId, shard: str) -> torch.Tensor | None:
        """The host copy of one shard as flat bytes (zero-copy; do not write), or ``None``."""
        expert = self._experts.get(expert_id)
        if expert is None or not expert.on_host or shard not in expert.specs:
            return None
        assert self._pool is not None  # only experts of this process are on host
        return self._pool.view(_name(expert_id, shard))

    def backup(self, expert_id: ExpertId, weights: Mapping[str, torch.Tensor]) -> None:
        """Copy expert ``expert_id``'s named shards to host and queue them for storage.

        Raises:
            StateError: the expert is already backed up or tracked here, or the manager
                has no host pool.
            CapacityError: no room even after dropping stored experts; nothing was kept.
            ConfigError: a bad id, shard name or tensor.
        """
        if not isinstance(expert_id, ExpertKey):
            require_int(expert_id, owner="WeightBackupManager.backup", field="expert_id")
        if expert_id in self._experts:
            raise StateError(
                subject="WeightBackupManager.backup", reason=f"expert {expert_id} is backed up"
            )
        if self._pool is None:
            raise StateError(
                subject="WeightBackupManager.backup", reason="this manager has no host pool"
            )
        pool = self._pool
        keys = {shard: self._namespace.key(_name(expert_id, shard)) for shard in weights}
        block = BLOB_ALIGNMENT
        need = sum(-(-t.numel() * t.element_size() // block) * block for t in weights.values())
        self.release_host(need - pool.stats().free_bytes)
        done: list[str] = []
        try:
            for shard, tensor in weights.items():
                pool.put(keys[shard].name, tensor)
                done.append(keys[shard].name)
        except (CapacityError, ConfigError):
            for name in done:
                pool.remove(name)
            raise
        specs = {s: tensor_spec(t.dtype, tuple(t.shape)) for s, t in weights.items()}
        self._experts[expert_id] = _Expert(specs=specs, host_bytes=need)
        if self._storage is None:
            return
        requests = [
            PutRequest(key=keys[s], spec=spec, buffers=[tensor_bytes(self._view(expert_id, s))])
            for s, spec in specs.items()
        ]
        for name in done:
            pool.pin(name)
        try:
            handle = self._storage.submit_put(requests, priority=self._config.put_priority)
        except StorageError as error:  # a full queue or a closed pipeline: host copy only
            for name in done:
                pool.unpin(name)
            self._early.append(ExpertBackedUp(expert_id=expert_id, ok=False, error=error))
            return
        self._puts[handle.op_id] = expert_id

    def track(self, expert_id: ExpertId, specs: Mapping[str, ObjectSpec]) -> None:
        """Know of an expert another process backed up (a peer holder, the storage tier).

        Raises:
            StateError: the expert is already backed up or tracked here.
            ConfigError: ``specs`` is empty.
        """
        if expert_id in self._experts:
            raise StateError(
                subject="WeightBackupManager.track", reason=f"expert {expert_id} is known"
            )
        if not specs:
            raise ConfigError(
                owner="WeightBackupManager.track", field="specs", value={}, reason="is empty"
            )
        self._experts[expert_id] = _Expert(
            specs=dict(specs), host_bytes=0, on_host=False, stored=True
        )

    def restore(
        self, expert_ids: Sequence[int], into: Mapping[str, torch.Tensor]
    ) -> list[RestoreState]:
        """Fill ``into[name][k]`` with expert ``expert_ids[k]``'s shard ``name`` (any device).

        Raises:
            ConfigError: an ``into`` tensor has no row per expert, or a row differs from a
                host shard's dtype or shape; nothing is copied or fetched.
        """
        for shard, dst in into.items():
            if dst.dim() < 1 or dst.shape[0] != len(expert_ids):
                raise ConfigError(
                    owner="WeightBackupManager.restore",
                    field=f"into[{shard!r}]",
                    value=tuple(dst.shape),
                    reason=f"must have one row per expert ({len(expert_ids)})",
                )
        rows = [{shard: dst[k] for shard, dst in into.items()} for k in range(len(expert_ids))]
        for expert_id, shards in zip(expert_ids, rows, strict=True):
            if self.on_host(expert_id):  # check every host expert before copying any
                self._check(expert_id, self._experts[expert_id], shards)
        states = []
        for expert_id, shards in zip(expert_ids, rows, strict=True):
            if self.on_host(expert_id):
                for shard, row in shards.items():
                    row.copy_(self._view(expert_id, shard))
                if expert_id in self._eviction:
                    self._eviction.access(expert_id)
                states.append(RestoreState.RESTORED)
            elif self._storage is not None:
                states.append(self._fetch(self._storage, expert_id, shards))
            else:
                states.append(RestoreState.MISSING)
        return states

    def restore_to(
        self, targets: Mapping[ExpertId, Mapping[str, Sequence[torch.Tensor]]]
    ) -> dict[ExpertId, RestoreState]:
        """Copy each shard ``targets[expert][shard]`` names into every one of its views.

        A view may have any dtype, shape and device of the shard's byte size (the bytes
        are copied as they are). Per expert: RESTORED from host, PEER from a peer holder
        (done when this returns), PENDING from storage (an :class:`ExpertRestored`
        follows; a failed peer read falls back to storage, or is reported the same way
        without one) or MISSING (neither backed up nor tracked here, or no copy left).

        Raises:
            ConfigError: a shard the expert does not have, or a view of another byte
                size; nothing is copied or fetched.
        """
        plan = self._plan(targets)
        return self._run(plan, targets)

    def restore_sync(
        self,
        targets: Mapping[ExpertId, Mapping[str, Sequence[torch.Tensor]]],
        *,
        timeout_s: float,
    ) -> dict[ExpertId, RestoreState]:
        """:meth:`restore_to`, returning once every view holds its shard.

        Events of other work that arrive meanwhile stay for the next :meth:`poll`.

        Raises:
            ConfigError: as :meth:`restore_to`.
            StateError: an expert has no copy anywhere (nothing was copied or fetched),
                or storage missed one.
            OperationTimeoutError: the storage reads did not finish in ``timeout_s``
                (the views they target may still be written later).
            StorageError: the first failed read (its own type).
        """
        plan = self._plan(targets)
        missing = sorted(str(e) for e, state in plan.items() if state is RestoreState.MISSING)
        if missing:
            raise StateError(
                subject="WeightBackupManager.restore_sync",
                reason=f"no copy of expert(s) {', '.join(missing)} on host, peers or storage",
            )
        states = self._run(plan, targets)
        waiting = {e for e, state in states.items() if state is RestoreState.PENDING}
        deadline = time.monotonic() + timeout_s
        others: list[WeightEvent] = []
        failure: StorageError | None = None
        try:
            while waiting:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise OperationTimeoutError(
                        operation=f"restore of {len(waiting)} expert(s) from storage",
                        timeout_s=timeout_s,
                    )
                for event in self.poll(min(left, 0.5)):
                    if not isinstance(event, ExpertRestored) or event.expert_id not in waiting:
                        others.append(event)
                        continue
                    waiting.discard(event.expert_id)
                    if event.outcome is not GetOutcome.HIT and failure is None:
                        failure = event.error or StateError(
                            subject="WeightBackupManager.restore_sync",
                            reason=f"expert {event.expert_id}: {event.outcome.value} in storage",
                        )
        finally:
            self._early = others + self._early
        if failure is not None:
            raise failure
        return states

    def release_host(self, nbytes: int) -> int:
        """Drop host copies of stored experts until ``nbytes`` are freed; return bytes freed."""
        if nbytes <= 0 or self._pool is None:
            return 0
        before = self._pool.stats().free_bytes
        for expert_id in self._eviction.evict(nbytes):
            self._experts[expert_id].on_host = False
            for shard in self._experts[expert_id].specs:
                self._pool.remove(_name(expert_id, shard))
        return self._pool.stats().free_bytes - before

    def poll(self, timeout_s: float = 0.0) -> list[WeightEvent]:
        """Finished storage work since the last call (waits up to ``timeout_s`` for some)."""
        events, self._early = self._early, []
        if self._storage is None:
            return events
        for handle in self._storage.completions(timeout_s if not events else 0.0):
            results = handle.partial()
            errors = [r.error for r in results if not isinstance(r, bool) and r.error is not None]
            if (expert_id := self._puts.pop(handle.op_id, None)) is not None:
                expert = self._experts[expert_id]
                if self._pool is not None:
                    for shard in expert.specs:
                        self._pool.unpin(_name(expert_id, shard))
                if not errors:
                    expert.stored = True
                    self._eviction.insert(expert_id, expert.host_bytes)
                first = errors[0] if errors else None
                events.append(ExpertBackedUp(expert_id=expert_id, ok=not errors, error=first))
            elif (get := self._gets.pop(handle.op_id, None)) is not None:
                expert_id, copies = get
                missed = [r for r in results if isinstance(r, GetResult) and not r.hit]
                if not missed:
                    for row, staging in copies:
                        row.copy_(staging)
                outcome = missed[0].outcome if missed else GetOutcome.HIT
                error = missed[0].error if missed else None
                events.append(ExpertRestored(expert_id=expert_id, outcome=outcome, error=error))
        return events

    # ------------------------------------------------------------------ internals

    def _plan(
        self, targets: Mapping[ExpertId, Mapping[str, Sequence[torch.Tensor]]]
    ) -> dict[ExpertId, RestoreState]:
        """Where each expert will come from; checks every view first."""
        plan: dict[ExpertId, RestoreState] = {}
        for expert_id, shards in targets.items():
            expert = self._experts.get(expert_id)
            if expert is None:
                plan[expert_id] = RestoreState.MISSING
                continue
            for shard, views in shards.items():
                spec = expert.specs.get(shard)
                if spec is None:
                    raise ConfigError(
                        owner="WeightBackupManager.restore_to",
                        field=f"targets[{expert_id}]",
                        value=shard,
                        reason=f"is not a shard of expert {expert_id}",
                        allowed=", ".join(sorted(expert.specs)),
                    )
                for view in views:
                    if view.numel() * view.element_size() != spec.nbytes:
                        raise ConfigError(
                            owner="WeightBackupManager.restore_to",
                            field=f"targets[{expert_id}][{shard!r}]",
                            value=f"{view.dtype} {tuple(view.shape)}",
                            reason=f"must hold the shard's {spec.nbytes} bytes ({spec})",
                        )
            if expert.on_host:
                plan[expert_id] = RestoreState.RESTORED
            elif self._peers is not None and all(self._peers.holds(expert_id, s) for s in shards):
                plan[expert_id] = RestoreState.PEER
            elif self._storage is not None and expert.stored:
                plan[expert_id] = RestoreState.PENDING
            else:
                plan[expert_id] = RestoreState.MISSING
        return plan

    def _run(
        self,
        plan: Mapping[ExpertId, RestoreState],
        targets: Mapping[ExpertId, Mapping[str, Sequence[torch.Tensor]]],
    ) -> dict[ExpertId, RestoreState]:
        states = dict(plan)
        reads: list[PeerRead] = []
        for expert_id, state in plan.items():
            shards = targets[expert_id]
            if state is RestoreState.RESTORED:
                for shard, views in shards.items():
                    source = self._view(expert_id, shard)
                    for view in views:
                        view.copy_(_as(source, view))
                if expert_id in self._eviction:
                    self._eviction.access(expert_id)
            elif state is RestoreState.PEER:
                reads += [
                    PeerRead(expert_id=expert_id, shard=s, into=v)
                    for s, vs in shards.items()
                    for v in vs
                ]
            elif state is RestoreState.PENDING:
                assert self._storage is not None
                self._fetch_views(self._storage, expert_id, shards)
        if reads:
            assert self._peers is not None
            try:
                self._peers.read(reads)
            except StorageError as error:
                for expert_id in dict.fromkeys(r.expert_id for r in reads):
                    states[expert_id] = RestoreState.PENDING
                    if self._storage is not None and self._experts[expert_id].stored:
                        self._fetch_views(self._storage, expert_id, targets[expert_id])
                    else:
                        failed = ExpertRestored(
                            expert_id=expert_id, outcome=GetOutcome.ERROR, error=error
                        )
                        self._early.append(failed)
        return states

    def _fetch_views(
        self,
        storage: StoragePipeline,
        expert_id: ExpertId,
        shards: Mapping[str, Sequence[torch.Tensor]],
    ) -> None:
        """One storage read per shard, staged, then copied into each view on success."""
        specs = self._experts[expert_id].specs
        stagings = {s: torch.empty(specs[s].nbytes, dtype=torch.uint8) for s in shards}
        copies = [(v, _as(stagings[s], v)) for s, views in shards.items() for v in views]
        self._submit_get(storage, expert_id, {s: (specs[s], stagings[s]) for s in shards}, copies)

    def _fetch(
        self, storage: StoragePipeline, expert_id: ExpertId, rows: Mapping[str, torch.Tensor]
    ) -> RestoreState:
        # Staged outside the pool: a failed or corrupt read must leave ``into`` untouched.
        copies = [(row, torch.empty(row.shape, dtype=row.dtype)) for row in rows.values()]
        shards = {
            shard: (tensor_spec(row.dtype, tuple(row.shape)), staging)
            for shard, (row, staging) in zip(rows, copies, strict=True)
        }
        self._submit_get(storage, expert_id, shards, copies)
        return RestoreState.PENDING

    def _submit_get(
        self,
        storage: StoragePipeline,
        expert_id: ExpertId,
        shards: Mapping[str, tuple[ObjectSpec, torch.Tensor]],
        copies: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> None:
        requests = [
            GetRequest(
                key=self._namespace.key(_name(expert_id, shard)),
                spec=spec,
                buffers=[tensor_bytes(staging)],
            )
            for shard, (spec, staging) in shards.items()
        ]
        try:
            handle = storage.submit_get(requests, priority=self._config.get_priority)
        except StorageError as error:
            failed = ExpertRestored(expert_id=expert_id, outcome=GetOutcome.ERROR, error=error)
            self._early.append(failed)
        else:
            self._gets[handle.op_id] = (expert_id, copies)

    def _check(
        self, expert_id: ExpertId, expert: _Expert, rows: Mapping[str, torch.Tensor]
    ) -> None:
        for shard, row in rows.items():
            spec = expert.specs.get(shard)
            if spec != tensor_spec(row.dtype, tuple(row.shape)):
                raise ConfigError(
                    owner="WeightBackupManager.restore",
                    field=f"into[{shard!r}]",
                    value=f"{row.dtype} {tuple(row.shape)}",
                    reason=f"must match expert {expert_id}'s shard: {spec}",
                )

    def _view(self, expert_id: ExpertId, shard: str) -> torch.Tensor:
        spec = self._experts[expert_id].specs[shard]
        assert self._pool is not None  # only called for shards on host
        view = self._pool.view(_name(expert_id, shard), getattr(torch, spec.dtype), spec.shape)
        assert view is not None  # only called for shards on host
        return view


def _as(source: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``source``'s bytes (contiguous) seen as a tensor of ``like``'s dtype and shape."""
    flat = source.reshape(-1).view(torch.uint8)
    return flat.view(like.dtype).view(like.shape)
