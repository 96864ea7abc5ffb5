"""The ``--storage-*`` flags: each flag's checks, the translation into SGLang's own
``hicache_*`` settings, conflicts, and the real (unpatched) SGLang 0.5.23 ``ServerArgs``
built from them.

The flag logic (``sglang_storage_adapters.flags``) imports no SGLang, so its own tests run
without it; the tests that build SGLang's parser and ``ServerArgs`` carry the ``sglang``
marker. They wire the flags in exactly as the patches do (``add_storage_cli_args`` after
``ServerArgs.add_cli_args``, ``apply_storage_args`` before ``from_cli_args``), without
patching anything; ``test_sglang_patches.py`` runs the patched copy itself.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from sglang_storage_adapters.flags import (
    AVAILABLE_MANAGERS,
    HICACHE_CLASS_NAME,
    HICACHE_MODULE_PATH,
    MANAGER_NAMES,
    SGLANG_DEFAULTS,
    STORAGE_DESTS,
    StorageFlags,
    add_storage_cli_args,
    apply_storage_args,
    extra_config,
    hicache_settings,
    host_pool_size,
    parse_backend_config,
    parse_host_memory,
    parse_managers,
    storage_flags_from_args,
)

from sglang_storage.errors import ConfigError

HICACHE_FIELDS = (
    "enable_hierarchical_cache",
    "hicache_storage_backend",
    "hicache_storage_backend_extra_config",
    "hicache_size",
    "hicache_ratio",
    "hicache_write_policy",
    "hicache_storage_prefetch_policy",
)


def _namespace(**values: object) -> argparse.Namespace:
    """A namespace as SGLang's parser leaves it: defaults, plus ``values``."""
    fields: dict[str, object] = dict(SGLANG_DEFAULTS)
    fields.update(dict.fromkeys(STORAGE_DESTS))
    fields["file_storage_path"] = None
    fields.update(values)
    return argparse.Namespace(**fields)


def _error(call: Callable[[], object]) -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        call()
    return caught.value


# ---------------------------------------------------------------------------- single flags


def test_backend_config_accepts_a_json_object() -> None:
    assert parse_backend_config('{"root": "/x", "capacity_bytes": "1GiB"}') == {
        "root": "/x",
        "capacity_bytes": "1GiB",
    }


@pytest.mark.parametrize(
    ("suffix", "text"),
    [
        (".json", '{"root": "/x", "io_threads": 4}'),
        (".toml", 'root = "/x"\nio_threads = 4\n'),
        (".yaml", "root: /x\nio_threads: 4\n"),
    ],
)
def test_backend_config_reads_a_file(tmp_path: Path, suffix: str, text: str) -> None:
    path = tmp_path / f"options{suffix}"
    path.write_text(text)
    assert parse_backend_config(f"@{path}") == {"root": "/x", "io_threads": 4}


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("{root: 1}", "is not valid JSON"),
        ("[1, 2]", "must hold an object of options, not list"),
        ("@/nonexistent/options.json", "cannot be read"),
        ("@options.ini", "unknown format"),
    ],
)
def test_backend_config_rejects_what_is_not_an_object_of_options(text: str, words: str) -> None:
    error = _error(lambda: parse_backend_config(text))
    assert error.field == "--storage-backend-config"
    assert words in str(error)


def test_backend_config_rejects_a_toml_value_json_cannot_carry(tmp_path: Path) -> None:
    path = tmp_path / "options.toml"
    path.write_text("when = 1979-05-27\n")
    assert "JSON cannot carry" in str(_error(lambda: parse_backend_config(f"@{path}")))


def test_host_memory_is_exact_in_either_unit_system_and_any_case() -> None:
    assert parse_host_memory("64GiB") == 64 * 2**30
    assert parse_host_memory("10gib") == 10 * 2**30
    assert parse_host_memory("1GB") == 10**9
    assert parse_host_memory("999MB") == 999 * 10**6  # under 1 GB is fine
    assert parse_host_memory("512MiB") == 2**29
    assert "must be more than 0" in str(_error(lambda: parse_host_memory("0")))
    gigs = str(_error(lambda: parse_host_memory("64 gigs")))
    assert "did you mean 64GB or 64GiB?" in gigs
    assert "KiB" in gigs  # lists the units


