"""Load-vs-recompute cost model: is loading a cache hit from a tier faster than prefill?

Users report storage hits that take longer to load than the GPU takes to recompute them.
SGLang 0.5.23's only guard is a fixed minimum: a host hit shorter than
``load_back_threshold = 10`` tokens is recomputed (``mem_cache/unified_radix_cache.py:576``,
``:1879``); storage hits of any length at or above the prefetch threshold are loaded. This
model decides from measurements instead:

- ``load_s(tier, n) = latency(tier) + n * bytes_per_token / bandwidth(tier)``
- ``recompute_s(n) = n / prefill_tokens_per_s``
- load when ``load_s <= recompute_s`` (at exact break-even loading wins: it spends no GPU
  time), recompute otherwise.

Estimates, all moving averages with weight ``ewma_alpha`` on the newest observation:

- Per tier, from ``observe(tier, nbytes, seconds)`` for each finished transfer (cover the
  whole path from that tier into device memory), a line ``seconds = latency + nbytes /
  bandwidth`` is fitted by exponentially weighted least squares (EWMA means of size and
  time, EW variance of size and covariance; O(1) per observation). When the observed sizes
  vary too little to separate the two (relative spread under 1%) or the fit has no positive
  slope, latency is the tier's prior latency, capped at half the mean observed time, and
  bandwidth explains the rest, so transfers of the observed size are predicted exactly.
  A fitted negative latency is clamped to 0 with bandwidth from the mean size and time.
- Prefill throughput: the ratio of the EWMA of tokens to the EWMA of seconds over
  ``observe_prefill(n_tokens, seconds)`` (a ratio of averages, so short batches do not
  dominate).
- Bytes per token: the sum over the pools a hit loads (the KV pool, plus e.g. SWA or
  Mamba state pools), given at construction.

Before any observation the configured priors are used: :data:`DEFAULT_TIER_PRIORS` (host:
16 GiB/s and 50 us per transfer, a conservative PCIe 4.0 x16 pinned copy; storage:
1 GiB/s and 1 ms, a local NVMe file backend), ``default_bandwidth_bytes_per_s`` /
``default_latency_s`` for any other named tier (the storage figures), and
``prior_prefill_tokens_per_s`` (10,000 tokens/s, a mid-size dense model on one GPU).
The model is linear in ``n``; prefill's attention term is quadratic, so it errs towards
recomputing long hits less than it should, never more.
"""

from __future__ import annotations

import contextlib
import enum
import math
from collections import Counter
from collections.abc import Collection, Mapping
from typing import Final

import attrs

from sglang_storage.config import (
    non_empty_str,
    non_negative_number,
    number_in_range,
    positive_number,
    require_int,
    tuple_of,
)
from sglang_storage.errors import ConfigError

__all__ = [
    "DEFAULT_TIER_PRIORS",
    "CostModel",
    "CostModelConfig",
    "CostModelStats",
    "EstimateSource",
    "LoadDecision",
    "LoadOutcome",
    "Tier",
    "TierPrior",
    "TierStats",
]

_GIB: Final = 1024**3
_MIN_RELATIVE_SPREAD: Final = 0.01  # size std / mean below this: latency is not identifiable


class Tier(enum.StrEnum):
    """The tiers a hit can be loaded from; any other non-empty ``str`` names a custom tier."""

    HOST = "host"
    """Host DRAM (HiCache L2), loaded into device memory."""
    STORAGE = "storage"
    """A storage backend (HiCache L3), loaded through host memory into device memory."""


class LoadOutcome(enum.Enum):
    """What the cost model recommends for a hit."""

    LOAD = "load"
    """Load the hit from its tier."""
    RECOMPUTE = "recompute"
    """Recompute the tokens with prefill; loading would be slower."""


