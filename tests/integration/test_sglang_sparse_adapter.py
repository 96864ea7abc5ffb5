"""The HiSparse adapter driven the way SGLang 0.5.23 drives its ``HiSparseCoordinator``.

SGLang's own HiSparse pools run on CPU here: the DSA device pool
(``HiSparseDSATokenToKVPool``, 64-token physical pages), its allocator
(``HiSparseTokenToKVPoolAllocator``: logical slots plus HiSparse device slots and the
``full_to_hisparse_device_index_mapping`` between them), the ``ReqToTokenPool`` and
``Req`` objects, with SGLang's runtime config (``override_server_args``) and a one-rank
gloo TP group. The adapter is installed through SGLang's ``HookRegistry`` and built through
the module attribute ``ModelRunner.maybe_init_hisparse_coordinator`` imports.

The call sequence is SGLang's (map section 4.2): prefill KV allocated with
``alloc_extend`` and written through the mapping, ``admit_request_into_staging`` (after the
prefill, ``batch_result_processor.py:396``), ``collect_ready_reqs`` (``scheduler.py:3923``),
then per decode step ``alloc_decode`` + ``map_last_loc_to_buffer`` (``schedule_batch.py``),
the model writing the new token's KV through the mapping, and per attention layer
``swap_in_selected_pages`` with that layer's top-k (``dsa_backend.py``); at the end
``request_finished`` then SGLang's own ``allocator.free`` of the request's logical slots,
and ``retract_req`` / ``abort_staging_request``. After every swap-in, the device rows at
the returned locations must hold, bit for bit, the KV each selected token was given.

What needs CUDA: SGLang's own coordinator (without ``sparse`` in ``--storage-managers``)
pins its host pool with ``cudaHostRegister`` in its constructor
(``hisparse_coordinator.py:618`` -> ``pool_host/common.py:147``); on CPU that step is
checked to be where SGLang's own class stops, and the GPU test checks it builds. SGLang's
CUDA swap-in kernels are not used by the adapter. The NPU ``SparseKVCacheManager`` module
imports ``sgl_kernel_npu`` at import time, so without it the module cannot be imported (the
last test pins that); its adapter (``npu_sparse``) is tested with named fakes in
``test_sglang_npu_sparse.py``.
"""

from __future__ import annotations

import json
import random
import sys
from array import array
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from support.sglang_hooks import hooks_installed

pytestmark = pytest.mark.sglang

PAGE = 64  # DSA's physical page
DEVICE_TOKENS = 256
LAYERS, LORA, ROPE = 2, 32, 16
TOP_K, BUFFER = 8, 16
ROWS = 3  # ReqToTokenPool(size=2) has 3 rows


@pytest.fixture(scope="module")
def tp_group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    import torch.distributed as dist

    owned = not dist.is_initialized()
    if owned:
        store = tmp_path_factory.mktemp("pg") / "store"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield dist.group.WORLD
    if owned:
        dist.destroy_process_group()


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
            page_size=PAGE,
            hicache_storage_backend="dynamic",
            hicache_storage_backend_extra_config=json.dumps(extra),
        )
        override.install()
        installed.append(override)

    yield publish
    for override in reversed(installed):
        override.restore()


@pytest.fixture
def coordinator_class() -> Iterator[Any]:
    """``install()`` through SGLang's HookRegistry; the class SGLang's model runner gets."""
    import sglang.srt.managers.hisparse_coordinator as origin
    from sglang_storage_adapters import sparse

    with hooks_installed(origin.HiSparseCoordinator, sparse.install, sparse):
        yield origin.HiSparseCoordinator


