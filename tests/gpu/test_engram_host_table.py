"""The Engram lookup kernel reads our host table in place on a GPU, as it reads SGLang's.

Marked ``gpu`` (and ``sglang``): skipped with a reason where CUDA is absent. Nothing is
faked here: the region is registered with the real CUDA runtime and SGLang's Triton
``engram_gather`` reads the rows through the host address (UVA). The CPU twin (layout,
budget, sharing, restore) is ``tests/integration/test_sglang_engram.py``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from support.sglang_hooks import hooks_installed

pytestmark = [pytest.mark.gpu, pytest.mark.sglang]

ROWS, DIM, BLOCK, LAYER = 8192, 256, 32, 3
COLUMNS = (0, ROWS)
NAMES = {"weight": "layers.3.engram.embed.weight", "scale": "layers.3.engram.embed.scale"}


class SoloGroup:
    """SGLang's TP group at TP 1 (``broadcast_object`` returns its input, as SGLang's)."""

    rank_in_group = 0
    world_size = 1

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        return obj

    def barrier(self) -> None:
        pass


@pytest.fixture
def engram(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    from sglang.srt.layers import engram as origin
    from sglang.srt.runtime_context import get_context, reset_context
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler
    from sglang_storage_adapters import engram as adapter
    from sglang_storage_adapters.flags import StorageFlags, hicache_settings

    settings = hicache_settings(
        StorageFlags(backend="file", backend_options={"root": str(tmp_path / "store")})
    )
    extra = json.loads(str(settings.pop("hicache_storage_backend_extra_config")))
    extra["storage_managers"] = ["kv", "engram"]
    args = ServerArgs(
        model_path="dummy", hicache_storage_backend_extra_config=json.dumps(extra), **settings
    )
    set_global_server_args_for_scheduler(args)
    get_context().override("test", model_path=str(tmp_path))
    monkeypatch.setenv("SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE", "1")
    monkeypatch.setenv("SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT", "shared")
    loader = origin.EngramEmbedding._load_rows
    with hooks_installed(origin._HostTable, adapter.install, adapter):
        try:
            yield origin
        finally:
            origin.EngramEmbedding._load_rows = loader
            adapter.shutdown()
    reset_context()


@pytest.mark.parametrize("layout", ["shared", "per_rank"])
def test_the_gather_kernel_reads_our_registered_table_as_sglangs_cpu_lookup(
    tmp_path: Path, engram: Any, layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import safetensors.torch
    from sglang.srt.model_loader.weight_utils import safetensors_weights_iterator
    from sglang.srt.runtime_context import get_parallel
    from sglang_storage_adapters.engram import StorageHostTable

    from sglang_storage.memory import Registration

    g = torch.Generator().manual_seed(5)
    weight = (torch.randn(ROWS, DIM, generator=g) * 4).to(torch.float8_e4m3fn)
    exponents = torch.randint(120, 135, (ROWS, DIM // BLOCK), generator=g, dtype=torch.uint8)
    path = tmp_path / "model.safetensors"
    tensors = {NAMES["weight"]: weight, NAMES["scale"]: exponents.view(torch.float8_e8m0fnu)}
    safetensors.torch.save_file(tensors, path)
    monkeypatch.setenv("SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT", layout)
    group = SoloGroup()
    with get_parallel().override(
        tp_size=1, tp_rank=0, tp_group=group, attn_tp_size=1, attn_tp_rank=0, attn_tp_group=group
    ):
        embed = engram.EngramEmbedding(ROWS, DIM, LAYER, COLUMNS)
        assert type(embed.host_table) is StorageHostTable
        assert embed.host_table.region.state().registration is Registration.REGISTERED
        params = {NAMES["weight"]: embed.weight, NAMES["scale"]: embed.scale}
        for name, tensor in safetensors_weights_iterator([str(path)]):
            params[name].weight_loader(params[name], tensor)
        embed.finish_load(label=f"layer {LAYER}")
        ids = torch.randint(0, ROWS, (512, 4), generator=g)
        on_gpu = embed(ids.cuda()).cpu()  # engram_gather through the host pointer
        monkeypatch.delenv("SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE")
        reference = engram.EngramEmbedding(ROWS, DIM, LAYER, COLUMNS)
        reference.weight.data.copy_(weight)
        reference.scale.data.copy_(tensors[NAMES["scale"]])
        expected = reference(ids)  # SGLang's torch path on CPU
    assert torch.equal(on_gpu.view(torch.int16), expected.view(torch.int16))
