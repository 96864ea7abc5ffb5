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

Not thread-safe: one owner thread calls every method. The manager drains its pipeline's
completions, so the pipeline must not be shared.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence

import attrs
import torch

from sglang_storage.config import instance_of, require_int
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
from sglang_storage.errors import CapacityError, ConfigError, StateError, StorageError
from sglang_storage.memory import BlobPool, tensor_bytes, tensor_spec
from sglang_storage.memory.records import BLOB_ALIGNMENT
from sglang_storage.transfer import Priority, StoragePipeline

__all__ = [
    "ExpertBackedUp",
    "ExpertRestored",
    "RestoreState",
    "WeightBackupConfig",
    "WeightBackupManager",
    "WeightEvent",
]


class RestoreState(enum.Enum):
    """What ``restore`` did for one expert."""

    RESTORED = "restored"
    PENDING = "pending"
    MISSING = "missing"


@attrs.frozen(kw_only=True)
class ExpertBackedUp:
    """The storage put of an expert's shards finished; ``error`` is the first failure."""

    expert_id: int
    ok: bool
    error: StorageError | None = None


@attrs.frozen(kw_only=True)
class ExpertRestored:
    """A restore from storage finished: HIT, or the first shard's failure (``into`` untouched)."""

    expert_id: int
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


def _name(expert_id: int, shard: str) -> str:
    return f"expert{expert_id}.{shard}"


class WeightBackupManager:
    """Expert weight shards kept on host and optionally in storage, restored on demand.

    Args:
        config: Namespace and priorities.
        pool: Host copies of the shards.
        eviction: Chooses experts whose host copies to drop (weights are bytes); it only
            ever tracks experts with an acknowledged storage copy.
        storage: The pipeline to the backend; ``None`` keeps every shard on host.
    """

    def __init__(
        self,
        config: WeightBackupConfig,
        pool: BlobPool,
        eviction: EvictionPolicy[int],
        storage: StoragePipeline | None = None,
    ) -> None:
        self._config = config
        self._pool = pool
        self._eviction = eviction
        self._storage = storage
        self._namespace = config.namespace
        self._experts: dict[int, _Expert] = {}
        self._puts: dict[int, int] = {}  # op id -> expert
        self._gets: dict[int, tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]] = {}
        self._early: list[WeightEvent] = []

    def on_host(self, expert_id: int) -> bool:
        """Whether ``expert_id``'s shards are on host."""
        expert = self._experts.get(expert_id)
        return expert is not None and expert.on_host

    def backup(self, expert_id: int, weights: Mapping[str, torch.Tensor]) -> None:
        """Copy expert ``expert_id``'s named shards to host and queue them for storage.

        Raises:
            StateError: the expert is already backed up here.
            CapacityError: no room even after dropping stored experts; nothing was kept.
            ConfigError: a bad id, shard name or tensor.
        """
        require_int(expert_id, owner="WeightBackupManager.backup", field="expert_id")
        if expert_id in self._experts:
            raise StateError(
                subject="WeightBackupManager.backup", reason=f"expert {expert_id} is backed up"
            )
        keys = {shard: self._namespace.key(_name(expert_id, shard)) for shard in weights}
        block = BLOB_ALIGNMENT
        need = sum(-(-t.numel() * t.element_size() // block) * block for t in weights.values())
        self.release_host(need - self._pool.stats().free_bytes)
        done: list[str] = []
        try:
            for shard, tensor in weights.items():
                self._pool.put(keys[shard].name, tensor)
                done.append(keys[shard].name)
        except (CapacityError, ConfigError):
            for name in done:
                self._pool.remove(name)
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
            self._pool.pin(name)
        try:
            handle = self._storage.submit_put(requests, priority=self._config.put_priority)
        except StorageError as error:  # a full queue or a closed pipeline: host copy only
            for name in done:
                self._pool.unpin(name)
            self._early.append(ExpertBackedUp(expert_id=expert_id, ok=False, error=error))
            return
        self._puts[handle.op_id] = expert_id

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

    def release_host(self, nbytes: int) -> int:
        """Drop host copies of stored experts until ``nbytes`` are freed; return bytes freed."""
        if nbytes <= 0:
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
        for handle in self._storage.completions(timeout_s):
            results = handle.partial()
            errors = [r.error for r in results if not isinstance(r, bool) and r.error is not None]
            if (expert_id := self._puts.pop(handle.op_id, None)) is not None:
                expert = self._experts[expert_id]
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

    def _fetch(
        self, storage: StoragePipeline, expert_id: int, rows: Mapping[str, torch.Tensor]
    ) -> RestoreState:
        # Staged outside the pool: a failed or corrupt read must leave ``into`` untouched.
        copies = [(row, torch.empty(row.shape, dtype=row.dtype)) for row in rows.values()]
        requests = [
            GetRequest(
                key=self._namespace.key(_name(expert_id, shard)),
                spec=tensor_spec(row.dtype, tuple(row.shape)),
                buffers=[tensor_bytes(staging)],
            )
            for shard, (row, staging) in zip(rows, copies, strict=True)
        ]
        try:
            handle = storage.submit_get(requests, priority=self._config.get_priority)
        except StorageError as error:
            failed = ExpertRestored(expert_id=expert_id, outcome=GetOutcome.ERROR, error=error)
            self._early.append(failed)
        else:
            self._gets[handle.op_id] = (expert_id, copies)
        return RestoreState.PENDING

    def _check(self, expert_id: int, expert: _Expert, rows: Mapping[str, torch.Tensor]) -> None:
        for shard, row in rows.items():
            spec = expert.specs.get(shard)
            if spec != tensor_spec(row.dtype, tuple(row.shape)):
                raise ConfigError(
                    owner="WeightBackupManager.restore",
                    field=f"into[{shard!r}]",
                    value=f"{row.dtype} {tuple(row.shape)}",
                    reason=f"must match expert {expert_id}'s shard: {spec}",
                )

    def _view(self, expert_id: int, shard: str) -> torch.Tensor:
        spec = self._experts[expert_id].specs[shard]
        view = self._pool.view(_name(expert_id, shard), getattr(torch, spec.dtype), spec.shape)
        assert view is not None  # only called for shards on host
        return view
