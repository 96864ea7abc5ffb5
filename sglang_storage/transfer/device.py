"""The device<->host pipeline: asynchronous offload (D2H) and load (H2D) of KV pages.

Contract, one line per primitive:

- ``DeviceHostPipeline(device_kv, host, config)`` - binds a device pool
  (:class:`~sglang_storage.transfer.device_kv.DeviceKV`) to a host pool
  (:class:`~sglang_storage.memory.KVHostPool`) and an I/O backend
  (:mod:`sglang_storage.transfer.io`); ``io_backend`` names the one in use.
- ``offload(host_pages, device_tokens)`` - copy whole device pages (token indices) into
  host pages, every layer; returns a :class:`DeviceTransferHandle`.
- ``load(host_pages, device_tokens)`` - copy host pages into device pages layer by layer,
  marking each layer done as it lands; returns a :class:`DeviceLoadHandle`.
- ``layer_counter`` - the :class:`LayerDoneCounter` a forward pass waits on:
  ``set_consumer(load)`` once per batch, then ``wait(layer)`` before layer ``layer`` reads
  its KV (SGLang's ``LayerDoneCounter.set_consumer`` / ``wait_until``).
- ``poll()`` - collect the finished transfers and return their results, without blocking;
  ``drain()`` - wait for every transfer, collect it and return the results.
- ``metrics()`` - counts, pages, bytes and latency per direction, of collected transfers.
- ``close()`` - ``drain()``, then refuse work; returns the results it collected.

Completion (the owner drains its own completions, as values): every transfer pins its
host pages from submission until the pipeline's owner *collects* it, finished, in
``poll()``, ``drain()`` or ``close()``, the only calls that unpin pages and count
results; each of them returns the :class:`DeviceTransferResult` of every transfer it
collected, in submission order, and each transfer is collected exactly once (so call
``poll()`` regularly, e.g. once per scheduler step; ``close()`` leaves nothing pinned).
The handle only observes: ``done()``, ``state`` and ``error`` never block and change
nothing, and ``wait()`` blocks until the copies finish and returns the same result value,
any number of times, without collecting it (the host pages stay pinned until the next
``poll()``). Bad arguments raise :class:`~sglang_storage.errors.ConfigError` and a free
host page :class:`~sglang_storage.errors.StateError`, before anything is pinned or copied.
A copy that fails is a ``FAILED`` transfer whose :class:`~sglang_storage.errors.StorageError`
is on its own handle (``error``) and result; on CUDA its events are recorded all the same,
so waiters see it finish. Nothing raises it: not ``poll()``, ``drain()`` or ``close()``,
and not a later call about other pages (a loaded layer of a failed load is refused by
that load's ``wait_layer``, see below).

On CUDA the copies run on two streams the pipeline owns (one per direction). A transfer
first waits for the work already queued on the caller's current stream (so it sees what
compute wrote, and a load cannot overwrite pages compute still reads), and for transfers
of the other direction still in flight on any of its host pages (a load of a host page
being offloaded reads the new bytes; an offload into a host page being loaded waits for
the load to read it); completion is tracked with events, never by spinning. Host memory
is read and written asynchronously only where it is page-locked; a pageable host pool is
copied synchronously (see :class:`~sglang_storage.transfer.io.TorchIOBackend`). Device
token indices given as a CUDA tensor are copied to the host to be checked, which waits for
the current stream; pass CPU tensors, or set ``check_device_tokens=False`` in the
config for indices the caller vouches for, to avoid that. The pipeline does not guard device
pages: a caller that reuses the device pages of an offload first calls its handle's
``fence()`` (or waits). On CPU the same calls copy synchronously and their handles are
finished when returned; no threads are used anywhere.

Threading: a pipeline is driven from one thread. ``LayerDoneCounter.wait`` and
``DeviceLoadHandle.wait_layer`` may also be called from the thread that runs the forward
pass: they only read what ``set_consumer`` published and enqueue a stream wait.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from typing import Self

import torch

from sglang_storage.errors import ConfigError, StateError, StorageError
from sglang_storage.memory import KVHostPool
from sglang_storage.transfer.device_handles import (
    DeviceLoadHandle,
    DeviceTransferHandle,
    LayerDoneCounter,
    TransferEvents,
    TransferLedger,
)
from sglang_storage.transfer.device_kv import DeviceKV, as_index_tensor, check_distinct
from sglang_storage.transfer.device_types import (
    CopyDirection,
    CopyMetrics,
    DeviceTransferConfig,
    DeviceTransferMetrics,
    DeviceTransferResult,
    DeviceTransferState,
)
from sglang_storage.transfer.io import CopyPlan, IOBackend, open_io_backend

# The values and handles are defined next door and re-exported: this is the one import.
__all__ = [
    "CopyDirection",
    "CopyMetrics",
    "DeviceHostPipeline",
    "DeviceLoadHandle",
    "DeviceTransferConfig",
    "DeviceTransferHandle",
    "DeviceTransferMetrics",
    "DeviceTransferResult",
    "DeviceTransferState",
    "LayerDoneCounter",
]

log = logging.getLogger(__name__)


def _stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)  # type: ignore[no-untyped-call]


class DeviceHostPipeline:
    """Asynchronous offload and layer-wise load of KV pages; see the module contract.

    Args:
        device_kv: The device pool.
        host: The host pool; its geometry must match ``device_kv.geometry``.
        config: The I/O backend choice (default ``auto``).
        io_backend: A backend to use instead of the one ``config`` names (a third-party or
            test backend bound to the same pools).

    Raises:
        ConfigError: the pools do not match.
        BackendUnavailableError: ``config`` asks for ``kernel`` where it cannot run.
    """

    def __init__(
        self,
        device_kv: DeviceKV,
        host: KVHostPool,
        config: DeviceTransferConfig | None = None,
        *,
        io_backend: IOBackend | None = None,
    ) -> None:
        device_kv.require_compatible(host)
        config = DeviceTransferConfig() if config is None else config
        if not isinstance(config, DeviceTransferConfig):
            raise ConfigError(
                owner="DeviceHostPipeline",
                field="config",
                value=type(config).__name__,
                reason="must be a DeviceTransferConfig",
            )
        self._device_kv = device_kv
        self._host = host
        self._config = config
        self._io = (
            io_backend
            if io_backend is not None
            else open_io_backend(config.io_backend, device_kv, host)
        )
        self._device = device_kv.device
        self._cuda = self._device.type == "cuda"
        self._streams: dict[CopyDirection, torch.cuda.Stream] = (
            {d: _stream(self._device) for d in CopyDirection} if self._cuda else {}
        )
        self._ids = itertools.count(1)
        self._ledger = TransferLedger(host)
        self._counter = LayerDoneCounter(self)
        self._closed = False
        log.info(
            "device<->host pipeline for %s on %s: %s", host.label, self._device, self._io.detail
        )

    # ------------------------------------------------------------------ facts

    @property
    def io_backend(self) -> str:
        """The name of the I/O backend in use (``"torch"`` or ``"kernel"``)."""
        return self._io.name

    @property
    def io_detail(self) -> str:
        """How the I/O backend copies on this machine."""
        return self._io.detail

    @property
    def config(self) -> DeviceTransferConfig:
        """The configuration the pipeline was built with."""
        return self._config

    @property
    def device(self) -> torch.device:
        """The device pool's device."""
        return self._device

    @property
    def layer_num(self) -> int:
        """Layers in the pools."""
        return self._device_kv.geometry.layer_num

    @property
    def layer_counter(self) -> LayerDoneCounter:
        """The per-layer completion counter forward passes wait on."""
        return self._counter

    @property
    def in_flight(self) -> int:
        """Transfers submitted and not yet collected (their host pages are pinned)."""
        return len(self._ledger.in_flight())

    def metrics(self) -> DeviceTransferMetrics:
        """Totals per direction of the transfers collected so far."""
        return self._ledger.metrics()

    # ------------------------------------------------------------------ transfers

    def offload(
        self, host_pages: torch.Tensor | Sequence[int], device_tokens: torch.Tensor | Sequence[int]
    ) -> DeviceTransferHandle:
        """Copy whole device pages into allocated host pages, every layer (D2H).

        Args:
            host_pages: Destination host page numbers, distinct.
            device_tokens: Source token indices, whole pages (``page_size`` consecutive
                tokens from a multiple of ``page_size`` per page), one page per host page.

        Raises:
            ConfigError: bad indices (lengths, ranges, partial pages, repeated host pages).
            StateError: a host page is not allocated, or the pipeline is closed.
        """
        return self._submit(CopyDirection.OFFLOAD, host_pages, device_tokens)

    def load(
        self, host_pages: torch.Tensor | Sequence[int], device_tokens: torch.Tensor | Sequence[int]
    ) -> DeviceLoadHandle:
        """Copy allocated host pages into whole device pages, layer by layer (H2D).

        Args:
            host_pages: Source host page numbers, distinct.
            device_tokens: Destination token indices, whole pages, each page once.

        Raises:
            ConfigError: bad indices (lengths, ranges, partial pages, repeated pages).
            StateError: a host page is not allocated, or the pipeline is closed.
        """
        handle = self._submit(CopyDirection.LOAD, host_pages, device_tokens)
        assert isinstance(handle, DeviceLoadHandle)
        return handle

    def poll(self) -> list[DeviceTransferResult]:
        """Collect every finished transfer and return its result, without blocking.

        Collecting unpins the transfer's host pages and counts it in ``metrics()``.
        Results come in submission order; each transfer is collected once (here, by
        ``drain`` or by ``close``), whether or not its handle was waited on. A failed
        transfer is a ``FAILED`` result, never an exception.
        """
        return self._ledger.collect()

    def drain(self) -> list[DeviceTransferResult]:
        """Wait for every transfer, collect it and return the results, as ``poll()``."""
        return self._ledger.collect(block=True)

    def close(self) -> list[DeviceTransferResult]:
        """``drain()`` (nothing stays pinned), then refuse further work.

        Returns the results ``drain()`` collected; closing again is a no-op that returns
        nothing.
        """
        if self._closed:
            return []
        results = self.drain()
        self._counter.reset()
        self._closed = True
        return results

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _submit(
        self,
        direction: CopyDirection,
        host_pages: torch.Tensor | Sequence[int],
        device_tokens: torch.Tensor | Sequence[int],
    ) -> DeviceTransferHandle:
        owner = f"DeviceHostPipeline.{direction.value}"
        if self._closed:
            raise StateError(subject=owner, reason="the pipeline is closed")
        hosts = self._host_index(host_pages, owner)
        devices = (
            self._device_kv.device_pages(
                device_tokens, distinct=direction is CopyDirection.LOAD, owner=owner
            )
            if self._config.check_device_tokens
            else self._device_kv.trusted_pages(device_tokens, owner=owner)
        )
        if devices.numel() != hosts.numel():
            raise ConfigError(
                owner=owner,
                field="device_tokens",
                value=f"{devices.numel()} pages",
                reason=f"must name one device page per host page ({hosts.numel()})",
            )
        self._host.pin(hosts)  # StateError (nothing pinned) when a page is not allocated
        transfer_id = next(self._ids)
        started = time.perf_counter()
        try:
            events, plan, error = (
                self._enqueue_cuda(direction, hosts, devices)
                if self._cuda
                else self._run_cpu(direction, hosts, devices)
            )
        except BaseException:
            if self._cuda:
                self._streams[direction].synchronize()
            self._host.unpin(hosts)
            raise
        kind = DeviceLoadHandle if direction is CopyDirection.LOAD else DeviceTransferHandle
        # A CPU transfer (no events) is finished already; it is collected by the next poll.
        return kind(
            pipeline=self,
            ledger=self._ledger,
            transfer_id=transfer_id,
            direction=direction,
            host_pages=hosts,
            nbytes=hosts.numel() * self._host.geometry.page_bytes,
            events=events,
            plan=plan,
            error=error,
            wall_s=time.perf_counter() - started,
        )

    def _run_cpu(
        self, direction: CopyDirection, hosts: torch.Tensor, devices: torch.Tensor
    ) -> tuple[None, CopyPlan | None, StorageError | None]:
        plan = None
        try:
            if hosts.numel():
                plan = self._io.plan(hosts, devices)
                if direction is CopyDirection.OFFLOAD:
                    plan.offload()
                else:
                    for layer in range(self.layer_num):
                        plan.load_layer(layer)
        except (RuntimeError, StorageError) as error:
            return None, plan, self._failure(direction, hosts.numel(), error)
        return None, plan, None

    def _enqueue_cuda(
        self, direction: CopyDirection, hosts: torch.Tensor, devices: torch.Tensor
    ) -> tuple[TransferEvents, CopyPlan | None, StorageError | None]:
        stream = self._streams[direction]
        layers = self.layer_num if direction is CopyDirection.LOAD else 0
        events = TransferEvents.create(layers)
        plan = None
        error = None
        recorded = 0
        # Start after what the caller queued: compute that wrote (or still reads) the pages.
        stream.wait_stream(torch.cuda.current_stream(self._device))
        # And after the other direction's transfers on the same host pages.
        for earlier in self._ledger.crossing(direction, hosts):
            earlier.fence(stream)
        with torch.cuda.device(self._device), torch.cuda.stream(stream):
            events.start.record(stream)
            try:
                if hosts.numel():
                    plan = self._io.plan(hosts, devices)
                if direction is CopyDirection.OFFLOAD:
                    if plan is not None:
                        plan.offload()
                else:
                    for layer in range(layers):
                        if plan is not None:
                            plan.load_layer(layer)
                        events.layers[layer].record(stream)
                        recorded += 1
            except (RuntimeError, StorageError) as failure:
                error = self._failure(direction, hosts.numel(), failure)
            # Every layer event is recorded, so no waiter can see a stale one.
            for event in events.layers[recorded:]:
                event.record(stream)
            events.finish.record(stream)
        return events, plan, error

    def _failure(self, direction: CopyDirection, pages: int, error: BaseException) -> StorageError:
        if isinstance(error, StorageError):
            return error
        failure = StorageError(
            f"{direction.value} of {pages} pages with I/O backend {self._io.name!r} failed: "
            f"{type(error).__name__}: {error}"
        )
        failure.__cause__ = error
        return failure

    def _host_index(self, host_pages: torch.Tensor | Sequence[int], owner: str) -> torch.Tensor:
        index = as_index_tensor(host_pages, owner=owner, field="host_pages")
        limit = self._host.geometry.num_pages
        out = (index < 0) | (index >= limit)
        if bool(out.any()):
            raise ConfigError(
                owner=owner,
                field="host_pages",
                value=index[out][:8].tolist(),
                reason="are out of range",
                allowed=f"0 .. {limit - 1}",
            )
        check_distinct(
            index, owner=owner, field="host_pages", what="a transfer names each host page once"
        )
        return index
