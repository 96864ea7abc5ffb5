"""Mapped host regions: the three modes, sharing between two real processes, the budget,
the huge page backing report on this machine, CUDA registration and bad input.

Registration is checked against :class:`FakeCudart`, a named fake of the CUDA runtime's
host-registration calls (no CUDA runs on these machines); everything else is real: real
mappings, a real memfd opened by a second, spawned process through ``/proc``, real files
and the kernel's own ``/proc/self/smaps``.
"""

from __future__ import annotations

import gc
import hashlib
import mmap
import multiprocessing
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from sglang_storage.core import DataKind
from sglang_storage.errors import (
    BackendIOError,
    BackendUnavailableError,
    CapacityError,
    ConfigError,
    StateError,
)
from sglang_storage.memory import (
    BudgetConfig,
    HostMemoryBudget,
    MappedRegion,
    MappedRegionConfig,
    MappingMode,
    MemoryFacts,
    Pinning,
    Registration,
    SharedHandle,
    read_backing,
    thp_mode,
)

FACTS = MemoryFacts(physical=64 << 30, available=64 << 30)
MIB = 1 << 20
HUGE = 2 * MIB


def budget(total: int = 256 * MIB) -> HostMemoryBudget:
    return HostMemoryBudget(BudgetConfig(total=total, headroom=0), facts=FACTS)


def used(b: HostMemoryBudget) -> int:
    return b.stats().kinds[DataKind.WEIGHT].used


class FakeCudart:
    """A fake of the CUDA runtime's host-registration calls (CUDA cannot run here)."""

    def __init__(self, *, refuse_with: int = 0) -> None:
        self.live: dict[int, tuple[int, int]] = {}
        self.refuse_with = refuse_with
        self.last_error = 0

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802
        if self.refuse_with:
            self.last_error = self.refuse_with
            return self.refuse_with
        self.live[ptr] = (size, flags)
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        return 0 if self.live.pop(ptr, None) is not None else 713

    def cudaGetLastError(self) -> int:  # noqa: N802
        error, self.last_error = self.last_error, 0
        return error


def config(
    mode: MappingMode = MappingMode.ANONYMOUS, nbytes: int = 8 * MIB, **kw: object
) -> MappedRegionConfig:
    return MappedRegionConfig(nbytes=nbytes, mode=mode, label="test table", **kw)  # type: ignore[arg-type]


# ------------------------------------------------------------------- modes and budget


