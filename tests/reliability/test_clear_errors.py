"""Bad configs and arguments that once ended in a traceback, ate memory or did harm.

A YAML alias bomb or an oversized file given as a config, a ``--backend-config`` nested
too deeply for the parser, an empty ``root``, a count no index can hold, an object
larger than a whole Mooncake segment, and a read-only hf3fs open of a class whose lock
file is gone: each must be a clear typed error (or exit 2 with a message), never a
traceback, an allocation of gigabytes, the current directory taken as a store, advice to
retry what cannot succeed, or a file created by a read-only open.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Final

import pytest
from sglang_storage_adapters import flags
from support.ledger import Ledger

from sglang_storage.cli.settings import MAX_CONFIG_BYTES, load_settings
from sglang_storage.core import ObjectSpec, PutOutcome, PutRequest
from sglang_storage.errors import CapacityError, ConfigError
from sglang_storage.storage import create_backend
from sglang_storage.storage.hf3fs import Hf3fsBackend, Hf3fsBackendConfig

LEDGER_AREA: Final = "clear errors for bad configs"

_CLI: Final = "import sys; from sglang_storage.cli import main; sys.exit(main(sys.argv[1:]))"
_ALIAS_BOMB: Final = """\
a: &a ["x","x","x","x","x","x","x","x","x"]
b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]
h: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]
i: &i [*h,*h,*h,*h,*h,*h,*h,*h,*h]
"""


def _cli(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _CLI, *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_a_yaml_alias_bomb_is_refused_before_it_expands(tmp_path: Path, ledger: Ledger) -> None:
    path = tmp_path / "bomb.yaml"
    path.write_text(_ALIAS_BOMB)
    ledger.fault("bad_config")
    ledger.operation()
    # Run in a child allowed 1 GiB more address space: expanding the bomb (9**9
    # references, their JSON check far more) would need many more.
    code = (
        "import os, resource, sys\n"
        "from sglang_storage_adapters import flags\n"
        "from sglang_storage.errors import ConfigError\n"
        "mapped = int(open('/proc/self/statm').read().split()[0]) * os.sysconf('SC_PAGE_SIZE')\n"
        "resource.setrlimit(resource.RLIMIT_AS, (mapped + (1 << 30),) * 2)\n"
        "try:\n"
        "    flags.parse_backend_config('@' + sys.argv[1])\n"
        "except ConfigError as error:\n"
        "    print('refused:', error.field, error.reason)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "refused: --storage-backend-config" in done.stdout
    assert "alias" in done.stdout


def test_an_oversized_config_file_is_refused_unread(tmp_path: Path, ledger: Ledger) -> None:
    big = "#" * (MAX_CONFIG_BYTES + 1) + "\n"
    for name in ("big.json", "big.toml", "big.yaml"):
        (tmp_path / name).write_text(big)
        ledger.fault("bad_config")
        ledger.operation()
        with pytest.raises(ConfigError, match="larger than") as caught:
            flags.parse_backend_config(f"@{tmp_path / name}")
        assert caught.value.field == "--storage-backend-config"
    ledger.fault("bad_config")
    ledger.operation()
    with pytest.raises(ConfigError, match="larger than") as settings_error:
        load_settings(tmp_path / "big.toml")
    assert settings_error.value.field == "file"


_DEEP: Final = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize("command", ["fsck", "stats", "replay", "bench"])
def test_a_deeply_nested_backend_config_is_a_usage_error(
    tmp_path: Path, command: str, ledger: Ledger
) -> None:
    deep = json.dumps({"durability": 0})[:-2] + _DEEP[:40_000] + _DEEP[-40_000:] + "}"
    argv = [command, "--backend-config", deep]
    if command != "replay":
        argv += ["--dir", str(tmp_path / "store")]
    ledger.fault("bad_flag")
    ledger.operation()
    done = _cli(*argv)
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.returncode == 2, done.stderr[-2000:]
    assert "nested too deeply" in done.stderr


@pytest.mark.parametrize("backend", ["file", "hf3fs"])
def test_an_empty_root_is_not_the_current_directory(backend: str, ledger: Ledger) -> None:
    ledger.fault("bad_config")
    ledger.operation()
    with pytest.raises(ConfigError, match="must not be empty") as caught:
        create_backend(
            backend, {"root": "", "allow_non_3fs": True} if backend == "hf3fs" else {"root": ""}
        )
    assert caught.value.field == "root"


def test_a_count_too_large_for_an_index_is_a_usage_error(ledger: Ledger) -> None:
    ledger.fault("bad_flag")
    ledger.operation()
    done = _cli("replay", "--users", "99999999999999999999999")
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.returncode == 2
    assert "above the maximum" in done.stderr


def test_read_only_hf3fs_creates_no_lock_file(tmp_path: Path, ledger: Ledger) -> None:
    from support.backend_conformance import namespace, pattern, put_bytes

    root = tmp_path / "hf3fs"
    root.mkdir()
    options: dict[str, object] = {
        "root": root,
        "allow_non_3fs": True,
        "data_file_size": 1 << 20,
        "data_files": 2,
        "client": "posix",
    }
    ns = namespace(model="ro-model")
    key, spec = ns.key("k"), ObjectSpec.raw(4096)
    with Hf3fsBackend(Hf3fsBackendConfig(**options)) as store:  # type: ignore[arg-type]
        assert put_bytes(store, key, spec, pattern(key, spec.nbytes)).outcome is PutOutcome.STORED
    locks = [p for p in root.rglob("lock") if p.parent != root]
    assert locks
    for lock in locks:
        lock.unlink()
    ledger.fault("bad_input")
    ledger.operation()
    with Hf3fsBackend(Hf3fsBackendConfig(**options, read_only=True)) as store:  # type: ignore[arg-type]
        assert store.exists([key]) == [True]
    assert [p for p in root.rglob("lock") if p.parent != root] == []


def test_an_object_larger_than_the_segment_says_so(tmp_path: Path, ledger: Ledger) -> None:
    pytest.importorskip("mooncake.store", reason="the Mooncake client is not installed")
    from support.backend_conformance import namespace
    from support.mooncake import MooncakeMaster, mooncake_master_path

    if mooncake_master_path() is None:
        pytest.skip("mooncake_master is not installed")
    with MooncakeMaster(tmp_path) as master:
        segment = 16 << 20
        backend = create_backend(
            "mooncake",
            {
                "master_address": master.master_address,
                "metadata_server": master.metadata_url,
                "global_segment_size": segment,
                "local_buffer_size": 64 << 20,
                "connect_timeout_s": 10,
            },
        )
        try:
            ns = namespace(model="big-model")
            spec = ObjectSpec.raw(2 * segment)
            ledger.fault("bad_input")
            ledger.operation()
            [result] = backend.put_from(
                [PutRequest(key=ns.key("big"), spec=spec, buffers=(bytearray(spec.nbytes),))]
            )
        finally:
            backend.close()
    assert result.outcome is PutOutcome.ERROR
    assert isinstance(result.error, CapacityError)
    assert "exceeds the segment" in str(result.error)
    assert "retry later" not in str(result.error)
