"""Moving bytes: the device<->host pipeline and the host<->storage pipeline.

Every transfer returns a typed handle (done, failed or cancelled; bytes; latency). The
storage side talks to a ``Protocol`` declared here, which the backends in
:mod:`sglang_storage.storage` satisfy; this layer never imports them. Imports only
:mod:`sglang_storage.memory` and the shared base.
"""
