"""Prefetch stop policies and prefetch admission, with SGLang 0.5.23's semantics.

A prefetch copies a storage hit into host memory while its request waits. The stop policy
answers, at each poll of a prefetch that has not finished, whether it may be cut short
now (the request then proceeds with the tokens that have landed):

- ``best_effort`` - always: never hold a request for storage.
- ``wait_complete`` - never: the request waits until the I/O ends.
- ``timeout`` (SGLang's default) - once the prefetch has waited longer than
  ``base + pages * per_page``, except that a prefetch whose every hit token has already
  landed is not cut (cutting it would salvage nothing).

A prefetch whose I/O has ended (done, failed or cancelled) is always terminated, whatever
the policy. Admission: a hit shorter than the prefetch threshold is not worth prefetching.

What SGLang 0.5.23 does (``sglang/srt``; checked against the installed package):

- Policies: ``UnifiedRadixCache._can_terminate_prefetch``
  (``mem_cache/unified_radix_cache.py:2295-2314``): ``best_effort`` -> True,
  ``wait_complete`` -> False, ``timeout`` -> ``_prefetch_deadline_expired`` (``:2273-2283``),
  which is False once ``completed_tokens >= len(hash_value) * page_size`` and otherwise
  ``elapsed > timeout_s`` (strictly greater). ``check_prefetch_progress`` (``:2391-2420``)
  asks the policy only while ``not operation.is_terminated()``.
- The wait clock starts at the first poll that could not terminate (the "first blocked
  admission poll", ``_start_storage_prefetch_wait``, ``:2259-2271``), not when the I/O was
  issued; ``PollTimer`` uses ``time.perf_counter`` (``utils/poll_timer.py``).
- The deadline is per page, not per token: ``pages = stats_requested_tokens // page_size``
  and ``timeout_s = prefetch_timeout_base + pages * prefetch_timeout_per_page``
  (``unified_radix_cache.py:2264-2268``), with ``prefetch_timeout_per_page =
  page_size / 1024 * prefetch_timeout_per_ki_token``
  (``mem_cache/unified_cache/storage_attachment.py:291-293``). A partial page adds nothing.
- Defaults: ``prefetch_timeout_base = 1`` s and ``prefetch_timeout_per_ki_token = 0.25`` s,
  read from the storage backend's extra config
  (``mem_cache/hybrid_cache/hybrid_cache_controller.py:404-407``; also
  ``unified_radix_cache.py:484-485``). There is **no cap** on the deadline in 0.5.23.
  (The issue's "2.0 s base, 0.1 s per 1K tokens, 30 s max" does not match 0.5.23; the
  defaults here are SGLang's, and the optional cap ``timeout_max_s`` is off by default.)
- ``--hicache-storage-prefetch-policy`` defaults to ``timeout``
  (``arg_groups/fields/memory.py:170-176``).
- Threshold: extra-config ``prefetch_threshold``, default 256 tokens
  (``hybrid_cache_controller.py:404``); the controller uses
  ``max(prefetch_threshold, page_size)`` (``managers/cache_controller.py:623``), and a
  page-aligned hit shorter than it is declined (``unified_radix_cache.py:2150``,
  ``len(prefetch_key) < self.prefetch_threshold``).
"""

from __future__ import annotations

import enum
import math
import time
from typing import Final, Literal

import attrs

from sglang_storage.config import (
    non_negative_int,
    non_negative_number,
    one_of,
    optional,
    positive_number,
    require_int,
)
from sglang_storage.core import Clock
from sglang_storage.errors import ConfigError

__all__ = [
    "PREFETCH_STOP_POLICY_NAMES",
    "SGLANG_PREFETCH_THRESHOLD_TOKENS",
    "SGLANG_PREFETCH_TIMEOUT_BASE_S",
    "SGLANG_PREFETCH_TIMEOUT_PER_KI_TOKEN_S",
    "PrefetchStopConfig",
    "PrefetchStopDecision",
    "PrefetchStopPolicy",
    "PrefetchStopPolicyName",
    "PrefetchStopReason",
    "make_prefetch_stop_policy",
]

PrefetchStopPolicyName = Literal["best_effort", "wait_complete", "timeout"]
"""The registered prefetch stop policy names (SGLang's ``--hicache-storage-prefetch-policy``)."""

PREFETCH_STOP_POLICY_NAMES: Final[tuple[str, ...]] = ("best_effort", "wait_complete", "timeout")
"""Every name :class:`PrefetchStopConfig` accepts."""

