"""SGLang keys a peer controls become object names one to one (the HiCache adapter).

SGLang hands the adapter arbitrary strings as keys. One that is not a safe file name
(``../../etc/passwd``) is stored under a digest name, ``sha256-<hex>``; the literal key
``sha256-<that hex>`` must not name the same object, or one key's page is served for the
other (wrong bytes). Built as SGLang builds a storage backend (its ``dynamic`` factory,
SGLang's own CPU host pool), on the ``file`` backend.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import pytest
import torch
from support.ledger import Ledger
from support.sglang_pools import SGLangHostPool, build_sglang_host_pool

pytestmark = pytest.mark.sglang

LEDGER_AREA: Final = "bad input"

PAGE: Final = 4
ADAPTER: Final = {
    "backend_name": "sglang_storage",
    "module_path": "sglang_storage_adapters.hicache_storage",
    "class_name": "HiCacheBackend",
    "interface_v1": 1,
}


def host_pool(seed: int) -> SGLangHostPool:
    pool = build_sglang_host_pool(
        attention="mha", layout="page_first", dtype=torch.bfloat16, layer_num=2,
        page_size=PAGE, num_pages=4,
    )  # fmt: skip
    raw = pool.kv_buffer.view(-1).view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, generator=torch.Generator().manual_seed(seed)))
    return pool


@pytest.fixture
def adapter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, Any]]:
    """Our HiCache backend as SGLang's factory builds it, and its host pool."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, PoolName
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    monkeypatch.delenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY", raising=False)
    monkeypatch.delenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", raising=False)
    config = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
        model_name="org/test-model",
        extra_config={
            **ADAPTER,
            "storage_backend": "file",
            "storage_options": {"root": str(tmp_path / "l3")},
        },
    )  # fmt: skip
    anchor = host_pool(seed=1)
    backend = StorageBackendFactory.create_backend("dynamic", config, anchor.pool)
    backend.register_mem_pool_host(anchor.pool)
    backend.register_mem_host_pool_v2(anchor.pool, PoolName.KV)
    backend.on_host_pools_registered()
    try:
        yield backend, anchor
    finally:
        backend.close()


def tokens_of(page: int) -> torch.Tensor:
    return torch.arange(page * PAGE, (page + 1) * PAGE, dtype=torch.int64)


def page(pool: SGLangHostPool, index: int) -> bytes:
    return bytes(pool.get_data_page(index * PAGE).contiguous().view(torch.uint8).numpy())


def test_a_key_and_the_digest_name_of_another_are_two_objects(
    adapter: tuple[Any, SGLangHostPool], ledger: Ledger
) -> None:
    backend, pool = adapter
    unsafe = "../../etc/passwd"
    lookalike = "sha256-" + hashlib.sha256(unsafe.encode()).hexdigest()
    ledger.fault("bad_input")
    ledger.operation(4)
    assert backend.batch_set_v1([unsafe], tokens_of(0)) == [True]
    assert backend.batch_exists([lookalike]) == 0, "another key's page answers this key"
    assert backend.batch_set_v1([lookalike], tokens_of(1)) == [True]
    # Both stored: each reads back its own page (into pages 2 and 3).
    got = backend.batch_get_v1([unsafe, lookalike], torch.cat([tokens_of(2), tokens_of(3)]))
    assert got == [True, True]
    wrong = sum(page(pool, 2 + i) != page(pool, i) for i in range(2))
    ledger.wrong(wrong * len(page(pool, 0)))
    assert wrong == 0
    names = {backend.object_key(key).name for key in (unsafe, lookalike)}
    assert len(names) == 2
    assert all("/" not in name and ".." not in name for name in names)
