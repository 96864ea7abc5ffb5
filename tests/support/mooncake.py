"""A real ``mooncake_master`` on loopback for tests.

:class:`MooncakeMaster` starts the master with its embedded HTTP metadata server on free
127.0.0.1 ports, waits until its health endpoint answers, and stops it with SIGTERM
(SIGKILL after a bound). Nothing listens on a non-loopback address.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any, Self

LOOPBACK = "127.0.0.1"


def mooncake_master_path() -> Path | None:
    """Return the ``mooncake_master`` launcher: the venv's first, then ``PATH``'s."""
    search = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    found = shutil.which("mooncake_master", path=search)
    return Path(found) if found else None


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


class _Service:
    """A child process with a log file: running, stopping and the tail of its log.

    Subclasses start it (setting ``_process``) in ``start()``; use as a context manager.
    """

    log_path: Path
    _process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start the process."""
        raise NotImplementedError

    def _spawn(self, argv: list[str], env: dict[str, str] | None = None) -> None:
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)

    @property
    def running(self) -> bool:
        """Whether the process is alive."""
        return self._process is not None and self._process.poll() is None

    def stop(self) -> None:
        """Stop the process: SIGTERM, then SIGKILL if it has not exited within 10 s."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)

    def log_tail(self, lines: int = 40) -> str:
        """Return the last ``lines`` lines of the process's log."""
        if not self.log_path.exists():
            return "(no log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()


class MooncakeMaster(_Service):
    """One ``mooncake_master`` process on loopback; use as a context manager.

    Args:
        log_dir: Where the master's output goes (``mooncake_master.log``).
        ready_timeout_s: How long to wait for the health endpoint before giving up.
    """

    def __init__(self, log_dir: Path, *, ready_timeout_s: float = 30.0) -> None:
        binary = mooncake_master_path()
        if binary is None:
            raise FileNotFoundError("mooncake_master is not installed")
        self.binary = binary
        self.log_path = log_dir / "mooncake_master.log"
        self.ready_timeout_s = ready_timeout_s
        self.rpc_port = self.http_port = self.metrics_port = 0

    @property
    def master_address(self) -> str:
        """``host:port`` of the master's RPC service, as clients' ``master_server_addr``."""
        return f"{LOOPBACK}:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        """URL of the embedded HTTP metadata server, as clients' ``metadata_server``."""
        return f"http://{LOOPBACK}:{self.http_port}/metadata"

    def start(self) -> None:
        """Start the master and return once it reports healthy; raise with its log if not."""
        # A port picked free can be taken before the master binds it; retry a few times.
        for _attempt in range(3):
            self.rpc_port, self.http_port, self.metrics_port = free_port(), free_port(), free_port()
            if self._launch():
                return
            self.stop()
        raise RuntimeError(f"mooncake_master did not become healthy; log:\n{self.log_tail()}")

    def restart(self, *, down_s: float = 0.0) -> None:
        """Stop the master, wait ``down_s``, and start it again on the same ports.

        Like a real master restart, everything it knew (objects, mounted segments) is gone;
        clients keep their addresses and must reconnect on their own.
        """
        self.stop()
        time.sleep(down_s)
        deadline = time.monotonic() + 20.0
        while not self._launch():
            self.stop()
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"mooncake_master did not restart on its ports; log:\n{self.log_tail()}"
                )
            time.sleep(0.5)

    def _launch(self) -> bool:
        self._spawn(
            [
                str(self.binary),
                f"--rpc_address={LOOPBACK}",
                f"--rpc_port={self.rpc_port}",
                "--enable_http_metadata_server=true",
                f"--http_metadata_server_host={LOOPBACK}",
                f"--http_metadata_server_port={self.http_port}",
                f"--metrics_host={LOOPBACK}",
                f"--metrics_port={self.metrics_port}",
            ]
        )
        return self._wait_healthy()

    def _wait_healthy(self) -> bool:
        assert self._process is not None
        deadline = time.monotonic() + self.ready_timeout_s
        url = f"http://{LOOPBACK}:{self.metrics_port}/health"
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                return False
            with (
                contextlib.suppress(urllib.error.URLError, ConnectionError, TimeoutError),
                urllib.request.urlopen(url, timeout=1.0) as response,
            ):
                if response.status == 200:
                    return True
            time.sleep(0.1)
        return False


