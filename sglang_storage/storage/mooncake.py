"""The ``mooncake`` backend: objects in a Mooncake Store cluster.

Every object is our self-checking format (:mod:`.format`): a 512-byte header, then the
payload. Mooncake stores it as one value under ``str(key)``
(``<model>/<kind>/<shard>/<name>``), so a namespace is a key prefix. How header and
payload reach the transfer engine is :class:`MooncakeTransfer`: zero copy (the caller's
buffers and a header slot as slices of one value, with Mooncake's multi-buffer batch
calls) or staged (packed into registered arenas, one slice per value); ``auto`` picks per
object. Header slots and arenas are registered once at open.

Registered memory. Mooncake moves bytes fastest (and over RDMA, only) from memory
registered with its transfer engine. Owners of long-lived host memory (host pools)
register it once with :meth:`MooncakeBackend.register_memory`; over ``tcp`` unregistered
buffers still work (measured here about 3x slower), over ``rdma`` a request with an
unregistered buffer is refused with a typed error instead of failing inside the engine.

Mooncake's behaviour, handled deliberately:

- A put of a key that exists succeeds and keeps the old value. Puts therefore ask which
  keys exist first and report those ``PRESENT``; a racing writer of the same key is
  harmless (same key, same content, and the old value is kept).
- Removal is refused while a reader holds a lease. Deletion, clearing and quarantine
  force it: every read verifies the header and checksum, so a read that races a removal
  (and gets the bytes of whatever reused the memory) never delivers them; it is read
  once more, which turns a race into a hit or a miss, and only persistent damage is
  reported corrupt.
- A full cluster (no segment can take the object) is a ``CapacityError`` result; the
  master evicts on its own above its high watermark, so later puts succeed again.
- A master that stops or restarts: calls fail with ``RPC_FAIL`` after the client's own
  RPC timeout (about 4 s each here; a put makes two calls). Meanwhile reads are
  misses (``exists`` false, ``get_into`` per-key errors) and writes are per-key errors;
  nothing raises to the caller. The Mooncake client reconnects and remounts its segment by
  itself, and the backend serves again without being reopened. A restarted master has
  lost every object it held (Mooncake's non-HA mode), so those keys read as misses.
- A read of a key whose put (by another client) has not finished is a miss.
- A stored value of another size than the requested spec (the client refuses buffers
  smaller than the value) is a ``CORRUPT`` result naming both sizes.
"""

from __future__ import annotations

import bisect
import collections
import ctypes
import enum
import hashlib
import ipaddress
import logging
import os
import re
import socket
import struct
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, Final

import attrs
import numpy as np

from sglang_storage.config import (
    BYTES,
    instance_of,
    int_in_range,
    non_empty_str,
    number_in_range,
)
from sglang_storage.core import (
    EvictionPolicy,
    GetOutcome,
    GetRequest,
    GetResult,
    Namespace,
    ObjectKey,
    PutRequest,
    PutResult,
)
from sglang_storage.errors import (
    BackendIOError,
    BackendUnavailableError,
    CapacityError,
    ConfigError,
    CorruptObjectError,
    StorageError,
)
from sglang_storage.storage.backend import (
    BackendStats,
    Capabilities,
    StatsRecorder,
    count_prefix,
    scrub,
)
from sglang_storage.storage.format import (
    HEADER_SIZE,
    check_object,
    checksum,
    decode_header,
    header_template,
)

__all__ = [
    "MooncakeBackend",
    "MooncakeBackendConfig",
    "MooncakeProtocol",
    "MooncakeTransfer",
    "error_name",
]

log = logging.getLogger(__name__)

NO_AVAILABLE_HANDLE: Final = -200
INVALID_PARAMS: Final = -600
REPLICA_IS_NOT_READY: Final = -703
OBJECT_NOT_FOUND: Final = -704
OBJECT_ALREADY_EXISTS: Final = -705
OBJECT_HAS_LEASE: Final = -706
TRANSFER_FAIL: Final = -800
RPC_FAIL: Final = -900

_ERROR_NAMES: Final[dict[int, str]] = {
    -1: "INTERNAL_ERROR",
    NO_AVAILABLE_HANDLE: "NO_AVAILABLE_HANDLE (no segment has room)",
    INVALID_PARAMS: "INVALID_PARAMS",
    REPLICA_IS_NOT_READY: "REPLICA_IS_NOT_READY",
    OBJECT_NOT_FOUND: "OBJECT_NOT_FOUND",
    OBJECT_ALREADY_EXISTS: "OBJECT_ALREADY_EXISTS",
    OBJECT_HAS_LEASE: "OBJECT_HAS_LEASE",
    TRANSFER_FAIL: "TRANSFER_FAIL",
    RPC_FAIL: "RPC_FAIL (master unreachable)",
}

_REREADS: Final = 2
"""Reads of an object that failed verification before it counts as corrupt."""

_AUTO_STAGE_LIMIT: Final = 128 << 10
"""Over TCP, ``auto`` stages payloads up to this size and moves larger ones zero copy."""

_HOST_PORT = re.compile(r"(?P<host>[A-Za-z0-9._-]+|\[[0-9A-Fa-f:]+\]):(?P<port>[0-9]{1,5})")
_METADATA = re.compile(r"(https?|etcd|redis)://\S+|P2PHANDSHAKE")


