"""The ``sglang.srt.plugins`` entry point installs our adapters and is a no-op without flags.

SGLang's ``load_plugins()`` finds :func:`sglang_storage_adapters.plugin.register` through
package metadata; every installer runs once per process. The HiCache stack strategy it
prepends builds our stack only when the server arguments carry the ``--storage-*``
settings (the ``kv`` manager on); otherwise SGLang's own ``_PlainKvStrategy`` is selected,
exactly as without the plug-in.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.sglang

PAGE = 4


@pytest.fixture(scope="module")
def kv_pool() -> Iterator[Any]:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.runtime_context import get_parallel, reset_context

    override = get_parallel().override(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)
    override.__enter__()
    yield MHATokenToKVPool(
        size=32,
        page_size=PAGE,
        dtype=torch.bfloat16,
        head_num=2,
        head_dim=16,
        layer_num=2,
        device="cpu",
        enable_memory_saver=False,
        kv_cache_layout="nhd",
    )
    override.__exit__(None, None, None)
    reset_context()  # unpublish the server args for whatever this worker runs next


def publish(**fields: Any) -> None:
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", page_size=PAGE, **fields))


def storage_fields(root: Path, managers: list[str] | None = None) -> dict[str, Any]:
    from sglang_storage_adapters.flags import StorageFlags, hicache_settings

    flags = StorageFlags(backend="file", backend_options={"root": str(root)})
    settings = hicache_settings(flags)
    if managers is not None:
        extra = json.loads(str(settings["hicache_storage_backend_extra_config"]))
        extra["storage_managers"] = managers
        settings["hicache_storage_backend_extra_config"] = json.dumps(extra)
    return settings


def selected(kv_pool: Any) -> Any:
    from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler as assembler
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

    return assembler._select_strategy(kv_pool, {ComponentType.FULL})


def test_entry_point_is_registered_under_sglangs_group() -> None:
    from sglang.srt.plugins import GENERAL_PLUGINS_GROUP

    found = {ep.name: ep.value for ep in entry_points(group=GENERAL_PLUGINS_GROUP)}
    assert found.get("sglang_storage") == "sglang_storage_adapters.plugin:register"


def test_load_plugins_installs_the_strategy_once() -> None:
    from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler as assembler
    from sglang.srt.plugins import load_plugins
    from sglang_storage_adapters import plugin
    from sglang_storage_adapters.hicache_controller import StorageStackStrategy

    load_plugins()  # what every SGLang scheduler process does first
    plugin.register()  # idempotent
    ours = [s for s in assembler._STRATEGIES if isinstance(s, StorageStackStrategy)]
    assert len(ours) == 1
    assert assembler._STRATEGIES[0] is ours[0]
    assert "sglang_storage_adapters.hicache_controller:install" in plugin.installed()


def test_without_storage_flags_sglang_picks_its_own_strategy(kv_pool: Any) -> None:
    from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler as assembler
    from sglang_storage_adapters import plugin

    plugin.register()
    publish(enable_hierarchical_cache=True)
    assert type(selected(kv_pool)) is assembler._PlainKvStrategy
    # SGLang's own L3 backend selected by name: still SGLang's stack.
    publish(enable_hierarchical_cache=True, hicache_storage_backend="file")
    assert type(selected(kv_pool)) is assembler._PlainKvStrategy


def test_storage_flags_select_our_strategy(kv_pool: Any, tmp_path: Path) -> None:
    from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler as assembler
    from sglang_storage_adapters import plugin
    from sglang_storage_adapters.hicache_controller import StorageStackStrategy

    plugin.register()
    publish(**storage_fields(tmp_path))
    assert isinstance(selected(kv_pool), StorageStackStrategy)
    # Flags given, but the kv manager not switched on: SGLang's stack.
    publish(**storage_fields(tmp_path, managers=["embedding"]))
    assert type(selected(kv_pool)) is assembler._PlainKvStrategy
    # A layout our host pool does not hold: SGLang's stack.
    publish(**storage_fields(tmp_path), hicache_mem_layout="page_unified")
    assert type(selected(kv_pool)) is assembler._PlainKvStrategy


def test_a_failing_installer_is_logged_and_skipped(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from sglang_storage_adapters import plugin

    monkeypatch.setattr(plugin, "INSTALLERS", ("sglang_storage_adapters.no_such_adapter:install",))
    plugin.register()
    assert "sglang_storage_adapters.no_such_adapter:install" not in plugin.installed()
    assert "installer sglang_storage_adapters.no_such_adapter:install failed" in caplog.text


def test_bad_storage_settings_are_reported_not_ignored(kv_pool: Any) -> None:
    from sglang_storage_adapters import plugin

    from sglang_storage.errors import ConfigError

    plugin.register()
    bad = {"backend_name": "sglang_storage", "storage_backend": "file", "storage_managers": "kv"}
    publish(
        enable_hierarchical_cache=True,
        hicache_storage_backend="dynamic",
        hicache_storage_backend_extra_config=json.dumps(bad),
    )
    with pytest.raises(ConfigError, match="storage_managers"):
        selected(kv_pool)
