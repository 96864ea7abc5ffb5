"""Backends by name: built-ins, options, and third-party backends (registered and plug-in).

The plug-in tests install a real distribution (a ``.dist-info`` with ``entry_points.txt``)
in a temporary directory and run a fresh interpreter with it on ``PYTHONPATH``, so the
registry's lazy entry point loading runs exactly as it would for an installed package,
and this process's registry is never touched by them.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

import attrs
import pytest
from support.backend_conformance import as_buffers

from sglang_storage.core import (
    EvictionPolicy,
    GetRequest,
    GetResult,
    Namespace,
    ObjectKey,
    ObjectSpec,
    PutRequest,
    PutResult,
)
from sglang_storage.core.kinds import DataKind
from sglang_storage.errors import BackendUnavailableError, ConfigError
from sglang_storage.policy.eviction import EvictionConfig, make_eviction_policy
from sglang_storage.storage import (
    Backend,
    BackendContext,
    BackendEntry,
    BackendStats,
    Capabilities,
    FileBackend,
    FileBackendConfig,
    MemoryBackend,
    MemoryBackendConfig,
    backend_entry,
    backend_names,
    create_backend,
    register_backend,
    registry,
)
from sglang_storage.storage.backend import count_prefix, scrub

KEY = Namespace(model="m", kind=DataKind.KV).key("k")


@pytest.fixture
def private_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Registrations made by the test vanish afterwards (the registry is process-global)."""
    monkeypatch.setattr(registry, "_entries", dict(registry._entries))
    monkeypatch.setattr(registry, "_broken", dict(registry._broken))


# ------------------------------------------------------------------ built-ins


def test_builtin_names() -> None:
    names = backend_names()
    assert {"file", "memory"} <= set(names)
    assert names == sorted(names)
    assert backend_entry("file").config_type is FileBackendConfig
    assert backend_entry("memory").config_type is MemoryBackendConfig
    assert backend_entry("file").summary


def test_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError) as caught:
        create_backend("s3", {})
    error = caught.value
    assert (error.field, error.value) == ("name", "s3")
    assert error.allowed is not None
    assert {"file", "memory"} <= set(error.allowed.split(", "))
    assert "file" in str(error)


def test_create_builtins(tmp_path: Path) -> None:
    memory = create_backend("memory")
    assert isinstance(memory, MemoryBackend)
    memory.close()
    file = create_backend("file", {"root": str(tmp_path), "io_threads": 3, "durability": "data"})
    assert isinstance(file, FileBackend)
    assert file.root == tmp_path
    file.close()
    instance = create_backend("file", FileBackendConfig(root=tmp_path))
    assert isinstance(instance, FileBackend)
    instance.close()


