"""The process's storage runtime: one budget, one backend per configuration, one namespace rule."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sglang_storage.core import DataKind, ObjectSpec, PutRequest
from sglang_storage.errors import CapacityError, ConfigError, StateError
from sglang_storage.managers.runtime import (
    RankLayout,
    RuntimeConfig,
    StorageRuntime,
    kv_page_namespace,
)
from sglang_storage.memory import (
    Attention,
    EmbeddingPool,
    EmbeddingPoolConfig,
    KVGeometry,
    KVHostPool,
    KVLayout,
    MemoryFacts,
    Pinning,
)
from sglang_storage.policy.eviction import EvictionConfig
from sglang_storage.storage import Backend
from sglang_storage.storage.keys import kv_namespace, model_fingerprint

MIB = 1 << 20
FACTS = MemoryFacts(physical=64 * MIB, available=64 * MIB)


def _runtime(**fields: object) -> StorageRuntime:
    config = RuntimeConfig(headroom=0, pinning=Pinning.NEVER, **fields)  # type: ignore[arg-type]
    return StorageRuntime(config, facts=FACTS)


def _geometry(num_pages: int) -> KVGeometry:
    return KVGeometry(  # 16 KiB pages
        attention=Attention.MHA,
        layout=KVLayout.PAGE_FIRST,
        dtype=torch.bfloat16,
        layer_num=2,
        page_size=16,
        num_pages=num_pages,
        head_num=4,
        head_dim=32,
    )


# ---------------------------------------------------------------------- host memory


def test_every_component_draws_from_one_budget() -> None:
    runtime = _runtime(host_memory=4 * MIB)
    kv = KVHostPool(_geometry(128), runtime.host_memory("kv"))  # 2 MiB
    decode = KVHostPool(_geometry(64), runtime.host_memory("decode"))  # 1 MiB
    embedding = EmbeddingPool(
        EmbeddingPoolConfig(dim=512, dtype=torch.bfloat16, capacity=MIB, label="vision"),
        runtime.host_memory("embedding"),
    )
    assert runtime.budget.stats().used == 4 * MIB
    assert (runtime.used("kv"), runtime.used("decode"), runtime.used("embedding")) == (
        2 * MIB,
        MIB,
        MIB,
    )
    with pytest.raises(CapacityError):  # the fourth pool finds the one budget full
        KVHostPool(_geometry(1), runtime.host_memory("sparse"))
    decode.close()
    assert runtime.used("decode") == 0
    KVHostPool(_geometry(64), runtime.host_memory("sparse")).close()
    kv.close()
    embedding.close()
    assert runtime.budget.stats().used == 0


def test_a_component_never_takes_another_components_reservation() -> None:
    runtime = _runtime(host_memory=4 * MIB, decode=2 * MIB)
    with pytest.raises(CapacityError) as refused:
        KVHostPool(_geometry(192), runtime.host_memory("kv"))  # 3 MiB: into decode's 2 MiB
    assert "reserved for other components" in str(refused.value)
    kv = KVHostPool(_geometry(128), runtime.host_memory("kv"))  # the 2 MiB not reserved
    decode = KVHostPool(_geometry(128), runtime.host_memory("decode"))  # its reservation
    assert runtime.budget.stats().used == 4 * MIB
    kv.close()
    decode.close()


def test_without_host_memory_the_budget_is_the_hosts_share_per_rank() -> None:
    runtime = _runtime(ranks_per_host=4)
    assert runtime.budget.config.total == 16 * MIB  # 64 MiB available, 4 ranks
    assert runtime.budget.config.ranks_per_host == 4
    with pytest.raises(CapacityError):
        KVHostPool(_geometry(1025), runtime.host_memory("kv"))  # 16 MiB + 16 KiB


def test_a_host_memory_the_ranks_of_a_host_cannot_hold_is_refused_at_start() -> None:
    with pytest.raises(CapacityError) as refused:
        _runtime(host_memory=20 * MIB, ranks_per_host=4)
    assert "shared by 4 ranks" in str(refused.value)
    _runtime(host_memory=16 * MIB, ranks_per_host=4)  # exactly the share


def test_reservations_must_fit_the_budget_and_name_known_components() -> None:
    with pytest.raises(ConfigError, match="reservations must fit"):
        RuntimeConfig(host_memory=MIB, kv=MIB, embedding=1)
    with pytest.raises(ConfigError, match="component"):
        _runtime().host_memory("nosuch")


# ---------------------------------------------------------------------- backends


def _put(backend: Backend, namespace_model: str, name: str, size: int) -> bool:
    namespace = kv_namespace(namespace_model, mla=False, tp_rank=0, tp_size=1)
    request = PutRequest(
        key=namespace.key(name),
        spec=ObjectSpec(dtype="uint8", shape=(size,)),
        buffers=(bytearray(size),),
    )
    (result,) = backend.put_from([request])
    return result.ok


def test_equal_options_share_one_backend_whose_cap_holds_for_all(tmp_path: Path) -> None:
    runtime = _runtime(eviction=EvictionConfig(name="s3fifo"))
    options = {"root": str(tmp_path), "capacity_bytes": "64KiB"}
    a = runtime.backend("file", options)
    b = runtime.backend("file", {"root": str(tmp_path), "capacity_bytes": 65536})
    assert a.backend is b.backend
    assert runtime.backend("file", {"root": str(tmp_path / "other")}).backend is not a.backend
    for i in range(12):  # two writers, 8 KiB each time: 96 KiB into a 64 KiB cap
        assert _put((a if i % 2 else b).backend, "m", f"k{i}", 8 << 10)
    stats = a.backend.stats()
    assert stats.capacity_bytes == 64 << 10
    assert stats.bytes <= 64 << 10


def test_the_last_lease_closes_the_backend(tmp_path: Path) -> None:
    runtime = _runtime()
    first = runtime.backend("memory", {})
    second = runtime.backend("memory", {})
    pipeline = runtime.storage_pipeline(first)
    first.release()
    first.release()  # a no-op: the second user still holds it
    assert _put(second.backend, "m", "k", 16)
    pipeline.close()
    second.release()
    assert runtime.open_backends() == 0
    with pytest.raises(StateError, match="released"):
        runtime.storage_pipeline(second)
    assert runtime.backend("memory", {}).backend is not second.backend  # a fresh one


def test_close_closes_what_is_still_open() -> None:
    runtime = _runtime()
    lease = runtime.backend("memory", {})
    pipeline = runtime.storage_pipeline(lease)
    runtime.close()
    assert pipeline.closed
    assert runtime.open_backends() == 0
    with pytest.raises(StateError, match="closed"):
        runtime.backend("memory", {})
    runtime.close()  # twice is a no-op


# ---------------------------------------------------------------------- namespaces


def _namespace(ranks: RankLayout, *, shared: bool = False) -> object:
    return kv_page_namespace(
        "org/model",
        pool="kv",
        mla=shared,
        shared=shared,
        dtype="bfloat16",
        shape=(4096,),
        layout="page_first",
        page_size=16,
        ranks=ranks,
    )


def test_every_rank_coordinate_places_pages_apart() -> None:
    base = RankLayout(tp_size=2, pp_size=2, cp_size=2, dcp_size=2, logical_page_size=16)
    seen = {
        _namespace(attrs_evolve(base, **{field: 1}))
        for field in ("tp_rank", "pp_rank", "cp_rank", "dcp_rank")
    }
    assert len(seen | {_namespace(base)}) == 5


def test_a_shared_pool_drops_the_tp_coordinates_only() -> None:
    rank0 = RankLayout(tp_rank=0, tp_size=2, pp_rank=1, pp_size=2)
    rank1 = RankLayout(tp_rank=1, tp_size=2, pp_rank=1, pp_size=2)
    assert _namespace(rank0, shared=True) == _namespace(rank1, shared=True)
    assert _namespace(rank0) != _namespace(rank1)
    other_stage = RankLayout(tp_rank=0, tp_size=2, pp_rank=0, pp_size=2)
    assert _namespace(rank0, shared=True) != _namespace(other_stage, shared=True)


def test_the_namespace_is_the_hicache_adapters_rule_without_parallelism() -> None:
    # The rule the HiCache adapter used before the runtime: kv_namespace over the
    # fingerprint of the model and the page format.
    expected = kv_namespace(
        model_fingerprint(
            "org/model",
            pool="kv",
            attention="mha",
            dtype="bfloat16",
            shape=(4096,),
            layout="page_first",
            page_size=16,
        ),
        mla=False,
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        cp_rank=0,
        cp_size=1,
    )
    assert _namespace(RankLayout()) == expected


def test_a_rank_outside_its_group_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="pp_rank"):
        RankLayout(pp_rank=2, pp_size=2)


def attrs_evolve(layout: RankLayout, **changes: int) -> RankLayout:
    import attrs

    return attrs.evolve(layout, **changes)


def test_the_kind_of_each_component_is_its_data_kind() -> None:
    runtime = _runtime(host_memory=2 * MIB, embedding=MIB)
    with pytest.raises(CapacityError):  # kv may not take embedding's reservation
        KVHostPool(_geometry(128), runtime.host_memory("kv"))
    assert runtime.budget.stats().kinds[DataKind.EMBEDDING].reserved == MIB
