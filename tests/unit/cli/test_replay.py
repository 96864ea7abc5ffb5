"""``sglang-storage replay`` end to end on small workloads: real pools, pipelines and backends.

Every run goes through the real KV cache manager with CPU tensors as the device and the
real ``file`` backend under ``tmp_path``. Faults are real damage to stored files, the
``faulty`` registry backend, and one named fake (:class:`LyingFileBackend`) that returns
wrong bytes as hits, which only the replay's own verification can catch.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Sequence
from pathlib import Path
from types import NoneType
from typing import Any

import attrs
import pytest
import torch

from sglang_storage.cli import main
from sglang_storage.cli import replay as replay_cli
from sglang_storage.cli.replay_engine import KVPattern, ModelShape
from sglang_storage.cli.replay_report import SCHEMA, SCHEMA_VERSION, Progress
from sglang_storage.cli.workload import WorkloadConfig
from sglang_storage.core import GetRequest, GetResult
from sglang_storage.managers.kv import KVCacheStats
from sglang_storage.storage import Backend
from sglang_storage.storage.file import FileBackend, FileBackendConfig
from sglang_storage.transfer import DeviceKV

# A workload and tiers scaled down from the defaults so that every tier serves hits:
# 24-page turns of 4 KiB pages, a 28-page device pool and a 48-page host pool.
SMALL = (
    *("--users", "4", "--turns", "3", "--system-prompts", "2", "--system-tokens", "64"),
    *("--context-tokens", "128", "--prompt-tokens", "32", "--answer-tokens", "32"),
    *("--concurrency", "3", "--layers", "2", "--kv-heads", "2", "--head-dim", "16"),
    *("--prefetch-threshold", "0", "--device-mem", "112KiB", "--host-mem", "192KiB"),
)

Report = dict[str, Any]


def replay(store: Path, *extra: str, expect: int = 0) -> Report:
    """Run the replay on ``store`` and return its JSON report."""
    out = store.with_suffix(".json")
    code = main(["replay", *SMALL, "--dir", str(store), "--json", str(out), *extra])
    assert code == expect
    report: Report = json.loads(out.read_text())
    return report


def stored_names(store: Path) -> set[str]:
    return {p.name for p in (store / "objects").rglob("*") if p.is_file()}


# ---------------------------------------------------------------------- the JSON report

NUM = (int, float)
LATENCY = {"count": int, "p50_s": (float, NoneType), "p99_s": (float, NoneType)}
LATENCY |= {"max_s": (float, NoneType)}
COST = {"recomputed_tokens": int, "prefill_s": NUM, "load_s": NUM, "total_s": NUM}
TIER = {"load": int, "recompute": int, "bandwidth_bytes_per_s": NUM, "latency_s": NUM}
TIER |= {"source": str, "observations": int}
REPORT_SCHEMA: dict[str, Any] = {
    "schema": str,
    "schema_version": int,
    "ok": bool,
    "elapsed_s": float,
    "config": {
        "workload": {f.name: int for f in attrs.fields(WorkloadConfig)},
        "model": {
            **dict.fromkeys(("layers", "kv_heads", "head_dim", "page_size"), int),
            "dtype": str,
            "page_bytes": int,
            "token_bytes": int,
        },
        "device": {"kind": str, "pages": int, "bytes": int},
        "host": {"pages": int, "bytes": int},
        "write_policy": str,
        "prefetch_policy": str,
        "prefetch_threshold_tokens": int,
        "prefill_tokens_per_s": NUM,
        "follow_cost_model": bool,
    },
    "storage": {
        "backend": str,
        "location": (str, NoneType),
        "objects": int,
        "bytes": int,
        "corrupt": int,
    },
    "tokens": {"turns": int, "prompt": int, "decode": int},
    "hits": {
        tier: {"tokens": int, "fraction": NUM} for tier in ("device", "host", "storage", "miss")
    },
    "storage_hits_not_loaded": dict.fromkeys(
        ("cost_model", "below_threshold", "truncated", "host_full"), int
    ),
    "bytes": dict.fromkeys(("d2h", "h2d", "host_to_storage", "storage_to_host"), int),
    "decisions": {"host": TIER, "storage": TIER},
    "latency": dict.fromkeys(
        ("turn", "d2h", "h2d", "prefetch", "storage_get", "storage_put", "storage_exists"), LATENCY
    ),
    "cost": {"prefill_tokens_per_s": NUM, "with_storage": COST, "without_storage": COST},
    "verification": {"pages_verified": int, "mismatched_pages": int, "mismatched_keys": list},
    "faults": dict.fromkeys(("load_failures", "host_write_failures", "host_full_skips"), int),
    "manager": {f.name: int for f in attrs.fields(KVCacheStats)},
}


def check_schema(value: object, spec: object, path: str = "report") -> None:
    if isinstance(spec, dict):
        assert isinstance(value, dict), path
        assert set(value) == set(spec), f"{path}: {sorted(set(value) ^ set(spec))}"
        for key, sub in spec.items():
            check_schema(value[key], sub, f"{path}.{key}")
        return
    kinds = spec if isinstance(spec, tuple) else (spec,)
    assert isinstance(spec, type | tuple)
    if bool not in kinds:
        assert not isinstance(value, bool), f"{path} is a bool"
    assert isinstance(value, kinds), f"{path} is {type(value).__name__}, not {kinds}"


def test_small_run_serves_every_tier_and_the_report_follows_the_schema(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = replay(tmp_path / "store", "--fresh")
    check_schema(report, REPORT_SCHEMA)
    assert (
        (report["schema"], report["schema_version"])
        == (SCHEMA, SCHEMA_VERSION)
        == (
            "sglang-storage.replay",
            1,
        )
    )
    hits = {tier: report["hits"][tier]["tokens"] for tier in report["hits"]}
    assert all(n > 0 for n in hits.values()), hits
    assert sum(hits.values()) == report["tokens"]["prompt"]
    assert report["ok"]
    assert report["verification"]["pages_verified"] > 0
    assert report["verification"]["mismatched_pages"] == 0
    assert report["storage"]["location"] == str((tmp_path / "store").absolute())
    assert report["storage"]["objects"] == len(stored_names(tmp_path / "store")) > 0
    moved = report["bytes"]
    assert all(moved[d] > 0 for d in moved), moved
    page_bytes = report["config"]["model"]["page_bytes"]
    assert moved["host_to_storage"] == report["storage"]["objects"] * page_bytes
    assert report["latency"]["turn"]["count"] == report["tokens"]["turns"] == 12
    assert report["cost"]["without_storage"]["recomputed_tokens"] == (
        hits["miss"] + hits["storage"]
    )
    text = capsys.readouterr().out
    for phrase in ("Where the", "storage (prefetched, loaded)", "Bytes moved", "p99"):
        assert phrase in text
    assert "byte-identical" in text
    assert str(tmp_path / "store") in text


def test_json_to_stdout_moves_the_text_to_stderr(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["replay", *SMALL, "--backend", "memory", "--json", "-"])
    captured = capsys.readouterr()
    assert code == 0
    report = json.loads(captured.out)
    check_schema(report, REPORT_SCHEMA)
    assert report["storage"]["backend"] == "memory"
    assert report["storage"]["location"] is None
    assert "Where the" in captured.err
    assert "\r[" not in captured.err  # not a terminal: no progress bar


# ---------------------------------------------------------------------- runs sharing a store


def test_a_second_run_on_the_same_dir_gets_storage_hits_and_fresh_forgets_them(
    tmp_path: Path,
) -> None:
    store = tmp_path / "store"
    first = replay(store, "--fresh")
    second = replay(store)
    assert second["hits"]["storage"]["tokens"] > first["hits"]["storage"]["tokens"]
    assert second["hits"]["miss"]["tokens"] < first["hits"]["miss"]["tokens"]
    assert second["bytes"]["host_to_storage"] == 0  # everything was stored already
    assert second["storage"]["objects"] == first["storage"]["objects"]
    assert second["ok"]
    again = replay(store, "--fresh")
    assert again["hits"]["storage"]["tokens"] < second["hits"]["storage"]["tokens"]
    assert again["storage"]["objects"] == first["storage"]["objects"]


def test_the_same_seed_replays_the_same_pages(tmp_path: Path) -> None:
    a = replay(tmp_path / "a", "--seed", "5")
    b = replay(tmp_path / "b", "--seed", "5")
    c = replay(tmp_path / "c", "--seed", "6")
    names = stored_names(tmp_path / "a")
    assert names == stored_names(tmp_path / "b")
    assert names.isdisjoint(stored_names(tmp_path / "c"))
    for key in ("tokens", "config"):
        assert a[key] == b[key]
    # The device tier is the engine's own LRU: the same turns give the same device hits.
    assert a["hits"]["device"] == b["hits"]["device"]
    assert a["tokens"] == c["tokens"]


# ---------------------------------------------------------------------- faults


def test_corrupted_stored_files_are_misses_never_wrong_pages(tmp_path: Path) -> None:
    store = tmp_path / "store"
    first = replay(store, "--fresh")
    files = sorted(p for p in (store / "objects").rglob("*") if p.is_file())
    for path in files[::2]:  # flip the last payload byte of every other object
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    second = replay(store)
    assert second["ok"]
    assert second["verification"]["mismatched_pages"] == 0
    assert second["storage"]["corrupt"] > 0
    assert second["storage_hits_not_loaded"]["truncated"] > 0
    assert second["manager"]["prefetch_truncated_pages"] > 0
    assert second["hits"]["miss"]["tokens"] > 0
    assert first["ok"]


def test_faulty_backend_runs_end_in_misses_never_wrong_pages(tmp_path: Path) -> None:
    store = tmp_path / "store"
    replay(store, "--fresh")
    config = {
        "inner": "file",
        "inner_options": {"root": str(store)},
        "seed": 7,
        "bit_flip_rate": 0.3,
        "error_rate": 0.05,
    }
    out = tmp_path / "faulty.json"
    faulty = ("--backend", "faulty", "--backend-config", json.dumps(config))
    code = main(["replay", *SMALL, *faulty, "--json", str(out)])
    report = json.loads(out.read_text())
    assert code == 0
    assert report["ok"]
    assert report["verification"]["pages_verified"] > 0
    assert report["storage"]["corrupt"] + report["storage_hits_not_loaded"]["truncated"] > 0


class LyingFileBackend(FileBackend):
    """A fake broken backend: flips a byte of every page it returns and calls it a hit."""

    def get_into(self, requests: Sequence[GetRequest]) -> list[GetResult]:
        results = super().get_into(requests)
        for request, result in zip(requests, results, strict=True):
            if result.hit:
                request.buffers[0][0] ^= 0x01
        return results


def test_verification_catches_a_backend_that_returns_wrong_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    store = tmp_path / "store"
    replay(store, "--fresh")

    def lying(name: str, options: dict[str, Any]) -> Backend:
        return LyingFileBackend(FileBackendConfig(root=options["root"]))

    monkeypatch.setattr(replay_cli, "create_backend", lying)
    capsys.readouterr()
    report = replay(store, expect=1)
    assert not report["ok"]
    bad = report["verification"]["mismatched_pages"]
    # Every page from storage is wrong, and again whenever a later turn loads it from host.
    assert bad >= report["hits"]["storage"]["tokens"] // 16 > 0
    assert len(report["verification"]["mismatched_keys"]) == min(bad, 5)
    assert "DIFFER" in capsys.readouterr().out


# ---------------------------------------------------------------------- progress bar


def read_all(master: int) -> str:
    """What was written to a pty whose other end is closed."""
    chunks = []
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the other end is closed and everything was read
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks).decode()


def test_progress_bar_is_drawn_only_on_a_terminal(tmp_path: Path) -> None:
    plain = io.StringIO()
    bar = Progress(plain, 3)
    for n in range(1, 4):
        bar.update(n)
    bar.close()
    assert not bar.enabled
    assert plain.getvalue() == ""

    master, slave = os.openpty()
    try:
        with os.fdopen(slave, "w", encoding="utf-8") as terminal:
            bar = Progress(terminal, 3)
            assert bar.enabled
            bar.update(3)
            bar.close()
        drawn = read_all(master)
    finally:
        os.close(master)
    assert "[" + "#" * 30 + "] 3/3 turns" in drawn
    assert drawn.startswith("\r")


def test_the_replay_draws_its_bar_on_a_terminal_stderr(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    master, slave = os.openpty()
    try:
        with os.fdopen(slave, "w", encoding="utf-8") as terminal:
            monkeypatch.setattr("sys.stderr", terminal)
            code = main(["replay", *SMALL, "--backend", "memory"])
        drawn = read_all(master)
    finally:
        os.close(master)
    assert code == 0, drawn
    assert "12/12 turns" in drawn


# ---------------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--users", "0"], "below the minimum 1"),
        (["--turns", "two"], "'two' is not an integer"),
        (["--device-mem", "12Q"], "'12Q'"),
        (["--host-mem", "0"], "at least 1 byte"),
        (["--device-mem", "64KiB"], "--device-mem 64 KiB holds 16 pages"),
        (["--host-mem", "64KiB"], "the longest turn needs 24 pages"),
        (["--dtype", "int8"], "invalid choice: 'int8'"),
        (["--write-policy", "sometimes"], "invalid choice: 'sometimes'"),
        (["--prefill-tokens-per-s", "0"], "finite number > 0"),
        (["--backend", "nope"], "'nope' is not a known backend; choose from"),
        (["--backend-config", "[1]"], "must be a JSON object"),
        (["--backend-config", "{bad"], "not valid JSON"),
        (["--backend-config", '{"nope": 1}'], "nope"),
        (["--backend", "memory", "--dir", "x"], "--dir applies to the file backend only"),
        (["--backend-config", '{"root": "y"}', "--dir", "x"], "--dir or root"),
        (["--kv-heads", "1", "--head-dim", "3"], "multiple of 8"),
    ],
)
def test_bad_arguments_are_usage_errors(
    argv: list[str],
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exited:
        main(["replay", *SMALL, *argv])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: sglang-storage replay")
    assert message in err
    assert list(tmp_path.iterdir()) == []  # nothing was created


def test_a_directory_that_is_a_file_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as exited:
        main(["replay", *SMALL, "--dir", str(tmp_path / "file")])
    assert exited.value.code == 2
    assert "is not a directory" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error where CUDA is absent")
def test_cuda_without_cuda_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["replay", *SMALL, "--device", "cuda", "--backend", "memory"])
    assert exited.value.code == 2
    assert "CUDA is not available" in capsys.readouterr().err


def test_help_shows_examples(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["replay", "--help"])
    assert exited.value.code == 0
    text = capsys.readouterr().out
    assert "examples:" in text
    assert "sglang-storage replay --fresh" in text
    assert "--backend-config" in text
    assert f'schema "{SCHEMA}" version {SCHEMA_VERSION}' in " ".join(text.split())


@pytest.mark.parametrize("policy", ["write_back", "write_through_selective"])
def test_other_write_policies_store_pages_for_the_next_run(tmp_path: Path, policy: str) -> None:
    first = replay(tmp_path / "store", "--fresh", "--write-policy", policy)
    second = replay(tmp_path / "store", "--write-policy", policy)
    assert first["ok"]
    assert second["ok"]
    assert first["storage"]["objects"] > 0
    assert second["hits"]["storage"]["tokens"] > 0


def test_the_pattern_catches_a_changed_byte_and_a_page_under_another_key() -> None:
    shape = ModelShape(layers=2, kv_heads=2, head_dim=16, page_size=4)
    device = DeviceKV.allocate(shape.geometry(8), 8 * 4)
    pattern = KVPattern(device, salt="test")
    keys = [f"{n:064x}" for n in range(1, 5)]
    pattern.fill(keys, [0, 2, 5, 7])
    assert pattern.check(keys, [0, 2, 5, 7]) == []
    assert pattern.check(keys[:2], [2, 0]) == keys[:2]  # swapped pages
    device.planes(1)[1].view(torch.uint8)[5 * 4 + 3, 0, 7] ^= 0x10  # page 5, layer 1, V
    assert pattern.check(keys, [0, 2, 5, 7]) == [keys[2]]
    # Another salt (another model) expects other bytes everywhere.
    assert KVPattern(device, salt="other").check(keys, [0, 2, 5, 7]) == keys
