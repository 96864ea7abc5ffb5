"""DeviceKV: a device KV pool described as SGLang holds it, checked on construction."""

from __future__ import annotations

import pytest
import torch

from sglang_storage.errors import ConfigError
from sglang_storage.memory import (
    Attention,
    BudgetConfig,
    HostMemory,
    HostMemoryBudget,
    KVGeometry,
    KVHostPool,
    KVLayout,
    MemoryFacts,
)
from sglang_storage.transfer.device_kv import DeviceKV

LAYERS, PAGE, HEADS, DIM = 2, 4, 2, 8


def geometry(
    attention: Attention = Attention.MHA, changes: dict[str, object] | None = None
) -> KVGeometry:
    mla = attention is Attention.MLA
    fields: dict[str, object] = {
        "attention": attention,
        "layout": KVLayout.PAGE_FIRST,
        "dtype": torch.bfloat16,
        "layer_num": LAYERS,
        "page_size": PAGE,
        "num_pages": 3,
        "head_num": 1 if mla else HEADS,
        "head_dim": 12 if mla else DIM,
    }
    fields.update(changes or {})
    return KVGeometry(**fields)  # type: ignore[arg-type]


def layers(
    shape: tuple[int, ...], dtype: torch.dtype = torch.bfloat16, n: int = LAYERS
) -> list[torch.Tensor]:
    return [torch.zeros(shape, dtype=dtype) for _ in range(n)]


def test_allocate_shapes_like_sglang() -> None:
    mha = DeviceKV.allocate(geometry(), 10)
    assert len(mha.k) == LAYERS
    assert mha.v is not None
    assert len(mha.v) == LAYERS
    assert mha.k[0].shape == (10, HEADS, DIM)
    assert mha.k[0].dtype == torch.bfloat16
    assert (mha.tokens, mha.num_pages, mha.device) == (10, 2, torch.device("cpu"))
    assert len(mha.planes(1)) == 2
    assert mha.planes(1)[1] is mha.v[1]
    mla = DeviceKV.allocate(geometry(Attention.MLA), 8)
    assert mla.v is None
    assert mla.k[1].shape == (8, 1, 12)
    assert mla.planes(0) == (mla.k[0],)


def test_wraps_lists_without_copying() -> None:
    k, v = layers((8, HEADS, DIM)), layers((8, HEADS, DIM))
    kv = DeviceKV(geometry=geometry(), k=k, v=v)
    assert isinstance(kv.k, tuple)
    assert kv.k[0] is k[0]
    assert kv.v is not None
    assert kv.v[1] is v[1]


@pytest.mark.parametrize(
    ("k", "v", "field", "match"),
    [
        (layers((8, HEADS, DIM), torch.float16), layers((8, HEADS, DIM)), "k[0]", "element type"),
        (layers((8, HEADS, DIM + 1)), layers((8, HEADS, DIM)), "k[0]", "shape"),
        (layers((8, HEADS * DIM)), layers((8, HEADS, DIM)), "k[0]", "shape"),
        (layers((8, HEADS, DIM), n=LAYERS + 1), layers((8, HEADS, DIM)), "k", "one per layer"),
        (layers((8, HEADS, DIM)), None, "v", "required for MHA"),
        (layers((8, HEADS, DIM)), layers((9, HEADS, DIM)), "v[0]", "as many tokens"),
        (layers((3, HEADS, DIM)), layers((3, HEADS, DIM)), "k[0]", "hold a page"),
        (
            [torch.zeros(DIM, 8, HEADS, dtype=torch.bfloat16).permute(1, 2, 0)] * LAYERS,
            layers((8, HEADS, DIM)),
            "k[0]",
            "contiguous",
        ),
        (["not a tensor"] * LAYERS, layers((8, HEADS, DIM)), "k[0]", "torch.Tensor"),
        (torch.zeros(8, HEADS, DIM), None, "k/v", "list or tuple"),
    ],
)
def test_mha_validation(k: object, v: object, field: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match) as caught:
        DeviceKV(geometry=geometry(), k=k, v=v)
    assert caught.value.field == field
    assert caught.value.owner == "DeviceKV"


def test_mla_validation() -> None:
    g = geometry(Attention.MLA)
    with pytest.raises(ConfigError, match="must be None for MLA"):
        DeviceKV(geometry=g, k=layers((8, 1, 12)), v=layers((8, 1, 12)))
    with pytest.raises(ConfigError, match="kv_lora_rank"):
        DeviceKV(geometry=g, k=layers((8, 2, 6)))


def test_allocate_refuses_less_than_a_page() -> None:
    with pytest.raises(ConfigError, match="tokens"):
        DeviceKV.allocate(geometry(), PAGE - 1)


@pytest.mark.parametrize(
    "change",
    [
        {"dtype": torch.float16},
        {"layer_num": LAYERS + 1},
        {"head_num": HEADS + 1},
        {"head_dim": DIM * 2},
        {"page_size": PAGE * 2},
    ],
    ids=lambda change: next(iter(change)),
)
def test_require_compatible_names_the_difference(change: dict[str, object]) -> None:
    facts = MemoryFacts(physical=64 << 30, available=64 << 30)
    memory = HostMemory(HostMemoryBudget(BudgetConfig(total=16 << 20, headroom=0), facts=facts))
    host = KVHostPool(geometry(changes=change), memory)
    device = DeviceKV.allocate(geometry(), 16)
    name = next(iter(change))
    with pytest.raises(ConfigError, match="must match the host pool") as caught:
        device.require_compatible(host)
    assert caught.value.field == f"geometry.{name}"
    # A different layout or page count is the host's own business.
    other = KVHostPool(geometry(changes={"layout": KVLayout.PAGE_HEAD, "num_pages": 5}), memory)
    device.require_compatible(other)


def test_device_pages_from_whole_page_tokens() -> None:
    kv = DeviceKV.allocate(geometry(), 3 * PAGE + 2)
    tokens = [2 * PAGE + j for j in range(PAGE)] + list(range(PAGE))
    assert kv.device_pages(tokens, distinct=True, owner="t").tolist() == [2, 0]
    assert kv.device_pages(
        torch.tensor(tokens, dtype=torch.int32), distinct=True, owner="t"
    ).tolist() == [2, 0]
    assert kv.device_pages([], distinct=True, owner="t").tolist() == []
    with pytest.raises(ConfigError, match="outside the device pool"):  # the trailing partial page
        kv.device_pages([3 * PAGE + j for j in range(PAGE)], distinct=False, owner="t")
    assert kv.device_pages(list(range(PAGE)) * 2, distinct=False, owner="t").tolist() == [0, 0]
    with pytest.raises(ConfigError, match="repeated"):
        kv.device_pages(list(range(PAGE)) * 2, distinct=True, owner="t")