def error_name(code: int) -> str:
    """Mooncake's name for the (negative) status ``code``."""
    return _ERROR_NAMES.get(code, f"Mooncake error {code}")


class MooncakeProtocol(enum.Enum):
    """How the transfer engine moves bytes between hosts."""

    TCP = "tcp"
    RDMA = "rdma"


class MooncakeTransfer(enum.Enum):
    """How an object's header and payload are handed to the transfer engine.

    ``zero_copy`` hands the caller's buffers and a header slot to the engine as separate
    slices of one value: no copy, but one more slice per object, which TCP pays for per
    object (``benchmarks/mooncake_backend.py``: 10-30%). ``staged`` packs header and payload
    into registered memory and moves one slice per object, paying a copy per byte instead;
    reads are verified there before a byte reaches the caller. ``auto`` goes zero copy over
    RDMA and, over TCP, stages objects up to 128 KiB (where the slice costs more than the
    copy) and moves larger ones zero copy.
    """

    AUTO = "auto"
    ZERO_COPY = "zero_copy"
    STAGED = "staged"


def _host_port(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    match = _HOST_PORT.fullmatch(value) if isinstance(value, str) else None
    if match is None or not 0 < int(match["port"]) < 65536:
        raise ConfigError(
            owner=type(instance).__name__,
            field=attribute.name,
            value=value,
            reason="is not a host:port address",
            allowed="host:port with a port in 1..65535, e.g. 10.0.0.5:50051",
        )


def _metadata(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, str) or _METADATA.fullmatch(value) is None:
        raise ConfigError(
            owner=type(instance).__name__,
            field=attribute.name,
            value=value,
            reason="is not a metadata server Mooncake understands",
            allowed="http://host:port/metadata (the master's embedded server), "
            "etcd://host:port, redis://host:port, or P2PHANDSHAKE",
        )


@attrs.frozen(kw_only=True)
class MooncakeBackendConfig:
    """Options of the ``mooncake`` backend."""

    master_address: str = attrs.field(validator=_host_port)
    """The master's RPC address, ``host:port``."""
    metadata_server: str = attrs.field(validator=_metadata)
    """Where transfer engines find each other: the master's HTTP metadata server
    (``http://host:port/metadata``), etcd, redis, or ``P2PHANDSHAKE``."""
    local_hostname: str = attrs.field(default="localhost", validator=non_empty_str)
    """The address other hosts reach this process's segment at (use the host's LAN
    address across hosts)."""
    protocol: MooncakeProtocol = attrs.field(
        default=MooncakeProtocol.TCP, validator=instance_of(MooncakeProtocol)
    )
    device_names: str = attrs.field(default="", validator=instance_of(str))
    """RDMA devices, comma separated (``mlx5_0,mlx5_1``); empty for TCP or auto."""
    global_segment_size: int = attrs.field(
        default=4 << 30, validator=int_in_range(0, None), metadata=BYTES
    )
    """Memory this process contributes to the cluster; 0 for a client that only uses
    other processes' segments."""
    local_buffer_size: int = attrs.field(
        default=16 << 20, validator=int_in_range(0, None), metadata=BYTES
    )
    """The client's own transfer buffer (Mooncake's non-zero-copy calls)."""
    replicas: int = attrs.field(default=1, validator=int_in_range(1, 16))
    """Copies of each object, on distinct segments."""
    connect_timeout_s: float = attrs.field(
        default=10.0, validator=number_in_range(0, 600, low_exclusive=True)
    )
    """How long opening waits for the master (and an HTTP metadata server) to answer a
    request; Mooncake's own set-up would wait about 90 s for an absent master and minutes
    for one that accepts connections but does not answer (stopped or hung)."""
    transfer: MooncakeTransfer = attrs.field(
        default=MooncakeTransfer.AUTO, validator=instance_of(MooncakeTransfer)
    )
    """How payloads reach the transfer engine; see :class:`MooncakeTransfer`."""
    staging_bytes: int = attrs.field(
        default=64 << 20, validator=int_in_range(1 << 20, None), metadata=BYTES
    )
    """Registered memory whole objects are packed into when staged (split into
    four arenas, one per call in flight); larger objects go zero copy."""
    header_slots: int = attrs.field(default=1024, validator=int_in_range(1, 1 << 16))
    """Object headers in flight at once on the zero-copy path (the registered header
    arena holds this many); larger batches are split."""

    def __attrs_post_init__(self) -> None:
        if self.protocol is MooncakeProtocol.TCP and self.device_names:
            raise ConfigError(
                owner=type(self).__name__,
                field="device_names",
                value=self.device_names,
                reason="names RDMA devices but protocol is tcp",
                allowed='an empty string with protocol "tcp", or protocol "rdma"',
            )


def _address(view: memoryview) -> int:
    """The address of the first byte of a non-empty contiguous byte view."""
    if view.readonly:
        return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def _names(keys: Sequence[ObjectKey]) -> list[str]:
    """Mooncake's names of ``keys`` (``str(key)`` of each).

    Built from one prefix when the keys share one namespace object, the usual batch.
    """
    if not keys:
        return []
    namespace = keys[0].namespace
    prefix = namespace.path + "/"
    return [prefix + key.name if key.namespace is namespace else str(key) for key in keys]


def _size_mismatch(stored: int, wanted: int) -> str:
    if stored < wanted:
        return f"truncated: holds {stored} payload bytes, the spec needs {wanted}"
    return f"holds {stored} payload bytes, the spec needs {wanted}"


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# The master's RPC framing (yalantinglibs coro_rpc): a 20-byte request header (magic,
# version, serialize type, message type, sequence number, function id, body and
# attachment lengths) and a 16-byte response header (magic, version, error code, message
# type, sequence number, lengths). A function's id is the first four bytes of the MD5 of
# its qualified name, big-endian.
_RPC_MAGIC: Final = 21
_RPC_REQUEST: Final = struct.Struct("<BBBBIIII")
_RPC_RESPONSE: Final = struct.Struct("<BBBBIII")
_RPC_SEQ: Final = 0x5C5C
_SERVICE_READY: Final = int.from_bytes(
    hashlib.md5(b"mooncake::WrappedMasterService::ServiceReady", usedforsecurity=False).digest()[
        :4
    ],
    "big",
)


def _remaining(deadline: float, address: str, what: str) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise BackendUnavailableError(
            backend="mooncake",
            reason=f"the Mooncake {what} at {address} did not answer within "
            "connect_timeout_s; check that it runs (and is not stopped) and is reachable",
        )
    return left


def _ask(address: str, what: str, request: bytes, wanted: int, deadline: float) -> bytes:
    """Send ``request`` to ``address`` and read ``wanted`` bytes back, by ``deadline``.

    Raises:
        BackendUnavailableError: no connection, no (or a short) answer in time.
    """
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection(
            (host.strip("[]"), int(port)), timeout=_remaining(deadline, address, what)
        ) as sock:
            sock.sendall(request)
            answer = b""
            while len(answer) < wanted:
                sock.settimeout(_remaining(deadline, address, what))
                piece = sock.recv(wanted - len(answer))
                if not piece:
                    break
                answer += piece
    except TimeoutError as error:
        raise BackendUnavailableError(
            backend="mooncake",
            reason=f"the Mooncake {what} at {address} accepted a connection but did not "
            "answer a request within connect_timeout_s (hung, stopped, or not a Mooncake "
            "service); check it, or fix the address",
        ) from error
    except OSError as error:
        raise BackendUnavailableError(
            backend="mooncake",
            reason=f"the Mooncake {what} at {address} does not accept connections "
            f"({error}); start it (mooncake_master) or fix the address",
        ) from error
    return answer


def _probe_master(address: str, deadline: float) -> None:
    """Raise unless the master at ``address`` answers an RPC (``ServiceReady``) in time.

    Any well-formed RPC response counts (also an error code of another Mooncake
    version): only the master's RPC server can send one, so a listener that accepts
    connections but never answers (a stopped or hung master) is told apart.
    """
    request = _RPC_REQUEST.pack(_RPC_MAGIC, 0, 0, 0, _RPC_SEQ, _SERVICE_READY, 0, 0)
    answer = _ask(address, "master", request, _RPC_RESPONSE.size, deadline)
    if len(answer) < _RPC_RESPONSE.size:
        raise BackendUnavailableError(
            backend="mooncake",
            reason=f"the service at {address} closed the connection without an RPC "
            "answer: it is no Mooncake master (master_address names the master's RPC "
            "port, 50051 by default)",
        )
    magic, _, _, _, seq, _, _ = _RPC_RESPONSE.unpack(answer)
    if magic != _RPC_MAGIC or seq != _RPC_SEQ:
        raise BackendUnavailableError(
            backend="mooncake",
            reason=f"the service at {address} answered with something other than a "
            "Mooncake master's RPC response: check master_address",
        )


def _probe_http(host_port: str, path: str, deadline: float) -> None:
    """Raise unless the HTTP metadata server at ``host_port`` answers a request in time."""
    request = (
        f"GET {path or '/'}?key=sglang-storage-probe HTTP/1.0\r\nHost: {host_port}\r\n\r\n"
    ).encode()
    answer = _ask(host_port, "metadata server", request, 5, deadline)
    if not answer.startswith(b"HTTP/"):
        raise BackendUnavailableError(
            backend="mooncake",
            reason=f"the metadata server at {host_port} did not answer HTTP: check metadata_server",
        )


class _FreeList:
    """Indices ``0..count-1`` handed out and given back by the calls in flight."""

    def __init__(self, count: int) -> None:
        self._free = collections.deque(range(count))
        self._ready = threading.Condition()

    def take(self, wanted: int) -> list[int]:
        """Between 1 and ``wanted`` free indices, waiting while none is free."""
        with self._ready:
            while not self._free:
                self._ready.wait()
            return [self._free.popleft() for _ in range(min(wanted, len(self._free)))]

    def give(self, indices: Sequence[int]) -> None:
        """Return indices taken before."""
        with self._ready:
            self._free.extend(indices)
            self._ready.notify_all()


class _HeaderSlots(_FreeList):
    """A registered arena of 512-byte header slots, handed out in runs per batch chunk."""

    def __init__(self, count: int) -> None:
        super().__init__(count)
        self.arena = bytearray(count * HEADER_SIZE)
        self.view = memoryview(self.arena)
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self.arena))

    def slot(self, index: int) -> memoryview:
        return self.view[index * HEADER_SIZE : (index + 1) * HEADER_SIZE]