class EstimateSource(enum.Enum):
    """Where a tier's bandwidth and latency estimates come from."""

    PRIOR = "prior"
    """No transfer observed yet: the configured prior."""
    FIT = "fit"
    """Both fitted from observed transfers of varied sizes."""
    PARTIAL_FIT = "partial_fit"
    """Observed transfers, but too uniform in size to separate latency from bandwidth:
    latency from the prior (capped), bandwidth from the observations."""


@attrs.frozen(kw_only=True)
class TierPrior:
    """Bandwidth and latency assumed for a tier before any transfer is observed."""

    tier: str = attrs.field(validator=non_empty_str)
    """The tier's name (a :class:`Tier` value or a custom name)."""
    bandwidth_bytes_per_s: float = attrs.field(validator=positive_number)
    """Bytes per second once a transfer is under way."""
    latency_s: float = attrs.field(validator=non_negative_number)
    """Fixed seconds per transfer, whatever its size."""


DEFAULT_TIER_PRIORS: Final[tuple[TierPrior, ...]] = (
    TierPrior(tier=Tier.HOST.value, bandwidth_bytes_per_s=16.0 * _GIB, latency_s=50e-6),
    TierPrior(tier=Tier.STORAGE.value, bandwidth_bytes_per_s=1.0 * _GIB, latency_s=1e-3),
)
"""Priors for the built-in tiers (see the module docstring for where they come from)."""


@attrs.frozen(kw_only=True)
class CostModelConfig:
    """Knobs of the load-vs-recompute cost model.

    Attributes:
        ewma_alpha: Weight of the newest observation in every moving average, in (0, 1].
        prior_prefill_tokens_per_s: Prefill throughput assumed before any is observed.
        tier_priors: Per-tier priors, at most one per tier name.
        default_bandwidth_bytes_per_s: Prior bandwidth of a tier not in ``tier_priors``.
        default_latency_s: Prior latency of a tier not in ``tier_priors``.
    """

    ewma_alpha: float = attrs.field(
        default=0.2, validator=number_in_range(0, 1, low_exclusive=True)
    )
    prior_prefill_tokens_per_s: float = attrs.field(default=10_000.0, validator=positive_number)
    tier_priors: tuple[TierPrior, ...] = attrs.field(
        default=DEFAULT_TIER_PRIORS, validator=tuple_of(attrs.validators.instance_of(TierPrior))
    )
    default_bandwidth_bytes_per_s: float = attrs.field(
        default=1.0 * _GIB, validator=positive_number
    )
    default_latency_s: float = attrs.field(default=1e-3, validator=non_negative_number)

    def __attrs_post_init__(self) -> None:
        repeated = sorted(n for n, c in Counter(p.tier for p in self.tier_priors).items() if c > 1)
        if repeated:
            raise ConfigError(
                owner=type(self).__name__,
                field="tier_priors",
                value=repeated,
                reason="names a tier more than once",
            )

    def prior_for(self, tier: str) -> TierPrior:
        """Return the prior of ``tier``: its entry in ``tier_priors``, else the defaults."""
        for prior in self.tier_priors:
            if prior.tier == tier:
                return prior
        return TierPrior(
            tier=tier,
            bandwidth_bytes_per_s=self.default_bandwidth_bytes_per_s,
            latency_s=self.default_latency_s,
        )


@attrs.frozen(kw_only=True)
class LoadDecision:
    """The cost model's recommendation for one hit, with every input it used."""

    outcome: LoadOutcome
    """Load or recompute."""
    tier: str
    """The tier the hit is on."""
    n_tokens: int
    """The hit's length in tokens."""
    nbytes: int
    """Bytes a load moves: ``n_tokens * bytes_per_token``."""
    bytes_per_token: int
    """Summed bytes per token of the pools the hit loads."""
    load_s: float
    """Estimated seconds to load: ``latency_s + nbytes / bandwidth_bytes_per_s``."""
    recompute_s: float
    """Estimated seconds to recompute: ``n_tokens / prefill_tokens_per_s``."""
    bandwidth_bytes_per_s: float
    """The tier's bandwidth estimate used."""
    latency_s: float
    """The tier's per-transfer latency estimate used."""
    prefill_tokens_per_s: float
    """The prefill throughput estimate used."""
    source: EstimateSource
    """Where the tier's estimates came from."""

    @property
    def load(self) -> bool:
        """Whether loading is recommended."""
        return self.outcome is LoadOutcome.LOAD