class Rig:
    """SGLang's HiSparse pools on CPU and the KV bytes every token was given."""

    def __init__(self) -> None:
        from sglang.srt.mem_cache.allocator.hisparse import HiSparseTokenToKVPoolAllocator
        from sglang.srt.mem_cache.hisparse_memory_pool import HiSparseDSATokenToKVPool
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

        self.pool = HiSparseDSATokenToKVPool(
            size=DEVICE_TOKENS,
            page_size=PAGE,
            kv_lora_rank=LORA,
            dtype=torch.bfloat16,
            qk_rope_head_dim=ROPE,
            layer_num=LAYERS,
            device="cpu",
            index_head_dim=128,  # DSA's indexer head dim (asserted by SGLang)
            enable_memory_saver=False,
            kv_cache_dim=LORA + ROPE,
        )
        self.allocator = HiSparseTokenToKVPoolAllocator(
            DEVICE_TOKENS, PAGE, torch.bfloat16, "cpu", self.pool, need_sort=False
        )
        self.req_to_token = ReqToTokenPool(
            size=ROWS - 1, max_context_len=256, device="cpu", enable_memory_saver=False
        )
        self.mapping = self.allocator.full_to_hisparse_device_index_mapping
        self.truth: dict[str, list[list[torch.Tensor]]] = {}  # rid -> per position, per layer
        self.gen = torch.Generator().manual_seed(5)

    def kwargs(self, tp_group: Any) -> dict[str, Any]:
        """``ModelRunner.maybe_init_hisparse_coordinator``'s arguments."""
        return {
            "req_to_token_pool": self.req_to_token,
            "token_to_kv_pool_allocator": self.allocator,
            "top_k": TOP_K,
            "device_buffer_size": BUFFER,
            "device": "cpu",
            "tp_group": tp_group,
        }

    def write(self, rid: str, logical: torch.Tensor) -> None:
        """The model writes fresh KV for tokens at ``logical`` (through the mapping)."""
        slots = self.mapping[logical]
        assert bool((slots > 0).all())
        for slot in slots.tolist():
            rows = []
            for layer in range(LAYERS):
                bits = torch.randint(
                    -(2**15), 2**15, (1, LORA + ROPE), generator=self.gen, dtype=torch.int16
                )
                self.pool.kv_buffer[layer][slot].view(torch.int16).copy_(bits)
                rows.append(bits.clone())
            self.truth[rid].append(rows)

    def prefill(self, rid: str, prompt_len: int) -> Any:
        """A request after its prefill: logical + HiSparse slots, KV written."""
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        req = Req(rid, "", array("q", range(prompt_len)), SamplingParams(max_new_tokens=64))
        assert self.req_to_token.alloc([req]) is not None
        n = torch.tensor([prompt_len])
        logical = self.allocator.alloc_extend(
            torch.tensor([0]), torch.tensor([0]), n, n, torch.tensor([-1]), prompt_len
        )
        assert logical is not None
        self.req_to_token.write((req.kv.req_pool_idx, slice(0, prompt_len)), logical.int())
        req.extend_end = prompt_len
        req.kv.kv_allocated_len = prompt_len
        self.truth[rid] = []
        self.write(rid, logical)
        return req

    def decode_step(self, coordinator: Any, reqs: list[Any]) -> torch.Tensor:
        """``ScheduleBatch.prepare_for_decode``: alloc, map the new tokens, model writes."""
        idx = torch.tensor([r.kv.req_pool_idx for r in reqs])
        seq_lens = torch.tensor([r.kv.kv_allocated_len + 1 for r in reqs])
        last = self.req_to_token.req_to_token[idx, seq_lens - 2].to(torch.int64)
        out = self.allocator.alloc_decode(seq_lens, seq_lens, last)
        for r, loc in zip(reqs, out.tolist(), strict=True):
            self.req_to_token.req_to_token[r.kv.req_pool_idx, r.kv.kv_allocated_len] = loc
            r.kv.kv_allocated_len += 1
        coordinator.map_last_loc_to_buffer(seq_lens, out, idx, seq_lens, idx)
        for r, loc in zip(reqs, out.tolist(), strict=True):
            self.write(r.rid, torch.tensor([loc]))
        return seq_lens

    def check_swap_in(
        self, coordinator: Any, reqs: list[Any], seq_lens: torch.Tensor, rng: random.Random
    ) -> int:
        """Every layer's top-k swapped in and compared bit for bit; returns tokens checked."""
        idx = torch.tensor([r.kv.req_pool_idx for r in reqs])
        checked = 0
        for layer in range(LAYERS):
            top_k = torch.full((len(reqs), TOP_K), -1, dtype=torch.int32)
            for i, n in enumerate(seq_lens.tolist()):
                picks = rng.sample(range(n), min(n, rng.randint(1, TOP_K)))
                top_k[i, : len(picks)] = torch.tensor(picks, dtype=torch.int32)
            locs = coordinator.swap_in_selected_pages(idx, seq_lens, top_k, layer)
            assert locs.dtype == torch.int32
            assert locs.shape == top_k.shape
            assert torch.equal(locs < 0, top_k < 0)  # padding stays padding
            for i, r in enumerate(reqs):
                for pos, loc in zip(top_k[i].tolist(), locs[i].tolist(), strict=True):
                    if pos < 0:
                        continue
                    got = self.pool.kv_buffer[layer][loc].view(torch.int16)
                    assert torch.equal(got, self.truth[r.rid][pos][layer]), (r.rid, pos, layer)
                    checked += 1
        return checked

    def release(self, req: Any) -> None:
        """SGLang's ``release_kv_cache`` after ``request_finished``: logical slots and row."""
        row = self.req_to_token.req_to_token[req.kv.req_pool_idx, : req.kv.kv_allocated_len]
        self.allocator.free(row.to(torch.int64))
        self.req_to_token.free(req)


