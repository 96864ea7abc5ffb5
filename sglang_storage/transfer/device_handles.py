"""Handles of device<->host transfers, and the layer-done counter forward passes wait on.

- :class:`DeviceTransferHandle` - one transfer: ``done()`` / ``state`` / ``error`` (never
  block, change nothing), ``wait()`` (blocks on an event) returns the
  :class:`DeviceTransferResult`, ``fence()`` makes the current CUDA stream wait for it.
- :class:`DeviceLoadHandle` - a load, plus ``wait_layer(i)``: the current CUDA stream
  waits for layer ``i`` only.
- :class:`LayerDoneCounter` - SGLang's ``LayerDoneCounter``: ``set_consumer(loads)`` per
  batch, ``wait(layer)`` per layer.

Handles are created by :class:`~sglang_storage.transfer.device.DeviceHostPipeline` only;
see its module for the life cycle and the threading rules. :class:`TransferEvents` and
:class:`TransferLedger` are the pipeline's internals (not exported from the package).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs
import torch

from sglang_storage.config import require_int
from sglang_storage.errors import ConfigError, StateError, StorageError
from sglang_storage.memory import KVHostPool
from sglang_storage.transfer.device_types import (
    CopyDirection,
    CopyMetrics,
    DeviceTransferMetrics,
    DeviceTransferResult,
    DeviceTransferState,
)
from sglang_storage.transfer.io import CopyPlan

if TYPE_CHECKING:
    from sglang_storage.transfer.device import DeviceHostPipeline

__all__ = [
    "DeviceLoadHandle",
    "DeviceTransferHandle",
    "LayerDoneCounter",
    "TransferEvents",
    "TransferLedger",
]


def _finished(event: torch.cuda.Event) -> bool:
    return bool(event.query())  # type: ignore[no-untyped-call]


@attrs.frozen(kw_only=True, eq=False)
class TransferEvents:
    """A CUDA transfer's events: timing bounds and, for loads, one per layer (internal)."""

    start: torch.cuda.Event
    """Recorded on the transfer stream before the copies (timing enabled)."""
    finish: torch.cuda.Event
    """Recorded after every copy (timing enabled; a host waiting on it sleeps)."""
    layers: tuple[torch.cuda.Event, ...]
    """A load's per-layer events, recorded as each layer lands; empty for an offload."""

    @classmethod
    def create(cls, layers: int) -> TransferEvents:
        """Fresh events for a transfer with ``layers`` per-layer events."""

        def event(*, timing: bool = False, blocking: bool = False) -> torch.cuda.Event:
            return torch.cuda.Event(enable_timing=timing, blocking=blocking)  # type: ignore[no-untyped-call]

        return cls(
            start=event(timing=True),
            # Blocking: a host waiting on it sleeps instead of spinning.
            finish=event(timing=True, blocking=True),
            layers=tuple(event() for _ in range(layers)),
        )


class TransferLedger:
    """A pipeline's books (internal): transfers not yet collected, and the totals.

    A transfer is opened at submission (its host pages are pinned) and stays here until
    :meth:`collect` takes it, finished: only then are its pages unpinned and its result
    counted. Handles never report here; reading one changes nothing.
    """

    def __init__(self, host: KVHostPool) -> None:
        self._host = host
        self._open: dict[int, DeviceTransferHandle] = {}
        self._totals = {direction: CopyMetrics() for direction in CopyDirection}

    def opened(self, handle: DeviceTransferHandle) -> None:
        """``handle`` was submitted; its host pages are pinned."""
        self._open[handle.transfer_id] = handle

    def collect(self, *, block: bool = False) -> list[DeviceTransferResult]:
        """Take every finished transfer: unpin its pages, count it, return its result.

        Results come in submission order, each once. ``block`` waits for every transfer
        (on its event) first, so that nothing stays open.
        """
        results = []
        for handle in list(self._open.values()):
            if not (block or handle.done()):
                continue
            result = handle.wait()
            del self._open[handle.transfer_id]
            handle._collected()
            self._host.unpin(handle.host_pages)
            self._totals[result.direction] = self._totals[result.direction].add(result)
            results.append(result)
        return results

    def in_flight(self) -> list[DeviceTransferHandle]:
        """The transfers not yet collected (finished or not), in submission order."""
        return list(self._open.values())

    def crossing(
        self, direction: CopyDirection, host_pages: torch.Tensor
    ) -> list[DeviceTransferHandle]:
        """Transfers of the other direction in flight that touch any of ``host_pages``.

        A load reading a host page an offload still writes (or an offload overwriting a
        host page a load still reads) must start after it: the two directions run on
        different streams, and pins count users, they do not exclude them.
        """
        return [
            handle
            for handle in self._open.values()
            if handle.direction is not direction
            and not handle.done()
            and bool(torch.isin(handle.host_pages, host_pages).any())
        ]

    def metrics(self) -> DeviceTransferMetrics:
        """A snapshot of the totals of the transfers collected so far."""
        return DeviceTransferMetrics(
            offload=self._totals[CopyDirection.OFFLOAD],
            load=self._totals[CopyDirection.LOAD],
            in_flight=len(self._open),
        )


