"""Work done in a second (spawned) process of the host for the mapped-region tests.

Spawned children import this module by name (``support`` is on ``sys.path``), so what they
run lives here rather than in a test module.
"""

from __future__ import annotations

import hashlib
from multiprocessing.connection import Connection

__all__ = ["attach_read_write"]


def attach_read_write(
    pid: int, fd: int, nbytes: int, write_at: int, write_len: int, conn: Connection
) -> None:
    """Attach to the creator's memfd region, report its bytes' digest, write a pattern.

    Sends ``(digest of every byte, charged_bytes, shared_from, registration)`` through
    ``conn``, then writes ``0xA5`` over ``[write_at, write_at + write_len)`` and closes; or
    sends ``("error", type name, message)`` when attaching fails.
    """
    from sglang_storage.errors import StorageError
    from sglang_storage.memory import MappedRegion, SharedHandle

    try:
        region = MappedRegion.attach(
            SharedHandle(pid=pid, fd=fd, nbytes=nbytes), label="attached by the second process"
        )
    except StorageError as error:
        conn.send(("error", type(error).__name__, str(error)))
        return
    with region:
        data = region.tensor.numpy()
        digest = hashlib.sha256(data.tobytes()).hexdigest()
        state = region.state()
        conn.send((digest, state.charged_bytes, state.shared_from, state.registration.value))
        data[write_at : write_at + write_len] = 0xA5
    conn.send("written")
