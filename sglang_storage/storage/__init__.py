"""Key-value storage backends behind one typed protocol.

Owns the backend protocol and its declared capabilities, the self-checking object format,
SGLang-compatible keys, the registry, and the backends themselves (``file`` as the embedded
default, ``mooncake``, ``hf3fs``). Backend-specific errors are translated into
:mod:`sglang_storage.errors` here. Imports only the layers below it.
"""