@attrs.frozen(kw_only=True)
class TierStats:
    """One tier's current estimates and decision counts."""

    tier: str
    """The tier's name."""
    bandwidth_bytes_per_s: float
    """Current bandwidth estimate."""
    latency_s: float
    """Current per-transfer latency estimate."""
    source: EstimateSource
    """Where the estimates come from."""
    observations: int
    """Transfers observed."""
    load_decisions: int
    """Decisions for this tier that recommended loading."""
    recompute_decisions: int
    """Decisions for this tier that recommended recomputing."""


@attrs.frozen(kw_only=True)
class CostModelStats:
    """A snapshot of the cost model's inputs and decisions."""

    tiers: tuple[TierStats, ...]
    """Every tier with a prior, an observation or a decision, by name."""
    prefill_tokens_per_s: float
    """Current prefill throughput estimate."""
    prefill_observations: int
    """Prefill batches observed."""
    bytes_per_token: tuple[tuple[str, int], ...]
    """``(pool, bytes per token)`` for every pool, by name."""
    load_decisions: int
    """Decisions, over all tiers, that recommended loading."""
    recompute_decisions: int
    """Decisions, over all tiers, that recommended recomputing."""
    last_decision: LoadDecision | None
    """The most recent decision, with its inputs; ``None`` before the first."""


def _check_seconds(value: object, *, owner: str) -> float:
    number = math.nan
    if not isinstance(value, bool) and isinstance(value, int | float):
        with contextlib.suppress(OverflowError):  # an int too large for a float
            number = float(value)
    if not (math.isfinite(number) and number > 0):
        raise ConfigError(
            owner=owner, field="seconds", value=value, reason="must be a finite number > 0"
        )
    return number


