"""Diagnostics for the three gpu test failures (not part of the suite)."""
import ctypes, sys, time
from pathlib import Path
sys.path[:0] = ["tests", "tests/gpu", "."]
import torch

def cudart_lib():
    paths = [l.split()[-1] for l in Path("/proc/self/maps").read_text().splitlines() if "libcudart.so" in l]
    return ctypes.CDLL(paths[0]) if paths else None

class Attr(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("device", ctypes.c_int), ("dptr", ctypes.c_void_p), ("hptr", ctypes.c_void_p)]

torch.ones(1, device="cuda")
lib = cudart_lib()
print("libcudart", lib)
def ptr_type(p):
    a = Attr(); rc = lib.cudaPointerGetAttributes(ctypes.byref(a), ctypes.c_void_p(p)); lib.cudaGetLastError()
    return rc, a.type

from test_pinned_memory import pinned_memory, GEOMETRY
from sglang_storage.core import DataKind
mem = pinned_memory(1 << 24)
buf = mem.allocate(DataKind.KV, 1 << 20, label="diag")
t = buf.tensor
print("registered: is_pinned", t.is_pinned(), "ptr attrs", ptr_type(t.data_ptr()), "page_locked", buf.page_locked)
x = torch.empty(16, pin_memory=True)
print("after torch pin_memory: is_pinned(ours)", t.is_pinned(), "torch's", x.is_pinned(), ptr_type(x.data_ptr()))
mem.release(buf)
print("released: is_pinned", t.is_pinned(), ptr_type(t.data_ptr()))

import test_device_pipeline as T
from support.gpu_kv import expected_load, same_bits, tensors, make_host
from sglang_storage.memory import KVLayout, Pinning
g = T.make_geometry(T.MHA, KVLayout.PAGE_FIRST, torch.bfloat16)
device, host = T.make_device(g, 12), make_host(g, Pinning.ALWAYS, 13)
pairs = [(2, 7), (9, 3)]
before = [t.cpu() for t in tensors(device)]
want = expected_load(host.kv_buffer, before, g, pairs)
rows = torch.tensor(T.tokens_of([d for _, d in pairs]), device="cuda")
print("current stream", torch.cuda.current_stream())
with T.slow_pipeline(device, host) as pipe:
    for d, s in pipe._streams.items():
        fl = ctypes.c_uint(99); rc = lib.cudaStreamGetFlags(ctypes.c_void_p(s.cuda_stream), ctypes.byref(fl))
        print("stream", d, s, "flags rc", rc, "flags", fl.value)
    e0 = torch.cuda.Event(enable_timing=True); e0.record()
    h0 = time.perf_counter()
    load = pipe.load([h for h, _ in pairs], T.tokens_of([d for _, d in pairs]))
    h1 = time.perf_counter()
    stale = device.k[T.LAYERS - 1].index_select(0, rows)
    e1 = torch.cuda.Event(enable_timing=True); e1.record()
    h2 = time.perf_counter()
    print("load.done right after", load.done())
    r = load.wait()
    torch.cuda.synchronize()
    print(f"submit {1e3*(h1-h0):.2f} ms host; stale index_select enqueued {1e3*(h2-h1):.3f} ms; e0->e1 on current stream {e0.elapsed_time(e1):.2f} ms; load latency {r.latency_s*1e3:.1f} ms")
    sub_before = before[T.LAYERS - 1][rows.cpu()]
    sub_want = want[T.LAYERS - 1][rows.cpu()]
    print("stale==before", same_bits(stale, sub_before), "stale==want", same_bits(stale, sub_want), "before==want", same_bits(sub_before, sub_want))
    pipe.poll()
