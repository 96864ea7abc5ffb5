"""Opening the ``mooncake`` backend against a master that accepts TCP but never answers.

A local listener that accepts connections and never replies, and a real
``mooncake_master`` stopped with SIGSTOP (its kernel still accepts connections). Opening
must end in ``connect_timeout_s`` with a ``BackendUnavailableError``; Mooncake's own
set-up holds the GIL and retries for minutes, so each open runs in a child process that
the test kills at its bound instead of hanging with it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import pytest
from support.ledger import Ledger
from support.mooncake import LOOPBACK, MooncakeMaster, mooncake_master_path

LEDGER_AREA: Final = "unresponsive Mooncake master"

pytest.importorskip("mooncake.store", reason="the Mooncake client is not installed")

_TIMEOUT_S: Final = 1.0
_BOUND_S: Final = 20.0  # the child's start and imports, plus the timeout
_OPEN: Final = """
import json, sys, time
from sglang_storage.errors import BackendUnavailableError
from sglang_storage.storage import create_backend
started = time.monotonic()
try:
    create_backend("mooncake", json.loads(sys.argv[1])).close()
    outcome = "opened"
except BackendUnavailableError as error:
    outcome = "unavailable: " + str(error)
print(json.dumps({"outcome": outcome, "seconds": time.monotonic() - started}))
"""


def _open_in_child(options: dict[str, object], ledger: Ledger) -> dict[str, object]:
    ledger.operation()
    try:
        done = subprocess.run(
            [sys.executable, "-c", _OPEN, json.dumps(options)],
            capture_output=True,
            text=True,
            timeout=_BOUND_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        ledger.hang()
        pytest.fail(f"opening did not return within {_BOUND_S} s")
    assert done.returncode == 0, done.stderr[-2000:]
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.fixture
def silent_listener() -> Iterator[str]:
    """``host:port`` of a socket whose backlog accepts connections that nobody answers."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        sock.listen(64)
        yield f"{LOOPBACK}:{sock.getsockname()[1]}"


def test_a_listener_that_never_answers_is_unavailable_in_time(
    silent_listener: str, ledger: Ledger
) -> None:
    ledger.fault("silent_master")
    result = _open_in_child(
        {
            "master_address": silent_listener,
            "metadata_server": "P2PHANDSHAKE",
            "global_segment_size": 0,
            "connect_timeout_s": _TIMEOUT_S,
        },
        ledger,
    )
    assert str(result["outcome"]).startswith("unavailable: "), result
    assert "did not answer" in str(result["outcome"])
    assert float(str(result["seconds"])) < _TIMEOUT_S + 1.0


@pytest.mark.skipif(mooncake_master_path() is None, reason="mooncake_master is not installed")
def test_a_stopped_master_is_unavailable_in_time(tmp_path: Path, ledger: Ledger) -> None:
    with MooncakeMaster(tmp_path) as master:
        options: dict[str, object] = {
            "master_address": master.master_address,
            "metadata_server": master.metadata_url,
            "global_segment_size": 16 << 20,
            "connect_timeout_s": _TIMEOUT_S,
        }
        process = master._process
        assert process is not None
        os.kill(process.pid, signal.SIGSTOP)
        ledger.fault("master_stopped")
        try:
            result = _open_in_child(options, ledger)
        finally:
            os.kill(process.pid, signal.SIGCONT)
        assert str(result["outcome"]).startswith("unavailable: "), result
        assert float(str(result["seconds"])) < _TIMEOUT_S + 1.0
        # Running again, it is opened as before.
        time.sleep(0.2)
        assert _open_in_child(options, ledger)["outcome"] == "opened"