class DeviceTransferHandle:
    """One device<->host transfer, made by the pipeline that submitted it.

    Queries (``done()``, ``state``, ``error`` and the properties) never block and change
    nothing: the transfer's host pages stay pinned until the owner collects it with the
    pipeline's ``poll()``, ``drain()`` or ``close()``. ``wait()`` blocks (on an event, not
    by polling) and returns the result, without collecting it either.
    """

    def __init__(
        self,
        *,
        pipeline: DeviceHostPipeline,
        ledger: TransferLedger,
        transfer_id: int,
        direction: CopyDirection,
        host_pages: torch.Tensor,
        nbytes: int,
        events: TransferEvents | None,
        plan: CopyPlan | None,
        error: StorageError | None,
        wall_s: float,
    ) -> None:
        self._pipeline = pipeline
        self._id = transfer_id
        self._direction = direction
        self._host_pages = host_pages
        self._nbytes = nbytes
        self._events = events
        self._plan = plan  # keeps the index tensors alive while the copies run
        self._error = error
        self._wall_s = wall_s  # the latency where there are no events (CPU)
        self._result: DeviceTransferResult | None = None  # the value, once finished
        ledger.opened(self)

    @property
    def pipeline(self) -> DeviceHostPipeline:
        """The pipeline that submitted the transfer."""
        return self._pipeline

    @property
    def transfer_id(self) -> int:
        """The pipeline's number for this transfer."""
        return self._id

    @property
    def direction(self) -> CopyDirection:
        """Offload (D2H) or load (H2D)."""
        return self._direction

    @property
    def host_pages(self) -> torch.Tensor:
        """The host pages the transfer reads or writes (pinned until it is collected)."""
        return self._host_pages

    @property
    def pages(self) -> int:
        """How many pages the transfer moves."""
        return self._host_pages.numel()

    @property
    def nbytes(self) -> int:
        """How many bytes the transfer moves."""
        return self._nbytes

    @property
    def state(self) -> DeviceTransferState:
        """``IN_FLIGHT`` until the copies finish, then ``DONE`` or ``FAILED``."""
        if not self.done():
            return DeviceTransferState.IN_FLIGHT
        return DeviceTransferState.DONE if self._error is None else DeviceTransferState.FAILED

    @property
    def error(self) -> StorageError | None:
        """Why the transfer failed, once it is ``FAILED``; None while in flight or done."""
        return self._error if self.done() else None

    def done(self) -> bool:
        """Whether the copies have finished (done or failed); never blocks."""
        return self._result is not None or self._events is None or _finished(self._events.finish)

    def wait(self) -> DeviceTransferResult:
        """Block until the transfer finishes and return its result (also when it failed).

        The same value every time; waiting does not collect the transfer (its host pages
        stay pinned until the pipeline's ``poll()`` returns the result).
        """
        if self._result is None:
            if self._events is None:
                latency = self._wall_s
            else:
                self._events.finish.synchronize()
                latency = float(self._events.start.elapsed_time(self._events.finish)) / 1000.0
            self._result = DeviceTransferResult(
                transfer_id=self._id,
                direction=self._direction,
                state=DeviceTransferState.DONE
                if self._error is None
                else DeviceTransferState.FAILED,
                pages=self.pages,
                nbytes=self._nbytes,
                latency_s=latency,
                error=self._error,
            )
        return self._result

    def fence(self, stream: torch.cuda.Stream | None = None) -> None:
        """Make ``stream`` (default: the current CUDA stream) wait for this transfer.

        Does not block the host. No-op on CPU, where the transfer has finished already.
        """
        if self._events is not None:
            waiter = torch.cuda.current_stream(self._pipeline.device) if stream is None else stream
            waiter.wait_event(self._events.finish)

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} #{self._id} {self._direction.value} "
            f"{self.pages} pages {self._nbytes} B {self.state.value}>"
        )

    def _collected(self) -> None:
        """The ledger collected the finished transfer: the copies need the plan no more."""
        self._plan = None


