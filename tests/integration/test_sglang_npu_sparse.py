"""The NPU sparse KV adapter driven the way SGLang 0.5.23's Ascend attention drives its manager.

SGLang's ``SparseKVCacheManager`` module imports ``sgl_kernel_npu`` and uses ``torch.npu``;
here both are the named fakes of :mod:`support.npu_fakes` (three kernels and a no-op
``torch.npu``), installed after SGLang is imported and removed after each test. Everything
else is SGLang's own: a CPU ``MLATokenToKVPool``, ``PagedTokenToKVPoolAllocator``,
``ReqToTokenPool``, ``Req``, ``ForwardMode``, the runtime config the adapter reads its
settings from, and the ``HookRegistry`` the adapter is installed through. The forward
batch is the handful of fields the manager reads (``ForwardBatch`` needs a model runner).

The call sequence is ``attention.py``'s, per layer: ``offload_v2`` of the forward's new
rows, then ``materialize_selected_kv`` with that layer's top-k (decode) or
``get_forward_kv`` (prefill). SGLang's own class (under the fake kernels) and the adapter
are driven side by side with the same rows; every selected buffer and prefix must equal,
bit for bit, SGLang's and the bytes each (token, layer) was given.

What needs an NPU: the real kernels, ``torch.npu`` streams and the shared-memory host
tensors of SGLang's class, and the adapter's copies onto NPU memory (here CPU tensors).
"""

from __future__ import annotations

import json
import random
import types
from array import array
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from support.npu_fakes import NPU_MANAGER_MODULE, FakeNpuKernels, npu_fakes_installed
from support.sglang_hooks import hooks_installed

pytestmark = pytest.mark.sglang

LAYERS, LORA, ROPE = 2, 16, 8
TOP_K = 6  # the sparse context (index_topk)
MAX_CONTEXT = 64
ROWS = 3  # ReqToTokenPool(size=2) has 3 rows


@pytest.fixture
def server_args(tmp_path: Path) -> Iterator[Callable[[list[str]], None]]:
    from sglang.srt.runtime_context import get_context

    installed: list[Any] = []

    def publish(managers: list[str]) -> None:
        extra = {
            "backend_name": "sglang_storage",
            "storage_backend": "file",
            "storage_options": {"root": str(tmp_path)},
            "storage_managers": managers,
        }
        override = get_context().override_server_args(
            hicache_storage_backend="dynamic",
            hicache_storage_backend_extra_config=json.dumps(extra),
        )
        override.install()
        installed.append(override)

    yield publish
    for override in reversed(installed):
        override.restore()


@pytest.fixture
def fakes() -> Iterator[FakeNpuKernels]:
    # SGLang first: a torch.npu present while sglang.srt.platforms loads misleads it.
    import sglang.srt.managers.schedule_batch
    import sglang.srt.mem_cache.allocator.paged
    import sglang.srt.mem_cache.memory_pool
    import sglang.srt.model_executor.forward_batch_info
    import sglang.srt.sampling.sampling_params  # noqa: F401

    with npu_fakes_installed() as kernels:
        yield kernels


@pytest.fixture
def manager_class(fakes: FakeNpuKernels) -> Iterator[Any]:
    """``install()`` through SGLang's HookRegistry; the class ``AscendAttnBackend`` gets."""
    import importlib

    from sglang_storage_adapters import npu_sparse

    origin = importlib.import_module(NPU_MANAGER_MODULE)
    with hooks_installed(origin.SparseKVCacheManager, npu_sparse.install, npu_sparse):
        yield importlib.import_module(NPU_MANAGER_MODULE).SparseKVCacheManager


class Pools:
    """SGLang's MLA device pool, its allocator and request rows, on CPU."""

    def __init__(self) -> None:
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool, ReqToTokenPool

        self.kv = MLATokenToKVPool(
            size=256,
            page_size=1,
            dtype=torch.bfloat16,
            kv_lora_rank=LORA,
            qk_rope_head_dim=ROPE,
            layer_num=LAYERS,
            device="cpu",
            enable_memory_saver=False,
        )
        self.allocator = PagedTokenToKVPoolAllocator(
            256, 1, torch.bfloat16, "cpu", self.kv, need_sort=False
        )
        self.req_to_token = ReqToTokenPool(
            size=ROWS - 1, max_context_len=MAX_CONTEXT, device="cpu", enable_memory_saver=False
        )

    def args(self) -> tuple[Any, Any, int]:
        return self.req_to_token, self.allocator, TOP_K


def layer(layer_id: int) -> Any:
    return types.SimpleNamespace(layer_id=layer_id)