class _Staging(_FreeList):
    """Registered arenas that whole objects are packed into, one arena per call in flight."""

    ARENAS: Final = 4

    def __init__(self, total: int) -> None:
        super().__init__(self.ARENAS)
        self.size = total // self.ARENAS
        self.buffers = [bytearray(self.size) for _ in range(self.ARENAS)]
        self.views = [memoryview(buffer) for buffer in self.buffers]
        self.bases = [ctypes.addressof(ctypes.c_char.from_buffer(b)) for b in self.buffers]


class _InFlight:
    """The backend's calls in flight: a context manager around each call.

    ``close()`` waits for them, so it never pulls the client from under one.
    """

    def __init__(self, lock: threading.Lock, backend: str) -> None:
        self._lock = lock
        self._idle = threading.Condition(lock)
        self._backend = backend
        self._active = 0
        self._closed = False

    def __enter__(self) -> None:
        with self._lock:
            if self._closed:
                raise BackendUnavailableError(
                    backend=self._backend, reason="the backend was closed"
                )
            self._active += 1

    def __exit__(self, *exc_info: object) -> None:
        with self._lock:
            self._active -= 1
            if self._closed and not self._active:  # only a close waits, once closed
                self._idle.notify_all()

    def close_locked(self) -> bool:
        """Refuse new calls and wait, the lock held, until none is in flight.

        Returns whether this was the first close.
        """
        if self._closed:
            return False
        self._closed = True
        while self._active:
            self._idle.wait()
        return True