SGLANG_PREFETCH_TIMEOUT_BASE_S: Final = 1.0
"""SGLang 0.5.23's default ``prefetch_timeout_base``, seconds."""
SGLANG_PREFETCH_TIMEOUT_PER_KI_TOKEN_S: Final = 0.25
"""SGLang 0.5.23's default ``prefetch_timeout_per_ki_token``, seconds per 1024 tokens."""
SGLANG_PREFETCH_THRESHOLD_TOKENS: Final = 256
"""SGLang 0.5.23's default ``prefetch_threshold``, tokens."""


@attrs.frozen(kw_only=True)
class PrefetchStopConfig:
    """Which prefetch stop policy to use, its deadline knobs and the prefetch threshold.

    Attributes:
        name: ``"best_effort"``, ``"wait_complete"`` or ``"timeout"`` (default, as SGLang).
        timeout_base_s: Seconds every prefetch may wait (SGLang ``prefetch_timeout_base``).
        timeout_per_ki_token_s: Extra seconds per 1024 requested tokens, counted in whole
            pages (SGLang ``prefetch_timeout_per_ki_token``).
        timeout_max_s: An upper bound on the deadline; ``None`` (default, as SGLang) for none.
        threshold_tokens: The shortest hit worth prefetching; the policy uses
            ``max(threshold_tokens, page_size)`` (SGLang ``prefetch_threshold``).
    """

    name: PrefetchStopPolicyName = attrs.field(
        default="timeout", validator=one_of(*PREFETCH_STOP_POLICY_NAMES)
    )
    timeout_base_s: float = attrs.field(
        default=SGLANG_PREFETCH_TIMEOUT_BASE_S, validator=non_negative_number
    )
    timeout_per_ki_token_s: float = attrs.field(
        default=SGLANG_PREFETCH_TIMEOUT_PER_KI_TOKEN_S, validator=non_negative_number
    )
    timeout_max_s: float | None = attrs.field(default=None, validator=optional(positive_number))
    threshold_tokens: int = attrs.field(
        default=SGLANG_PREFETCH_THRESHOLD_TOKENS, validator=non_negative_int
    )


class PrefetchStopReason(enum.Enum):
    """Why a prefetch may, or may not, be terminated now."""

    FINISHED = "finished"
    """The I/O has ended (done, failed or cancelled): terminate under every policy."""
    BEST_EFFORT = "best_effort"
    """``best_effort``: terminate now with what has landed."""
    WAIT_COMPLETE = "wait_complete"
    """``wait_complete``: keep waiting until the I/O ends."""
    DATA_LANDED = "data_landed"
    """``timeout``: every hit token has landed, so cutting would salvage nothing; keep waiting."""
    WITHIN_DEADLINE = "within_deadline"
    """``timeout``: the wait has not exceeded the deadline; keep waiting."""
    DEADLINE_EXPIRED = "deadline_expired"
    """``timeout``: the wait exceeded the deadline; terminate with what has landed."""


_TERMINATING: Final = frozenset(
    {
        PrefetchStopReason.FINISHED,
        PrefetchStopReason.BEST_EFFORT,
        PrefetchStopReason.DEADLINE_EXPIRED,
    }
)


@attrs.frozen(kw_only=True)
class PrefetchStopDecision:
    """A stop policy's verdict on one poll of one prefetch."""

    reason: PrefetchStopReason
    """Why; :attr:`terminate` follows from it."""
    elapsed_s: float
    """Seconds since the wait started, by the policy's clock."""
    timeout_s: float | None
    """The deadline for this prefetch under ``timeout``; ``None`` under the other policies."""

    @property
    def terminate(self) -> bool:
        """Whether the prefetch may be terminated now (the request proceeds)."""
        return self.reason in _TERMINATING


