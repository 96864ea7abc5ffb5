"""Bad input at every entry point a user or a peer reaches: a clear typed error, or a miss.

Table-driven. Each row of :data:`CONFIG_CASES` is one bad value given to one entry point:
backend options through the registry, JSON through ``build_config`` and the adapters'
``--storage-*`` flags (and the extra config a peer process hands over), policy names,
host pool geometry and budgets, object keys and specs, page-hash inputs, and requests
with wrong buffers. Each must raise exactly the listed error type, whose ``field`` is the
offending one and whose message says what is allowed.

Then what a peer or an operator can leave in a ``file`` store's directory: foreign files
and directories at object paths, an object of an older format version, an object of
another model fingerprint, malformed store markers, stray files elsewhere in the tree.
Reads of those are misses or typed per-key results (never bytes, and the buffers are
zeroed or untouched); opening such a store works or fails with a typed error.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from sglang_storage_adapters import flags
from sglang_storage_adapters.runtime import runtime_settings
from support.ledger import Ledger

from sglang_storage.config import build_config
from sglang_storage.core import (
    DataKind,
    EvictionPolicy,
    GetOutcome,
    GetRequest,
    Namespace,
    ObjectKey,
    ObjectSpec,
    PutOutcome,
    PutRequest,
    Shard,
)
from sglang_storage.errors import (
    BackendUnavailableError,
    ConfigError,
    CorruptObjectError,
    StorageError,
)
from sglang_storage.memory import Attention, BudgetConfig, KVGeometry, KVLayout
from sglang_storage.policy import (
    EvictionConfig,
    PrefetchStopConfig,
    WritePolicyConfig,
    make_eviction_policy,
)
from sglang_storage.storage import create_backend
from sglang_storage.storage.file import FileBackend, FileBackendConfig
from sglang_storage.storage.format import FORMAT_VERSION
from sglang_storage.storage.keys import kv_namespace, model_fingerprint, namespace_seed, page_hashes

LEDGER_AREA = "bad input"

NS = Namespace(model="bad-input-model", kind=DataKind.KV)
KEY = NS.key("page0")
SPEC = ObjectSpec.raw(1000)
SENTINEL = 0xA5


class Case(NamedTuple):
    """One bad input: what is called, the error it must raise, its field, what it allows."""

    id: str
    call: Callable[[Path], object]
    error: type[StorageError]
    field: str
    allowed: str
    """A part of the message that says what is allowed (or what was expected)."""


def _geometry(**changes: Any) -> KVGeometry:
    args: dict[str, Any] = {
        "attention": Attention.MHA,
        "layout": KVLayout.PAGE_FIRST,
        "dtype": torch.float16,
        "layer_num": 2,
        "page_size": 4,
        "num_pages": 8,
        "head_num": 2,
        "head_dim": 16,
    }
    args.update(changes)
    return KVGeometry(**args)


def _file(**options: object) -> Callable[[Path], object]:
    return lambda tmp: create_backend("file", {"root": str(tmp / "store"), **options})


def _extra_config(extra: object) -> Callable[[Path], object]:
    """SGLang's server args as a peer (another rank's launcher) hands them over."""
    raw = extra if isinstance(extra, str) else json.dumps(extra)
    args = types.SimpleNamespace(
        hicache_storage_backend="dynamic", hicache_storage_backend_extra_config=raw
    )
    return lambda tmp: runtime_settings(args)


def _peer(**extra: object) -> dict[str, object]:
    return {"backend_name": flags.DYNAMIC_BACKEND_NAME, "storage_backend": "file", **extra}


def _config_file(name: str, text: bytes) -> Callable[[Path], object]:
    def call(tmp: Path) -> object:
        path = tmp / name
        path.write_bytes(text)
        return flags.parse_backend_config(f"@{path}")

    return call


RUNTIME = "sglang_storage runtime settings (--hicache-storage-backend-extra-config)"
LAUNCH = "launch_server"
FILE_OPTS = "adopt, capacity_bytes, clean_at_open, durability, file_mode, io_threads"
SIZES = "an integer byte count or a number followed by one of"
SAFE = "1-160 characters from A-Z a-z 0-9 . _ -"

CONFIG_CASES: list[Case] = [
    # ---- backend configs through the registry (JSON shapes)
    Case("unknown-backend", lambda t: create_backend("nfs", {}), ConfigError, "name", "file"),
    Case("backend-name-not-str", lambda t: create_backend(None, {}), ConfigError, "name", "file"),  # type: ignore[arg-type]
    Case("unknown-option", _file(rot=1), ConfigError, "rot", FILE_OPTS),
    Case("missing-root", lambda t: create_backend("file", {}), ConfigError, "root", "is required"),
    Case("root-not-str", _file(root=5), ConfigError, "root", "must be Path"),
    Case("root-list", _file(root=["a"]), ConfigError, "root", "must be Path"),
    Case("capacity-negative", _file(capacity_bytes=-1), ConfigError, "capacity_bytes", ">= 1"),
    Case("capacity-zero", _file(capacity_bytes=0), ConfigError, "capacity_bytes", ">= 1"),
    Case("capacity-float", _file(capacity_bytes=1.5), ConfigError, "capacity_bytes", "must be int"),
    Case("capacity-bool", _file(capacity_bytes=True), ConfigError, "capacity_bytes", "not bool"),
    Case("capacity-unit", _file(capacity_bytes="12 parsecs"), ConfigError, "capacity_bytes", SIZES),
    Case(
        "capacity-negative-size",
        _file(capacity_bytes="-5GiB"),
        ConfigError,
        "capacity_bytes",
        SIZES,
    ),
    Case(
        "capacity-overflow", _file(capacity_bytes="1e400GiB"), ConfigError, "capacity_bytes", SIZES
    ),
    Case(
        "capacity-without-eviction",
        _file(capacity_bytes=4096),
        ConfigError,
        "eviction",
        "EvictionPolicy",
    ),
    Case("durability-unknown", _file(durability="sometimes"), ConfigError, "durability", "'full'"),
    Case("durability-int", _file(durability=1), ConfigError, "durability", "'none', 'data'"),
    Case("io-threads-zero", _file(io_threads=0), ConfigError, "io_threads", "<= 64"),
    Case("io-threads-str", _file(io_threads="2"), ConfigError, "io_threads", "must be int"),
    Case(
        "options-not-mapping",
        lambda t: create_backend("file", ["root"]),  # type: ignore[arg-type]
        ConfigError,
        "options",
        "a mapping",
    ),
    Case(
        "option-name-not-str",
        lambda t: create_backend("file", {1: 2}),  # type: ignore[dict-item]
        ConfigError,
        "1",
        FILE_OPTS,
    ),
    Case(
        "memory-capacity-negative",
        lambda t: create_backend("memory", {"capacity_bytes": -3}),
        ConfigError,
        "capacity_bytes",
        ">= 1",
    ),
    Case(
        "mooncake-missing",
        lambda t: create_backend("mooncake", {}),
        ConfigError,
        "master_address, metadata_server",
        "is required",
    ),
    Case(
        "mooncake-address",
        lambda t: create_backend(
            "mooncake", {"master_address": "nohost", "metadata_server": "P2PHANDSHAKE"}
        ),
        ConfigError,
        "master_address",
        "host:port",
    ),
    Case("hf3fs-unknown", lambda t: create_backend("hf3fs", {"x": 1}), ConfigError, "x", "root"),
    Case(
        "root-is-a-file",
        lambda t: (t / "f").write_text("x") and create_backend("file", {"root": str(t / "f")}),
        BackendUnavailableError,
        "",
        "Not a directory",
    ),
    # ---- JSON through build_config
    Case(
        "json-not-object",
        lambda t: build_config(FileBackendConfig, json.loads('["root"]')),
        ConfigError,
        "options",
        "root",
    ),
    Case(
        "json-nested-unknown",
        lambda t: build_config(EvictionConfig, json.loads('{"name": "lru", "ratio": 1}')),
        ConfigError,
        "ratio",
        "name, small_ratio",
    ),
    # ---- the adapters' --storage-* flags
    Case(
        "flag-json-malformed",
        lambda t: flags.parse_backend_config('{"root": '),
        ConfigError,
        "--storage-backend-config",
        "a JSON object",
    ),
    Case(
        "flag-json-array",
        lambda t: flags.parse_backend_config('["root"]'),
        ConfigError,
        "--storage-backend-config",
        "must hold an object of options",
    ),
    Case(
        "flag-json-null",
        lambda t: flags.parse_backend_config("null"),
        ConfigError,
        "--storage-backend-config",
        "must hold an object of options",
    ),
    Case(
        "flag-file-missing",
        lambda t: flags.parse_backend_config(f"@{t}/absent.json"),
        ConfigError,
        "--storage-backend-config",
        "cannot be read",
    ),
    Case(
        "flag-file-format",
        lambda t: flags.parse_backend_config(f"@{t}/options.ini"),
        ConfigError,
        "--storage-backend-config",
        "@FILE.json, @FILE.toml",
    ),
    Case(
        "flag-file-bad-json",
        _config_file("o.json", b'{"root": }'),
        ConfigError,
        "--storage-backend-config",
        "is not valid json",
    ),
    Case(
        "flag-file-bad-toml",
        _config_file("o.toml", b"root = "),
        ConfigError,
        "--storage-backend-config",
        "is not valid toml",
    ),
    Case(
        "flag-file-not-utf8",
        _config_file("o.toml", b"root = '\xff'"),
        ConfigError,
        "--storage-backend-config",
        "is not valid toml",
    ),
    Case(
        "flag-host-memory",
        lambda t: flags.parse_host_memory("lots"),
        ConfigError,
        "--storage-host-memory",
        SIZES,
    ),
    Case(
        "flag-host-memory-zero",
        lambda t: flags.parse_host_memory("0"),
        ConfigError,
        "--storage-host-memory",
        "must be more than 0",
    ),
    Case(
        "flag-managers-unknown",
        lambda t: flags.parse_managers("kv,foo"),
        ConfigError,
        "--storage-managers",
        "kv, decode",
    ),
    Case(
        "flag-backend-unknown",
        lambda t: flags.StorageFlags(backend="nfs"),
        ConfigError,
        "--storage-backend",
        "file",
    ),
    Case(
        "flag-backend-option",
        lambda t: flags.StorageFlags(backend="file", backend_options={"root": str(t), "x": 1}),
        ConfigError,
        "x",
        FILE_OPTS,
    ),
    Case(
        "flag-prefetch-timeout-without-timeout-policy",
        lambda t: flags.StorageFlags(
            backend="file",
            backend_options={"root": str(t)},
            prefetch_policy="best_effort",
            prefetch_timeout_base=1.0,
        ),
        ConfigError,
        "--storage-prefetch-timeout-base",
        "--storage-prefetch-policy timeout",
    ),
    # ---- what a peer hands over in SGLang's extra config
    Case(
        "peer-extra-config-not-json",
        _extra_config("{"),
        ConfigError,
        "hicache_storage_backend_extra_config",
        "a JSON object",
    ),
    Case(
        "peer-extra-config-array",
        _extra_config("[1]"),
        ConfigError,
        "hicache_storage_backend_extra_config",
        "a JSON object",
    ),
    Case(
        "peer-managers-not-list",
        _extra_config(_peer(storage_managers="kv")),
        ConfigError,
        "storage_managers",
        "kv, decode",
    ),
    Case(
        "peer-manager-unknown",
        _extra_config(_peer(storage_managers=["kv", 3])),
        ConfigError,
        "managers[1]",
        "'kv'",
    ),
    Case(
        "peer-options-not-object",
        _extra_config(_peer(storage_options=[1])),
        ConfigError,
        "storage_options",
        "a JSON object",
    ),
    Case(
        "peer-backend-missing",
        _extra_config({"backend_name": flags.DYNAMIC_BACKEND_NAME}),
        ConfigError,
        "storage_backend",
        "a registered backend name",
    ),
    # ---- policy names
    Case(
        "eviction-name",
        lambda t: EvictionConfig(name="lfu"),  # type: ignore[arg-type]
        ConfigError,
        "name",
        "'lru', 's3fifo'",
    ),
    Case(
        "eviction-ratio",
        lambda t: EvictionConfig(name="s3fifo", small_ratio=0.9),
        ConfigError,
        "small_ratio",
        "<= 0.5",
    ),
    Case(
        "prefetch-name",
        lambda t: PrefetchStopConfig(name="eventually"),  # type: ignore[arg-type]
        ConfigError,
        "name",
        "'best_effort', 'wait_complete', 'timeout'",
    ),
    Case(
        "write-policy-name",
        lambda t: WritePolicyConfig(name="write_around"),  # type: ignore[arg-type]
        ConfigError,
        "name",
        "'write_through', 'write_through_selective', 'write_back'",
    ),
    Case(
        "eviction-json-name",
        lambda t: build_config(EvictionConfig, {"name": "LRU-2"}),
        ConfigError,
        "name",
        "'lru', 's3fifo'",
    ),
    # ---- host pools: geometry and budget
    Case("kv-dtype", lambda t: _geometry(dtype=torch.int32), ConfigError, "dtype", "bfloat16"),
    Case("kv-dtype-name", lambda t: _geometry(dtype="float16"), ConfigError, "dtype", "bfloat16"),
    Case(
        "kv-layout-name",
        lambda t: _geometry(layout="page_first"),
        ConfigError,
        "layout",
        "KVLayout",
    ),
    Case("kv-zero-pages", lambda t: _geometry(num_pages=0), ConfigError, "num_pages", ">= 1"),
    Case("kv-negative-heads", lambda t: _geometry(head_num=-2), ConfigError, "head_num", ">= 1"),
    Case(
        "kv-mla-heads",
        lambda t: _geometry(attention=Attention.MLA, head_num=2),
        ConfigError,
        "head_num",
        "must be 1 for MLA",
    ),
    Case(
        "kv-mla-page-head",
        lambda t: _geometry(attention=Attention.MLA, layout=KVLayout.PAGE_HEAD, head_num=1),
        ConfigError,
        "layout",
        "layer_first, page_first, page_first_direct",
    ),
    Case("budget-negative", lambda t: BudgetConfig(total=-1), ConfigError, "total", ">= 0"),
    Case(
        "budget-over-reserved",
        lambda t: BudgetConfig(total=10, kv=20),
        ConfigError,
        "kv, embedding, record, weight",
        "must fit in total",
    ),
    Case(
        "budget-json-size",
        lambda t: build_config(BudgetConfig, {"total": "5 KiBs"}),
        ConfigError,
        "total",
        SIZES,
    ),
    # ---- keys and specs
    Case("key-slash", lambda t: NS.key("a/b"), ConfigError, "name", SAFE),
    Case("key-dotdot", lambda t: NS.key(".."), ConfigError, "name", SAFE),
    Case("key-empty", lambda t: NS.key(""), ConfigError, "name", SAFE),
    Case("key-too-long", lambda t: NS.key("a" * 161), ConfigError, "name", SAFE),
    Case("key-bytes", lambda t: NS.key(b"abc"), ConfigError, "name", SAFE),  # type: ignore[arg-type]
    Case("key-non-ascii", lambda t: NS.key("clé"), ConfigError, "name", SAFE),
    Case(
        "key-namespace-str",
        lambda t: ObjectKey(namespace="m/kv/all", name="a"),  # type: ignore[arg-type]
        ConfigError,
        "namespace",
        "must be Namespace",
    ),
    Case(
        "model-slash",
        lambda t: Namespace(model="a/b", kind=DataKind.KV),
        ConfigError,
        "model",
        "1-96",
    ),
    Case(
        "kind-str",
        lambda t: Namespace(model="m", kind="kv"),  # type: ignore[arg-type]
        ConfigError,
        "kind",
        "must be DataKind",
    ),
    Case("shard-rank", lambda t: Shard(tp_rank=4, tp_size=4), ConfigError, "tp_rank", "0..3"),
    Case("shard-label", lambda t: Shard.from_label("tp1of"), ConfigError, "label", "'tp1of4'"),
    Case(
        "spec-dtype",
        lambda t: ObjectSpec(dtype="float128", shape=(1,)),
        ConfigError,
        "dtype",
        "bfloat16",
    ),
    Case(
        "spec-dtype-torch",
        lambda t: ObjectSpec(dtype=torch.float16, shape=(1,)),  # type: ignore[arg-type]
        ConfigError,
        "dtype",
        "float16",
    ),
    Case("spec-shape-negative", lambda t: ObjectSpec.raw(-1), ConfigError, "shape", "ints >= 0"),
    Case(
        "spec-shape-float",
        lambda t: ObjectSpec(dtype="uint8", shape=(1.0,)),
        ConfigError,
        "shape",
        "ints >= 0",
    ),
    Case(
        "spec-shape-9-dims",
        lambda t: ObjectSpec(dtype="uint8", shape=(1,) * 9),
        ConfigError,
        "shape",
        "0-8 ints",
    ),
    Case(
        "spec-layout",
        lambda t: ObjectSpec(dtype="uint8", shape=(1,), layout="Page-First"),
        ConfigError,
        "layout",
        "a-z 0-9 _",
    ),
    Case("hash-text", lambda t: page_hashes("abc", 4), ConfigError, "token_ids", "not text"),  # type: ignore[arg-type]
    Case(
        "hash-float",
        lambda t: page_hashes([1.0], 1),  # type: ignore[list-item]
        ConfigError,
        "token_ids[0]",
        "int token id",
    ),
    Case(
        "hash-negative",
        lambda t: page_hashes([1, -2], 2),
        ConfigError,
        "token_ids[1]",
        "non-negative",
    ),
    Case("hash-none", lambda t: page_hashes(None, 2), ConfigError, "token_ids", "sized sequence"),  # type: ignore[arg-type]
    Case(
        "hash-iterator",
        lambda t: page_hashes(iter([1, 2]), 2),  # type: ignore[arg-type]
        ConfigError,
        "token_ids",
        "not an iterator",
    ),
    Case("hash-page-size", lambda t: page_hashes([1], 0), ConfigError, "page_size", "at least 1"),
    Case("hash-prior", lambda t: page_hashes([1], 1, "xyz"), ConfigError, "prior_hash", "64 hex"),
    Case("seed-int", lambda t: namespace_seed(5, None), ConfigError, "extra_key", "a str or None"),  # type: ignore[arg-type]
    Case("fingerprint-empty", lambda t: model_fingerprint(""), ConfigError, "model", "non-empty"),
    Case(
        "kv-namespace-rank",
        lambda t: kv_namespace("m", mla=False, tp_rank=3, tp_size=2),
        ConfigError,
        "tp_rank",
        "0..1",
    ),
    # ---- requests with wrong buffers
    Case(
        "get-short-buffer",
        lambda t: GetRequest(key=KEY, spec=SPEC, buffers=[bytearray(999)]),
        ConfigError,
        "buffers",
        "exactly 1000 bytes",
    ),
    Case(
        "put-long-buffers",
        lambda t: PutRequest(key=KEY, spec=SPEC, buffers=[bytes(500), bytes(501)]),
        ConfigError,
        "buffers",
        "exactly 1000 bytes",
    ),
    Case(
        "get-read-only-buffer",
        lambda t: GetRequest(key=KEY, spec=SPEC, buffers=[bytes(1000)]),
        ConfigError,
        "buffers",
        "read-only",
    ),
    Case(
        "get-strided-buffer",
        lambda t: GetRequest(key=KEY, spec=SPEC, buffers=[memoryview(bytearray(2000))[::2]]),
        ConfigError,
        "buffers",
        "not C-contiguous",
    ),
    Case(
        "put-no-buffer-protocol",
        lambda t: PutRequest(key=KEY, spec=SPEC, buffers=[object()]),
        ConfigError,
        "buffers",
        "bytes-like objects",
    ),
    Case(
        "get-buffers-none",
        lambda t: GetRequest(key=KEY, spec=SPEC, buffers=None),  # type: ignore[arg-type]
        ConfigError,
        "buffers",
        "a list or tuple of bytes-like objects",
    ),
    Case(
        "get-single-buffer",
        lambda t: GetRequest(key=KEY, spec=SPEC, buffers=bytearray(1000)),
        ConfigError,
        "buffers",
        "a list or tuple of bytes-like objects",
    ),
    Case(
        "get-key-str",
        lambda t: GetRequest(key=str(KEY), spec=SPEC, buffers=[bytearray(1000)]),  # type: ignore[arg-type]
        ConfigError,
        "key",
        "must be ObjectKey",
    ),
    Case(
        "get-spec-dict",
        lambda t: GetRequest(key=KEY, spec={"dtype": "uint8"}, buffers=[bytearray(1000)]),  # type: ignore[arg-type]
        ConfigError,
        "spec",
        "must be ObjectSpec",
    ),
]


@pytest.mark.parametrize("case", CONFIG_CASES, ids=[case.id for case in CONFIG_CASES])
def test_bad_value_is_a_typed_error_naming_field_and_rule(
    case: Case, tmp_path: Path, ledger: Ledger
) -> None:
    ledger.fault("bad_input")
    ledger.operation()
    with pytest.raises(StorageError) as raised:
        case.call(tmp_path)
    error = raised.value
    assert type(error) is case.error, f"{type(error).__name__}: {error}"
    if isinstance(error, ConfigError):
        assert case.field in error.field, error
        assert error.field in str(error)
    assert case.allowed in str(error), error


@pytest.mark.sglang
@pytest.mark.parametrize(
    ("extra", "field", "allowed"),
    [
        ({"bogus": 1}, "bogus", "storage_backend"),
        ({}, "storage_backend", "file"),
        ({"storage_backend": "nfs"}, "storage_backend", "file"),
        ({"storage_backend": 3}, "storage_backend", "file"),
        ({"storage_backend": "file", "storage_options": [1]}, "storage_options", "a JSON object"),
        ({"storage_backend": "file", "eviction": "lru"}, "eviction", '{"name": "lru"}'),
        ({"storage_backend": "file", "eviction": {"name": "lfu"}}, "name", "'lru', 's3fifo'"),
    ],
)
def test_hicache_extra_config_from_sglang_is_checked(
    extra: dict[str, object], field: str, allowed: str, ledger: Ledger
) -> None:
    """The extra config SGLang's ``dynamic`` backend hands the HiCache adapter."""
    from sglang_storage_adapters.hicache_storage import parse_extra_config

    ledger.fault("bad_config")
    ledger.operation()
    with pytest.raises(ConfigError) as raised:
        parse_extra_config(extra)
    assert raised.value.field == field
    assert allowed in str(raised.value)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--storage-backend", "nfs"], "is not a known sglang_storage backend"),
        (["--storage-backend", "file", "--storage-backend-config", "{"], "is not valid JSON"),
        (["--storage-backend", "file", "--storage-host-memory", "x"], "is not a size"),
        (
            ["--storage-backend", "file", "--storage-prefetch-threshold", "-1"],
            "must be an int >= 0",
        ),
        (["--storage-backend", "file", "--storage-write-policy", "x"], "invalid choice"),
        (["--storage-host-memory", "8GiB"], "needs --storage-backend"),
        (
            ["--storage-backend", "file", "--storage-backend-config", '{"root": "/r", "fsync": 1}'],
            "fsync: unknown option",
        ),
    ],
)
def test_bad_flags_are_usage_errors_naming_the_flag(
    argv: list[str], message: str, ledger: Ledger, capsys: pytest.CaptureFixture[str]
) -> None:
    """On the command line a bad flag is argparse's usage error (exit 2), not a traceback."""
    ledger.fault("bad_flag")
    ledger.operation()
    parser = argparse.ArgumentParser(prog="launch_server")
    flags.add_storage_cli_args(parser)
    with pytest.raises(SystemExit) as exited:
        flags.apply_storage_args(parser.parse_args(argv), parser)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert "--storage-" in err.splitlines()[-1]


