"""Host memory as one budgeted resource shared by every data kind.

Owns the process-wide host memory budget with per-kind reservations, pinned (CUDA) and
plain (CPU-only) allocators behind one API, the page/slot allocator with pin counts, and
the typed host pools (KV in SGLang's layouts, embeddings, records). Imports only the
shared base (:mod:`sglang_storage.errors`, ``units``, ``config``).
"""
