"""Install an adapter through SGLang's HookRegistry for one test, and undo it afterwards.

HookRegistry rebinds every module attribute that is the replaced class, so undoing an
install means restoring each of those bindings and the registry's own state.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from types import ModuleType

__all__ = ["hooks_installed", "records_installed"]


@contextlib.contextmanager
def hooks_installed(
    original: type, install: Callable[[], object], adapter: ModuleType
) -> Iterator[None]:
    """Run ``install()`` and apply the hooks it registered (only those: hooks another test
    left registered are not applied a second time); on exit, every binding of ``original``
    (outside ``adapter``, which keeps its own reference) and the registry are restored."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    saved = ({k: list(v) for k, v in HookRegistry._hooks.items()}, set(HookRegistry._patched))
    bound = [
        (module, name)
        for module in list(sys.modules.values())
        if module is not adapter
        for name, value in list(vars(module).items())
        if value is original
    ]
    HookRegistry.reset()  # apply this adapter's hooks only, not again what others left
    install()
    HookRegistry.apply_hooks()
    try:
        yield
    finally:
        for module, name in bound:
            setattr(module, name, original)
        HookRegistry.reset()
        HookRegistry._hooks.update(saved[0])
        HookRegistry._patched.update(saved[1])


_COLLECTORS = ("_maybe_collect_routed_experts", "_maybe_collect_indexer_topk")


@contextlib.contextmanager
def records_installed() -> Iterator[ModuleType]:
    """The records adapter installed as SGLang's plug-in loader would; yields the adapter.

    On exit SGLang's names and collect methods are restored, the adapter's publishers
    closed and the runtime context reset.
    """
    from sglang.srt.managers.scheduler_components.batch_result_processor import (
        SchedulerBatchResultProcessor,
    )
    from sglang.srt.runtime_context import reset_context
    from sglang.srt.state_capturer import base
    from sglang_storage_adapters import records

    saved = {name: SchedulerBatchResultProcessor.__dict__[name] for name in _COLLECTORS}
    try:
        with hooks_installed(base.BaseHostCache, records.install, records):
            yield records
    finally:
        for name, method in saved.items():
            setattr(SchedulerBatchResultProcessor, name, method)
        for publisher in records._publishers.values():
            publisher.close()
        records._publishers.clear()
        reset_context()
