"""A real mooncake_master runs on loopback and a client in another process stores bytes in it.

This is the environment check the Mooncake backend's tests build on: the wheel, its
``libibverbs1`` system dependency and the master all work on this machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.mooncake import LOOPBACK, MooncakeMaster

pytestmark = pytest.mark.mooncake

CLIENT = r"""
import json, os, sys
from mooncake.store import MooncakeDistributedStore

metadata_url, master_address = sys.argv[1], sys.argv[2]
store = MooncakeDistributedStore()
rc = store.setup("127.0.0.1", metadata_url, 64 << 20, 16 << 20, "tcp", "", master_address)
if rc != 0:
    print(json.dumps({"setup": rc}))
    sys.exit(1)
payload = os.urandom(256 << 10)
result = {
    "setup": rc,
    "put": store.put("foundation/page-0", payload),
    "roundtrip": store.get("foundation/page-0") == payload,
    "exists": store.is_exist("foundation/page-0"),
    "absent": store.is_exist("foundation/never-written"),
    "batch_exists": list(store.batch_is_exist(["foundation/page-0", "foundation/nope"])),
}
store.close()
print(json.dumps(result))
"""


def test_client_process_stores_and_reads_back_through_a_loopback_master(tmp_path: Path) -> None:
    with MooncakeMaster(tmp_path) as master:
        env = dict(os.environ, MC_TCP_BIND_ADDRESS=LOOPBACK)
        result = subprocess.run(
            [sys.executable, "-c", CLIENT, master.metadata_url, master.master_address],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert result.returncode == 0, f"{result.stdout}\n{result.stderr}\n{master.log_tail()}"
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    assert outcome == {
        "setup": 0,
        "put": 0,
        "roundtrip": True,
        "exists": 1,
        "absent": 0,
        "batch_exists": [1, 0],
    }


def test_master_stops_on_exit(tmp_path: Path) -> None:
    master = MooncakeMaster(tmp_path)
    states = [master.running]
    with master:
        states.append(master.running)
    states.append(master.running)
    assert states == [False, True, False]
