"""Metrics of the host<->storage pipeline as frozen snapshots.

- :class:`LatencySnapshot` - a latency histogram over fixed, log-spaced buckets
  (:data:`LATENCY_BOUNDS_S`: 1 us to 100 s, four per decade) with quantile estimates.
- :class:`KindMetrics` - everything counted for one operation kind (get, put, exists):
  operations by outcome, pages, bytes, per-page outcomes, backend calls, queue depth and
  two latency histograms (submission to completion, and one backend call).
- :class:`PipelineMetrics` - the three kinds plus pipeline-wide figures, as returned by
  ``StoragePipeline.metrics()``.

:class:`LatencyHistogram` and :class:`KindRecorder` are the mutable recorders the pipeline
updates under its lock; they are not thread-safe on their own.
"""

from __future__ import annotations

import bisect
import enum
import math
import operator
import types
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, Final

import attrs

from sglang_storage.errors import OperationTimeoutError
from sglang_storage.transfer.handles import OpKind, OpState, Priority, TransferHandle

__all__ = [
    "LATENCY_BOUNDS_S",
    "KindMetrics",
    "KindRecorder",
    "LatencyHistogram",
    "LatencySnapshot",
    "PipelineMetrics",
]

LATENCY_BOUNDS_S: Final[tuple[float, ...]] = tuple(10.0 ** (k / 4 - 6) for k in range(33))
"""Upper bounds of the latency buckets in seconds: 1 us .. 100 s, four buckets per decade.

Bucket ``i`` counts samples in ``(bounds[i-1], bounds[i]]``; one more bucket counts the
samples above the last bound.
"""


def _frozen_mapping(value: Mapping[Any, int]) -> Mapping[Any, int]:
    return types.MappingProxyType(dict(value))


@attrs.frozen(kw_only=True)
class LatencySnapshot:
    """A latency histogram at one moment; quantiles are estimates within one bucket."""

    bounds_s: tuple[float, ...] = LATENCY_BOUNDS_S
    """Bucket upper bounds in seconds."""
    counts: tuple[int, ...] = (0,) * (len(LATENCY_BOUNDS_S) + 1)
    """Samples per bucket; the last entry counts samples above ``bounds_s[-1]``."""
    count: int = 0
    """Number of samples."""
    total_s: float = 0.0
    """Sum of all samples in seconds."""
    min_s: float = 0.0
    """Smallest sample (0 when there are none)."""
    max_s: float = 0.0
    """Largest sample (0 when there are none)."""

    @property
    def mean_s(self) -> float | None:
        """The mean sample, or ``None`` without samples."""
        return self.total_s / self.count if self.count else None

    @property
    def p50_s(self) -> float | None:
        """Estimated median, or ``None`` without samples."""
        return self.quantile(0.5)

    @property
    def p99_s(self) -> float | None:
        """Estimated 99th percentile, or ``None`` without samples."""
        return self.quantile(0.99)

    def quantile(self, q: float) -> float | None:
        """Estimated ``q``-quantile (0 <= q <= 1) in seconds, or ``None`` without samples.

        Interpolates geometrically within the bucket that holds the quantile, and never
        answers outside the observed ``[min_s, max_s]``.
        """
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"quantile must be within [0, 1], got {q!r}")
        if not self.count:
            return None
        if q == 0.0:
            return self.min_s
        if q == 1.0:
            return self.max_s
        rank = max(1.0, q * self.count)
        seen = 0
        for index, in_bucket in enumerate(self.counts):
            if not in_bucket or seen + in_bucket < rank:
                seen += in_bucket
                continue
            low = self.bounds_s[index - 1] if index > 0 else self.min_s
            high = self.bounds_s[index] if index < len(self.bounds_s) else self.max_s
            low, high = max(low, self.min_s), min(high, self.max_s)
            fraction = (rank - seen) / in_bucket
            if low <= 0.0 or high <= low:
                estimate = low + (high - low) * fraction
            else:
                estimate = low * (high / low) ** fraction
            return min(max(estimate, self.min_s), self.max_s)
        return self.max_s  # pragma: no cover - counts always sum to count


class LatencyHistogram:
    """Records latencies into :data:`LATENCY_BOUNDS_S` buckets (not thread-safe)."""

    def __init__(self) -> None:
        self._counts = [0] * (len(LATENCY_BOUNDS_S) + 1)
        self._count = 0
        self._total = 0.0
        self._min = math.inf
        self._max = 0.0

    def observe(self, seconds: float) -> None:
        """Add one sample (negative values count as 0)."""
        seconds = max(0.0, seconds)
        self._counts[bisect.bisect_left(LATENCY_BOUNDS_S, seconds)] += 1
        self._count += 1
        self._total += seconds
        self._min = min(self._min, seconds)
        self._max = max(self._max, seconds)

    def snapshot(self) -> LatencySnapshot:
        """The histogram as a frozen value."""
        return LatencySnapshot(
            counts=tuple(self._counts),
            count=self._count,
            total_s=self._total,
            min_s=self._min if self._count else 0.0,
            max_s=self._max,
        )


