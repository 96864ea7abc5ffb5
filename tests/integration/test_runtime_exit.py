"""A process's storage runtime is closed at a normal exit: writes it had queued are stored.

SGLang's scheduler processes exit without telling the adapters; the runtime registers
an ``atexit`` close when it is built (``sglang_storage_adapters.runtime``). The writer here
is a real second process that queues writes through the process runtime's pipeline and
returns at once; the parent then reads every object back from the same ``file`` store.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from sglang_storage.core import DataKind, GetOutcome, GetRequest, Namespace, ObjectKey, ObjectSpec
from sglang_storage.storage.file import FileBackend, FileBackendConfig

COUNT = 400
NBYTES = 256 << 10

WRITER = textwrap.dedent(
    """
    import sys

    from sglang_storage.core import DataKind, Namespace, ObjectKey, ObjectSpec, PutRequest
    from sglang_storage_adapters.runtime import parse_settings, process_runtime

    root, count, nbytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    settings = parse_settings({"storage_backend": "file", "storage_options": {"root": root}})
    runtime = process_runtime(settings, ranks_per_host=1)
    lease = runtime.backend("file", {"root": root})
    pipeline = runtime.storage_pipeline(lease)
    namespace = Namespace(model="exit-test", kind=DataKind.RECORD)
    requests = [
        PutRequest(
            key=ObjectKey(namespace=namespace, name=f"obj-{i:04d}"),
            spec=ObjectSpec.raw(nbytes),
            buffers=[bytes([i % 251]) * nbytes],
        )
        for i in range(count)
    ]
    pipeline.submit_put(requests)
    print("queued", flush=True)  # and return at once: nothing waits for the handle
    """
)


def test_queued_writes_are_stored_when_the_process_exits(tmp_path: Path) -> None:
    root = tmp_path / "store"
    done = subprocess.run(
        [sys.executable, "-c", WRITER, str(root), str(COUNT), str(NBYTES)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "queued"

    namespace = Namespace(model="exit-test", kind=DataKind.RECORD)
    backend = FileBackend(FileBackendConfig(root=str(root)))
    try:
        buffers = [bytearray(NBYTES) for _ in range(COUNT)]
        requests = [
            GetRequest(
                key=ObjectKey(namespace=namespace, name=f"obj-{i:04d}"),
                spec=ObjectSpec.raw(NBYTES),
                buffers=[memoryview(buffers[i])],
            )
            for i in range(COUNT)
        ]
        results = backend.get_into(requests)
    finally:
        backend.close()
    assert [r.outcome for r in results] == [GetOutcome.HIT] * COUNT
    for i, buffer in enumerate(buffers):
        assert buffer == bytes([i % 251]) * NBYTES, i