class PrefetchStopPolicy:
    """Decides when a waiting prefetch may be cut short, and which hits to prefetch at all.

    Pure: it holds no per-prefetch state. The caller records ``started_at = policy.now()``
    at the first poll that did not terminate (SGLang starts its wait there) and passes it
    back on every later poll.

    Args:
        config: The policy name and knobs.
        page_size: Tokens per page of the KV pool (>= 1); deadlines count whole pages.
        clock: Monotonic seconds; ``time.monotonic`` unless a test drives its own.
    """

    def __init__(
        self, config: PrefetchStopConfig, *, page_size: int, clock: Clock = time.monotonic
    ) -> None:
        require_int(page_size, owner="PrefetchStopPolicy", field="page_size", low=1)
        self._config = config
        self._page_size = page_size
        self._clock = clock
        # Same operation order as SGLang (storage_attachment.py:291-293), so the floats match.
        self._per_page_s = page_size / 1024 * config.timeout_per_ki_token_s
        self._threshold = max(config.threshold_tokens, page_size)

    @property
    def name(self) -> PrefetchStopPolicyName:
        """The policy's registered name."""
        return self._config.name

    @property
    def config(self) -> PrefetchStopConfig:
        """The configuration the policy was built from."""
        return self._config

    @property
    def page_size(self) -> int:
        """Tokens per page."""
        return self._page_size

    @property
    def threshold_tokens(self) -> int:
        """The shortest (page-aligned) hit worth prefetching: ``max(threshold, page_size)``."""
        return self._threshold

    def now(self) -> float:
        """Return the policy clock's current reading, for ``started_at``."""
        return self._clock()

    def admits(self, hit_tokens: int) -> bool:
        """Return whether a storage hit of ``hit_tokens`` is worth prefetching.

        The hit is cut down to whole pages first, as SGLang's page-aligned prefetch key is.
        """
        hit = require_int(hit_tokens, owner="PrefetchStopPolicy.admits", field="hit_tokens")
        return hit // self._page_size * self._page_size >= self._threshold

    def timeout_s(self, n_tokens: int) -> float:
        """Return the deadline of a prefetch of ``n_tokens`` requested tokens under ``timeout``.

        ``base + (n_tokens // page_size) * (page_size / 1024 * per_ki_token)``, capped at
        ``timeout_max_s`` when one is set.
        """
        tokens = require_int(n_tokens, owner="PrefetchStopPolicy.timeout_s", field="n_tokens")
        pages = tokens // self._page_size
        timeout = self._config.timeout_base_s + pages * self._per_page_s
        cap = self._config.timeout_max_s
        return timeout if cap is None else min(timeout, cap)

    def decide(
        self,
        *,
        started_at: float,
        n_tokens: int,
        completed_tokens: int,
        finished: bool = False,
        hit_tokens: int | None = None,
    ) -> PrefetchStopDecision:
        """Return whether the prefetch may be terminated now, and why.

        Args:
            started_at: The clock reading when the wait started (:meth:`now`).
            n_tokens: The tokens the prefetch was asked for; sets the deadline.
            completed_tokens: The tokens that have landed in host memory so far.
            finished: Whether the I/O has ended (done, failed or cancelled).
            hit_tokens: The tokens of the current storage hit (SGLang's
                ``len(hash_value) * page_size``), which can shrink below ``n_tokens``; once
                ``completed_tokens`` reaches it the data has landed. Defaults to
                ``n_tokens`` cut down to whole pages.

        Raises:
            ConfigError: A count is negative or not an int, or ``started_at`` is later
                than the clock's current reading.
        """
        owner = "PrefetchStopPolicy.decide"
        requested = require_int(n_tokens, owner=owner, field="n_tokens")
        completed = require_int(completed_tokens, owner=owner, field="completed_tokens")
        if hit_tokens is None:
            hit = requested // self._page_size * self._page_size
        else:
            hit = require_int(hit_tokens, owner=owner, field="hit_tokens")
        now = self._clock()
        elapsed = now - started_at
        if not math.isfinite(elapsed) or elapsed < 0:
            raise ConfigError(
                owner=owner,
                field="started_at",
                value=started_at,
                reason=f"must be a finite clock reading no later than now ({now!r})",
            )
        timeout = self.timeout_s(requested) if self.name == "timeout" else None
        return PrefetchStopDecision(
            reason=self._reason(finished, completed, hit, elapsed, timeout),
            elapsed_s=elapsed,
            timeout_s=timeout,
        )

    def _reason(
        self, finished: bool, completed: int, hit: int, elapsed: float, timeout: float | None
    ) -> PrefetchStopReason:
        if finished:
            return PrefetchStopReason.FINISHED
        if self.name == "best_effort":
            return PrefetchStopReason.BEST_EFFORT
        if timeout is None:
            return PrefetchStopReason.WAIT_COMPLETE
        if completed >= hit:
            return PrefetchStopReason.DATA_LANDED
        if elapsed > timeout:
            return PrefetchStopReason.DEADLINE_EXPIRED
        return PrefetchStopReason.WITHIN_DEADLINE


def make_prefetch_stop_policy(
    config: PrefetchStopConfig, *, page_size: int, clock: Clock = time.monotonic
) -> PrefetchStopPolicy:
    """Return the stop policy ``config`` names, for a pool of ``page_size`` tokens per page."""
    return PrefetchStopPolicy(config, page_size=page_size, clock=clock)