class MooncakeBackend:
    """Self-checking objects in a Mooncake Store cluster, shared by every host in it.

    Args:
        config: Where the master is and how to reach it.
        eviction: Unused: the Mooncake master evicts on its own (accepted so every
            backend is built the same way).

    Raises:
        BackendUnavailableError: the Mooncake client is not installed, or cannot set up
            against the master (the message names the master and the failing step).
    """

    name = "mooncake"

    def __init__(
        self,
        config: MooncakeBackendConfig,
        *,
        eviction: EvictionPolicy[ObjectKey] | None = None,
    ) -> None:
        del eviction
        self._config = config
        self._store, self._replicate = self._connect(config)
        self._stats = StatsRecorder()
        self._lock = threading.Lock()
        self._known: dict[ObjectKey, int] = {}
        self._regions: list[tuple[int, int]] = []  # sorted (start, end), registered
        self._calls = _InFlight(self._lock, self.name)
        self._unreachable = False
        transfer = config.transfer
        if transfer is MooncakeTransfer.AUTO and config.protocol is MooncakeProtocol.RDMA:
            transfer = MooncakeTransfer.ZERO_COPY
        self.transfer = transfer
        """The transfer mode in use (``auto`` is kept only over TCP, where it stages small
        objects and moves large ones zero copy)."""
        self._stage_limit = _AUTO_STAGE_LIMIT if transfer is MooncakeTransfer.AUTO else None
        try:
            self._headers = _HeaderSlots(config.header_slots)
            self._register(self._headers.base, len(self._headers.arena))
            self._staging: _Staging | None = None
            if transfer is not MooncakeTransfer.ZERO_COPY:
                self._staging = _Staging(config.staging_bytes)
                for base in self._staging.bases:
                    self._register(base, self._staging.size)
        except BaseException:
            self._store.close()
            raise

    # ------------------------------------------------------------------ set-up

    @staticmethod
    def _connect(config: MooncakeBackendConfig) -> tuple[Any, Any]:
        try:
            from mooncake.store import MooncakeDistributedStore, ReplicateConfig
        except ImportError as error:
            raise BackendUnavailableError(
                backend="mooncake",
                reason=f"the Mooncake client cannot be imported ({error}); install "
                "'sglang-storage[mooncake]' (CUDA) or 'sglang-storage[mooncake-cpu]', and "
                "the libibverbs1 system package",
            ) from error
        # Mooncake's own set-up holds the GIL and retries for minutes against a master
        # that accepts connections but does not answer, so the master must have answered
        # a real request, within connect_timeout_s for both probes together, first.
        deadline = time.monotonic() + config.connect_timeout_s
        _probe_master(config.master_address, deadline)
        server = re.fullmatch(r"http://([^/]+)(/.*)?", config.metadata_server)
        if server is not None:
            host_port = server[1] if ":" in server[1] else f"{server[1]}:80"
            _probe_http(host_port, server[2] or "/", deadline)
        if _is_loopback(config.local_hostname):
            # Otherwise the engine advertises a non-loopback address that a loopback
            # master and peers may not reach.
            os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
        store = MooncakeDistributedStore()
        status = store.setup(
            config.local_hostname,
            config.metadata_server,
            config.global_segment_size,
            config.local_buffer_size,
            config.protocol.value,
            config.device_names,
            config.master_address,
        )
        if status != 0:
            raise BackendUnavailableError(
                backend="mooncake",
                reason=f"setup against master {config.master_address} (metadata "
                f"{config.metadata_server}) failed: {error_name(status)}; check that the "
                "master is running and reachable, and that global_segment_size fits in "
                "this host's memory",
            )
        replicate = ReplicateConfig()
        replicate.replica_num = config.replicas
        return store, replicate

    @property
    def capabilities(self) -> Capabilities:
        """Zero copy; shared by every process and host of the cluster; in memory only.

        Not scannable: Mooncake's Python client (``MooncakeDistributedStore``) has no call
        that lists keys, so the backend cannot enumerate what the cluster holds.
        """
        return Capabilities(
            zero_copy=True,
            shared_across_processes=True,
            shared_across_hosts=True,
            durable=False,
            bounded=True,
            registers_memory=True,
            scannable=False,
        )

    # ------------------------------------------------------------------ memory registration

    def register_memory(self, buffer: memoryview) -> None:
        """Register ``buffer``'s memory with the transfer engine, once, for zero-copy moves.

        Raises:
            ConfigError: ``buffer`` is empty or overlaps memory registered before.
            BackendIOError: the engine refused the registration.
        """
        if buffer.nbytes == 0:
            raise ConfigError(
                owner="mooncake backend",
                field="buffer",
                value="0 bytes",
                reason="is empty",
                allowed="a non-empty contiguous host buffer",
            )
        with self._calls:
            self._register(_address(buffer), buffer.nbytes)

    def unregister_memory(self, buffer: memoryview) -> None:
        """Undo :meth:`register_memory` for the same buffer; unknown buffers are ignored."""
        with self._calls:
            start = _address(buffer) if buffer.nbytes else 0
            with self._lock:
                region = (start, start + buffer.nbytes)
                if region not in self._regions:
                    return
                self._regions.remove(region)
            self._store.unregister_buffer(start)

    def _register(self, start: int, size: int) -> None:
        end = start + size
        with self._lock:
            at = bisect.bisect_left(self._regions, (start, end))
            before = self._regions[at - 1] if at else None
            after = self._regions[at] if at < len(self._regions) else None
            if (before and before[1] > start) or (after and after[0] < end):
                raise ConfigError(
                    owner="mooncake backend",
                    field="buffer",
                    value=f"{size} bytes at {start:#x}",
                    reason="overlaps memory registered before",
                    allowed="each region registered once (unregister it first)",
                )
            status = self._store.register_buffer(start, size)
            if status != 0:
                raise BackendIOError(
                    backend=self.name,
                    operation=f"registration of {size} bytes",
                    reason=error_name(status),
                    code=status,
                )
            self._regions.insert(at, (start, end))

    def _registered(self, start: int, size: int) -> bool:
        with self._lock:
            at = bisect.bisect_right(self._regions, (start, 1 << 64)) - 1
            return (
                at >= 0 and self._regions[at][0] <= start and start + size <= self._regions[at][1]
            )

    # ------------------------------------------------------------------ existence

    def exists(self, keys: Sequence[ObjectKey]) -> list[bool]:
        """Whether each key is stored; all false while the master is unreachable."""
        with self._calls:
            return self._exists(keys)

    def prefix_hits(self, keys: Sequence[ObjectKey]) -> int:
        """How many leading keys are stored; 0 while the master is unreachable."""
        with self._calls:
            codes = self._exist_codes(keys)
        if codes.count(1) == len(codes):  # every key: counted in C, the usual answer
            return len(codes)
        return count_prefix(code == 1 for code in codes)

    def _exists(self, keys: Sequence[ObjectKey]) -> list[bool]:
        return [code == 1 for code in self._exist_codes(keys)]

    def _exist_codes(self, keys: Sequence[ObjectKey]) -> list[int]:
        """Mooncake's answer per key: 1 stored, 0 not, negative an error."""
        if not keys:
            return []
        codes: list[int] = self._store.batch_is_exist(_names(keys))
        self._note_reachability(codes)
        return codes

    # ------------------------------------------------------------------ reads

    def get_into(self, requests: Sequence[GetRequest]) -> list[GetResult]:
        """Read each object into its buffers and verify it; see the module docstring.

        An object that fails verification is read again (twice at most) before it is
        called corrupt: a read can race a forced removal (another client's delete, clear
        or quarantine) whose memory was already reused, and then holds another object's
        bytes. A race resolves (a later read is a hit or a miss); damage stays, and only
        then is the object reported ``CORRUPT`` and removed.
        """
        with self._calls:
            results = self._read(requests)
            suspects = [i for i, r in enumerate(results) if r.outcome is GetOutcome.CORRUPT]
            for _ in range(_REREADS):
                if not suspects:
                    break
                again = self._read([requests[i] for i in suspects])
                for i, result in zip(suspects, again, strict=True):
                    results[i] = result
                suspects = [i for i in suspects if results[i].outcome is GetOutcome.CORRUPT]
            for i in suspects:
                self._quarantine(results[i].key)
                log.warning("mooncake backend: %s; removed", results[i].error)
        self._stats.record_gets(results)
        return results

    def _read(self, requests: Sequence[GetRequest]) -> list[GetResult]:
        """One read of each request, verified; corrupt results are not yet acted on."""
        results: list[GetResult | None] = [None] * len(requests)
        staged, direct = self._route([request.nbytes for request in requests])
        for arena, run in self._packed(staged, requests):
            for i, result in self._get_staged(requests, arena, run):
                results[i] = result
        for chunk, slots in self._chunks(direct):
            got = self._get_chunk([requests[i] for i in chunk], slots)
            for i, result in zip(chunk, got, strict=True):
                results[i] = result
        return [result for result in results if result is not None]

    def _get_staged(
        self, requests: Sequence[GetRequest], arena: int, run: list[tuple[int, int]]
    ) -> list[tuple[int, GetResult]]:
        assert self._staging is not None
        base, view = self._staging.bases[arena], self._staging.views[arena]
        sizes = [HEADER_SIZE + requests[i].nbytes for i, _ in run]
        codes = self._store.batch_get_into(
            _names([requests[i].key for i, _ in run]), [base + at for _, at in run], sizes
        )
        self._note_reachability(codes)
        out = []
        for (i, at), size, code in zip(run, sizes, codes, strict=True):
            whole = view[at : at + size]
            out.append((i, self._finish(requests[i], whole[:HEADER_SIZE], whole, code)))
        return out

    def _get_chunk(self, requests: Sequence[GetRequest], slots: list[int]) -> list[GetResult]:
        live, keys, pointers, sizes, refused = self._slices(requests, slots)
        codes: dict[int, int] = {}
        if live:
            got = self._store.batch_get_into_multi_buffers(keys, pointers, sizes)
            self._note_reachability(got)
            codes = dict(zip(live, got, strict=True))
        return [
            GetResult.error_of(request.key, refused[i])
            if i in refused
            else self._finish(request, self._headers.slot(slot), None, codes[i])
            for i, (request, slot) in enumerate(zip(requests, slots, strict=True))
        ]

    def _slices(
        self, requests: Sequence[GetRequest | PutRequest], slots: list[int]
    ) -> tuple[list[int], list[str], list[list[int]], list[list[int]], dict[int, StorageError]]:
        """The zero-copy slices of each request (its header slot, then its buffers).

        Returns the positions that may go with their keys, slice addresses and sizes, and
        the refusal of each position that may not (unregistered memory over RDMA).
        """
        live: list[int] = []
        keys: list[str] = []
        pointers: list[list[int]] = []
        sizes: list[list[int]] = []
        refused: dict[int, StorageError] = {}
        names = _names([request.key for request in requests])
        for i, (request, slot) in enumerate(zip(requests, slots, strict=True)):
            ptrs, lens = [self._headers.base + slot * HEADER_SIZE], [HEADER_SIZE]
            for buffer in request.buffers:
                if buffer.nbytes:
                    ptrs.append(_address(buffer))
                    lens.append(buffer.nbytes)
            refusal = self._unregistered(ptrs, lens)
            if refusal is not None:
                refused[i] = refusal
                continue
            live.append(i)
            keys.append(names[i])
            pointers.append(ptrs)
            sizes.append(lens)
        return live, keys, pointers, sizes, refused

    def _finish(
        self, request: GetRequest, header: memoryview, staged: memoryview | None, code: int
    ) -> GetResult:
        """The result of one read; ``staged`` holds the whole object when it was staged."""
        key = request.key
        if code == OBJECT_NOT_FOUND:
            self._forget([key])
            return GetResult.miss_of(key)
        if code == REPLICA_IS_NOT_READY:  # another client's put of it is still running
            return GetResult.miss_of(key)
        if code in (INVALID_PARAMS, TRANSFER_FAIL):
            # The client refuses buffers smaller (INVALID_PARAMS) or, with several
            # buffers, larger (TRANSFER_FAIL) than the stored value: compare sizes.
            size = self._store.get_size(str(key))
            if size >= 0 and size != HEADER_SIZE + request.nbytes:
                scrub(request.buffers)
                return self._corrupt(key, _size_mismatch(size - HEADER_SIZE, request.nbytes))
        if code < 0:
            scrub(request.buffers)
            return GetResult.error_of(key, self._call_error(f"read of {key}", code))
        payload = request.buffers if staged is None else [staged[HEADER_SIZE:]]
        reason = self._verify(request, header, payload, code)
        if reason is not None:
            scrub(request.buffers)
            return self._corrupt(key, reason)
        if staged is not None:
            at = HEADER_SIZE
            for buffer in request.buffers:
                buffer[:] = staged[at : at + buffer.nbytes]
                at += buffer.nbytes
        with self._lock:
            self._known[key] = HEADER_SIZE + request.nbytes
        return GetResult.hit_of(request)

    def _verify(
        self, request: GetRequest, header: memoryview, payload: Sequence[memoryview], got: int
    ) -> str | None:
        """Why the bytes read must not be delivered, or None."""
        expected = HEADER_SIZE + request.nbytes
        seen = bytes(header[: min(got, HEADER_SIZE)])
        template = header_template(request.key.namespace, request.spec)
        recorded = template.expected_checksum(seen, request.key.name)
        if recorded is None:
            try:
                decoded = decode_header(seen, where=str(request.key))
            except CorruptObjectError as error:
                return error.reason
            return (
                check_object(decoded, request.key, request.spec)
                or "header differs from the expected one"
            )
        if got < expected:
            return f"truncated: {got - HEADER_SIZE} of {request.nbytes} payload bytes"
        if got > expected:
            return "has bytes after its payload"
        if checksum(payload) != recorded:
            return "payload checksum mismatch"
        return None

    def _corrupt(self, key: ObjectKey, reason: str) -> GetResult:
        return GetResult.corrupt_of(key, CorruptObjectError(key=str(key), reason=reason))

    def _quarantine(self, key: ObjectKey) -> None:
        self._forget([key])
        status = self._store.remove(str(key), True)
        if status not in (0, OBJECT_NOT_FOUND):
            log.warning(
                "mooncake backend: could not remove corrupt %s: %s", key, error_name(status)
            )

    # ------------------------------------------------------------------ writes

    def put_from(self, requests: Sequence[PutRequest]) -> list[PutResult]:
        """Store each request's buffers under its key; keys already stored are kept."""
        with self._calls:
            results: list[PutResult | None] = [None] * len(requests)
            present = self._exists([request.key for request in requests])
            first: dict[ObjectKey, int] = {}
            todo: list[int] = []
            for i, request in enumerate(requests):
                if present[i]:
                    results[i] = PutResult.present_of(request.key)
                elif request.key in first:  # written by this batch already
                    continue
                else:
                    first[request.key] = i
                    todo.append(i)
            staged, direct = self._route([requests[i].nbytes for i in todo])
            for arena, run in self._packed([todo[i] for i in staged], requests):
                for i, result in self._put_staged(requests, arena, run):
                    results[i] = result
            for chunk, slots in self._chunks([todo[i] for i in direct]):
                put = self._put_chunk([requests[i] for i in chunk], slots)
                for i, result in zip(chunk, put, strict=True):
                    results[i] = result
            for i, request in enumerate(requests):
                if results[i] is None:
                    earlier = results[first[request.key]]
                    assert earlier is not None
                    results[i] = earlier if not earlier.ok else PutResult.present_of(request.key)
        done = [result for result in results if result is not None]
        self._stats.record_puts(done)
        return done

    def _put_staged(
        self, requests: Sequence[PutRequest], arena: int, run: list[tuple[int, int]]
    ) -> list[tuple[int, PutResult]]:
        assert self._staging is not None
        base, view = self._staging.bases[arena], self._staging.views[arena]
        sizes = []
        for i, at in run:
            request = requests[i]
            offset = at + HEADER_SIZE
            for buffer in request.buffers:
                view[offset : offset + buffer.nbytes] = buffer
                offset += buffer.nbytes
            payload = view[at + HEADER_SIZE : offset]
            template = header_template(request.key.namespace, request.spec)
            view[at : at + HEADER_SIZE] = template.header(request.key.name, checksum([payload]))
            sizes.append(offset - at)
        codes = self._store.batch_put_from(
            _names([requests[i].key for i, _ in run]),
            [base + at for _, at in run],
            sizes,
            self._replicate,
        )
        self._note_reachability(codes)
        return [
            (i, self._put_result(requests[i], code))
            for (i, _), code in zip(run, codes, strict=True)
        ]

    def _put_chunk(self, requests: Sequence[PutRequest], slots: list[int]) -> list[PutResult]:
        for request, slot in zip(requests, slots, strict=True):
            template = header_template(request.key.namespace, request.spec)
            self._headers.slot(slot)[:] = template.header(
                request.key.name, checksum(request.buffers)
            )
        live, keys, pointers, sizes, refused = self._slices(requests, slots)
        codes: dict[int, int] = {}
        if live:
            got = self._store.batch_put_from_multi_buffers(keys, pointers, sizes, self._replicate)
            self._note_reachability(got)
            codes = dict(zip(live, got, strict=True))
        return [
            PutResult.error_of(request.key, refused[i])
            if i in refused
            else self._put_result(request, codes[i])
            for i, request in enumerate(requests)
        ]

    def _put_result(self, request: PutRequest, code: int) -> PutResult:
        key = request.key
        if code == 0:
            with self._lock:
                self._known[key] = HEADER_SIZE + request.nbytes
            return PutResult.stored_of(request)
        if code == OBJECT_ALREADY_EXISTS:
            return PutResult.present_of(key)
        segment = self._config.global_segment_size
        if code == NO_AVAILABLE_HANDLE and 0 < segment < HEADER_SIZE + request.nbytes:
            # No eviction makes room for an object larger than a whole segment.
            too_big = CapacityError(
                resource="one Mooncake segment (global_segment_size)",
                requested=HEADER_SIZE + request.nbytes,
                available=segment,
                hint="the value exceeds the segment, so no retry can store it; "
                "raise global_segment_size or store smaller objects",
            )
            return PutResult.error_of(key, too_big)
        if code == NO_AVAILABLE_HANDLE:
            full = CapacityError(
                resource="Mooncake cluster segments",
                requested=HEADER_SIZE + request.nbytes,
                available=0,
                hint="the master evicts above its high watermark, so retry later; or "
                "contribute more memory (global_segment_size, more clients)",
            )
            return PutResult.error_of(key, full)
        return PutResult.error_of(key, self._call_error(f"write of {key}", code))

    # ------------------------------------------------------------------ removal

    def delete(self, keys: Sequence[ObjectKey]) -> None:
        """Remove the stored ones of ``keys`` (forcing past read leases).

        Raises:
            BackendUnavailableError: the master is unreachable.
            BackendIOError: Mooncake refused a removal.
        """
        if not keys:
            return
        with self._calls:
            codes = self._store.batch_remove(_names(keys), True)
            self._note_reachability(codes)
            removed = sum(1 for code in codes if code == 0)
            self._forget(keys)
            self._stats.record_deleted(removed)
            for key, code in zip(keys, codes, strict=True):
                # A key whose put is still running is not stored yet: the put may win.
                if code not in (0, OBJECT_NOT_FOUND, REPLICA_IS_NOT_READY):
                    raise self._call_error(f"removal of {key}", code)

    def clear(self, namespace: Namespace) -> None:
        """Remove every object of ``namespace`` from the cluster.

        Raises:
            BackendUnavailableError: the master is unreachable.
            BackendIOError: Mooncake refused the removal.
        """
        with self._calls:
            status = self._store.remove_by_regex(f"^{re.escape(namespace.path)}/", True)
            self._note_reachability([status])
            with self._lock:
                for key in [key for key in self._known if key.namespace == namespace]:
                    del self._known[key]
            if status < 0:
                raise self._call_error(f"clear of {namespace.path}", status)

    def _forget(self, keys: Sequence[ObjectKey]) -> None:
        with self._lock:
            for key in keys:
                self._known.pop(key, None)

    # ------------------------------------------------------------------ stats and life cycle

    def stats(self) -> BackendStats:
        """Counters, and the objects this instance wrote or read and has not seen removed."""
        with self._calls, self._lock:
            objects, nbytes = len(self._known), sum(self._known.values())
        return self._stats.snapshot(objects=objects, nbytes=nbytes, capacity_bytes=None)

    def close(self) -> None:
        """Wait for calls in flight, unmount this process's segment and disconnect."""
        with self._lock:
            if not self._calls.close_locked():
                return
            regions, self._regions = self._regions, []
        for start, _end in regions:
            self._store.unregister_buffer(start)
        self._store.close()

    # ------------------------------------------------------------------ helpers

    def _route(self, payloads: Sequence[int]) -> tuple[list[int], list[int]]:
        """The positions of objects that are staged, and of those that go zero copy."""
        if self._staging is None:
            return [], list(range(len(payloads)))
        fits = self._staging.size - HEADER_SIZE
        if self._stage_limit is not None:
            fits = min(fits, self._stage_limit)
        staged = [i for i, nbytes in enumerate(payloads) if nbytes <= fits]
        if len(staged) == len(payloads):
            return staged, []
        return staged, [i for i, nbytes in enumerate(payloads) if nbytes > fits]

    def _packed(
        self, indices: Sequence[int], requests: Sequence[GetRequest] | Sequence[PutRequest]
    ) -> Iterator[tuple[int, list[tuple[int, int]]]]:
        """Runs of ``(arena, [(index, offset)])`` packing the objects at ``indices``.

        Each arena is held while the caller uses its run.
        """
        assert self._staging is not None or not indices
        at = 0
        while at < len(indices):
            assert self._staging is not None
            (arena,) = self._staging.take(1)
            try:
                run, offset = [], 0
                while at < len(indices):
                    size = HEADER_SIZE + requests[indices[at]].nbytes
                    if offset + size > self._staging.size:
                        break
                    run.append((indices[at], offset))
                    offset += size
                    at += 1
                yield arena, run
            finally:
                self._staging.give([arena])

    def _chunks(self, indices: Sequence[int]) -> Iterator[tuple[Sequence[int], list[int]]]:
        """``indices`` in runs that each hold a set of header slots while they run."""
        at = 0
        while at < len(indices):
            slots = self._headers.take(len(indices) - at)
            try:
                yield indices[at : at + len(slots)], slots
            finally:
                self._headers.give(slots)
            at += len(slots)

    def _unregistered(self, pointers: list[int], sizes: list[int]) -> StorageError | None:
        if self._config.protocol is not MooncakeProtocol.RDMA:
            return None
        for start, size in zip(pointers[1:], sizes[1:], strict=True):
            if not self._registered(start, size):
                return ConfigError(
                    owner="mooncake backend",
                    field="buffers",
                    value=f"{size} bytes at {start:#x}",
                    reason="are not registered memory, which RDMA needs",
                    allowed="buffers inside memory passed to register_memory()",
                )
        return None

    def _call_error(self, operation: str, code: int) -> StorageError:
        if code == RPC_FAIL:
            return BackendUnavailableError(
                backend=self.name,
                reason=f"{operation}: the master at {self._config.master_address} is "
                "unreachable; the client reconnects by itself",
            )
        return BackendIOError(
            backend=self.name, operation=operation, reason=error_name(code), code=code
        )

    def _note_reachability(self, codes: Sequence[int]) -> None:
        """Log once when the master stops answering, and once when it answers again."""
        failed = RPC_FAIL in codes
        if failed == self._unreachable:
            return
        self._unreachable = failed
        if failed:
            log.warning(
                "mooncake backend: master %s unreachable; reads are misses and writes fail "
                "until it answers again",
                self._config.master_address,
            )
        else:
            log.info("mooncake backend: master %s answers again", self._config.master_address)
