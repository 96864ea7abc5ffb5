"""sglang_storage's metrics in SGLang's ``/metrics`` (``--enable-metrics``).

SGLang serves ``/metrics`` from a ``MultiProcessCollector`` over
``PROMETHEUS_MULTIPROC_DIR``, which SGLang sets only with ``--enable-metrics``. Every
adapter adds its live components to the process's
:data:`~sglang_storage.managers.observability.SOURCES` when it builds them, and
:func:`refresh` writes their snapshot into this process's files there: from the HiCache
backend's ``get_stats()`` (which SGLang's tree calls on every ``check_hicache_events``
when metrics are on) and from the other adapters' per-step hooks. Refreshes are at most
one a second, and without ``--enable-metrics`` :func:`refresh` is a time comparison and
an environment lookup.

``prometheus_client`` is imported only once the variable is set (it picks its value
store when first imported, and SGLang sets the variable after plug-ins are loaded).
"""

from __future__ import annotations

import logging
from typing import Final

from sglang_storage.managers.logs import RateLimitedLog

__all__ = ["refresh"]

log = logging.getLogger(__name__)

_limited: Final = RateLimitedLog(log)


def refresh() -> None:
    """Write this process's metrics for SGLang's ``/metrics`` when it serves them.

    Never raises into SGLang's scheduler: a failure is a rate-limited warning.
    """
    try:
        from sglang_storage.managers.prometheus import refresh_multiprocess

        refresh_multiprocess()
    except Exception as error:  # noqa: BLE001 - metrics must never stop serving
        _limited.warning("refresh", "sglang_storage metrics: refresh failed: %s", error)
