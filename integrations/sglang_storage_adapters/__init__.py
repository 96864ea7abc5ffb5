"""Drop-in adapters that run SGLang 0.5.23 on sglang_storage.

This is the only package that imports ``sglang``. Its modules:

- :mod:`.hicache_storage` - ``HiCacheBackend``: our backends as SGLang's ``dynamic``
  HiCache L3 storage backend (v0, v1 zero copy, v2 multi-pool).
- :mod:`.flags` - the ``--storage-*`` server flags and their translation into SGLang's
  own ``hicache_*`` settings (called from ``patches/sglang-0.5.23``).
- :mod:`.runtime` - ``runtime_settings(server_args)``: whether sglang_storage is on in this
  process and which managers serve.
- :mod:`.plugin` - the ``sglang.srt.plugins`` entry point; runs each adapter's installer.
- :mod:`.hicache_controller` - the HiCache controller, host pools and device<->host engine
  on our pools and pipelines (installed as a stack strategy).
- :mod:`.decode` - ``DecodeKVCacheOffloadManager`` on our decode offload manager.
- :mod:`.sparse` - the HiSparse coordinator on our sparse KV manager.
- :mod:`.embedding` - the encoder embedding cache controller, its store and the static
  multimodal cache on our embedding manager (also installed by patch ``0003`` in
  encoder ranks, which never load plug-ins).
- :mod:`.bench_baselines` - SGLang's ``HiCacheFile`` as a ``sglang-storage bench``
  baseline (``--compare sglang-file``).
- :mod:`.patching` - ``python -m sglang_storage_adapters.patching apply|revert|status``,
  behind ``make apply-patches`` / ``make revert-patches``.

The adapters keep SGLang's call contracts exactly, and those contracts are specific to
one release, so every adapter first calls :func:`require_supported_sglang`:

- :data:`SUPPORTED_SGLANG_VERSION` - the release the adapters and ``patches/`` target.
- :func:`installed_sglang_version` - the installed release, read from package metadata
  without importing SGLang.
- :func:`check_sglang_version` - raise :class:`IncompatibleSGLangError` unless a given
  version is the supported one.
- :func:`require_supported_sglang` - the same check for the installed release.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Final

from sglang_storage.errors import StorageError

__all__ = [
    "SUPPORTED_SGLANG_VERSION",
    "IncompatibleSGLangError",
    "check_sglang_version",
    "installed_sglang_version",
    "require_supported_sglang",
]

SUPPORTED_SGLANG_VERSION: Final = "0.5.23"


class IncompatibleSGLangError(StorageError):
    """SGLang is missing, or is a release the adapters were not written against.

    Args:
        found: The installed SGLang version, or ``None`` when it is not installed.
        required: The version the adapters support.
    """

    def __init__(self, *, found: str | None, required: str) -> None:
        self.found = found
        self.required = required
        have = "SGLang is not installed" if found is None else f"SGLang {found} is installed"
        super().__init__(
            f"the sglang_storage adapters need SGLang {required}, but {have}; "
            f"install it with: pip install 'sglang-storage[sglang]' "
            f"(or sglang=={required})"
        )


def installed_sglang_version() -> str | None:
    """Return the installed SGLang version, or ``None`` when SGLang is not installed."""
    try:
        return version("sglang")
    except PackageNotFoundError:
        return None


def check_sglang_version(found: str | None) -> None:
    """Raise unless ``found`` is the supported SGLang release.

    Args:
        found: An SGLang version string, or ``None`` for "not installed".

    Raises:
        IncompatibleSGLangError: ``found`` is ``None`` or another release.
    """
    if found != SUPPORTED_SGLANG_VERSION:
        raise IncompatibleSGLangError(found=found, required=SUPPORTED_SGLANG_VERSION)


def require_supported_sglang() -> str:
    """Return the installed SGLang version after checking it is the supported release.

    Raises:
        IncompatibleSGLangError: SGLang is missing or another release.
    """
    found = installed_sglang_version()
    check_sglang_version(found)
    assert found is not None  # checked just above
    return found
