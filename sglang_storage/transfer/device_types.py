"""Values of the device<->host pipeline: directions, states, configuration, results, metrics.

All frozen: a :class:`DeviceTransferResult` is what a finished transfer reports,
:class:`CopyMetrics` the totals per direction, :class:`DeviceTransferConfig` the choice of
I/O backend. The pipeline itself is in :mod:`sglang_storage.transfer.device`.
"""

from __future__ import annotations

import enum
from typing import Any

import attrs

from sglang_storage.config import instance_of
from sglang_storage.errors import ConfigError, StorageError
from sglang_storage.transfer.io import IOBackendChoice

__all__ = [
    "CopyDirection",
    "CopyMetrics",
    "DeviceTransferConfig",
    "DeviceTransferMetrics",
    "DeviceTransferResult",
    "DeviceTransferState",
]


class CopyDirection(enum.Enum):
    """Which way a device<->host transfer moves pages."""

    OFFLOAD = "offload"
    """Device to host (D2H), every layer at once."""
    LOAD = "load"
    """Host to device (H2D), layer by layer."""


class DeviceTransferState(enum.Enum):
    """Where a device<->host transfer is in its life."""

    IN_FLIGHT = "in_flight"
    """Submitted; copies may still be running."""
    DONE = "done"
    """Every copy finished."""
    FAILED = "failed"
    """A copy failed; the destination pages hold partial data."""


def _to_choice(value: object) -> object:
    if isinstance(value, str):
        for choice in IOBackendChoice:
            if choice.value == value:
                return choice
    return value


def _choice_valid(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, IOBackendChoice):
        raise ConfigError(
            owner=type(instance).__name__,
            field=attribute.name,
            value=value,
            reason="is not an I/O backend",
            allowed=", ".join(c.value for c in IOBackendChoice),
        )


@attrs.frozen(kw_only=True)
class DeviceTransferConfig:
    """How a device<->host pipeline moves bytes."""

    io_backend: IOBackendChoice = attrs.field(
        default=IOBackendChoice.AUTO, converter=_to_choice, validator=_choice_valid
    )
    """``auto``, ``torch`` or ``kernel`` (a string is accepted); see :class:`IOBackendChoice`."""
    check_device_tokens: bool = attrs.field(default=True, validator=instance_of(bool))
    """Whether device token indices are checked (whole pages, in range, a loaded page once).

    Checking reads the values, so a CUDA index tensor is copied to the host first, which
    waits for the work queued on the current stream. False trusts the indices, as SGLang's
    own transfer kernels trust its allocator's: a CUDA tensor is used where it is and
    submitting never waits for the GPU (see ``DeviceKV.trusted_pages``).
    """


@attrs.frozen(kw_only=True)
class DeviceTransferResult:
    """How one device<->host transfer ended."""

    transfer_id: int
    """The pipeline's number for the transfer (increasing in submission order)."""
    direction: CopyDirection
    state: DeviceTransferState
    """``DONE`` or ``FAILED``."""
    pages: int
    """Pages moved (or meant to be)."""
    nbytes: int
    """Bytes moved (or meant to be): ``pages * geometry.page_bytes``."""
    latency_s: float
    """Seconds the copies took (device time on CUDA, wall time on CPU)."""
    error: StorageError | None = None
    """Why the transfer failed; None when it is ``DONE``."""

    @property
    def ok(self) -> bool:
        """Whether the transfer is ``DONE``."""
        return self.state is DeviceTransferState.DONE


@attrs.frozen(kw_only=True)
class CopyMetrics:
    """Totals of finished transfers in one direction."""

    transfers: int = 0
    """Transfers collected, done or failed."""
    failed: int = 0
    """Of which failed."""
    pages: int = 0
    """Pages moved by the transfers that are done."""
    nbytes: int = 0
    """Bytes moved by the transfers that are done."""
    latency_s: float = 0.0
    """Summed latency of the transfers that are done."""
    max_latency_s: float = 0.0
    """Longest latency of a transfer that is done."""

    @property
    def mean_latency_s(self) -> float:
        """Mean latency of the transfers that are done (0 when there are none)."""
        done = self.transfers - self.failed
        return self.latency_s / done if done else 0.0

    @property
    def bytes_per_s(self) -> float:
        """Bytes moved per second of copying (0 when nothing was timed)."""
        return self.nbytes / self.latency_s if self.latency_s > 0 else 0.0

    def add(self, result: DeviceTransferResult) -> CopyMetrics:
        """These totals with ``result`` counted."""
        if not result.ok:
            return attrs.evolve(self, transfers=self.transfers + 1, failed=self.failed + 1)
        return attrs.evolve(
            self,
            transfers=self.transfers + 1,
            pages=self.pages + result.pages,
            nbytes=self.nbytes + result.nbytes,
            latency_s=self.latency_s + result.latency_s,
            max_latency_s=max(self.max_latency_s, result.latency_s),
        )


@attrs.frozen(kw_only=True)
class DeviceTransferMetrics:
    """A snapshot of a device<->host pipeline's totals."""

    offload: CopyMetrics
    """Device to host."""
    load: CopyMetrics
    """Host to device."""
    in_flight: int
    """Transfers submitted and not yet collected."""

    def of(self, direction: CopyDirection) -> CopyMetrics:
        """The totals of ``direction``."""
        return self.offload if direction is CopyDirection.OFFLOAD else self.load
