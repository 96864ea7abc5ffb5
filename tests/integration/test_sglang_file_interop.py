"""Pages stored by our file backend carry exactly the bytes SGLang 0.5.23's ``HiCacheFile`` writes.

For each KV layout, SGLang's real host pool and our :class:`KVHostPool` hold the same
bytes. SGLang's ``HiCacheFile.batch_set`` stores its flat data pages under keys from
SGLang's own ``get_hash_str``; our backend stores the same pages (``page_views`` /
``page_spec``) under keys from our ``page_hashes``. Then:

- the keys are the same strings;
- each of our objects is a 512-byte header followed by exactly the bytes of SGLang's file;
- reading our objects back into a fresh pool (in another page order) reproduces every page.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from support.sglang_pools import build_hicache_file, build_sglang_host_pool

from sglang_storage.core import GetRequest, PutRequest
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
from sglang_storage.storage import FileBackend, FileBackendConfig
from sglang_storage.storage.format import HEADER_SIZE
from sglang_storage.storage.keys import kv_namespace, model_fingerprint, page_hashes

pytestmark = pytest.mark.sglang

LAYERS, PAGE, PAGES, HEADS, HEAD_DIM = 3, 4, 5, 2, 16
MLA_WIDTH = 48
CASES = [
    (attention, layout)
    for attention in Attention
    for layout in KVLayout
    if not (attention is Attention.MLA and layout is KVLayout.PAGE_HEAD)
]


def _memory() -> HostMemory:
    facts = MemoryFacts(physical=64 << 30, available=64 << 30)
    return HostMemory(HostMemoryBudget(BudgetConfig(total=1 << 30), facts=facts))


@pytest.mark.parametrize(("attention", "layout"), CASES, ids=lambda c: str(c.value))
def test_our_payload_is_hicache_files_page(
    tmp_path: Path, attention: Attention, layout: KVLayout
) -> None:
    from sglang.srt.mem_cache.utils import get_hash_str

    mla = attention is Attention.MLA
    theirs = build_sglang_host_pool(
        attention=attention.value,
        layout=layout.value,
        dtype=torch.bfloat16,
        layer_num=LAYERS,
        page_size=PAGE,
        num_pages=PAGES,
        head_num=HEADS,
        head_dim=HEAD_DIM,
        kv_lora_rank=32,
        qk_rope_head_dim=16,
    )
    geometry = KVGeometry(
        attention=attention,
        layout=layout,
        dtype=torch.bfloat16,
        layer_num=LAYERS,
        page_size=PAGE,
        num_pages=PAGES,
        head_num=1 if mla else HEADS,
        head_dim=MLA_WIDTH if mla else HEAD_DIM,
    )
    generator = torch.Generator().manual_seed(7)
    raw = theirs.kv_buffer.view(-1).view(torch.uint8)
    raw.copy_(torch.randint(0, 256, (raw.numel(),), dtype=torch.uint8, generator=generator))

    tokens = [random.Random(3).randrange(2**31) for _ in range(PAGES * PAGE)]
    their_keys: list[str] = get_hash_str(tokens, page_size=PAGE)
    our_names = page_hashes(tokens, PAGE)
    assert our_names == their_keys

    sglang_dir, ours_dir = tmp_path / "hicache", tmp_path / "ours"
    store = build_hicache_file(
        sglang_dir, mla=mla, page_first=layout is not KVLayout.LAYER_FIRST, model_name="interop"
    )
    assert store.batch_set(their_keys, [theirs.get_data_page(p * PAGE) for p in range(PAGES)])

    namespace = kv_namespace(model_fingerprint("interop", layout=layout.value), mla=mla)
    keys = [namespace.key(name) for name in our_names]
    with (
        KVHostPool(geometry, _memory()) as pool,
        FileBackend(FileBackendConfig(root=ours_dir)) as backend,
    ):
        pool.kv_buffer.copy_(theirs.kv_buffer.view(pool.kv_buffer.shape))
        spec = pool.page_spec
        puts = [
            PutRequest(key=k, spec=spec, buffers=pool.page_views(p)) for p, k in enumerate(keys)
        ]
        assert all(r.ok for r in backend.put_from(puts))

        files = {path.name: path.read_bytes() for path in sglang_dir.iterdir()}
        assert len(files) == PAGES
        for page, (key, name) in enumerate(zip(keys, their_keys, strict=True)):
            (their_file,) = [data for fname, data in files.items() if fname.startswith(name)]
            ours_object = backend.path_of(key).read_bytes()
            assert len(ours_object) == HEADER_SIZE + len(their_file)
            assert ours_object[HEADER_SIZE:] == their_file, f"page {page}"

        # Back into a fresh pool, in reverse page order: every page comes home.
        with KVHostPool(geometry, _memory()) as fresh:
            order = list(reversed(range(PAGES)))
            gets = [
                GetRequest(key=keys[p], spec=spec, buffers=fresh.page_views(slot))
                for slot, p in enumerate(order)
            ]
            assert all(r.hit for r in backend.get_into(gets))
            for slot, p in enumerate(order):
                assert torch.equal(
                    fresh.read_page(slot).view(torch.uint8), pool.read_page(p).view(torch.uint8)
                )