@attrs.frozen(kw_only=True)
class KindMetrics:
    """What the pipeline counted for one operation kind since it started."""

    kind: OpKind
    """The operation kind."""
    submitted: int = 0
    """Operations accepted."""
    rejected: int = 0
    """Submissions refused by back-pressure (queue full, or the wait for room timed out)."""
    done: int = 0
    """Operations that ended ``DONE``."""
    failed: int = 0
    """Operations that ended ``FAILED`` (including ``timed_out``)."""
    cancelled: int = 0
    """Operations that ended ``CANCELLED``."""
    timed_out: int = 0
    """Failed operations whose cause is a missed deadline."""
    late: int = 0
    """Done operations that finished after their deadline."""
    pages: int = 0
    """Pages in accepted operations."""
    bytes: int = 0
    """Payload bytes moved: read for hits, written for stored pages."""
    page_outcomes: Mapping[str, int] = attrs.field(factory=dict, converter=_frozen_mapping)
    """Pages by per-page outcome (``hit``/``miss``/``corrupt``/``error`` for get,
    ``stored``/``present``/``error`` for put, ``present``/``absent`` for exists), and
    ``skipped`` for pages of stopped operations that no backend call attempted."""
    backend_calls: int = 0
    """Backend calls made."""
    backend_errors: int = 0
    """Backend calls that raised (or broke the store's contract)."""
    queue_depth: int = 0
    """Operations of this kind waiting for a backend call now."""
    queue_depth_max: int = 0
    """The largest ``queue_depth`` seen."""
    latency: LatencySnapshot = LatencySnapshot()
    """Submission to terminal state, per operation."""
    call_latency: LatencySnapshot = LatencySnapshot()
    """Duration of one backend call."""


@attrs.frozen(kw_only=True)
class PipelineMetrics:
    """A snapshot of a storage pipeline's metrics."""

    store: str
    """The store's name."""
    workers: int
    """Worker threads configured."""
    in_flight: int
    """Operations submitted and not yet terminal."""
    queued: Mapping[Priority, int] = attrs.field(converter=_frozen_mapping)
    """Operations waiting for a backend call, by priority."""
    get: KindMetrics
    """Get operations."""
    put: KindMetrics
    """Put operations."""
    exists: KindMetrics
    """Exists operations."""

    def of(self, kind: OpKind) -> KindMetrics:
        """The metrics of ``kind``."""
        return {OpKind.GET: self.get, OpKind.PUT: self.put, OpKind.EXISTS: self.exists}[kind]


_OUTCOME: Final = operator.attrgetter("outcome")
_NBYTES: Final = operator.attrgetter("nbytes")


class KindRecorder:
    """Mutable counters behind one :class:`KindMetrics` (the owner serialises access)."""

    def __init__(self, kind: OpKind) -> None:
        self.kind = kind
        self._ops: Counter[str] = Counter()
        self._pages: Counter[str] = Counter()
        self._outcomes: Counter[enum.Enum] = Counter()
        self._submitted_pages = 0
        self._bytes = 0
        self._calls = 0
        self._call_errors = 0
        self._queued = 0
        self._queued_max = 0
        self._latency = LatencyHistogram()
        self._call_latency = LatencyHistogram()

    def submitted(self, pages: int) -> None:
        """An operation of ``pages`` pages was accepted."""
        self._ops["submitted"] += 1
        self._submitted_pages += pages

    def rejected(self) -> None:
        """A submission was refused by back-pressure."""
        self._ops["rejected"] += 1

    def enqueued(self) -> None:
        """An operation joined a queue."""
        self._queued += 1
        self._queued_max = max(self._queued_max, self._queued)

    def dequeued(self) -> None:
        """An operation left its queue (fully dispatched, cancelled or expired)."""
        self._queued -= 1

    def call(self, seconds: float, results: Sequence[object], *, failed: bool) -> None:
        """One backend call took ``seconds`` and returned ``results`` (empty if it failed)."""
        self._calls += 1
        self._call_errors += failed
        self._call_latency.observe(seconds)
        if not results:
            return
        if self.kind is OpKind.EXISTS:
            present = results.count(True)
            self._pages["present"] += present
            self._pages["absent"] += len(results) - present
        else:
            # C-level loops: this runs for every page. Outcomes are enum members, whose
            # hash is Python code: count the first one by identity, hash only the others.
            outcomes = list(map(_OUTCOME, results))
            first = outcomes[0]
            same = outcomes.count(first)
            self._outcomes[first] += same
            if same != len(outcomes):
                self._outcomes.update(outcome for outcome in outcomes if outcome is not first)
            self._bytes += sum(map(_NBYTES, results))

    def finished(self, handle: TransferHandle[Any], skipped: int) -> None:
        """``handle`` became terminal; ``skipped`` of its pages were never attempted."""
        state = handle.state
        self._ops[state.value] += 1
        if state is OpState.FAILED and isinstance(handle.error, OperationTimeoutError):
            self._ops["timed_out"] += 1
        if state is OpState.DONE and handle.late:
            self._ops["late"] += 1
        if skipped:
            self._pages["skipped"] += skipped
        if handle.latency_s is not None:
            self._latency.observe(handle.latency_s)

    def snapshot(self) -> KindMetrics:
        """The counters as a frozen value."""
        return KindMetrics(
            kind=self.kind,
            submitted=self._ops["submitted"],
            rejected=self._ops["rejected"],
            done=self._ops[OpState.DONE.value],
            failed=self._ops[OpState.FAILED.value],
            cancelled=self._ops[OpState.CANCELLED.value],
            timed_out=self._ops["timed_out"],
            late=self._ops["late"],
            pages=self._submitted_pages,
            bytes=self._bytes,
            page_outcomes={
                **{str(outcome.value): n for outcome, n in self._outcomes.items()},
                **{name: n for name, n in self._pages.items() if n},
            },
            backend_calls=self._calls,
            backend_errors=self._call_errors,
            queue_depth=self._queued,
            queue_depth_max=self._queued_max,
            latency=self._latency.snapshot(),
            call_latency=self._call_latency.snapshot(),
        )
