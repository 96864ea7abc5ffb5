"""Baselines ``sglang-storage bench --compare NAME`` runs side by side with our backends.

A baseline is another implementation of page storage (SGLang's ``HiCacheFile``, say) that
the benchmark drives on the same pages, in the same run, as our backend. The command never
imports one directly (``sglang_storage`` must not import SGLang); baselines are plug-ins
found by name in the ``sglang_storage.bench_baselines`` entry point group, each naming a
:class:`BaselineEntry`::

    [project.entry-points."sglang_storage.bench_baselines"]
    sglang-file = "sglang_storage_adapters.bench_baselines:SGLANG_FILE"

Contract of :class:`BenchBaseline` (one instance per directory, opened by its entry):

- ``put(names, pages)`` stores each page under its name; returns how many are stored.
- ``get(names, pages)`` reads each name into its page; returns how many were found.
- ``exists(names)`` returns how many leading names are stored.
- ``close()`` releases what it holds; its files stay for the harness to remove.

Pages are 1-D ``torch.uint8`` tensors, rows of one host buffer; names are unique hex
strings. Calls may come from several threads at once (``--concurrency``).
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final, Protocol

import attrs
import torch

from sglang_storage.config import non_empty_str
from sglang_storage.errors import BackendUnavailableError, ConfigError

__all__ = [
    "ENTRY_POINT_GROUP",
    "BaselineEntry",
    "BenchBaseline",
    "baseline_entry",
    "baseline_names",
]

ENTRY_POINT_GROUP: Final = "sglang_storage.bench_baselines"


class BenchBaseline(Protocol):
    """Page storage the benchmark compares ours with: put, get and exists of page batches."""

    def put(self, names: Sequence[str], pages: Sequence[torch.Tensor]) -> int:
        """Store each page under its name; returns how many are stored now."""
        ...

    def get(self, names: Sequence[str], pages: Sequence[torch.Tensor]) -> int:
        """Read each name's stored bytes into its page; returns how many were found."""
        ...

    def exists(self, names: Sequence[str]) -> int:
        """How many of ``names``, from the first, are stored without a gap."""
        ...

    def close(self) -> None:
        """Release what the baseline holds (its files stay)."""
        ...


@attrs.frozen(kw_only=True)
class BaselineEntry:
    """A baseline by name: how to open one in a directory, and what it needs installed."""

    name: str = attrs.field(validator=non_empty_str)
    summary: str
    """One line for ``--help``, listings and the report."""
    open: Callable[[Path], BenchBaseline]
    """Open the baseline on an empty directory. Raises
    :class:`~sglang_storage.errors.BackendUnavailableError` (saying what to install) when
    what it needs is missing."""
    files_local: bool = True
    """Its pages are files under the directory it was opened on (cold reads apply)."""


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    return {point.name: point for point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def baseline_names() -> list[str]:
    """The names of every installed baseline, sorted."""
    return sorted(_entry_points())


def baseline_entry(name: str) -> BaselineEntry:
    """The installed baseline called ``name``.

    Raises:
        ConfigError: no installed baseline has that name (the message lists those that do).
        BackendUnavailableError: the plug-in is installed but does not load.
    """
    points = _entry_points()
    point = points.get(name)
    if point is None:
        raise ConfigError(
            owner="sglang-storage bench",
            field="--compare",
            value=name,
            reason="is not an installed bench baseline",
            allowed=", ".join(sorted(points)) or f"none (no entry points in {ENTRY_POINT_GROUP})",
        )
    try:
        loaded: object = point.load()
    except ImportError as error:
        raise BackendUnavailableError(
            backend=name, reason=f"its plug-in {point.value!r} does not import: {error}"
        ) from error
    if not isinstance(loaded, BaselineEntry) or loaded.name != name:
        raise BackendUnavailableError(
            backend=name,
            reason=f"entry point {point.value!r} is not a BaselineEntry named {name!r}",
        )
    return loaded