def mooncake_client_path() -> Path | None:
    """Return the ``mooncake_client`` launcher (a process that contributes a segment)."""
    search = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    found = shutil.which("mooncake_client", path=search)
    return Path(found) if found else None


class MooncakeSegment(_Service):
    """A separate ``mooncake_client`` process that contributes memory to a master.

    Objects a client without memory of its own stores land in this segment, so their
    bytes cross TCP between two processes. Use as a context manager.

    Args:
        master: The running master to mount on.
        size: The segment's size, as ``mooncake_client`` reads it ("256MB"; at least
            16 MiB).
    """

    def __init__(self, master: MooncakeMaster, *, size: str = "256MB") -> None:
        binary = mooncake_client_path()
        if binary is None:
            raise FileNotFoundError("mooncake_client is not installed")
        self.binary = binary
        self.master = master
        self.size = size
        self.log_path = master.log_path.with_name("mooncake_segment.log")

    def start(self) -> None:
        """Start the segment process; it mounts within a second (see MooncakeCluster)."""
        self._spawn(
            [
                str(self.binary),
                f"--host={LOOPBACK}",
                f"--port={free_port()}",
                f"--global_segment_size={self.size}",
                f"--master_server_address={self.master.master_address}",
                f"--metadata_server={self.master.metadata_url}",
                "--protocol=tcp",
            ],
            env=dict(os.environ, MC_TCP_BIND_ADDRESS=LOOPBACK),
        )


class MooncakeCluster:
    """A master, a segment process, and a raw client of our own on loopback.

    The raw client (``MooncakeDistributedStore`` with no memory of its own) is what tests
    use to look behind a backend: read a stored value whole, overwrite it, wipe the
    cluster between tests. Use as a context manager; ready once a probe value can be
    stored (the segment has mounted).

    Args:
        log_dir: Where the master's and the segment's logs go.
        segment_size: The segment process's size ("256MB").
    """

    def __init__(self, log_dir: Path, *, segment_size: str = "256MB") -> None:
        self.master = MooncakeMaster(log_dir)
        self.segment = MooncakeSegment(self.master, size=segment_size)
        self.raw: Any = None

    def options(self, **extra: object) -> dict[str, object]:
        """Options of the ``mooncake`` backend for a client of this cluster with no memory
        of its own (its objects live in the segment process)."""
        return {
            "master_address": self.master.master_address,
            "metadata_server": self.master.metadata_url,
            "local_hostname": LOOPBACK,
            "global_segment_size": 0,
            "local_buffer_size": "16MiB",
            **extra,
        }

    def start(self) -> None:
        """Start the master and the segment; return when a value can be stored."""
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", LOOPBACK)
        from mooncake.store import MooncakeDistributedStore

        self.master.start()
        self.segment.start()
        self.raw = MooncakeDistributedStore()
        status = self.raw.setup(
            LOOPBACK,
            self.master.metadata_url,
            0,
            64 << 20,
            "tcp",
            "",
            self.master.master_address,
        )
        if status != 0:
            raise RuntimeError(f"raw client setup failed ({status}):\n{self.master.log_tail()}")
        self.wait_writable()

    def wait_writable(self, timeout_s: float = 30.0) -> None:
        """Return once a probe value can be stored (the segment is mounted)."""
        deadline = time.monotonic() + timeout_s
        while self.raw.put("cluster-probe", b"x") != 0:
            if not self.segment.running:
                raise RuntimeError(f"the segment process exited:\n{self.segment.log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"no segment mounted in time:\n{self.master.log_tail()}")
            time.sleep(0.1)
        self.raw.remove("cluster-probe", True)

    def wipe(self) -> None:
        """Remove every value in the cluster."""
        self.raw.remove_all(True)

    def stop(self) -> None:
        """Stop the raw client, the segment and the master."""
        if self.raw is not None:
            self.raw.close()
            self.raw = None
        self.segment.stop()
        self.master.stop()

    def __enter__(self) -> MooncakeCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()
