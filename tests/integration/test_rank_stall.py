"""Two real ranks: a stalled rank is a miss on both within the bound, never a hang.

Two processes join one ``gloo`` process group (``init_process_group`` over
``tcp://127.0.0.1``), each builds a :class:`~sglang_storage.managers.controller.CacheController`
over its own pipeline to one shared ``file`` root, agreeing through the adapters'
``rank_sync([group.WORLD])`` (a ``StoreRankSync`` on the default ``torch.distributed``
store: what ``StorageCacheController`` and the decode adapter use). Rank 1's backend is
the ``faulty`` backend, paused except where a phase makes it slow. The phases, in the same
order on both ranks (agreements are matched by name and order):

- healthy: rank 0 stores 8 pages; a hit query agrees on 8 (and on the MIN when rank 1
  asks for fewer), a read in two batches agrees on 8 and reads rank 0's bytes exactly;
- rank 1 stops polling for twice the bound: rank 0's query and read end as not agreed
  (0 pages) within the bound, and rank 1, polling again, gets the same miss at once;
- rank 1's backend answers far later than the bound: the same on both ranks;
- healthy again: the same query agrees on the real hit count;
- the decode adapter's agreement (``rank_sync(..., name="decode").agree_min``, bounded and
  blocking): a rank late past the bound is ``None`` on both, then both agree on the MIN.

Each child reports its timings as JSON; the parent prints them (``pytest -s``) and kills
a child that does not finish in time (then the test fails).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.sglang

ROOT = Path(__file__).resolve().parents[2]
BOUND_S = 1.0
STALL_S = 2.0 * BOUND_S
SLOW_S = 2.0 * BOUND_S
MARGIN_S = 2.5  # a shared 2-core CI machine: a miss must come before BOUND_S + MARGIN_S
JOIN_S = 90.0

CHILD = textwrap.dedent(
    """
    import json, sys, time
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from sglang_storage.core import ObjectKey
    from sglang_storage.managers.controller import (
        CacheController, ControllerConfig, HitQueryDone, ReadProgress,
    )
    from sglang_storage.memory import (
        Attention, BudgetConfig, HostMemory, HostMemoryBudget, KVGeometry, KVHostPool,
        KVLayout, MemoryFacts,
    )
    from sglang_storage.storage import create_backend
    from sglang_storage.storage.faults import FaultInjectingBackend, FaultSchedule
    from sglang_storage.storage.keys import kv_namespace, model_fingerprint
    from sglang_storage.transfer import StoragePipeline, StoragePipelineConfig
    from sglang_storage_adapters.ranks import rank_sync

    port, rank, root, bound, stall, slow = sys.argv[1:7]
    rank, bound, stall, slow = int(rank), float(bound), float(stall), float(slow)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
        timeout=timedelta(seconds=60),
    )
    PAGE, N = 4, 8
    facts = MemoryFacts(physical=64 << 30, available=64 << 30)
    memory = HostMemory(HostMemoryBudget(BudgetConfig(total=64 << 20, headroom=0), facts=facts))
    geometry = KVGeometry(
        attention=Attention.MHA, layout=KVLayout.PAGE_FIRST, dtype=torch.bfloat16,
        layer_num=2, page_size=PAGE, num_pages=64, head_num=2, head_dim=8,
    )
    host = KVHostPool(geometry, memory)
    backend = create_backend("file", {"root": root})
    if rank == 1:
        backend = FaultInjectingBackend(
            backend, FaultSchedule(seed=3, latency_rate=1.0, latency_s=slow)
        )
        backend.pause()
    # Enough workers that a slow backend's calls of one phase all run at once.
    pipeline = StoragePipeline(backend, StoragePipelineConfig(workers=4, batch_pages=4))
    ranks = rank_sync([dist.group.WORLD])
    assert (ranks.rank, ranks.world_size) == (rank, 2), ranks
    controller = CacheController(
        host=host, device=None, storage=pipeline, ranks=ranks,
        config=ControllerConfig(rank_timeout_s=bound, exists_timeout_s=30.0, read_batch_pages=4),
    )
    ns = kv_namespace(model_fingerprint("test/rank-stall", page_size=PAGE), mla=False)
    keys = [ObjectKey(namespace=ns, name=f"page{i:03d}") for i in range(N)]
    nbytes = N * host.page_spec.nbytes
    data = torch.randint(0, 256, (nbytes,), generator=torch.Generator().manual_seed(5),
                         dtype=torch.uint8)
    out = {"rank": rank}

    def drain(ids, deadline_s=20.0):
        # Poll until the query and the read (ids) have ended; their events and when.
        query_id, read_id = ids
        found, began = {}, time.monotonic()
        while len(found) < 2:
            assert time.monotonic() - began < deadline_s, f"rank {rank} stuck: {found}"
            for e in controller.poll():
                if isinstance(e, HitQueryDone) and e.query_id == query_id:
                    found["hit"] = (e, time.monotonic())
                elif isinstance(e, ReadProgress) and e.read_id == read_id and e.final:
                    found["read"] = (e, time.monotonic())
            time.sleep(0.002)
        return found

    def record(name, found, since):
        hit, read = found["hit"][0], found["read"][0]
        out[name] = {
            "hit": [hit.pages, hit.local_pages, hit.agreed],
            "read": [read.pages, read.requested_pages, read.agreed],
            "hit_s": found["hit"][1] - since,
            "read_s": found["read"][1] - since,
            "pinned": host.slots.stats().pinned,
        }

    def start(query_keys):
        target = host.alloc(N)
        return target, (controller.query(query_keys), controller.read(keys, target))

    # ---- healthy: rank 0 stores, both agree on the hit and read it
    if rank == 0:
        pages = host.alloc(N)
        host.write_pages(pages, data)
        backup = controller.backup(keys, pages)
        while not any(getattr(e, "backup_id", None) == backup for e in controller.poll()):
            time.sleep(0.002)
        host.free(pages)
    dist.barrier()
    since = time.monotonic()
    # rank 1 asks for the first 5 only: the hit is the MIN, 5
    target, ids = start(keys if rank == 0 else keys[:5])
    record("healthy", drain(ids), since)
    out["healthy"]["bytes_equal"] = bool(
        torch.equal(host.read_pages(target).reshape(-1).view(torch.uint8), data)
    )
    host.free(target)

    # ---- rank 1 does not poll for `stall` seconds
    dist.barrier()
    since = time.monotonic()
    target, ids = start(keys)
    if rank == 1:
        time.sleep(stall)
        out["woke_s"] = time.monotonic() - since
    record("no_poll", drain(ids), since)
    host.free(target)

    # ---- rank 1's backend answers after `slow` seconds
    dist.barrier()
    if rank == 1:
        backend.resume()
    since = time.monotonic()
    target, ids = start(keys)
    record("slow_backend", drain(ids), since)
    if rank == 1:
        backend.pause()
    host.free(target)

    # ---- healthy again: the real hit count
    dist.barrier()
    since = time.monotonic()
    target, ids = start(keys)
    record("recovered", drain(ids), since)
    out["stats"] = {
        "rank_misses": controller.stats().rank_misses,
        "read_pages": controller.stats().read_pages,
    }
    host.free(target)

    # ---- the decode adapter's agreement: bounded agree_min on its own prefix
    decode = rank_sync([dist.group.WORLD], name="decode")
    dist.barrier()
    if rank == 1:
        time.sleep(stall)
    since = time.monotonic()
    out["decode_late"] = [decode.agree_min("decode_ready", 3 + rank, timeout_s=bound),
                          time.monotonic() - since]
    dist.barrier()
    since = time.monotonic()
    out["decode_ok"] = [decode.agree_min("decode_ready", 3 + rank, timeout_s=bound),
                        time.monotonic() - since]

    controller.close(timeout_s=5.0)
    pipeline.close(timeout_s=5.0)
    backend.close()
    dist.barrier()
    dist.destroy_process_group()
    print("RESULT " + json.dumps(out), flush=True)
    """
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(root: Path) -> list[dict[str, Any]]:
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    port = free_port()
    args = [str(port), "", str(root), str(BOUND_S), str(STALL_S), str(SLOW_S)]
    children = []
    for rank in range(2):
        args[1] = str(rank)
        children.append(
            subprocess.Popen(
                [sys.executable, "-c", CHILD, *args],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                cwd=ROOT,
                env=env,
            )
        )
    outputs: list[str] = []
    deadline = time.monotonic() + JOIN_S
    try:
        for child in children:
            try:
                outputs.append(child.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
            except subprocess.TimeoutExpired:
                pytest.fail(f"a rank hung (no exit within {JOIN_S} s)")
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.communicate()
    results = []
    for rank, (child, text) in enumerate(zip(children, outputs, strict=True)):
        lines = [line for line in text.splitlines() if line.startswith("RESULT ")]
        assert child.returncode == 0, f"rank {rank} failed:\n{text[-4000:]}"
        assert lines, f"rank {rank} reported nothing:\n{text[-4000:]}"
        results.append(json.loads(lines[-1].removeprefix("RESULT ")))
    return results


def test_a_stalled_rank_is_a_miss_on_both_ranks_within_the_bound(tmp_path: Path) -> None:
    started = time.monotonic()
    ranks = run_ranks(tmp_path)
    total = time.monotonic() - started
    for out in ranks:
        r = out["rank"]
        for phase in ("healthy", "no_poll", "slow_backend", "recovered"):
            p = out[phase]
            print(
                f"rank {r} {phase:12s} hit={p['hit']} after {p['hit_s']:.3f} s, "
                f"read={p['read']} after {p['read_s']:.3f} s"
            )
        print(f"rank {r} decode: late={out['decode_late']} ok={out['decode_ok']}")
    print(f"rank 1 woke after {ranks[1]['woke_s']:.3f} s; both ranks done in {total:.1f} s")

    r0, r1 = ranks
    # Healthy: the MIN of 8 and 5 on both; the read agrees on all 8, byte-exact.
    assert r0["healthy"]["hit"] == [5, 8, True]
    assert r1["healthy"]["hit"] == [5, 5, True]
    for out in ranks:
        assert out["healthy"]["read"] == [8, 8, True]
        assert out["healthy"]["bytes_equal"]
        assert out["healthy"]["pinned"] == 0

    # Rank 1 not polling: a miss on rank 0 within the bound, and on rank 1 when it polls.
    for phase in ("no_poll", "slow_backend"):
        assert r0[phase]["hit"] == [0, 8, False], phase
        assert r0[phase]["read"] == [0, 8, False], phase
        assert BOUND_S * 0.9 <= r0[phase]["hit_s"] < BOUND_S + MARGIN_S, phase
        assert BOUND_S * 0.9 <= r0[phase]["read_s"] < BOUND_S + MARGIN_S, phase
        assert r1[phase]["hit"][0] == 0, phase
        assert r1[phase]["hit"][2] is False, phase
        assert r1[phase]["read"] == [0, 8, False], phase
        assert r0[phase]["pinned"] == r1[phase]["pinned"] == 0, phase
    woke = r1["woke_s"]
    assert r1["no_poll"]["hit"][1] == 8  # its own storage had all 8: the agreement said 0
    assert r1["no_poll"]["hit_s"] - woke < MARGIN_S
    assert r1["no_poll"]["read_s"] - woke < MARGIN_S
    # Rank 1's backend answered after SLOW_S; then its miss came at once.
    assert SLOW_S * 0.9 <= r1["slow_backend"]["hit_s"] < SLOW_S + MARGIN_S
    assert r1["slow_backend"]["read_s"] < SLOW_S + MARGIN_S

    # Neither rank stalls: the same query agrees on the real hit count again.
    for out in ranks:
        assert out["recovered"]["hit"] == [8, 8, True]
        assert out["recovered"]["read"] == [8, 8, True]
        assert out["stats"]["rank_misses"] == 4  # two queries, two reads abandoned
        assert out["stats"]["read_pages"] == 16

    # The decode adapter's agreement: None on both when a rank is late, then the MIN.
    assert r0["decode_late"][0] is None
    assert r1["decode_late"][0] is None
    assert BOUND_S * 0.9 <= r0["decode_late"][1] < BOUND_S + MARGIN_S
    assert r1["decode_late"][1] < MARGIN_S  # late: reads the abandoned outcome at once
    assert r0["decode_ok"][0] == r1["decode_ok"][0] == 3


def test_the_adapters_agree_through_this_rank_sync() -> None:
    """What the children use is what the HiCache controller and the decode adapter use."""
    from sglang_storage_adapters import decode, hicache_controller, ranks

    assert vars(hicache_controller)["rank_sync"] is ranks.rank_sync
    assert vars(decode)["rank_sync"] is ranks.rank_sync
    # Without torch.distributed initialised (this process), one rank agrees alone.
    assert ranks.rank_sync([None]).world_size == 1
