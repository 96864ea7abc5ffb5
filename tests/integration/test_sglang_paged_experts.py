"""SGLang 0.5.23's paged-experts host store on our budget, built through SGLang's own names.

The adapter replaces ``HostExpertStore`` through SGLang's HookRegistry; SGLang's
``PagedExpertsMoEMethod`` (``method.py``) and its repack (``formats.py``) construct it by
the names they imported, so the tests construct it through those names too. The layer is
what the store reads of SGLang's ``FusedMoE`` layer: one ``[K, *row]`` tensor per paged
weight (here on the CPU, which stands for the GPU slots). ``page_in`` is SGLang's own code
running on our rows; ``gather`` is a CUDA kernel and is not run here.
"""

from __future__ import annotations

import gc
import json
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from support.sglang_hooks import hooks_installed

pytestmark = pytest.mark.sglang

EXPERTS, SLOTS = 8, 2
NAMES = ("w13_weight", "w2_weight", "w13_scale")


def publish(
    root: Path, *, managers: list[str] | None = None, host_memory: int | None = None
) -> Any:
    """ServerArgs as ``--storage-backend file`` leaves them, published for this process."""
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler
    from sglang_storage_adapters.flags import StorageFlags, hicache_settings

    settings = hicache_settings(StorageFlags(backend="file", backend_options={"root": str(root)}))
    extra = json.loads(str(settings.pop("hicache_storage_backend_extra_config")))
    if managers is not None:
        extra["storage_managers"] = managers
    if host_memory is not None:
        extra["host_memory"] = host_memory
    args = ServerArgs(
        model_path="dummy", hicache_storage_backend_extra_config=json.dumps(extra), **settings
    )
    set_global_server_args_for_scheduler(args)
    return args


@pytest.fixture
def installed() -> Iterator[Any]:
    """Our store installed as SGLang's plug-in loader would; SGLang's names restored after."""
    from sglang.srt.layers.moe.paged_experts import store as origin
    from sglang.srt.runtime_context import reset_context
    from sglang_storage_adapters import experts

    with hooks_installed(origin.HostExpertStore, experts.install, experts):
        from sglang.srt.layers.moe.paged_experts import method

        yield method.HostExpertStore  # the name PagedExpertsMoEMethod constructs
    reset_context()


def layer() -> Any:
    """The paged tensors of one MoE layer: K GPU slots of each (CPU tensors here)."""
    return types.SimpleNamespace(
        w13_weight=torch.nn.Parameter(torch.zeros(SLOTS, 6, 4, dtype=torch.bfloat16)),
        w2_weight=torch.nn.Parameter(torch.zeros(SLOTS, 4, 3, dtype=torch.bfloat16)),
        w13_scale=torch.nn.Parameter(
            torch.zeros(SLOTS, 2, dtype=torch.float32).to(torch.float8_e8m0fnu)
        ),
    )


def row_bytes(moe: Any) -> int:
    return sum(getattr(moe, n)[0].numel() * getattr(moe, n).element_size() for n in NAMES)


def used() -> int:
    from sglang.srt.runtime_context import get_server_args
    from sglang_storage_adapters.runtime import process_runtime, runtime_settings

    settings = runtime_settings(get_server_args())
    assert settings is not None
    return process_runtime(settings).used("experts")


def test_experts_live_in_the_budget_and_page_in_exactly(tmp_path: Path, installed: Any) -> None:
    from sglang_storage_adapters.experts import StorageHostExpertStore

    publish(tmp_path)
    moe = layer()
    before = used()
    store = installed(layer=moe, names=list(NAMES), num_experts=EXPERTS, pin=False)
    assert type(store) is StorageHostExpertStore
    assert used() - before == EXPERTS * row_bytes(moe)  # every expert of every tensor
    for name in NAMES:
        host, gpu = store.host[name], getattr(moe, name)
        assert host.shape == (EXPERTS, *gpu.shape[1:])
        assert host.dtype == gpu.dtype
    # The loader writes one expert's rows through a view, as SGLang's weight loader does.
    generator = torch.Generator().manual_seed(3)
    for name in NAMES:
        host = store.host[name]
        nbytes = host[0].numel() * host.element_size()
        for e in range(EXPERTS):
            data = torch.randint(0, 255, (nbytes,), generator=generator, dtype=torch.uint8)
            host[e : e + 1].view(torch.uint8).reshape(-1).copy_(data)
    store.page_in(moe, [(5, 0), (7, 1)])  # SGLang's own copy into the GPU slots
    for name in NAMES:
        gpu, host = getattr(moe, name).data, store.host[name]
        assert torch.equal(gpu[0].view(torch.uint8), host[5].view(torch.uint8))
        assert torch.equal(gpu[1].view(torch.uint8), host[7].view(torch.uint8))

    # A dropped store (the staged store a repack replaces) gives its memory back.
    del store
    gc.collect()
    assert used() == before


def test_a_budget_too_small_refuses_the_store_and_keeps_nothing(
    tmp_path: Path, installed: Any
) -> None:
    from sglang_storage.errors import CapacityError

    moe = layer()
    publish(tmp_path, host_memory=EXPERTS * row_bytes(moe) // 2)
    before = used()
    with pytest.raises(CapacityError):
        installed(layer=moe, names=list(NAMES), num_experts=EXPERTS, pin=False)
    gc.collect()
    assert used() == before  # the tensors allocated before the refusal went back


def test_without_experts_in_storage_managers_sglang_builds_its_own_store(
    tmp_path: Path, installed: Any
) -> None:
    from sglang_storage_adapters.experts import StorageHostExpertStore

    publish(tmp_path, managers=["kv"])
    store = installed(layer=layer(), names=list(NAMES), num_experts=EXPERTS, pin=False)
    assert type(store) is StorageHostExpertStore.__bases__[0]  # SGLang's own class
    assert store.host["w2_weight"].shape == (EXPERTS, 4, 3)