def _check_layer(layer: int, layers: int, *, owner: str) -> None:
    require_int(layer, owner=owner, field="layer")
    if layer >= layers:
        raise ConfigError(
            owner=owner,
            field="layer",
            value=layer,
            reason="is out of range",
            allowed=f"0 .. {layers - 1}",
        )


class DeviceLoadHandle(DeviceTransferHandle):
    """A load (H2D): also tells a forward pass when each layer has landed."""

    def wait_layer(self, layer: int) -> None:
        """Make the current CUDA stream wait until layer ``layer`` is on the device.

        Does not block the host. On CPU the load has finished already.

        Raises:
            ConfigError: ``layer`` is out of range.
            StateError: the load failed while being submitted; the layer is not usable.
        """
        _check_layer(layer, self._pipeline.layer_num, owner="DeviceLoadHandle.wait_layer")
        if self._error is not None:
            raise StateError(
                subject=f"load #{self._id}",
                reason=f"failed, layer {layer} is not loaded: {self._error}",
            )
        if self._events is not None:
            stream = torch.cuda.current_stream(self._pipeline.device)
            stream.wait_event(self._events.layers[layer])


class LayerDoneCounter:
    """What a forward pass waits on so that layer ``i`` waits only for layer ``i``'s KV.

    SGLang's ``LayerDoneCounter`` semantics: the scheduler names the load(s) of the batch
    about to run with :meth:`set_consumer`; the attention of layer ``i`` calls
    :meth:`wait` (SGLang's ``wait_until(i)``), which makes the current CUDA stream wait for
    layer ``i`` of those loads only. With no consumer, :meth:`wait` returns at once.
    Any number of loads may be in flight; each has its own per-layer events.
    """

    def __init__(self, pipeline: DeviceHostPipeline) -> None:
        self._pipeline = pipeline
        self._consumer: tuple[DeviceLoadHandle, ...] = ()

    @property
    def layer_num(self) -> int:
        """Layers in the pool."""
        return self._pipeline.layer_num

    @property
    def consumer(self) -> tuple[DeviceLoadHandle, ...]:
        """The loads :meth:`wait` waits for."""
        return self._consumer

    def set_consumer(self, loads: DeviceLoadHandle | Sequence[DeviceLoadHandle] | None) -> None:
        """Make :meth:`wait` wait for ``loads`` (None: for nothing).

        Raises:
            ConfigError: a load was not submitted by this counter's pipeline.
        """
        chosen = (
            ()
            if loads is None
            else (loads,)
            if isinstance(loads, DeviceLoadHandle)
            else tuple(loads)
        )
        for load in chosen:
            if getattr(load, "pipeline", None) is not self._pipeline:
                raise ConfigError(
                    owner="LayerDoneCounter.set_consumer",
                    field="loads",
                    value=load,
                    reason="must be loads submitted by this counter's pipeline",
                )
        self._consumer = chosen

    def wait(self, layer: int) -> None:
        """Make the current CUDA stream wait until ``layer`` of the consumer loads landed.

        Raises:
            ConfigError: ``layer`` is out of range.
            StateError: a consumer load failed while being submitted.
        """
        _check_layer(layer, self._pipeline.layer_num, owner="LayerDoneCounter.wait")
        for load in self._consumer:
            load.wait_layer(layer)

    def reset(self) -> None:
        """Forget the consumer (SGLang's ``reset``)."""
        self._consumer = ()
