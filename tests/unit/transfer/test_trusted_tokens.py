"""``check_device_tokens=False``: device token indices trusted, as SGLang's kernels trust them.

Checking token indices reads their values, which for a CUDA tensor means a copy to the
host that waits for the GPU; the SGLang controller adapter trusts SGLang's allocator
instead. Here, on CPU: only what needs no look at the values is still checked, and with
valid indices the trusted path moves exactly the bytes the checked path moves, for every
layout. That submitting with CUDA indices does not wait for the GPU is a ``gpu`` test
(``tests/gpu/test_device_pipeline.py``).
"""

from __future__ import annotations

import random

import pytest
import torch
from support.gpu_kv import COMBO_IDS, COMBOS, make_device, make_host, same_bits, tensors

from sglang_storage.errors import ConfigError
from sglang_storage.memory import Attention, KVGeometry, KVLayout, Pinning
from sglang_storage.transfer.device import DeviceHostPipeline, DeviceTransferConfig
from sglang_storage.transfer.device_kv import DeviceKV
from sglang_storage.transfer.io import upload_index

PAGE, HOST_PAGES, DEVICE_PAGES = 4, 8, 12


def geometry(attention: Attention, layout: KVLayout) -> KVGeometry:
    mla = attention is Attention.MLA
    return KVGeometry(
        attention=attention,
        layout=layout,
        dtype=torch.bfloat16,
        layer_num=3,
        page_size=PAGE,
        num_pages=HOST_PAGES,
        head_num=1 if mla else 2,
        head_dim=40 if mla else 16,
    )


def tokens(pages: list[int]) -> torch.Tensor:
    return torch.tensor([p * PAGE + j for p in pages for j in range(PAGE)])


def test_the_option_is_a_validated_bool() -> None:
    assert DeviceTransferConfig().check_device_tokens is True
    with pytest.raises(ConfigError, match="check_device_tokens"):
        DeviceTransferConfig(check_device_tokens="no")  # type: ignore[arg-type]


def test_trusted_pages_checks_only_what_needs_no_look_at_the_values() -> None:
    g = geometry(Attention.MHA, KVLayout.PAGE_FIRST)
    device = DeviceKV.allocate(g, DEVICE_PAGES * PAGE, "cpu")
    assert device.trusted_pages(tokens([5, 0, 9]), owner="t").tolist() == [5, 0, 9]
    assert device.trusted_pages([8, 9, 10, 11], owner="t").tolist() == [2]
    as_int32 = tokens([3]).to(torch.int32)
    assert device.trusted_pages(as_int32, owner="t").dtype == torch.int64
    every_other = tokens([1, 2, 3, 4])[::2]  # not contiguous: still read in place
    assert device.trusted_pages(every_other, owner="t").tolist() == [1, 3]
    with pytest.raises(ConfigError, match="whole pages"):
        device.trusted_pages(tokens([1])[:3], owner="t")
    with pytest.raises(ConfigError, match="integer tensor"):
        device.trusted_pages(tokens([1]).float(), owner="t")
    with pytest.raises(ConfigError, match="1-D"):
        device.trusted_pages(tokens([1, 2]).view(2, PAGE), owner="t")
    # What the checked path refuses, the trusted one takes on the caller's word.
    with pytest.raises(ConfigError, match="whole pages"):
        device.device_pages([1, 2, 3, 4], distinct=False, owner="t")
    assert device.trusted_pages([1, 2, 3, 4], owner="t").tolist() == [0]


@pytest.mark.parametrize(("attention", "layout"), COMBOS, ids=COMBO_IDS)
def test_trusted_and_checked_move_the_same_bytes(attention: Attention, layout: KVLayout) -> None:
    g = geometry(attention, layout)
    rng = random.Random(3)
    sources = rng.sample(range(DEVICE_PAGES), 5)
    targets = rng.sample([p for p in range(DEVICE_PAGES) if p not in sources], 5)
    host_pages = rng.sample(range(HOST_PAGES), 5)
    outcomes = []
    for check in (True, False):
        device = make_device(g, DEVICE_PAGES * PAGE, 1, on="cpu")
        host = make_host(g, Pinning.NEVER, 2)
        config = DeviceTransferConfig(io_backend="torch", check_device_tokens=check)
        with DeviceHostPipeline(device, host, config) as pipe:
            assert pipe.offload(host_pages, tokens(sources)).wait().ok
            assert pipe.load(host_pages[::-1], tokens(targets)).wait().ok
        outcomes.append((host.kv_buffer.clone(), [t.clone() for t in tensors(device)]))
        host.close()
    (host_a, device_a), (host_b, device_b) = outcomes
    assert same_bits(host_a, host_b)
    assert all(same_bits(a, b) for a, b in zip(device_a, device_b, strict=True))
    # And the load really moved something: the targets now hold the sources' rows.
    original = [t.clone() for t in tensors(make_device(g, DEVICE_PAGES * PAGE, 1, on="cpu"))]
    src, dst = tokens(sources[::-1]), tokens(targets)
    assert all(same_bits(b[dst], o[src]) for b, o in zip(device_b, original, strict=True))


def test_an_index_already_on_the_device_is_used_as_it_is() -> None:
    index = torch.arange(6)
    assert upload_index(index, torch.device("cpu")) is index
