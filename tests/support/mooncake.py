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


class MooncakeMaster:
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
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def master_address(self) -> str:
        """``host:port`` of the master's RPC service, as clients' ``master_server_addr``."""
        return f"{LOOPBACK}:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        """URL of the embedded HTTP metadata server, as clients' ``metadata_server``."""
        return f"http://{LOOPBACK}:{self.http_port}/metadata"

    @property
    def running(self) -> bool:
        """Whether the master process is alive."""
        return self._process is not None and self._process.poll() is None

    def start(self) -> None:
        """Start the master and return once it reports healthy; raise with its log if not."""
        # A port picked free can be taken before the master binds it; retry a few times.
        for _attempt in range(3):
            self.rpc_port, self.http_port, self.metrics_port = free_port(), free_port(), free_port()
            log = self.log_path.open("ab")
            self._process = subprocess.Popen(
                [
                    str(self.binary),
                    f"--rpc_address={LOOPBACK}",
                    f"--rpc_port={self.rpc_port}",
                    "--enable_http_metadata_server=true",
                    f"--http_metadata_server_host={LOOPBACK}",
                    f"--http_metadata_server_port={self.http_port}",
                    f"--metrics_host={LOOPBACK}",
                    f"--metrics_port={self.metrics_port}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            log.close()
            if self._wait_healthy():
                return
            self.stop()
        raise RuntimeError(f"mooncake_master did not become healthy; log:\n{self.log_tail()}")

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

    def stop(self) -> None:
        """Stop the master: SIGTERM, then SIGKILL if it has not exited within 10 s."""
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
        """Return the last ``lines`` lines of the master's log."""
        if not self.log_path.exists():
            return "(no log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def __enter__(self) -> MooncakeMaster:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()