def test_host_memory_help_states_both_unit_systems() -> None:
    parser = argparse.ArgumentParser()
    add_storage_cli_args(parser)
    text = " ".join(parser.format_help().split())
    assert "powers of 1000" in text
    assert "powers of 1024" in text


@pytest.mark.parametrize(
    ("text", "exact"),
    [
        ("512MiB", 2**29),
        ("10GiB", 10 * 2**30),
        ("1GB", 10**9),
        ("3", 3),
        ("7777777777", 7777777777),
    ],
)
def test_host_pool_gets_the_exact_bytes_and_sglang_whole_gb(text: str, exact: int) -> None:
    flags = StorageFlags(backend="memory", host_memory_bytes=parse_host_memory(text))
    settings = hicache_settings(flags)
    assert settings["hicache_size"] == max(1, exact // 10**9)
    server_args = argparse.Namespace(**settings)
    host_size = host_pool_size(server_args)
    assert host_size is not None
    # SGLang's own sizing of a host pool from host_size, for several bytes-per-token:
    # the pool holds exactly exact // bytes_per_token tokens.
    for per_token in (1, 2, 3, 4096, 131072, 2**29, exact):
        assert int(host_size * 1e9 // per_token) == exact // per_token


def test_host_pool_size_is_none_without_the_flag() -> None:
    settings = hicache_settings(StorageFlags(backend="memory"))
    assert host_pool_size(argparse.Namespace(**settings)) is None
    assert host_pool_size(argparse.Namespace()) is None


def test_host_memory_is_echoed_at_start(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_storage_cli_args(parser)
    args = parser.parse_args(["--storage-backend", "memory", "--storage-host-memory", "10GB"])
    for field, value in SGLANG_DEFAULTS.items():
        setattr(args, field, value)
    apply_storage_args(args, parser)
    assert "--storage-host-memory is 10000000000 bytes (9.31 GiB) per rank" in (
        capsys.readouterr().err
    )


def test_managers_accept_the_served_ones_and_refuse_the_others() -> None:
    assert parse_managers(" kv ") == ("kv",)
    served = "kv,decode,sparse,npu-sparse,embedding,experts,records,weights,engram"
    assert parse_managers(served) == AVAILABLE_MANAGERS == MANAGER_NAMES
    unknown = _error(lambda: parse_managers("kv,vision"))
    assert "names no sglang_storage manager" in str(unknown)
    assert unknown.allowed == ", ".join(MANAGER_NAMES)
    assert "without empty items" in str(_error(lambda: parse_managers("kv,")))


# ---------------------------------------------------------------------------- StorageFlags


def test_flags_check_the_backend_options_against_its_config_class(tmp_path: Path) -> None:
    StorageFlags(backend="file", backend_options={"root": str(tmp_path)})
    missing = _error(lambda: StorageFlags(backend="file"))
    assert str(missing).startswith("file backend options (--storage-backend-config).root")
    assert "is required" in str(missing)
    unknown = _error(lambda: StorageFlags(backend="memory", backend_options={"root": "/x"}))
    assert "unknown option" in str(unknown)
    assert unknown.allowed == "capacity_bytes"
    bad = _error(
        lambda: StorageFlags(
            backend="file", backend_options={"root": "/x", "capacity_bytes": "lots"}
        )
    )
    assert "capacity_bytes" in str(bad)


def test_file_backend_root_may_come_from_file_storage_path() -> None:
    flags = StorageFlags(backend="file", file_storage_path="/var/cache/kv")
    assert flags.backend_options == {}  # the adapter fills root in; the flags only check


def test_flags_reject_unknown_backends_and_misplaced_values() -> None:
    unknown = _error(lambda: StorageFlags(backend="nope"))
    assert unknown.field == "--storage-backend"
    assert "memory" in (unknown.allowed or "")
    assert "must be >= 1" in str(
        _error(lambda: StorageFlags(backend="memory", host_memory_bytes=0))
    )
    timeouts = _error(
        lambda: StorageFlags(
            backend="memory", prefetch_policy="best_effort", prefetch_timeout_base=2.0
        )
    )
    assert "applies only to the timeout prefetch policy" in str(timeouts)
    assert "is not a supported choice (got 'vision')" in str(
        _error(lambda: StorageFlags(backend="memory", managers=("kv", "vision")))
    )


def test_translation_is_sglang_s_dynamic_backend_with_our_adapter(tmp_path: Path) -> None:
    flags = StorageFlags(
        backend="file",
        backend_options={"root": str(tmp_path), "capacity_bytes": "500GiB"},
        host_memory_bytes=parse_host_memory("64GiB"),
        write_policy="write_back",
        prefetch_policy="timeout",
        prefetch_threshold=128,
        prefetch_timeout_base=2.0,
        prefetch_timeout_per_ki_token=0.5,
    )
    assert extra_config(flags) == {
        "backend_name": "sglang_storage",
        "module_path": HICACHE_MODULE_PATH,
        "class_name": HICACHE_CLASS_NAME,
        "interface_v1": 1,
        "storage_backend": "file",
        "storage_options": {"root": str(tmp_path), "capacity_bytes": "500GiB"},
        "storage_managers": list(AVAILABLE_MANAGERS),
        "storage_host_pool_bytes": 64 * 2**30,
        "prefetch_threshold": 128,
        "prefetch_timeout_base": 2.0,
        "prefetch_timeout_per_ki_token": 0.5,
    }
    settings = hicache_settings(flags)
    assert json.loads(str(settings.pop("hicache_storage_backend_extra_config"))) == extra_config(
        flags
    )
    assert settings == {
        "enable_hierarchical_cache": True,
        "hicache_storage_backend": "dynamic",
        "hicache_size": 68,  # 64 GiB = 68.7e9 bytes, whole GB rounded down
        "hicache_write_policy": "write_back",
        "hicache_storage_prefetch_policy": "timeout",
    }


def test_translation_leaves_unset_flags_to_sglang() -> None:
    flags = StorageFlags(backend="memory")
    assert set(hicache_settings(flags)) == {
        "enable_hierarchical_cache",
        "hicache_storage_backend",
        "hicache_storage_backend_extra_config",
    }
    assert not any(key.startswith("prefetch_") for key in extra_config(flags))


@pytest.mark.sglang
def test_hicache_adapter_constants_name_the_adapter_class() -> None:
    from sglang_storage_adapters import hicache_storage

    assert hicache_storage.__name__ == HICACHE_MODULE_PATH
    assert hasattr(hicache_storage, HICACHE_CLASS_NAME)
    # The adapter accepts every key the flags write, once SGLang popped its prefetch keys.
    flags = StorageFlags(backend="memory", prefetch_threshold=1)
    keys = {k: v for k, v in extra_config(flags).items() if not k.startswith("prefetch_")}
    settings = hicache_storage.parse_extra_config(keys)
    assert settings.storage_backend == "memory"


# ---------------------------------------------------------------------------- apply_storage_args


def test_no_storage_flag_leaves_the_namespace_untouched() -> None:
    args = _namespace(hicache_storage_backend="file", hicache_size=7)
    before = dict(vars(args))
    assert apply_storage_args(args) is args
    assert vars(args) == before


def test_storage_flags_become_hicache_fields_once() -> None:
    args = _namespace(storage_backend="memory", storage_write_policy="write_through_selective")
    translated = apply_storage_args(args)
    assert translated is not args
    assert args.storage_backend == "memory"  # the input is not modified
    assert all(getattr(translated, dest) is None for dest in STORAGE_DESTS)
    assert translated.enable_hierarchical_cache is True
    assert translated.hicache_storage_backend == "dynamic"
    assert translated.hicache_write_policy == "write_through_selective"
    # prepare_server_args and from_cli_args both call it: the second call is a no-op.
    assert apply_storage_args(translated) is translated


def test_other_storage_flags_need_storage_backend() -> None:
    error = _error(lambda: apply_storage_args(_namespace(storage_host_memory=2 * 10**9)))
    assert error.field == "--storage-host-memory"
    assert "needs --storage-backend" in str(error)


@pytest.mark.parametrize(
    ("ours", "theirs", "words"),
    [
        ({}, {"hicache_storage_backend": "file"}, "--hicache-storage-backend"),
        ({}, {"hicache_storage_backend_extra_config": "{}"}, "--hicache-storage-backend-extra"),
        ({}, {"disable_radix_cache": True}, "--disable-radix-cache"),
        ({}, {"enable_unified_cache_external_linker": True}, "--enable-unified-cache-external"),
        ({"storage_host_memory": 2 * 10**9}, {"hicache_size": 4}, "--hicache-size"),
        ({"storage_host_memory": 2 * 10**9}, {"hicache_ratio": 2.0}, "--hicache-ratio"),
        (
            {"storage_write_policy": "write_back"},
            {"hicache_write_policy": "write_through_selective"},
            "--hicache-write-policy",
        ),
        (
            {"storage_prefetch_policy": "best_effort"},
            {"hicache_storage_prefetch_policy": "wait_complete"},
            "--hicache-storage-prefetch-policy",
        ),
        (
            {"storage_prefetch_timeout_base": 3.0},
            {"hicache_storage_prefetch_policy": "best_effort"},
            "applies only to the timeout prefetch policy",
        ),
    ],
)
def test_conflicts_with_hicache_flags_are_errors(
    ours: dict[str, object], theirs: dict[str, object], words: str
) -> None:
    args = _namespace(storage_backend="memory", **ours, **theirs)
    assert words in str(_error(lambda: apply_storage_args(args)))


def test_hicache_flags_that_do_not_overlap_still_combine() -> None:
    args = _namespace(
        storage_backend="memory",
        enable_hierarchical_cache=True,
        hicache_ratio=1.5,
        hicache_write_policy="write_back",
    )
    translated = apply_storage_args(args)
    assert translated.hicache_ratio == 1.5
    assert translated.hicache_write_policy == "write_back"


def test_with_a_parser_a_bad_flag_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="sglang serve")
    with pytest.raises(SystemExit) as caught:
        apply_storage_args(_namespace(storage_backend="file"), parser)
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert "sglang serve: error: file backend options (--storage-backend-config).root" in err


# ---------------------------------------------------------------------------- real ServerArgs


def _sglang_parser() -> argparse.ArgumentParser:
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="sglang serve")
    ServerArgs.add_cli_args(parser)
    # What patch 0001 adds (already there when the venv's SGLang is patched).
    with contextlib.suppress(argparse.ArgumentError):
        add_storage_cli_args(parser)
    return parser


def _server_args(argv: list[str]) -> Any:
    from sglang.srt.server_args import ServerArgs

    parser = _sglang_parser()
    args = apply_storage_args(parser.parse_args(argv), parser)  # what patch 0002 adds
    return ServerArgs.from_cli_args(args)


@pytest.mark.sglang
def test_sglang_defaults_are_the_ones_the_conflict_checks_assume() -> None:
    import msgspec
    from sglang.srt.server_args import ServerArgs

    declared = {field.name: field.default for field in msgspec.structs.fields(ServerArgs)}
    assert {name: declared[name] for name in SGLANG_DEFAULTS} == dict(SGLANG_DEFAULTS)
    assert not set(STORAGE_DESTS) & set(declared), "a --storage-* dest is a ServerArgs field"


@pytest.mark.sglang
def test_without_storage_flags_server_args_are_unchanged() -> None:
    import msgspec
    from sglang.srt.server_args import ServerArgs

    argv = ["--model-path", "m", "--enable-hicache", "--hicache-storage-backend", "file"]
    plain = argparse.ArgumentParser()
    ServerArgs.add_cli_args(plain)
    expected = ServerArgs.from_cli_args(plain.parse_args(argv))
    assert msgspec.structs.asdict(_server_args(argv)) == msgspec.structs.asdict(expected)


@pytest.mark.sglang
def test_server_args_from_storage_flags(tmp_path: Path) -> None:
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (
        HybridCacheController,
    )

    server_args = _server_args(
        [
            "--model-path",
            "m",
            "--storage-backend",
            "file",
            "--storage-backend-config",
            json.dumps({"root": str(tmp_path), "capacity_bytes": "10GiB"}),
            "--storage-host-memory",
            "16GB",
            "--storage-write-policy",
            "write_back",
            "--storage-prefetch-policy",
            "timeout",
            "--storage-prefetch-threshold",
            "64",
            "--storage-prefetch-timeout-per-ki-token",
            "0.125",
            "--storage-managers",
            "kv",
        ]
    )
    assert server_args.enable_hierarchical_cache is True
    assert server_args.hicache_storage_backend == "dynamic"
    assert server_args.hicache_size == 16
    assert server_args.hicache_write_policy == "write_back"
    assert server_args.hicache_storage_prefetch_policy == "timeout"
    # SGLang's own parser of the extra config: prefetch keys popped, the rest kept.
    extra, threshold, base, per_ki, pass_prefix = (
        HybridCacheController.parse_storage_backend_extra_config(
            server_args.hicache_storage_backend_extra_config
        )
    )
    assert (threshold, base, per_ki, pass_prefix) == (64, 1, 0.125, False)
    assert extra == {
        "backend_name": "sglang_storage",
        "module_path": HICACHE_MODULE_PATH,
        "class_name": HICACHE_CLASS_NAME,
        "interface_v1": 1,
        "storage_backend": "file",
        "storage_options": {"root": str(tmp_path), "capacity_bytes": "10GiB"},
        "storage_managers": ["kv"],
        "storage_host_pool_bytes": 16 * 10**9,
    }


@pytest.mark.sglang
@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--storage-backend", "nope"], "argument --storage-backend: is not a known"),
        (["--storage-write-policy", "sometimes"], "argument --storage-write-policy: invalid"),
        (["--storage-host-memory", "0"], "argument --storage-host-memory: must be more than 0"),
        (["--storage-managers", "kv,vision"], "names no sglang_storage manager"),
        (["--storage-prefetch-threshold", "-1"], "argument --storage-prefetch-threshold: must"),
        (["--storage-backend-config", "{"], "argument --storage-backend-config: is not valid"),
        (["--storage-backend", "memory", "--hicache-storage-backend", "file"], "cannot be"),
        (["--storage-backend", "file"], "root: is required"),
        (["--storage-backend", "memory", "--storage-backend-config", '{"x": 1}'], "unknown"),
        (["--storage-prefetch-policy", "best_effort"], "needs --storage-backend"),
    ],
)
def test_bad_storage_flags_are_usage_errors(
    argv: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as caught:
        _server_args(["--model-path", "m", *argv])
    assert caught.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("sglang serve: error: ")
    assert words in last


@pytest.mark.sglang
def test_help_lists_the_storage_group() -> None:
    text = _sglang_parser().format_help()
    assert "sglang_storage (--storage-*)" in text
    for dest in STORAGE_DESTS:
        assert "--" + dest.replace("_", "-") in text


# ------------------------------------------------------------------ --storage-config

CONFIG_TOML = """
backend = "file"
host-memory = "512MiB"
write_policy = "write_back"
prefetch-policy = "timeout"
prefetch-threshold = 64
prefetch-timeout-base = 2
managers = ["kv", "decode"]

[backend-config]
root = "{root}"
capacity_bytes = "1GiB"
"""


def _config_args(tmp_path: Path, text: str, *argv: str, suffix: str = ".toml") -> Any:
    path = tmp_path / f"storage{suffix}"
    path.write_text(text)
    parser = argparse.ArgumentParser()
    add_storage_cli_args(parser)
    args = parser.parse_args(["--storage-config", str(path), *argv])
    for field, value in SGLANG_DEFAULTS.items():
        setattr(args, field, value)
    args.file_storage_path = None
    return args


def test_config_file_round_trips_into_the_same_flags_as_the_command_line(
    tmp_path: Path,
) -> None:
    root = str(tmp_path / "kv")
    from_file = storage_flags_from_args(_config_args(tmp_path, CONFIG_TOML.format(root=root)))
    parser = argparse.ArgumentParser()
    add_storage_cli_args(parser)
    options = json.dumps({"root": root, "capacity_bytes": "1GiB"})
    argv = [
        "--storage-backend", "file", "--storage-backend-config", options,
        "--storage-host-memory", "512MiB", "--storage-write-policy", "write_back",
        "--storage-prefetch-policy", "timeout", "--storage-prefetch-threshold", "64",
        "--storage-prefetch-timeout-base", "2", "--storage-managers", "kv,decode",
    ]  # fmt: skip
    from_flags = storage_flags_from_args(parser.parse_args(argv))
    assert from_file is not None
    assert from_file == from_flags
    assert from_file.host_memory_bytes == 2**29
    assert from_flags is not None
    assert hicache_settings(from_file) == hicache_settings(from_flags)


def test_config_file_as_json(tmp_path: Path) -> None:
    text = json.dumps({"backend": "memory", "host-memory": 2**20, "managers": "kv"})
    flags = storage_flags_from_args(_config_args(tmp_path, text, suffix=".json"))
    assert flags is not None
    assert (flags.backend, flags.host_memory_bytes, flags.managers) == ("memory", 2**20, ("kv",))


def test_flags_override_the_config_file(tmp_path: Path) -> None:
    root = str(tmp_path / "kv")
    args = _config_args(
        tmp_path,
        CONFIG_TOML.format(root=root),
        "--storage-write-policy", "write_through",
        "--storage-backend-config", json.dumps({"root": root}),
    )  # fmt: skip
    flags = storage_flags_from_args(args)
    assert flags is not None
    assert flags.write_policy == "write_through"
    assert dict(flags.backend_options) == {"root": root}  # replaced, not merged
    assert flags.prefetch_threshold == 64  # the file's, where no flag says otherwise


def test_config_file_sets_sglang_fields_once(tmp_path: Path) -> None:
    args = _config_args(tmp_path, 'backend = "memory"\nhost-memory = "2GB"\n')
    translated = apply_storage_args(args)
    assert translated.storage_config is None
    assert translated.hicache_size == 2
    assert apply_storage_args(translated) is translated


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ('backend = "file"\nhostmemory = "1GB"\n', "did you mean 'host-memory'?"),
        ('backend = "nope"\n', "is not a known sglang_storage backend"),
        ('backend = "memory"\nhost-memory = "4 gigs"\n', "did you mean 4GB or 4GiB?"),
        ('backend = "memory"\nwrite-policy = "sometimes"\n', "write-policy"),
        ('backend = "memory"\nmanagers = ["kv", "vision"]\n', "names no sglang_storage manager"),
        ('backend = "file"\n[backend-config]\nrot = "/x"\n', "did you mean 'rot' -> 'root'?"),
        ('backend = "memory"\nprefetch-policy = "best_effort"\nprefetch-timeout-base = 1\n',
         "applies only to the timeout prefetch policy"),
        ('backend = "memory"\nprefetch-threshold = true\n', "prefetch-threshold"),
        ("backend = \n", "is not valid TOML"),
    ],
)  # fmt: skip
def test_bad_config_files_are_usage_errors_naming_file_and_key(
    tmp_path: Path, text: str, words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    parser = argparse.ArgumentParser(prog="sglang serve")
    add_storage_cli_args(parser)
    with pytest.raises(SystemExit) as caught:
        parser.parse_args(["--storage-config", str(path)])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert words in err
    assert str(path) in err


def test_every_storage_flag_has_a_config_file_key() -> None:
    from sglang_storage.cli.settings import SETTING_KEYS

    flags = {dest.removeprefix("storage_").replace("_", "-") for dest in STORAGE_DESTS}
    assert flags - {"config"} == set(SETTING_KEYS)