def test_deeply_nested_json_flag_is_a_config_error(ledger: Ledger) -> None:
    ledger.fault("bad_config")
    with pytest.raises(ConfigError):
        flags.parse_backend_config("[" * 100_000 + "]" * 100_000)


# ---------------------------------------------------------------------- the store's directory


@pytest.fixture
def store(tmp_path: Path) -> Iterator[FileBackend]:
    with FileBackend(FileBackendConfig(root=tmp_path / "store")) as backend:
        yield backend


def _read(backend: FileBackend, key: ObjectKey, spec: ObjectSpec = SPEC) -> tuple[Any, bytes]:
    target = bytearray([SENTINEL]) * spec.nbytes
    [result] = backend.get_into([GetRequest(key=key, spec=spec, buffers=[memoryview(target)])])
    return result, bytes(target)


def _plant(backend: FileBackend, name: str, make: Callable[[Path], object]) -> ObjectKey:
    key = NS.key(name)
    path = backend.path_of(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    make(path)
    return key


def _old_format_object(path: Path) -> None:
    """A whole object of this name, but with an older format version in its header."""
    with FileBackend(FileBackendConfig(root=path.parent / "scratch")) as other:
        key = NS.key(path.name)
        other.put_from([PutRequest(key=key, spec=SPEC, buffers=[os.urandom(1000)])])
        data = bytearray(other.path_of(key).read_bytes())
    data[4:6] = (FORMAT_VERSION - 1).to_bytes(2, "little")
    path.write_bytes(bytes(data))


FOREIGN: list[tuple[str, Callable[[Path], object], GetOutcome, type[StorageError] | None, str]] = [
    (
        "text",
        lambda p: p.write_text("hello\n"),
        GetOutcome.CORRUPT,
        CorruptObjectError,
        "truncated header",
    ),
    (
        "empty",
        lambda p: p.write_bytes(b""),
        GetOutcome.CORRUPT,
        CorruptObjectError,
        "truncated header",
    ),
    (
        "zeros",
        lambda p: p.write_bytes(bytes(1512)),
        GetOutcome.CORRUPT,
        CorruptObjectError,
        "not an sglang-storage object",
    ),
    (
        "old-format",
        _old_format_object,
        GetOutcome.CORRUPT,
        CorruptObjectError,
        f"this build reads version {FORMAT_VERSION}",
    ),
    (
        "symlink-dev-zero",
        lambda p: p.symlink_to("/dev/zero"),
        GetOutcome.CORRUPT,
        CorruptObjectError,
        "is not a regular file",
    ),
    ("dangling-symlink", lambda p: p.symlink_to(p.parent / "absent"), GetOutcome.MISS, None, ""),
    (
        "directory",
        lambda p: p.mkdir(),
        GetOutcome.CORRUPT,
        CorruptObjectError,
        "is not a regular file",
    ),
]


@pytest.mark.parametrize(
    ("name", "make", "outcome", "error", "reason"), FOREIGN, ids=[row[0] for row in FOREIGN]
)
def test_foreign_file_at_an_object_path_is_never_delivered(
    store: FileBackend,
    ledger: Ledger,
    name: str,
    make: Callable[[Path], object],
    outcome: GetOutcome,
    error: type[StorageError] | None,
    reason: str,
) -> None:
    ledger.fault("foreign_file")
    key = _plant(store, name, make)
    ledger.operation()
    result, data = _read(store, key)
    assert result.outcome is outcome, result
    if error is None:
        assert result.error is None
    else:
        assert type(result.error) is error
        assert reason in str(result.error)
    assert data in (bytes(SPEC.nbytes), bytes([SENTINEL]) * SPEC.nbytes), "bytes were delivered"
    if outcome is GetOutcome.CORRUPT:
        # Moved aside: the next read is a plain miss, and a write can take the key.
        assert store.quarantined == 1
        assert _read(store, key)[0].outcome is GetOutcome.MISS
        [put] = store.put_from([PutRequest(key=key, spec=SPEC, buffers=[bytes(range(200)) * 5])])
        assert put.outcome is PutOutcome.STORED
        again, data = _read(store, key)
        assert again.outcome is GetOutcome.HIT
        assert data == bytes(range(200)) * 5
    if result.outcome is GetOutcome.HIT:
        ledger.wrong(SPEC.nbytes)
    assert ledger.wrong_bytes == 0


def test_object_of_another_model_fingerprint_is_a_miss(store: FileBackend, ledger: Ledger) -> None:
    """Other fingerprint, same name: a miss; moved under our fingerprint: corrupt, no bytes."""
    ledger.fault("other_fingerprint")
    fingerprint = model_fingerprint("org/model-7b", dtype="bfloat16", page_size=64)
    ours = kv_namespace(fingerprint, mla=False, tp_rank=0, tp_size=2)
    theirs = kv_namespace(
        model_fingerprint("org/model-7b", dtype="float16", page_size=64),
        mla=False,
        tp_rank=0,
        tp_size=2,
    )
    name = page_hashes(list(range(64)), 64)[0]
    payload = os.urandom(SPEC.nbytes)
    [put] = store.put_from([PutRequest(key=theirs.key(name), spec=SPEC, buffers=[payload])])
    assert put.outcome is PutOutcome.STORED
    ledger.operation(2)
    result, data = _read(store, ours.key(name))
    assert (result.outcome, data) == (GetOutcome.MISS, bytes([SENTINEL]) * SPEC.nbytes)
    assert store.exists([ours.key(name)]) == [False]

    # Copied by hand under our fingerprint's path: refused, naming both models.
    target = store.path_of(ours.key(name))
    target.parent.mkdir(parents=True, exist_ok=True)
    os.link(store.path_of(theirs.key(name)), target)
    result, data = _read(store, ours.key(name))
    assert result.outcome is GetOutcome.CORRUPT
    assert isinstance(result.error, CorruptObjectError)
    assert f"was written for model {theirs.model!r}, not {ours.model!r}" in str(result.error)
    assert data == bytes(SPEC.nbytes)
    # Theirs is untouched.
    result, data = _read(store, theirs.key(name))
    assert (result.outcome, data) == (GetOutcome.HIT, payload)


def test_wrong_spec_on_read_is_corrupt_never_reinterpreted(
    store: FileBackend, ledger: Ledger
) -> None:
    """The same bytes asked for as another dtype, shape or layout are not delivered."""
    spec = ObjectSpec(dtype="float16", shape=(10, 50), layout="page_first")
    store.put_from([PutRequest(key=KEY, spec=spec, buffers=[os.urandom(spec.nbytes)])])
    for other in (
        ObjectSpec(dtype="bfloat16", shape=(10, 50), layout="page_first"),
        ObjectSpec(dtype="float16", shape=(50, 10), layout="page_first"),
        ObjectSpec(dtype="float16", shape=(10, 50), layout="layer_first"),
        ObjectSpec(dtype="uint8", shape=(1000,), layout="page_first"),
    ):
        ledger.fault("wrong_spec")
        ledger.operation()
        # Each refusal quarantines the object; put it back for the next.
        store.put_from([PutRequest(key=KEY, spec=spec, buffers=[os.urandom(spec.nbytes)])])
        result, data = _read(store, KEY, other)
        assert result.outcome is GetOutcome.CORRUPT, other
        assert isinstance(result.error, CorruptObjectError)
        assert "not the expected" in str(result.error)
        assert data == bytes(other.nbytes)


def test_stray_files_in_the_tree_do_not_break_opening(tmp_path: Path, ledger: Ledger) -> None:
    root = tmp_path / "store"
    with FileBackend(FileBackendConfig(root=root)) as backend:
        [put] = backend.put_from([PutRequest(key=KEY, spec=SPEC, buffers=[bytes(1000)])])
        assert put.outcome is PutOutcome.STORED
    strays = [
        root / "objects" / "README",
        root / "objects" / NS.model / "kv" / "junk",
        root / "objects" / NS.model / "kv" / "all" / "zz" / "f",
        root / "objects" / "not a model!" / "kv" / "all" / "00" / "x",
        root / "objects" / NS.model / "kv" / "tp9of2" / "00" / "x",
        root / "tmp" / "notapid.tmp",
        root / "tmp" / "999999999.x.tmp",
        root / "quarantine" / "something",
        root / "unrelated.bin",
    ]
    for stray in strays:
        ledger.fault("foreign_file")
        stray.parent.mkdir(parents=True, exist_ok=True)
        stray.write_bytes(b"stray")
    for capacity in (None, 1 << 20):
        eviction: EvictionPolicy[ObjectKey] | None = (
            make_eviction_policy(EvictionConfig()) if capacity else None
        )
        ledger.operation()
        with FileBackend(
            FileBackendConfig(root=root, capacity_bytes=capacity), eviction=eviction
        ) as reopened:
            assert reopened.stats().objects == 1
            result, data = _read(reopened, KEY)
            assert (result.outcome, data) == (GetOutcome.HIT, bytes(1000))
    # Nothing of someone else's was deleted: "999999999.x.tmp" only looks like a dead
    # writer's file (temporary files of ours are named .sgs-... and locked by their writer).
    assert [s.exists() for s in strays] == [True] * len(strays)


@pytest.mark.parametrize(
    ("marker", "reason"),
    [
        ("not json", "cannot use"),
        ("", "cannot use"),
        ("[1]", "format version None"),
        (
            json.dumps({"format_version": FORMAT_VERSION - 1}),
            f"format version {FORMAT_VERSION - 1}",
        ),
        (
            json.dumps({"format_version": FORMAT_VERSION + 1}),
            f"format version {FORMAT_VERSION + 1}",
        ),
    ],
)
def test_bad_store_marker_is_refused_at_open(
    tmp_path: Path, ledger: Ledger, marker: str, reason: str
) -> None:
    ledger.fault("bad_marker")
    ledger.operation()
    root = tmp_path / "store"
    root.mkdir()
    (root / "sglang-storage.json").write_text(marker)
    with pytest.raises(BackendUnavailableError) as raised:
        FileBackend(FileBackendConfig(root=root))
    assert reason in str(raised.value)
    assert str(root) in str(raised.value)


def test_fifo_at_an_object_path_does_not_block_reads(store: FileBackend, ledger: Ledger) -> None:
    ledger.fault("foreign_file")
    key = _plant(store, "fifo", lambda p: os.mkfifo(p))
    results: list[Any] = []
    reader = threading.Thread(target=lambda: results.append(_read(store, key)), daemon=True)
    reader.start()
    reader.join(timeout=1.0)
    blocked = reader.is_alive()
    if blocked:
        ledger.hang()
        # Unblock the reader: open the FIFO's other end.
        os.close(os.open(store.path_of(key), os.O_WRONLY | os.O_NONBLOCK))
        reader.join(timeout=10)
    assert not blocked, "get_into blocked on a FIFO"
    assert results[0][0].outcome in (GetOutcome.MISS, GetOutcome.CORRUPT, GetOutcome.ERROR)
