"""SGLang 0.5.23's own storage as ``sglang-storage bench --compare`` baselines.

- ``sglang-file`` (:data:`SGLANG_FILE`): SGLang's ``HiCacheFile``
  (``sglang.srt.mem_cache.hicache_storage``), built as SGLang's factory builds it for TP
  rank 0 of 1 with its defaults (no metadata cache, no evictor), driven through the
  generic tensor API its HiCache controller uses: ``batch_set``, ``batch_get`` into
  target tensors, ``batch_exists``.

SGLang is imported when a baseline is opened, not when this module is, so listing the
baselines works without SGLang; opening one without SGLang 0.5.23 raises
:class:`~sglang_storage.errors.BackendUnavailableError` saying what to install.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final, Protocol, cast

import torch

from sglang_storage.cli.bench_baseline import BaselineEntry, BenchBaseline
from sglang_storage.errors import BackendUnavailableError
from sglang_storage_adapters import (
    SUPPORTED_SGLANG_VERSION,
    IncompatibleSGLangError,
    require_supported_sglang,
)

__all__ = ["SGLANG_FILE", "SGLangFileBaseline"]

_ENV_PREFIX: Final = "SGLANG_HICACHE_FILE_BACKEND_"
_INSTALL: Final = f"pip install 'sglang-storage[sglang]' (SGLang {SUPPORTED_SGLANG_VERSION})"


class _HiCacheFile(Protocol):
    """The part of SGLang's ``HiCacheFile`` the baseline calls (SGLang is untyped)."""

    def batch_set(self, keys: list[str], values: list[torch.Tensor]) -> bool: ...

    def batch_get(
        self, keys: list[str], target_locations: list[torch.Tensor]
    ) -> list[torch.Tensor | None]: ...

    def batch_exists(self, keys: list[str]) -> int: ...


class SGLangFileBaseline:
    """SGLang's ``HiCacheFile`` on one directory, as a :class:`BenchBaseline`.

    ``put`` writes page by page and stops at the first failure, as ``batch_set`` does, so
    it counts the pages of a batch only when the whole batch was stored.

    Raises:
        BackendUnavailableError: SGLang 0.5.23 is not installed or does not import, or
            ``HiCacheFile`` did not come up with its defaults.
    """

    def __init__(self, directory: Path) -> None:
        self._store = _open_hicache_file(directory)

    def put(self, names: Sequence[str], pages: Sequence[torch.Tensor]) -> int:
        """``batch_set`` of the pages."""
        return len(names) if self._store.batch_set(list(names), values=list(pages)) else 0

    def get(self, names: Sequence[str], pages: Sequence[torch.Tensor]) -> int:
        """``batch_get`` into the pages."""
        got = self._store.batch_get(list(names), target_locations=list(pages))
        return sum(page is not None for page in got)

    def exists(self, names: Sequence[str]) -> int:
        """``batch_exists``: the longest stored prefix."""
        return int(self._store.batch_exists(list(names)))

    def close(self) -> None:
        """Nothing to release: ``HiCacheFile`` holds no open files."""


def _open_hicache_file(directory: Path) -> _HiCacheFile:
    try:
        require_supported_sglang()
        from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig
    except IncompatibleSGLangError as error:
        raise BackendUnavailableError(backend="sglang-file", reason=str(error)) from error
    except ImportError as error:
        raise BackendUnavailableError(
            backend="sglang-file",
            reason=f"SGLang does not import ({error}); install it with: {_INSTALL}",
        ) from error
    # Its directory, metadata cache and evictor can be set through the environment; the
    # baseline is SGLang's default configuration, so those settings are removed.
    for name in [name for name in os.environ if name.startswith(_ENV_PREFIX)]:
        del os.environ[name]
    config = HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name="sglang-storage-bench",
        extra_config=None,
    )
    store: Any = HiCacheFile(config, file_path=str(directory))
    if store.metadata_cache is not None or store._evictor.enabled:
        raise BackendUnavailableError(
            backend="sglang-file", reason="HiCacheFile did not come up with its default settings"
        )
    return cast(_HiCacheFile, store)


def _open(directory: Path) -> BenchBaseline:
    return SGLangFileBaseline(directory)


SGLANG_FILE: Final = BaselineEntry(
    name="sglang-file",
    summary=f"SGLang {SUPPORTED_SGLANG_VERSION}'s HiCacheFile (one raw .bin file per page)",
    open=_open,
)
"""The ``sglang-file`` baseline (entry point ``sglang_storage.bench_baselines``)."""
