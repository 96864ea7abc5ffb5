"""The sparse KV manager driven layer-wise (the NPU sparse path): offload, materialize, prefix.

Every layer of a token is written to the host as the forward computes it
(``offload_layer``), a decode step reads each layer's own top-k into a caller buffer
through a per-layer device window (``materialize_layer``), and a prefill reads a layer's
whole prefix (``read_layer_prefix``). A reference model keeps the bytes each (token,
layer) was given; every read must return exactly those bytes.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch

from sglang_storage.errors import CapacityError, ConfigError, StateError
from sglang_storage.managers.sparse import (
    BackupDone,
    LayerFill,
    Restored,
    SparseEvent,
    SparseKVConfig,
    SparseKVManager,
)
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
from sglang_storage.storage import create_backend
from sglang_storage.storage.keys import kv_namespace, model_fingerprint
from sglang_storage.transfer import (
    DeviceHostPipeline,
    DeviceKV,
    StoragePipeline,
    StoragePipelineConfig,
)

LAYERS, HEAD_DIM, SLOTS, MAX_TOKENS, MAX_REQUESTS = 3, 24, 6, 64, 2
WAIT_S = 10.0
NAMESPACE = kv_namespace(model_fingerprint("test/sparse-layers", page_size=1), mla=True)


def geometry(num_pages: int, attention: Attention = Attention.MLA) -> KVGeometry:
    mla = attention is Attention.MLA
    return KVGeometry(
        attention=attention,
        layout=KVLayout.LAYER_FIRST,
        dtype=torch.bfloat16,
        layer_num=LAYERS,
        page_size=1,
        num_pages=num_pages,
        head_num=1 if mla else 2,
        head_dim=HEAD_DIM if mla else 8,
    )


def memory() -> HostMemory:
    facts = MemoryFacts(physical=64 << 30, available=64 << 30)
    return HostMemory(HostMemoryBudget(BudgetConfig(total=64 << 20, headroom=0), facts=facts))


CONFIG = SparseKVConfig(device_slots=SLOTS, max_tokens=MAX_TOKENS, max_requests=MAX_REQUESTS)


class Rig:
    """A layer-wise manager (no device pipeline) and the bytes of every (token, layer)."""

    def __init__(self, *, host_pages: int = MAX_REQUESTS * MAX_TOKENS, storage: bool = False):
        self.host = KVHostPool(geometry(host_pages), memory())
        self.backend = create_backend("memory", {}) if storage else None
        self.storage = (
            None
            if self.backend is None
            else StoragePipeline(self.backend, StoragePipelineConfig(workers=2, batch_pages=8))
        )
        self.manager = SparseKVManager(
            host=self.host,
            config=CONFIG,
            storage=self.storage,
            namespace=None if self.storage is None else NAMESPACE,
        )
        self.truth: dict[str, dict[tuple[int, int], torch.Tensor]] = {}
        self.gen = torch.Generator().manual_seed(11)

    def rows(self, n: int) -> torch.Tensor:
        bits = torch.randint(-(2**15), 2**15, (n, 1, HEAD_DIM), generator=self.gen)
        return bits.to(torch.int16).view(torch.bfloat16)

    def offload(self, rid: str, layer: int, positions: list[int]) -> None:
        rows = self.rows(len(positions))
        self.manager.offload_layer(rid, layer, torch.tensor(positions), rows)
        table = self.truth.setdefault(rid, {})
        for i, p in enumerate(positions):
            table[p, layer] = rows[i].clone()

    def forward(self, rid: str, positions: list[int]) -> None:
        """One forward: every layer writes the same new positions, layer by layer."""
        for layer in range(LAYERS):
            self.offload(rid, layer, positions)

    def check(self, rid: str, layer: int, positions: list[int], rows: torch.Tensor) -> None:
        for i, p in enumerate(positions):
            want = self.truth[rid][p, layer].view(torch.int16)
            assert torch.equal(rows[i].view(torch.int16), want), (rid, layer, p)

    def settle(self) -> list[SparseEvent]:
        events: list[SparseEvent] = []
        for _ in range(int(WAIT_S / 0.05)):
            events += self.manager.poll(timeout_s=0.05)
            if not self.manager.busy:
                return events
        raise AssertionError("the manager did not settle")

    def close(self) -> None:
        if self.storage is not None:
            assert self.storage.close(timeout_s=WAIT_S).clean
        if self.backend is not None:
            self.backend.close()


@pytest.fixture
def rig() -> Iterator[Rig]:
    made = Rig()
    yield made
    made.close()


def window() -> torch.Tensor:
    return torch.zeros((SLOTS, 1, HEAD_DIM), dtype=torch.bfloat16)


def test_prefill_decode_and_top_k_read_the_bytes_each_layer_was_given(rig: Rig) -> None:
    rng = random.Random(4)
    windows = {(rid, layer): window() for rid in "ab" for layer in range(LAYERS)}
    for rid, prompt in (("a", 13), ("b", 5)):
        rig.manager.admit(rid)
        rig.forward(rid, list(range(9)) if prompt > 9 else list(range(prompt)))
        if prompt > 9:  # a second prefill chunk continues the first
            rig.forward(rid, list(range(9, prompt)))
        for layer in range(LAYERS):
            rig.check(
                rid, layer, list(range(prompt)), rig.manager.read_layer_prefix(rid, layer, prompt)
            )
    lengths = {"a": 13, "b": 5}
    hits = 0
    for _ in range(10):  # decode steps
        for rid in "ab":
            rig.forward(rid, [lengths[rid]])
            lengths[rid] += 1
            for layer in range(LAYERS):  # each layer with its own top-k
                picks = rng.sample(range(lengths[rid]), min(lengths[rid], rng.randint(1, SLOTS)))
                out = torch.zeros((SLOTS, 1, HEAD_DIM), dtype=torch.bfloat16)
                fill = rig.manager.materialize_layer(
                    rid, layer, picks, window=windows[rid, layer], out=out
                )
                assert fill.hits + fill.misses == len(picks)
                hits += fill.hits
                rig.check(rid, layer, picks, out)
                rig.check(rid, layer, picks, windows[rid, layer])  # refilled with the pick
                assert not out[len(picks) :].view(torch.int16).any()  # rows past it untouched
    assert hits > 0
    device_out = torch.empty((lengths["a"], 1, HEAD_DIM), dtype=torch.bfloat16)
    got = rig.manager.read_layer_prefix("a", 1, lengths["a"], out=device_out)
    assert got is device_out
    rig.check("a", 1, list(range(lengths["a"])), device_out)
    for rid in "ab":
        rig.manager.release(rid)
    assert rig.host.stats().used_bytes == 0


def test_window_hits_are_the_previous_selection_of_that_layer(rig: Rig) -> None:
    rig.manager.admit("r")
    rig.forward("r", list(range(10)))
    w0, w1 = window(), window()
    out = torch.empty((SLOTS, 1, HEAD_DIM), dtype=torch.bfloat16)
    assert rig.manager.materialize_layer("r", 0, [1, 2, 3], window=w0, out=out) == LayerFill(
        hits=0, misses=3
    )
    # The window is poisoned: a hit must come from it, a miss from the host.
    w0[0] = 0  # slot 0 held position 1
    again = rig.manager.materialize_layer("r", 0, [3, 1, 7], window=w0, out=out)
    assert again == LayerFill(hits=2, misses=1)
    assert not out[1].view(torch.int16).any()  # position 1 came from the (zeroed) window
    rig.check("r", 0, [3, 7], out[[0, 2]])
    # Layer 1's window is its own: nothing of layer 0's selection is a hit there.
    other = rig.manager.materialize_layer("r", 1, [3, 1], window=w1, out=out)
    assert other == LayerFill(hits=0, misses=2)
    rig.check("r", 1, [3, 1], out)


def test_backup_keeps_the_tokens_written_on_every_layer_and_restores_them() -> None:
    rig = Rig(storage=True)
    try:
        rig.manager.admit("r")
        rig.forward("r", list(range(12)))
        rig.offload("r", 0, [12, 13])  # layer 0 only: not whole, not stored
        tokens = [500 + i for i in range(14)]
        rig.manager.finish("r", tokens)
        assert rig.settle() == [BackupDone(request_id="r", tokens=12)]
        assert rig.host.stats().used_bytes == 0
        rig.manager.restore("s", tokens)
        assert rig.settle() == [Restored(request_id="s", tokens=12, requested=14)]
        rig.truth["s"] = rig.truth["r"]
        for layer in range(LAYERS):
            rig.check("s", layer, list(range(12)), rig.manager.read_layer_prefix("s", layer, 12))
        rig.forward("s", [12])  # a restored request continues layer-wise
        out = torch.empty((SLOTS, 1, HEAD_DIM), dtype=torch.bfloat16)
        rig.manager.materialize_layer("s", 2, [12, 0], window=window(), out=out)
        rig.check("s", 2, [12, 0], out)
        rig.manager.release("s")
    finally:
        rig.close()


def test_misuse_is_refused_and_changes_nothing(rig: Rig) -> None:
    m = rig.manager
    m.admit("r")
    rig.forward("r", [0, 1, 2])
    before = rig.host.stats().used_bytes
    with pytest.raises(ConfigError, match="continue at 3"):
        rig.offload("r", 0, [4])  # a gap
    with pytest.raises(ConfigError, match="distinct"):
        m.offload_layer("r", 0, [3, 3], rig.rows(2))
    with pytest.raises(ConfigError, match="rows"):
        m.offload_layer("r", 0, [3], rig.rows(2))
    with pytest.raises(ConfigError, match="rows"):
        m.offload_layer("r", 0, [3], rig.rows(1).float())
    with pytest.raises(ConfigError, match="layer_id"):
        m.offload_layer("r", LAYERS, [3], rig.rows(1))
    with pytest.raises(ConfigError, match=r"0\.\.3 \(the tokens written on layer 0"):
        m.read_layer_prefix("r", 0, 4)
    with pytest.raises(ConfigError, match=r"0\.\.2"):
        m.materialize_layer("r", 0, [3], window=window(), out=window())
    with pytest.raises(ConfigError, match="window"):
        m.materialize_layer("r", 0, [1], window=window()[:2], out=window())
    with pytest.raises(ConfigError, match="out"):
        m.materialize_layer("r", 0, [0, 1], window=window(), out=window()[:1])
    assert rig.host.stats().used_bytes == before
    rig.offload("r", 0, [3])  # layer 0 ahead of the others is fine
    assert m.read_layer_prefix("r", 0, 4).shape == (4, 1, HEAD_DIM)
    with pytest.raises(ConfigError, match=r"0\.\.3 \(the tokens written on layer 1"):
        m.read_layer_prefix("r", 1, 4)  # layer 1 has 3 tokens
    m.admit("t")
    with pytest.raises(StateError, match="no device pipeline"):
        m.append("t", 1)
    with pytest.raises(StateError):
        m.offload_layer("nobody", 0, [0], rig.rows(1))
    with pytest.raises(CapacityError):
        m.admit("u")  # both regions are taken (r, t)


def test_full_host_pool_refuses_new_tokens_and_keeps_the_old() -> None:
    rig = Rig(host_pages=4)
    try:
        rig.manager.admit("r")
        rig.forward("r", [0, 1, 2])
        with pytest.raises(CapacityError):
            rig.offload("r", 0, [3, 4])
        for layer in range(LAYERS):
            rig.check("r", layer, [0, 1, 2], rig.manager.read_layer_prefix("r", layer, 3))
        rig.forward("r", [3])
    finally:
        rig.close()


def test_token_wise_and_layer_wise_requests_do_not_mix() -> None:
    g = geometry(32)
    host = KVHostPool(g, memory())
    manager = SparseKVManager(
        host=host,
        device=DeviceHostPipeline(DeviceKV.allocate(g, SLOTS * MAX_REQUESTS), host),
        config=CONFIG,
    )
    rows = torch.zeros((1, 1, HEAD_DIM), dtype=torch.bfloat16)
    manager.admit("tokens")
    manager.append("tokens", 2)
    with pytest.raises(StateError, match="device buffer"):
        manager.offload_layer("tokens", 0, [2], rows)
    manager.admit("layers")
    manager.offload_layer("layers", 0, [0], rows)
    for call in (
        lambda: manager.append("layers", 1),
        lambda: manager.prefetch("layers", [0]),
        lambda: manager.evict("layers", [0]),
    ):
        with pytest.raises(StateError, match="layer-wise"):
            call()
    mha = KVHostPool(geometry(8, Attention.MHA), memory())
    other = SparseKVManager(host=mha, config=CONFIG)
    other.admit("r")
    with pytest.raises(ConfigError, match="MLA"):
        other.offload_layer("r", 0, [0], torch.zeros((1, 2, 8), dtype=torch.bfloat16))