def test_staging_decode_and_top_k_swap_in_read_the_bytes_each_token_was_given(
    tp_group: Any, server_args: Callable[[list[str]], None], coordinator_class: Any
) -> None:
    from sglang_storage_adapters.sparse import HiSparseAdapter

    server_args(["kv", "sparse"])
    rig = Rig()
    hisparse_free = rig.allocator.hisparse_attn_allocator.available_size()
    coordinator = coordinator_class(**rig.kwargs(tp_group))
    assert isinstance(coordinator, HiSparseAdapter)
    reserved = hisparse_free - rig.allocator.hisparse_attn_allocator.available_size()
    assert reserved == PAGE  # ROWS * BUFFER = 48 slots, one whole 64-token page

    a = rig.prefill("a", 40)  # 40 tokens > 16 device slots: 24 go to the host at staging
    b = rig.prefill("b", 10)
    for req in (a, b):
        coordinator.admit_request_into_staging(req)
        assert req.hisparse_staging
    assert coordinator.has_ongoing_staging()
    assert [r.hisparse_staging for r in (a, b)] == [True, True]
    assert coordinator.collect_ready_reqs() == [a, b]
    assert not coordinator.has_ongoing_staging()
    assert not a.hisparse_staging
    # The prefill's own HiSparse slots went back to SGLang's allocator.
    assert rig.allocator.hisparse_attn_allocator.available_size() == hisparse_free - reserved

    rng = random.Random(3)
    checked = 0
    for _ in range(12):  # b grows past its 16 slots too
        seq_lens = rig.decode_step(coordinator, [a, b])
        checked += rig.check_swap_in(coordinator, [a, b], seq_lens, rng)
    assert checked > 100
    stats = coordinator.get_token_stats()
    assert stats.device_tokens == 2 * BUFFER  # both regions full
    assert stats.host_tokens > 0

    for req in (a, b):
        coordinator.request_finished(req)
        rig.release(req)
    assert rig.allocator.hisparse_attn_allocator.available_size() == hisparse_free - reserved
    assert rig.allocator.logical_attn_allocator.available_size() == rig.allocator.size_full
    assert coordinator.get_token_stats().host_tokens == 0
    coordinator.destroy()
    assert rig.allocator.hisparse_attn_allocator.available_size() == hisparse_free