@pytest.mark.parametrize(
    ("name", "options", "field"),
    [
        pytest.param("memory", {"capacity": 10}, "capacity", id="unknown-option"),
        pytest.param("file", {"root": "/x", "threads": 2}, "threads", id="unknown-file-option"),
        pytest.param("file", {}, "root", id="missing-root"),
        pytest.param("file", {"root": "/x", "io_threads": "4"}, "io_threads", id="str-for-int"),
        pytest.param("file", {"root": "/x", "io_threads": True}, "io_threads", id="bool-for-int"),
        pytest.param("file", {"root": "/x", "io_threads": 65}, "io_threads", id="out-of-range"),
        pytest.param("file", {"root": 5}, "root", id="int-for-path"),
        pytest.param("file", {"root": "/x", "durability": "eventually"}, "durability", id="enum"),
        pytest.param("memory", {"capacity_bytes": "lots"}, "capacity_bytes", id="bad-size"),
        pytest.param("memory", {"capacity_bytes": -1}, "capacity_bytes", id="negative-size"),
        pytest.param("memory", {"capacity_bytes": 1.5}, "capacity_bytes", id="float-size"),
    ],
)
def test_bad_options_name_the_field(name: str, options: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as caught:
        create_backend(name, options)
    assert field in caught.value.field


def test_unknown_option_lists_the_allowed_ones() -> None:
    with pytest.raises(ConfigError) as caught:
        create_backend("file", {"root": "/x", "fsync": True})
    assert caught.value.allowed == (
        "adopt, capacity_bytes, clean_at_open, durability, file_mode, io_threads, read_only, root"
    )


def test_options_of_another_type_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        create_backend("memory", FileBackendConfig(root=tmp_path))
    assert caught.value.field == "options"


@pytest.mark.parametrize(
    ("size", "expected"),
    [("1GiB", 1 << 30), ("64MiB", 64 << 20), ("4096", 4096), (123456, 123456)],
)
def test_capacity_accepts_size_strings(size: object, expected: int) -> None:
    eviction: EvictionPolicy[ObjectKey] = make_eviction_policy(EvictionConfig(name="lru"))
    backend = create_backend("memory", {"capacity_bytes": size}, eviction=eviction)
    try:
        assert backend.stats().capacity_bytes == expected
        assert backend.capabilities.bounded
    finally:
        backend.close()


def test_capacity_without_eviction_policy_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        create_backend("file", {"root": str(tmp_path), "capacity_bytes": "1GiB"})
    assert caught.value.field == "eviction"


def test_unusable_root_is_unavailable(tmp_path: Path) -> None:
    (tmp_path / "plain-file").write_text("x")
    with pytest.raises(BackendUnavailableError) as caught:
        create_backend("file", {"root": str(tmp_path / "plain-file" / "store")})
    assert caught.value.backend == "file"


# ------------------------------------------------------------------ a third-party backend


@attrs.frozen(kw_only=True)
class DictBackendConfig:
    """Options of the test's third-party backend."""

    label: str = "dict"
    max_objects: int = 100


class DictBackend:
    """A third-party backend written only from the ``Backend`` protocol (no sglang_storage
    backend code reused beyond the public helpers)."""

    def __init__(self, config: DictBackendConfig) -> None:
        self.config = config
        self._objects: dict[ObjectKey, tuple[ObjectSpec, bytes]] = {}
        self._closed = False

    @property
    def name(self) -> str:
        return self.config.label

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(
            zero_copy=False,
            shared_across_processes=False,
            shared_across_hosts=False,
            durable=False,
            bounded=False,
        )

    def _check(self) -> None:
        if self._closed:
            raise BackendUnavailableError(backend=self.name, reason="closed")

    def exists(self, keys: Sequence[ObjectKey]) -> list[bool]:
        self._check()
        return [key in self._objects for key in keys]

    def prefix_hits(self, keys: Sequence[ObjectKey]) -> int:
        self._check()
        return count_prefix(key in self._objects for key in keys)

    def get_into(self, requests: Sequence[GetRequest]) -> list[GetResult]:
        self._check()
        results = []
        for request in requests:
            stored = self._objects.get(request.key)
            if stored is None:
                results.append(GetResult.miss_of(request.key))
                continue
            spec, data = stored
            if spec != request.spec:
                scrub(request.buffers)
                results.append(GetResult.corrupt_of(request.key, _mismatch(request.key)))
                continue
            offset = 0
            for buffer in request.buffers:
                buffer[:] = data[offset : offset + buffer.nbytes]
                offset += buffer.nbytes
            results.append(GetResult.hit_of(request))
        return results

    def put_from(self, requests: Sequence[PutRequest]) -> list[PutResult]:
        self._check()
        results = []
        for request in requests:
            if request.key in self._objects:
                results.append(PutResult.present_of(request.key))
            else:
                data = b"".join(request.buffers)
                self._objects[request.key] = (request.spec, data)
                results.append(PutResult.stored_of(request))
        return results

    def delete(self, keys: Sequence[ObjectKey]) -> None:
        self._check()
        for key in keys:
            self._objects.pop(key, None)

    def clear(self, namespace: Namespace) -> None:
        self._check()
        for key in [k for k in self._objects if k.namespace == namespace]:
            del self._objects[key]

    def stats(self) -> BackendStats:
        return BackendStats(
            objects=len(self._objects),
            bytes=sum(len(data) for _, data in self._objects.values()),
            capacity_bytes=None,
        )

    def close(self) -> None:
        self._closed = True


def _mismatch(key: ObjectKey) -> BackendUnavailableError:
    return BackendUnavailableError(backend="dict", reason=f"{key} has another spec")


def _make_dict_backend(config: DictBackendConfig, context: BackendContext) -> Backend:
    return DictBackend(config)


def test_third_party_backend_satisfies_the_protocol() -> None:
    backend: Backend = DictBackend(DictBackendConfig())  # mypy checks the protocol here
    spec = ObjectSpec.raw(4)
    [put] = backend.put_from([PutRequest(key=KEY, spec=spec, buffers=as_buffers(b"abcd"))])
    assert put.ok
    target = bytearray(4)
    [got] = backend.get_into([GetRequest(key=KEY, spec=spec, buffers=as_buffers(target))])
    assert got.hit
    assert target == b"abcd"
    assert backend.prefix_hits([KEY]) == 1
    backend.close()


@pytest.mark.usefixtures("private_registry")
def test_register_a_third_party_backend() -> None:
    entry = BackendEntry(
        name="dict-test-backend",
        config_type=DictBackendConfig,
        factory=_make_dict_backend,
        summary="a dict, for tests",
    )
    register_backend(entry)
    assert "dict-test-backend" in backend_names()
    assert backend_entry("dict-test-backend") is entry
    backend = create_backend("dict-test-backend", {"label": "mine", "max_objects": 5})
    assert isinstance(backend, DictBackend)
    assert backend.config == DictBackendConfig(label="mine", max_objects=5)
    assert backend.name == "mine"
    data = bytes(range(16))
    spec = ObjectSpec(dtype="int32", shape=(4,))
    [put] = backend.put_from([PutRequest(key=KEY, spec=spec, buffers=as_buffers(data))])
    assert put.nbytes == 16
    target = bytearray(16)
    [got] = backend.get_into([GetRequest(key=KEY, spec=spec, buffers=as_buffers(target))])
    assert got.hit
    assert bytes(target) == data
    with pytest.raises(ConfigError) as caught:
        create_backend("dict-test-backend", {"max_objects": "many"})
    assert caught.value.field == "max_objects"
    # A name is taken once; replace=True overrides it.
    with pytest.raises(ConfigError) as clash:
        register_backend(entry)
    assert clash.value.value == "dict-test-backend"
    other = attrs.evolve(entry, summary="replaced")
    register_backend(other, replace=True)
    assert backend_entry("dict-test-backend").summary == "replaced"
    with pytest.raises(ConfigError):
        register_backend(attrs.evolve(entry, name="file"))
    assert backend_entry("file").config_type is FileBackendConfig


def test_private_registry_left_no_trace() -> None:
    assert "dict-test-backend" not in backend_names()


def test_entry_name_is_validated() -> None:
    with pytest.raises(ConfigError):
        BackendEntry(name="", config_type=DictBackendConfig, factory=_make_dict_backend)


# ------------------------------------------------------------------ plug-ins


PLUGIN_MODULE = """
import attrs
from sglang_storage.storage import BackendEntry, MemoryBackend, MemoryBackendConfig

@attrs.frozen(kw_only=True)
class TinyConfig:
    label: str = "tiny"

def _factory(config, context):
    backend = MemoryBackend(MemoryBackendConfig())
    backend.label = config.label
    return backend

ENTRY = BackendEntry(name="tinyplug", config_type=TinyConfig, factory=_factory)

def make_entry():
    return BackendEntry(name="tinyplug2", config_type=TinyConfig, factory=_factory)

FILE_CLASH = BackendEntry(name="file", config_type=TinyConfig, factory=_factory)
NOT_AN_ENTRY = 42
"""

ENTRY_POINTS = """
[sglang_storage.backends]
tinyplug = tiny_plugin:ENTRY
tinyplug2 = tiny_plugin:make_entry
brokenplug = broken_plugin:ENTRY
notanentry = tiny_plugin:NOT_AN_ENTRY
misnamed = tiny_plugin:ENTRY
missingattr = tiny_plugin:NO_SUCH_NAME
file = tiny_plugin:FILE_CLASH

[some.other.group]
ignored = broken_plugin:ENTRY
"""

PROBE = """
import json
from sglang_storage.core import Namespace, ObjectSpec, PutRequest, GetRequest
from sglang_storage.core.kinds import DataKind
from sglang_storage.errors import BackendUnavailableError
from sglang_storage.storage import FileBackendConfig, backend_entry, backend_names, create_backend

out = {"names": backend_names()}
backend = create_backend("tinyplug", {"label": "from-options"})
out["label"] = backend.label
key = Namespace(model="m", kind=DataKind.KV).key("k")
[put] = backend.put_from([PutRequest(key=key, spec=ObjectSpec.raw(3), buffers=[b"xyz"])])
target = bytearray(3)
[got] = backend.get_into([GetRequest(key=key, spec=ObjectSpec.raw(3), buffers=[target])])
out["round_trip"] = [put.outcome.value, got.outcome.value, target.decode()]
out["tinyplug2"] = type(create_backend("tinyplug2")).__name__
out["file_is_builtin"] = backend_entry("file").config_type is FileBackendConfig
for name in ("brokenplug", "notanentry", "misnamed", "missingattr", "ignored"):
    try:
        create_backend(name)
        out[name] = "created"
    except BackendUnavailableError as error:
        out[name] = ["unavailable", error.backend, error.reason]
    except Exception as error:
        out[name] = [type(error).__name__, str(error)]
print(json.dumps(out))
"""


def _install_plugin(site: Path) -> None:
    dist = site / "tiny_plugin-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: tiny-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(textwrap.dedent(ENTRY_POINTS).lstrip())
    (site / "tiny_plugin.py").write_text(PLUGIN_MODULE)
    (site / "broken_plugin.py").write_text('raise RuntimeError("plug-in exploded on import")\n')


def test_plugins_load_through_entry_points(tmp_path: Path) -> None:
    site = tmp_path / "site"
    _install_plugin(site)
    done = subprocess.run(
        [sys.executable, "-c", PROBE],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["names"] == sorted({*backend_names(), "tinyplug", "tinyplug2"})
    assert out["label"] == "from-options"
    assert out["round_trip"] == ["stored", "hit", "xyz"]
    assert out["tinyplug2"] == "MemoryBackend"
    assert out["file_is_builtin"] is True, "a plug-in cannot take a built-in's name"
    kind, backend, reason = out["brokenplug"]
    assert (kind, backend) == ("unavailable", "brokenplug")
    assert "broken_plugin:ENTRY" in reason
    assert "RuntimeError: plug-in exploded on import" in reason
    assert out["notanentry"][0] == "unavailable"
    assert "TypeError" in out["notanentry"][2]
    assert out["misnamed"][0] == "unavailable"
    assert "entry point 'misnamed' names backend 'tinyplug'" in out["misnamed"][2]
    assert out["missingattr"][0] == "unavailable"
    assert "AttributeError" in out["missingattr"][2]
    assert out["ignored"][0] == "ConfigError", "only the sglang_storage.backends group counts"
    # Each broken plug-in is reported once, as a warning, and the rest still work.
    assert "plug-in 'broken_plugin:ENTRY' failed to load" in done.stderr


def test_without_plugins_only_builtins(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import json; from sglang_storage.storage import backend_names; "
            "print(json.dumps(backend_names()))",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin"},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == backend_names()
    assert {"file", "memory"} <= set(backend_names())


def test_test_only_backends_work_by_name_but_are_not_listed() -> None:
    assert "faulty" not in backend_names()
    assert "faulty" in backend_names(test_backends=True)
    assert backend_entry("faulty").test_only
    assert not backend_entry("file").test_only
    with pytest.raises(ConfigError) as caught:
        backend_entry("nope")
    assert "faulty" not in (caught.value.allowed or "")
    assert "file" in (caught.value.allowed or "")
