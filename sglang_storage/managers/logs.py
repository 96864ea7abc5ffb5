"""Messages of a serving process: rate-limited warnings and the sglang_storage log level.

- :class:`RateLimitedLog` - at most one record per key per interval; the first record
  after a quiet spell says how many similar ones were suppressed, so a failing backend
  logs a line a minute, not one per page.
- :data:`LOG_LEVELS` / :func:`apply_log_level` - the level of the ``sglang_storage`` and
  ``sglang_storage_adapters`` loggers (``--storage-log-level``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Final

import attrs

from sglang_storage.errors import ConfigError

__all__ = ["LOGGERS", "LOG_LEVELS", "RateLimitedLog", "apply_log_level"]

LOG_LEVELS: Final = ("debug", "info", "warning", "error")
"""The levels ``--storage-log-level`` accepts."""

LOGGERS: Final = ("sglang_storage", "sglang_storage_adapters")
"""The loggers a log level applies to (and every logger below them)."""

DEFAULT_INTERVAL_S: Final = 60.0


@attrs.define
class _Key:
    last: float
    suppressed: int = 0


class RateLimitedLog:
    """Emits at most one record per key every ``interval_s`` seconds.

    Args:
        logger: Where records go.
        interval_s: The quiet time per key after a record (> 0).
        clock: Monotonic seconds (injectable for tests).

    Thread-safe.
    """

    def __init__(
        self,
        logger: logging.Logger,
        *,
        interval_s: float = DEFAULT_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not interval_s > 0:
            raise ConfigError(
                owner="RateLimitedLog", field="interval_s", value=interval_s, reason="must be > 0"
            )
        self._logger = logger
        self._interval = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._keys: dict[str, _Key] = {}

    def warning(self, key: str, message: str, *args: object) -> bool:
        """Log ``message % args`` at WARNING unless ``key`` logged within the interval.

        Returns whether a record was emitted; a suppressed one is counted and the count
        is appended to the key's next record.
        """
        return self.log(logging.WARNING, key, message, *args)

    def log(self, level: int, key: str, message: str, *args: object) -> bool:
        """:meth:`warning` at ``level``."""
        if not self._logger.isEnabledFor(level):
            return False
        now = self._clock()
        with self._lock:
            held = self._keys.get(key)
            if held is not None and now - held.last < self._interval:
                held.suppressed += 1
                return False
            suppressed = 0 if held is None else held.suppressed
            self._keys[key] = _Key(last=now)
        if suppressed:
            message = f"{message} (suppressed {suppressed} similar in the last %.0f s)"
            args = (*args, self._interval)
        self._logger.log(level, message, *args)
        return True

    def suppressed(self, key: str) -> int:
        """Records of ``key`` suppressed since its last emitted one."""
        with self._lock:
            held = self._keys.get(key)
            return 0 if held is None else held.suppressed


def apply_log_level(level: str) -> None:
    """Set the level of :data:`LOGGERS` to ``level`` (one of :data:`LOG_LEVELS`).

    Raises:
        ConfigError: an unknown level.
    """
    if level not in LOG_LEVELS:
        raise ConfigError(
            owner="sglang_storage logging",
            field="log_level",
            value=level,
            reason="is not a log level",
            allowed=", ".join(LOG_LEVELS),
        )
    for name in LOGGERS:
        logging.getLogger(name).setLevel(level.upper())
