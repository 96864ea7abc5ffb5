"""The diagnostic behind docs/gpu/README.md's "what failed on the first try" (not a test).

Run on a CUDA machine from the repository root: ``python3 docs/gpu/diag_gpu.py``. It asks
the CUDA runtime (``cudaPointerGetAttributes`` from the loaded libcudart) whether memory our
``PinnedAllocator`` registered is host-registered, next to ``Tensor.is_pinned()``; and it
times a slow load's submission and a compute read issued while the load sleeps, in a fresh
process.
"""

from __future__ import annotations

import ctypes
import sys
import time
from pathlib import Path

sys.path[:0] = ["tests", "tests/gpu", "."]

import torch  # noqa: E402


class PointerAttributes(ctypes.Structure):
    """``cudaPointerAttributes``: memory type (0 unregistered, 1 host, 2 device, 3 managed)."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("device", ctypes.c_int),
        ("device_pointer", ctypes.c_void_p),
        ("host_pointer", ctypes.c_void_p),
    ]


def loaded_cudart() -> ctypes.CDLL:
    """The libcudart torch loaded (found in ``/proc/self/maps``)."""
    maps = Path("/proc/self/maps").read_text().splitlines()
    return ctypes.CDLL(next(line.split()[-1] for line in maps if "libcudart.so" in line))


def pointer_type(cudart: ctypes.CDLL, address: int) -> tuple[int, int]:
    """``(status, memory type)`` of ``address``; clears the error a failure latches."""
    attributes = PointerAttributes()
    status = cudart.cudaPointerGetAttributes(ctypes.byref(attributes), ctypes.c_void_p(address))
    cudart.cudaGetLastError()
    return int(status), int(attributes.type)


def registration(cudart: ctypes.CDLL) -> None:
    """Registered memory: what ``is_pinned()`` says and what the runtime says."""
    from test_pinned_memory import pinned_memory

    from sglang_storage.core import DataKind

    memory = pinned_memory(1 << 24)
    buffer = memory.allocate(DataKind.KV, 1 << 20, label="diag")
    tensor = buffer.tensor
    print(
        "registered: is_pinned",
        tensor.is_pinned(),
        "runtime (status, type)",
        pointer_type(cudart, tensor.data_ptr()),
    )
    own = torch.empty(16, pin_memory=True)
    print("torch's own pinned tensor: is_pinned", own.is_pinned())
    memory.release(buffer)
    print("released: runtime (status, type)", pointer_type(cudart, tensor.data_ptr()))


def stale_read(cudart: ctypes.CDLL) -> None:
    """A sleeping load's submission time and a compute read issued while it sleeps."""
    import test_device_pipeline as t
    from support.gpu_kv import expected_load, make_host, same_bits, tensors

    from sglang_storage.memory import KVLayout, Pinning

    g = t.make_geometry(t.MHA, KVLayout.PAGE_FIRST, torch.bfloat16)
    device, host = t.make_device(g, 12), make_host(g, Pinning.ALWAYS, 13)
    pairs = [(2, 7), (9, 3)]
    before = [tensor.cpu() for tensor in tensors(device)]
    want = expected_load(host.kv_buffer, before, g, pairs)
    tokens = t.tokens_of([d for _, d in pairs])
    rows = torch.tensor(tokens, device="cuda")
    with t.slow_pipeline(device, host) as pipe:
        for direction, stream in pipe._streams.items():
            flags = ctypes.c_uint(0)
            status = cudart.cudaStreamGetFlags(
                ctypes.c_void_p(stream.cuda_stream), ctypes.byref(flags)
            )
            print("stream", direction, "flags", flags.value, "status", status)
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        load = pipe.load([h for h, _ in pairs], tokens)
        t1 = time.perf_counter()
        stale = device.k[t.LAYERS - 1].index_select(0, rows)
        read = torch.cuda.Event(enable_timing=True)
        read.record()
        t2 = time.perf_counter()
        print("load done right after its submission:", load.done())
        result = load.wait()
        torch.cuda.synchronize()
        print(
            f"submission {1e3 * (t1 - t0):.2f} ms; read launch {1e3 * (t2 - t1):.3f} ms; "
            f"read done {start.elapsed_time(read):.2f} ms after the start; "
            f"load {1e3 * result.latency_s:.1f} ms"
        )
        old = before[t.LAYERS - 1][rows.cpu()]
        new = want[t.LAYERS - 1][rows.cpu()]
        print("read saw the old rows", same_bits(stale, old), "the new", same_bits(stale, new))
        pipe.poll()


def main() -> None:
    """Both diagnostics, in this order (the first initialises CUDA)."""
    torch.ones(1, device="cuda")
    cudart = loaded_cudart()
    registration(cudart)
    stale_read(cudart)


if __name__ == "__main__":
    main()