def _check_name(value: object, *, owner: str, field: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(owner=owner, field=field, value=value, reason="must be a non-empty str")
    return str(value)


@attrs.define(slots=True)
class _TierEstimator:
    """Exponentially weighted least-squares fit of ``seconds = latency + nbytes / bw``."""

    prior: TierPrior
    observations: int = 0
    mean_bytes: float = 0.0
    mean_seconds: float = 0.0
    var_bytes: float = 0.0
    cov: float = 0.0
    load_decisions: int = 0
    recompute_decisions: int = 0

    def observe(self, nbytes: float, seconds: float, alpha: float) -> None:
        if not self.observations:
            self.mean_bytes, self.mean_seconds = nbytes, seconds
        else:
            dx, dy = nbytes - self.mean_bytes, seconds - self.mean_seconds
            self.mean_bytes += alpha * dx
            self.mean_seconds += alpha * dy
            self.var_bytes = (1 - alpha) * (self.var_bytes + alpha * dx * dx)
            self.cov = (1 - alpha) * (self.cov + alpha * dx * dy)
        self.observations += 1

    def estimate(self) -> tuple[float, float, EstimateSource]:
        """Return ``(bandwidth, latency, source)``."""
        if not self.observations:
            return self.prior.bandwidth_bytes_per_s, self.prior.latency_s, EstimateSource.PRIOR
        mx, my = self.mean_bytes, self.mean_seconds
        spread_ok = self.var_bytes > (_MIN_RELATIVE_SPREAD * mx) ** 2
        if spread_ok and self.cov > 0:
            slope = self.cov / self.var_bytes
            intercept = my - slope * mx
            if intercept >= 0:
                return 1.0 / slope, intercept, EstimateSource.FIT
            return mx / my, 0.0, EstimateSource.FIT
        latency = min(self.prior.latency_s, my / 2)
        return mx / (my - latency), latency, EstimateSource.PARTIAL_FIT


class CostModel:
    """Decides, for a hit of ``n`` tokens on a tier, whether loading beats recomputing.

    Pure arithmetic on what the owner reports: ``observe`` after each transfer,
    ``observe_prefill`` after each prefill batch, ``decide`` before a load. Not
    thread-safe: the owner serialises calls.

    Args:
        config: Smoothing and priors.
        bytes_per_token: Bytes one token occupies in each pool a hit loads, by pool name
            (e.g. ``{"kv": 2 * layers * kv_heads * head_dim * dtype_bytes}``); non-empty.
    """

    def __init__(self, config: CostModelConfig, *, bytes_per_token: Mapping[str, int]) -> None:
        owner = "CostModel"
        pools = dict(bytes_per_token)
        if not pools:
            raise ConfigError(
                owner=owner,
                field="bytes_per_token",
                value=pools,
                reason="must name at least one pool",
            )
        for pool, size in pools.items():
            _check_name(pool, owner=owner, field="bytes_per_token")
            require_int(size, owner=owner, field=f"bytes_per_token[{pool!r}]", low=1)
        self._config = config
        self._bytes_per_token = pools
        self._tiers: dict[str, _TierEstimator] = {
            p.tier: _TierEstimator(prior=p) for p in config.tier_priors
        }
        self._prefill_observations = 0
        self._mean_prefill_tokens = 0.0
        self._mean_prefill_seconds = 0.0
        self._last: LoadDecision | None = None

    @property
    def config(self) -> CostModelConfig:
        """The configuration the model was built from."""
        return self._config

    @property
    def bytes_per_token(self) -> Mapping[str, int]:
        """Bytes per token of each pool, by name (a copy)."""
        return dict(self._bytes_per_token)

    @property
    def prefill_tokens_per_s(self) -> float:
        """The current prefill throughput estimate (the prior until one is observed)."""
        if not self._prefill_observations:
            return self._config.prior_prefill_tokens_per_s
        return self._mean_prefill_tokens / self._mean_prefill_seconds

    def observe(self, tier: str, nbytes: int, seconds: float) -> None:
        """Record a finished transfer of ``nbytes`` from ``tier`` that took ``seconds``.

        Raises:
            ConfigError: ``tier`` is not a non-empty str, ``nbytes`` not an int >= 1, or
                ``seconds`` not a finite number > 0. Nothing is recorded then.
        """
        owner = "CostModel.observe"
        name = _check_name(tier, owner=owner, field="tier")
        size = require_int(nbytes, owner=owner, field="nbytes", low=1)
        duration = _check_seconds(seconds, owner=owner)
        self._tier(name).observe(float(size), duration, self._config.ewma_alpha)

    def observe_prefill(self, n_tokens: int, seconds: float) -> None:
        """Record a prefill of ``n_tokens`` that took ``seconds`` of GPU time.

        Raises:
            ConfigError: ``n_tokens`` is not an int >= 1 or ``seconds`` not a finite
                number > 0. Nothing is recorded then.
        """
        owner = "CostModel.observe_prefill"
        tokens = float(require_int(n_tokens, owner=owner, field="n_tokens", low=1))
        duration = _check_seconds(seconds, owner=owner)
        if not self._prefill_observations:
            self._mean_prefill_tokens, self._mean_prefill_seconds = tokens, duration
        else:
            alpha = self._config.ewma_alpha
            self._mean_prefill_tokens += alpha * (tokens - self._mean_prefill_tokens)
            self._mean_prefill_seconds += alpha * (duration - self._mean_prefill_seconds)
        self._prefill_observations += 1

    def estimate(self, tier: str) -> tuple[float, float, EstimateSource]:
        """Return ``tier``'s current ``(bandwidth bytes/s, latency s, source)``."""
        return self._estimate(_check_name(tier, owner="CostModel.estimate", field="tier"))

    def decide(
        self, tier: str, n_tokens: int, *, pools: Collection[str] | None = None
    ) -> LoadDecision:
        """Return whether a hit of ``n_tokens`` on ``tier`` should be loaded or recomputed.

        Args:
            tier: The tier holding the hit.
            n_tokens: The hit's length (>= 1).
            pools: The pools the hit loads; all configured pools when ``None``.

        Raises:
            ConfigError: A bad tier or count, or an unknown or empty set of pools. Nothing
                is counted then.
        """
        owner = "CostModel.decide"
        name = _check_name(tier, owner=owner, field="tier")
        tokens = require_int(n_tokens, owner=owner, field="n_tokens", low=1)
        per_token = self._pool_bytes(pools, owner=owner)
        bandwidth, latency, source = self._estimate(name)
        prefill = self.prefill_tokens_per_s
        nbytes = tokens * per_token
        load_s = latency + nbytes / bandwidth
        recompute_s = tokens / prefill
        outcome = LoadOutcome.LOAD if load_s <= recompute_s else LoadOutcome.RECOMPUTE
        decision = LoadDecision(
            outcome=outcome,
            tier=name,
            n_tokens=tokens,
            nbytes=nbytes,
            bytes_per_token=per_token,
            load_s=load_s,
            recompute_s=recompute_s,
            bandwidth_bytes_per_s=bandwidth,
            latency_s=latency,
            prefill_tokens_per_s=prefill,
            source=source,
        )
        estimator = self._tier(name)
        if outcome is LoadOutcome.LOAD:
            estimator.load_decisions += 1
        else:
            estimator.recompute_decisions += 1
        self._last = decision
        return decision

    def stats(self) -> CostModelStats:
        """Return a snapshot of every input the model uses and its decision counts."""
        tiers = []
        for name in sorted(self._tiers):
            estimator = self._tiers[name]
            bandwidth, latency, source = estimator.estimate()
            tiers.append(
                TierStats(
                    tier=name,
                    bandwidth_bytes_per_s=bandwidth,
                    latency_s=latency,
                    source=source,
                    observations=estimator.observations,
                    load_decisions=estimator.load_decisions,
                    recompute_decisions=estimator.recompute_decisions,
                )
            )
        return CostModelStats(
            tiers=tuple(tiers),
            prefill_tokens_per_s=self.prefill_tokens_per_s,
            prefill_observations=self._prefill_observations,
            bytes_per_token=tuple(sorted(self._bytes_per_token.items())),
            load_decisions=sum(t.load_decisions for t in tiers),
            recompute_decisions=sum(t.recompute_decisions for t in tiers),
            last_decision=self._last,
        )

    def _tier(self, name: str) -> _TierEstimator:
        estimator = self._tiers.get(name)
        if estimator is None:
            estimator = self._tiers[name] = _TierEstimator(prior=self._config.prior_for(name))
        return estimator

    def _estimate(self, name: str) -> tuple[float, float, EstimateSource]:
        estimator = self._tiers.get(name)
        if estimator is None:
            prior = self._config.prior_for(name)
            return prior.bandwidth_bytes_per_s, prior.latency_s, EstimateSource.PRIOR
        return estimator.estimate()

    def _pool_bytes(self, pools: Collection[str] | None, *, owner: str) -> int:
        if pools is None:
            return sum(self._bytes_per_token.values())
        names = set(pools) if not isinstance(pools, str) else {pools}
        unknown = sorted(names - self._bytes_per_token.keys(), key=repr)
        if unknown or not names:
            raise ConfigError(
                owner=owner,
                field="pools",
                value=sorted(names, key=repr),
                reason=f"names unknown pools {unknown}" if unknown else "must name a pool",
                allowed=", ".join(sorted(self._bytes_per_token)),
            )
        return sum(self._bytes_per_token[name] for name in names)