def test_retract_and_staging_abort_free_everything(
    tp_group: Any, server_args: Callable[[list[str]], None], coordinator_class: Any
) -> None:
    server_args(["kv", "sparse"])
    rig = Rig()
    coordinator = coordinator_class(**rig.kwargs(tp_group))
    hisparse_free = rig.allocator.hisparse_attn_allocator.available_size()
    staged = rig.prefill("staged", 20)
    coordinator.admit_request_into_staging(staged)
    coordinator.retract_req(staged)  # still staging: abort_staging_request
    assert not coordinator.has_ongoing_staging()
    assert not staged.hisparse_staging
    rig.release(staged)

    running = rig.prefill("running", 30)
    coordinator.admit_request_into_staging(running)
    assert coordinator.collect_ready_reqs() == [running]
    seq_lens = rig.decode_step(coordinator, [running])
    assert rig.check_swap_in(coordinator, [running], seq_lens, random.Random(1)) > 0
    coordinator.retract_req(running)  # decoding: request_finished
    rig.release(running)
    assert rig.allocator.hisparse_attn_allocator.available_size() == hisparse_free
    assert coordinator.get_token_stats().host_tokens == 0
    coordinator.destroy()


def test_unserved_options_are_refused_with_what_is_allowed(
    tp_group: Any, server_args: Callable[[list[str]], None], coordinator_class: Any
) -> None:
    from sglang_storage.errors import ConfigError, StateError

    server_args(["kv", "sparse"])
    rig = Rig()
    with pytest.raises(ConfigError, match="must exceed top_k"):
        coordinator_class(**{**rig.kwargs(tp_group), "device_buffer_size": TOP_K})
    with pytest.raises(ConfigError, match="speculative"):
        coordinator_class(**rig.kwargs(tp_group), num_draft_tokens=3)
    coordinator = coordinator_class(**rig.kwargs(tp_group))
    with pytest.raises(StateError, match="direct-to-host"):
        _ = coordinator.mem_pool_host
    coordinator.destroy()


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU-only check; with CUDA the gpu test builds SGLang's class"
)
def test_without_sparse_in_storage_managers_sglang_builds_its_own_class(
    tp_group: Any, server_args: Callable[[list[str]], None], coordinator_class: Any
) -> None:
    import sglang.srt.managers.hisparse_coordinator as origin

    server_args(["kv"])
    # SGLang's own constructor runs; on CPU it stops where it pins its host pool.
    with pytest.raises(RuntimeError, match="NVIDIA driver") as error:
        coordinator_class(**Rig().kwargs(tp_group))
    frames = [str(frame.path) for frame in error.traceback]
    assert origin.__file__ in frames
    assert any(f.endswith("pool_host/common.py") for f in frames)


@pytest.mark.gpu
def test_without_sparse_the_replacement_is_sglangs_class_on_gpu(
    tp_group: Any, server_args: Callable[[list[str]], None], coordinator_class: Any
) -> None:
    # Needs CUDA: SGLang's coordinator pins its host pool (cudaHostRegister).
    from sglang_storage_adapters.sparse import HiSparseAdapter

    server_args(["kv"])
    coordinator = coordinator_class(**Rig().kwargs(tp_group))
    assert type(coordinator) is HiSparseAdapter.__bases__[0]
    coordinator.destroy()


def test_the_npu_manager_cannot_be_imported_without_sgl_kernel_npu() -> None:
    # SGLang's NPU SparseKVCacheManager imports sgl_kernel_npu (and uses torch.npu streams,
    # events and shared-memory host tensors) at module level; nothing of it runs here.
    pytest.importorskip("sglang")
    if "sgl_kernel_npu" in sys.modules:
        pytest.skip("sgl_kernel_npu is installed")
    with pytest.raises(ModuleNotFoundError, match="sgl_kernel_npu"):
        __import__("sglang.srt.hardware_backend.npu.sparsity_driven_kv_offload.manager")