def prefill_batch(rows: list[int], prefix: list[int], lens: list[int]) -> Any:
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    total = sum(lens)
    return types.SimpleNamespace(
        forward_mode=ForwardMode.EXTEND,
        req_pool_indices=torch.tensor(rows),
        seq_lens=torch.tensor([p + n for p, n in zip(prefix, lens, strict=True)]),
        extend_seq_lens=torch.tensor(lens),
        extend_prefix_lens=torch.tensor(prefix),
        extend_seq_lens_cpu=list(lens),
        out_cache_loc=torch.arange(total),
    )


def decode_batch(rows: list[int], seq_lens: list[int]) -> Any:
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    return types.SimpleNamespace(
        forward_mode=ForwardMode.DECODE,
        req_pool_indices=torch.tensor(rows),
        seq_lens=torch.tensor(seq_lens),
        extend_seq_lens=None,
        extend_prefix_lens=None,
        extend_seq_lens_cpu=None,
        out_cache_loc=torch.arange(len(rows)),
    )


class Model:
    """Fresh KV rows for each forward, and the bytes every (row, position, layer) got."""

    def __init__(self) -> None:
        self.gen = torch.Generator().manual_seed(9)
        self.truth: dict[tuple[int, int, int], torch.Tensor] = {}

    def rows(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        bits = torch.randint(-(2**15), 2**15, (n, 1, LORA + ROPE), generator=self.gen)
        kv = bits.to(torch.int16).view(torch.bfloat16)
        return kv[..., :LORA].contiguous(), kv[..., LORA:].contiguous()

    def remember(
        self, layer_id: int, placed: list[tuple[int, int]], k: torch.Tensor, pe: torch.Tensor
    ) -> None:
        kv = torch.cat([k, pe], dim=-1)
        for i, (row, pos) in enumerate(placed):
            self.truth[row, pos, layer_id] = kv[i].clone()

    def expect(self, row: int, positions: list[int], layer_id: int) -> torch.Tensor:
        return torch.stack([self.truth[row, p, layer_id] for p in positions])


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def test_prefill_decode_and_top_k_match_sglangs_manager_byte_for_byte(
    server_args: Callable[[list[str]], None], manager_class: Any, fakes: FakeNpuKernels
) -> None:
    from sglang_storage_adapters.npu_sparse import NpuSparseAdapter, _original

    server_args(["kv", "npu-sparse"])
    ours = manager_class(*Pools().args())
    assert isinstance(ours, NpuSparseAdapter)
    theirs = _original[0](*Pools().args())  # SGLang's own class, on the fake kernels
    assert type(theirs).__name__ == "SparseKVCacheManager"
    assert ours.sparse_context_len == theirs.sparse_context_len == TOP_K
    model = Model()
    rows = [1, 2]
    lengths = {1: 10, 2: 7}

    def forward(batch: Any, placed: list[tuple[int, int]]) -> None:
        for layer_id in range(LAYERS):
            k, pe = model.rows(len(placed))
            model.remember(layer_id, placed, k, pe)
            for manager in (ours, theirs):
                manager.offload_v2(k, pe, layer(layer_id), batch, None)

    # Prefill, ragged: 10 + 7 rows, then every layer's whole prefix (get_forward_kv).
    prefill = prefill_batch(rows, [0, 0], [10, 7])
    forward(prefill, [(1, p) for p in range(10)] + [(2, p) for p in range(7)])
    for layer_id in range(LAYERS):
        got = ours.get_forward_kv(layer(layer_id), prefill)
        want = theirs.get_forward_kv(layer_id, prefill)
        truth = torch.cat(
            [model.expect(1, list(range(10)), layer_id), model.expect(2, list(range(7)), layer_id)]
        )
        assert [tuple(t.shape) for t in got] == [(17, 1, LORA), (17, 1, ROPE)]
        for g, w in zip(got, want, strict=True):
            assert torch.equal(bits(g), bits(w))
        assert torch.equal(bits(torch.cat(got, dim=-1)), bits(truth))

    rng = random.Random(2)
    for step in range(8):
        seq = [lengths[r] + 1 for r in rows]
        forward(decode_batch(rows, seq), [(r, lengths[r]) for r in rows])
        for r in rows:
            lengths[r] += 1
        batch = decode_batch(rows, seq)
        for layer_id in range(LAYERS):
            topk = torch.full((len(rows), TOP_K), -1, dtype=torch.int32)
            for i, r in enumerate(rows):
                picks = rng.sample(range(lengths[r]), rng.randint(1, TOP_K))
                if step % 3 == 2:  # padding in the middle, not only at the end
                    topk[i, : len(picks)] = torch.tensor(picks, dtype=torch.int32)
                    topk[i, 0] = -1
                else:
                    topk[i, : len(picks)] = torch.tensor(picks, dtype=torch.int32)
            selected = {}
            for name, manager in (("ours", ours), ("theirs", theirs)):
                buffer = torch.zeros((len(rows), TOP_K, 1, LORA + ROPE), dtype=torch.bfloat16)
                manager.materialize_selected_kv(
                    layer(layer_id), batch, topk.unsqueeze(1), buffer, None
                )
                selected[name] = buffer
            assert torch.equal(bits(selected["ours"]), bits(selected["theirs"]))
            for i, r in enumerate(rows):
                for j, p in enumerate(topk[i].tolist()):
                    if p >= 0:
                        assert torch.equal(
                            bits(selected["ours"][i, j]), bits(model.truth[r, p, layer_id])
                        )
    assert ours.hit_tokens > 0  # the windows served some
    assert ours.miss_tokens > 0
    for name in ("hit_done", "miss_done", "refill_done", "slot_map_done"):
        assert getattr(ours, name).recorded == 8 * LAYERS  # once per materialize
    assert ours.host_pool.stats().used_bytes > 0
    ours.reset_requests(rows)
    assert ours.host_pool.stats().used_bytes == 0
    ours.close()


def admitted(pools: Pools, rid: str) -> Any:
    """A ``Req`` given a request row by SGLang's ``ReqToTokenPool.alloc``."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    req = Req(rid, "", array("q", range(4)), SamplingParams(max_new_tokens=4))
    assert pools.req_to_token.alloc([req]) is not None
    return req


def test_a_reused_request_row_starts_empty(
    server_args: Callable[[list[str]], None], manager_class: Any
) -> None:
    server_args(["kv", "npu-sparse"])
    pools = Pools()
    ours = manager_class(*pools.args())
    model = Model()
    req = admitted(pools, "a")
    row = req.kv.req_pool_idx
    for layer_id in range(LAYERS):
        ours.offload_v2(*model.rows(5), layer(layer_id), prefill_batch([row], [0], [5]), None)
    assert ours.host_pool.stats().used_bytes == 5 * ours.host_pool.geometry.page_bytes
    pools.req_to_token.free(req)
    again = admitted(pools, "b")  # SGLang gives the row to a new request: it is dropped
    assert again.kv.req_pool_idx == row
    assert ours.host_pool.stats().used_bytes == 0
    k_nope, k_pe = ours.get_forward_kv(layer(0), prefill_batch([row], [0], [0]))
    assert k_nope.shape == (0, 1, LORA)
    assert k_pe.shape == (0, 1, ROPE)
    ours.close()


def test_gaps_and_unwritten_tokens_are_refused_not_read(
    server_args: Callable[[list[str]], None], manager_class: Any
) -> None:
    from sglang_storage.errors import ConfigError

    server_args(["kv", "npu-sparse"])
    ours = manager_class(*Pools().args())
    model = Model()
    ours.offload_v2(*model.rows(4), layer(0), prefill_batch([1], [0], [4]), None)
    with pytest.raises(ConfigError, match="must continue at 4"):  # a chunk after a gap
        ours.offload_v2(*model.rows(2), layer(0), prefill_batch([1], [6], [2]), None)
    with pytest.raises(ConfigError, match="tokens written on layer 1"):
        ours.get_forward_kv(layer(1), prefill_batch([1], [0], [4]))
    buffer = torch.zeros((1, TOP_K, 1, LORA + ROPE), dtype=torch.bfloat16)
    with pytest.raises(ConfigError, match=r"0\.\.3"):
        ours.materialize_selected_kv(
            layer(0), decode_batch([1], [5]), torch.tensor([[4]]), buffer, None
        )
    with pytest.raises(ConfigError, match="is not a layer"):
        ours.get_forward_kv(LAYERS, prefill_batch([1], [0], [4]))
    with pytest.raises(ConfigError, match="sparse_context_len"):
        manager_class(Pools().req_to_token, Pools().allocator, 0)
    ours.close()


def test_without_npu_sparse_sglang_builds_its_own_class(
    server_args: Callable[[list[str]], None], manager_class: Any, fakes: FakeNpuKernels
) -> None:
    from sglang_storage_adapters.npu_sparse import NpuSparseAdapter, _original

    server_args(["kv", "sparse"])
    pools = Pools()
    theirs = manager_class(*pools.args())
    assert type(theirs) is _original[0]
    assert not isinstance(theirs, NpuSparseAdapter)
    assert len(fakes.shm_tensors) == LAYERS  # its shared-memory host buffers, one per layer
    # SGLang's own row hook reads req.req_pool_idx, which 0.5.23's Req does not have.
    with pytest.raises(AttributeError, match="req_pool_idx"):
        admitted(pools, "a")


def test_install_registers_nothing_where_the_npu_module_does_not_import() -> None:
    import sys

    from sglang_storage_adapters import npu_sparse, plugin

    if "sgl_kernel_npu" in sys.modules:
        pytest.skip("sgl_kernel_npu is installed")
    registered: list[object] = []
    recorder = types.SimpleNamespace(register=lambda *a, **k: registered.append(a))
    assert npu_sparse.install(recorder) is False
    assert registered == []
    assert "sglang_storage_adapters.npu_sparse:install" in plugin.INSTALLERS
