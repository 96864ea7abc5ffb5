"""sglang_storage: one typed storage subsystem for SGLang.

It moves the KV cache and SGLang's other large tensors (encoder embeddings, sparse
attention tokens, decode-side request KV, RL records, expert weights) between GPU, host
DRAM and storage backends. Layers, lowest first, each importing only those below it:

- base modules :mod:`sglang_storage.errors`, :mod:`sglang_storage.units`,
  :mod:`sglang_storage.config` - the error hierarchy and validated config types;
- :mod:`sglang_storage.memory` - host memory budget, allocators, typed host pools;
- :mod:`sglang_storage.transfer` - device<->host and host<->storage pipelines;
- :mod:`sglang_storage.storage` - key-value backends and the stored object format;
- :mod:`sglang_storage.policy` - eviction, prefetch, write and cost decisions;
- :mod:`sglang_storage.managers` - one manager per data kind;
- :mod:`sglang_storage.cli` - the ``sglang-storage`` command.

Importing this package never imports SGLang; the adapters that do live in the separate
``sglang_storage_adapters`` package.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

__all__ = ["__version__"]

try:
    __version__: str = version("sglang-storage")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"
