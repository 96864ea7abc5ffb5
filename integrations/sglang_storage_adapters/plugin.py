"""The ``sglang.srt.plugins`` entry point: installs every sglang_storage adapter in a process.

SGLang 0.5.23 calls :func:`register` (through ``load_plugins()``) at the start of every
scheduler process, the engine, the detokenizer, the DP controller and ``launch_server``;
it is registered in ``pyproject.toml`` as::

    [project.entry-points."sglang.srt.plugins"]
    sglang_storage = "sglang_storage_adapters.plugin:register"

Each adapter contributes one installer to :data:`INSTALLERS` as ``"module:function"``; an
installer is imported and called once per process and must leave SGLang's behaviour
unchanged unless :func:`~.runtime.runtime_settings` says its manager is on (it is called
before the server arguments exist, so it registers something that decides later, e.g. a
stack strategy whose ``matches`` reads the settings, or a HookRegistry replacement whose
constructor does). An installer that fails is logged and skipped; the others still run.

Without CUDA, :func:`register` first says (once, in the process SGLang starts from, before
it loads a model) that serving needs a GPU and which parts run on CPU (:data:`NO_CUDA`):
otherwise the first sign is SGLang failing inside model loading (``No module named
'vllm'``).
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing
from typing import Any, Final

__all__ = ["INSTALLERS", "NO_CUDA", "hook_registry", "installed", "register", "say_if_no_cuda"]

log = logging.getLogger(__name__)

INSTALLERS: Final[tuple[str, ...]] = (
    # HiCache controller + KV host pool: a stack strategy (register_stack_strategy).
    "sglang_storage_adapters.hicache_controller:install",
    # Decode-side KV offload: HookRegistry class REPLACE of DecodeKVCacheOffloadManager.
    "sglang_storage_adapters.decode:install",
    # HiSparse coordinator: HookRegistry class REPLACE of HiSparseCoordinator.
    "sglang_storage_adapters.sparse:install",
    # NPU sparse KV: HookRegistry class REPLACE of SparseKVCacheManager, only where it imports.
    "sglang_storage_adapters.npu_sparse:install",
    # Encoder embedding caches: HookRegistry AROUND on EmbeddingStoreFactory.create_backend,
    # class REPLACE of EmbeddingCacheController and MultiModalStaticCache (+ patch 0003).
    "sglang_storage_adapters.embedding:install",
    # Paged-experts host store: HookRegistry class REPLACE of HostExpertStore.
    "sglang_storage_adapters.experts:install",
    # Elastic-EP expert backup: HookRegistry function REPLACE of run_expert_backup_manager,
    # class REPLACE of ExpertBackupClient.
    "sglang_storage_adapters.elastic_ep:install",
    # Engram host tables: HookRegistry class REPLACE of _HostTable, AROUND on
    # EngramEmbedding._load_rows (rows restored from storage are not loaded again).
    "sglang_storage_adapters.engram:install",
    # RL top-k capture: HookRegistry class REPLACE of BaseHostCache, AROUND on the
    # scheduler's _maybe_collect_routed_experts / _maybe_collect_indexer_topk.
    "sglang_storage_adapters.records:install",
)
"""Every adapter's installer, ``"module:function"``; append yours here."""

NO_CUDA: Final = (
    "sglang_storage: no CUDA device here (torch %s, CUDA build %s): serving with SGLang "
    "needs a GPU, so launch_server will fail while loading the model. What runs on this "
    "machine: `sglang-storage replay` (the KV cache tiers on a generated chat workload, "
    "through the file backend) and `sglang-storage bench` (backend benchmarks, optionally "
    "against SGLang's HiCacheFile)."
)
"""The warning :func:`say_if_no_cuda` logs."""

_done: list[str] = []
_said: list[bool] = []


def installed() -> tuple[str, ...]:
    """The installers that ran in this process without failing."""
    return tuple(_done)


def say_if_no_cuda() -> bool:
    """Warn with :data:`NO_CUDA` when CUDA is absent; once, and only in a top process.

    SGLang's own processes (schedulers, detokenizer) are children of the one that loaded
    the plug-in first, so the user sees the line once. Returns whether it was logged.
    """
    if _said or multiprocessing.parent_process() is not None:
        return False
    _said.append(True)
    import torch

    if torch.cuda.is_available():
        return False
    log.warning(NO_CUDA, torch.__version__, torch.version.cuda or "none")
    return True


def register() -> None:
    """Run every installer of :data:`INSTALLERS` not yet run in this process."""
    say_if_no_cuda()
    for spec in INSTALLERS:
        if spec in _done:
            continue
        module_name, _, function = spec.partition(":")
        try:
            getattr(importlib.import_module(module_name), function)()
        except Exception:  # a broken adapter must not stop SGLang or the other adapters
            log.exception("sglang_storage: installer %s failed; that adapter is off", spec)
            continue
        _done.append(spec)


def hook_registry(registry: Any = None) -> tuple[Any, Any]:
    """The registry an adapter's ``install`` registers with, and SGLang's ``HookType``.

    ``registry`` None means SGLang's ``HookRegistry``.
    """
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    return (HookRegistry if registry is None else registry), HookType