@pytest.mark.parametrize("mode", [MappingMode.ANONYMOUS, MappingMode.MEMFD])
def test_a_region_is_charged_while_open_and_its_bytes_are_the_mapping(mode: MappingMode) -> None:
    b = budget()
    region = MappedRegion.create(config(mode), b)
    assert used(b) == 8 * MIB
    tensor = region.tensor
    assert tensor.dtype == torch.uint8
    assert tensor.shape == (8 * MIB,)
    assert region.address == tensor.data_ptr()
    assert region.address % mmap_page() == 0
    tensor[::4096] = 7
    assert int(tensor.sum()) == 7 * (8 * MIB // 4096)
    state = region.state()
    assert (state.mode, state.charged_bytes, state.shared_from) == (mode, 8 * MIB, None)
    assert state.registration is Registration.UNAVAILABLE  # no CUDA here, and said so
    assert "CUDA is not available" in state.registration_note
    region.close()
    assert used(b) == 0
    assert region.state().closed
    assert region.state().charged_bytes == 0
    assert region.state().registration is Registration.CLOSED
    region.close()  # twice is a no-op
    with pytest.raises(StateError):
        region.tensor  # noqa: B018


def mmap_page() -> int:
    import mmap

    return mmap.PAGESIZE


def test_a_region_the_budget_cannot_hold_is_refused_and_nothing_stays_charged() -> None:
    b = budget(4 * MIB)
    with pytest.raises(CapacityError) as raised:
        MappedRegion.create(config(MappingMode.MEMFD), b)
    assert raised.value.requested == 8 * MIB
    assert raised.value.available == 4 * MIB
    assert used(b) == 0


def test_a_region_collected_unclosed_gives_its_charge_back() -> None:
    b = budget()
    region = MappedRegion.create(config(), b)
    assert used(b) == 8 * MIB
    del region
    gc.collect()
    assert used(b) == 0


def test_memfd_share_handle_and_anonymous_cannot_be_shared() -> None:
    b = budget()
    with MappedRegion.create(config(MappingMode.MEMFD), b) as shared:
        handle = shared.share_handle()
        assert handle.pid == os.getpid()
        assert handle.nbytes == 8 * MIB
        assert Path(handle.proc_path).readlink().as_posix().startswith("/memfd:")
    with MappedRegion.create(config(), b) as private, pytest.raises(StateError):
        private.share_handle()


# ------------------------------------------------------------------- two processes


def test_a_second_process_attaches_reads_the_same_bytes_and_its_writes_are_seen() -> None:
    from support.mapped_workers import attach_read_write

    b = budget()
    nbytes = 4 * MIB
    with MappedRegion.create(config(MappingMode.MEMFD, nbytes), b) as region:
        data = region.tensor.numpy()
        data[:] = np.random.default_rng(5).integers(0, 256, nbytes, dtype=np.uint8)
        expected = hashlib.sha256(data.tobytes()).hexdigest()
        handle = region.share_handle()
        context = multiprocessing.get_context("spawn")
        parent, child = context.Pipe()
        process = context.Process(
            target=attach_read_write,
            args=(handle.pid, handle.fd, nbytes, MIB, 4096, child),
        )
        process.start()
        try:
            assert parent.poll(60), "the second process did not report"
            digest, charged, shared_from, registration = parent.recv()
            assert parent.poll(30)
            assert parent.recv() == "written"
        finally:
            process.join(30)
        assert process.exitcode == 0
        assert digest == expected  # every byte the creator wrote, seen by the other process
        assert charged == 0
        assert shared_from == os.getpid()
        assert registration == Registration.UNAVAILABLE.value
        assert (data[MIB : MIB + 4096] == 0xA5).all()  # the other process's write, seen here
        assert used(b) == nbytes


def test_attaching_an_unreachable_memfd_is_a_clear_error() -> None:
    dead = multiprocessing.get_context("spawn").Process(target=int)
    dead.start()
    dead.join()
    assert dead.pid is not None
    with pytest.raises(BackendUnavailableError, match="PID namespace"):
        MappedRegion.attach(SharedHandle(pid=dead.pid, fd=3, nbytes=MIB), label="gone")


def test_attaching_a_descriptor_that_is_no_memfd_or_has_another_size_is_refused(
    tmp_path: Path,
) -> None:
    path = tmp_path / "plain"
    path.write_bytes(bytes(MIB))
    fd = os.open(path, os.O_RDWR)
    try:
        with pytest.raises(BackendUnavailableError, match="not a memfd"):
            MappedRegion.attach(SharedHandle(pid=os.getpid(), fd=fd, nbytes=MIB), label="x")
    finally:
        os.close(fd)
    with MappedRegion.create(config(MappingMode.MEMFD), budget()) as region:
        handle = region.share_handle()
        wrong = SharedHandle(pid=handle.pid, fd=handle.fd, nbytes=MIB)
        with pytest.raises(StateError, match="holds 8388608 bytes"):
            MappedRegion.attach(wrong, label="x")


# ------------------------------------------------------------------- huge pages


def test_the_backing_report_is_what_the_kernel_gave_on_this_machine() -> None:
    enabled, shmem = thp_mode("enabled"), thp_mode("shmem_enabled")
    print(f"transparent_hugepage enabled={enabled!r} shmem_enabled={shmem!r}")
    b = budget()
    nbytes = 16 * MIB
    with (
        MappedRegion.create(config(nbytes=nbytes), b) as asked,
        MappedRegion.create(config(nbytes=nbytes, huge_pages=False), b) as plain,
        MappedRegion.create(config(MappingMode.MEMFD, nbytes), b) as shared,
    ):
        untouched = asked.backing()
        assert untouched.found
        assert untouched.mapped_kb == 0
        for region in (asked, plain, shared):
            region.tensor[:] = 1  # fault every page in
        reports = {
            name: r.backing()
            for name, r in (("asked", asked), ("plain", plain), ("shared", shared))
        }
        for name, report in reports.items():
            print(name, report.describe())
            assert report.mapped_kb == nbytes // 1024, name  # Rss of exactly this mapping
            assert (report.thp_enabled, report.thp_shmem_enabled) == (enabled, shmem)
            assert report.huge_kb <= report.mapped_kb
        assert reports["asked"].huge_pages_asked
        assert not reports["plain"].huge_pages_asked
        if enabled == "never":
            assert reports["asked"].huge_kb == 0
        else:  # madvise or always: an advised, 2 MiB-aligned anonymous region gets them
            assert reports["asked"].anon_huge_kb > 0, reports["asked"].describe()
        if enabled in ("madvise", "never"):
            assert reports["plain"].huge_kb == 0  # not advised: base pages
        if shmem in ("never", "deny"):
            assert reports["shared"].shmem_huge_kb == 0  # shmem gets none, asked or not


def test_the_report_of_part_of_a_larger_area_counts_only_that_parts_pages() -> None:
    """smaps gives one area's totals; a range inside a bigger (or merged) area is counted."""
    area = mmap.mmap(-1, 4 * MIB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        area.madvise(mmap.MADV_NOHUGEPAGE)  # 4 KiB pages: touching one byte faults one page
        view = np.frombuffer(area, dtype=np.uint8)
        view[: 2 * MIB] = 1  # the first half resident, the second never touched
        address = view.ctypes.data
        whole = read_backing(address, 4 * MIB, huge_pages_asked=False)
        part = read_backing(address + MIB, 2 * MIB, huge_pages_asked=False)
        untouched = read_backing(address + 2 * MIB, 2 * MIB, huge_pages_asked=False)
        assert whole.mapped_kb == 2048
        assert part.mapped_kb == 1024, part.describe()  # smaps alone would say 2048
        assert untouched.mapped_kb == 0
        assert part.huge_kb <= part.mapped_kb
        del view
    finally:
        area.close()


def test_prefault_makes_every_page_resident_before_any_touch() -> None:
    with MappedRegion.create(config(nbytes=4 * MIB, prefault=True), budget()) as region:
        assert region.backing().mapped_kb == 4 * 1024
    with MappedRegion.create(
        config(MappingMode.MEMFD, nbytes=4 * MIB, prefault=True), budget()
    ) as region:
        assert region.backing().mapped_kb == 4 * 1024


def test_collapse_reports_whether_the_kernel_folded_the_region() -> None:
    with MappedRegion.create(config(nbytes=4 * MIB, huge_pages=False), budget()) as region:
        region.tensor[:] = 3
        folded = region.collapse(tries=1)
        report = region.backing()
        if folded:
            assert report.anon_huge_kb > 0
        assert int(region.tensor[::4096].sum()) == 3 * 1024  # the bytes survive either way


# ------------------------------------------------------------------- file-backed


def test_a_file_backed_region_maps_the_files_bytes_and_writes_reach_the_file(
    tmp_path: Path,
) -> None:
    path = tmp_path / "table.bin"
    payload = np.random.default_rng(1).integers(0, 256, 2 * MIB, dtype=np.uint8).tobytes()
    path.write_bytes(payload)
    b = budget()
    with MappedRegion.create(
        config(MappingMode.FILE, 2 * MIB, path=str(path), read_only=True), b
    ) as ro:
        assert bytes(ro.tensor.numpy()) == payload
        assert ro.state().read_only
        assert used(b) == 2 * MIB
    with MappedRegion.create(config(MappingMode.FILE, 2 * MIB, path=str(path)), b) as rw:
        rw.tensor[:4096] = 9
    assert path.read_bytes()[:4096] == bytes([9]) * 4096
    assert path.read_bytes()[4096:] == payload[4096:]
    created = tmp_path / "new.bin"
    with MappedRegion.create(config(MappingMode.FILE, MIB, path=str(created)), b) as fresh:
        assert int(fresh.tensor.sum()) == 0
    assert created.stat().st_size == MIB
    assert used(b) == 0


def test_a_read_only_file_smaller_than_the_region_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "short.bin"
    path.write_bytes(bytes(4096))
    b = budget()
    with pytest.raises(ConfigError, match="fewer than"):
        MappedRegion.create(config(MappingMode.FILE, MIB, path=str(path), read_only=True), b)
    with pytest.raises(BackendIOError):
        MappedRegion.create(
            config(MappingMode.FILE, MIB, path=str(tmp_path / "none"), read_only=True), b
        )
    assert used(b) == 0


# ------------------------------------------------------------------- registration


def test_registration_goes_through_the_injected_runtime_and_ends_at_close() -> None:
    cudart = FakeCudart()
    b = budget()
    region = MappedRegion.create(config(), b, cudart=cudart)
    assert region.page_locked
    assert region.state().registration is Registration.REGISTERED
    assert cudart.live == {region.address: (8 * MIB, 3)}
    region.close()
    assert cudart.live == {}
    never = MappedRegion.create(config(pinning=Pinning.NEVER), b, cudart=cudart)
    assert never.state().registration is Registration.NOT_ASKED
    assert cudart.live == {}
    never.close()


def test_a_read_only_file_is_registered_read_only(tmp_path: Path) -> None:
    path = tmp_path / "ro.bin"
    path.write_bytes(bytes(MIB))
    cudart = FakeCudart()
    config_ro = config(MappingMode.FILE, MIB, path=str(path), read_only=True)
    with MappedRegion.create(config_ro, budget(), cudart=cudart) as region:
        assert cudart.live[region.address] == (MIB, 3 | 8)  # cudaHostRegisterReadOnly


def test_a_refused_registration_raises_and_gives_everything_back() -> None:
    cudart = FakeCudart(refuse_with=2)
    b = budget()
    with pytest.raises(BackendUnavailableError, match="failed with code 2"):
        MappedRegion.create(config(), b, cudart=cudart)
    assert used(b) == 0
    assert cudart.last_error == 0


def test_pinning_always_without_cuda_is_refused() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here, so pinning 'always' is satisfiable")
    with pytest.raises(BackendUnavailableError, match="always"):
        MappedRegion.create(config(pinning=Pinning.ALWAYS), budget())


# ------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"nbytes": 0, "mode": MappingMode.ANONYMOUS}, "nbytes"),
        ({"nbytes": MIB, "mode": "memfd"}, "mode"),
        ({"nbytes": MIB, "mode": MappingMode.FILE}, "path"),
        ({"nbytes": MIB, "mode": MappingMode.ANONYMOUS, "path": "/tmp/x"}, "path"),
        ({"nbytes": MIB, "mode": MappingMode.MEMFD, "read_only": True}, "read_only"),
        ({"nbytes": MIB, "mode": MappingMode.FILE, "path": " "}, "path"),
        ({"nbytes": MIB, "mode": MappingMode.ANONYMOUS, "huge_pages": 1}, "huge_pages"),
    ],
)
def test_bad_configs_say_which_field(fields: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as raised:
        MappedRegionConfig(label="x", **fields)  # type: ignore[arg-type]
    assert raised.value.field == field


def test_bad_handles_and_arguments_are_config_errors() -> None:
    with pytest.raises(ConfigError):
        SharedHandle(pid=0, fd=3, nbytes=MIB)
    with pytest.raises(ConfigError):
        SharedHandle(pid=1, fd=-1, nbytes=MIB)
    with pytest.raises(ConfigError):
        MappedRegion.create("8 MiB", budget())  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        MappedRegion.attach((1, 3), label="x")  # type: ignore[arg-type]
