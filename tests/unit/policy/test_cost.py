from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_storage.config import build_config
from sglang_storage.errors import ConfigError
from sglang_storage.policy import (
    DEFAULT_TIER_PRIORS,
    CostModel,
    CostModelConfig,
    EstimateSource,
    LoadOutcome,
    Tier,
    TierPrior,
)

# Exact binary fractions, so break-even is exact in floating point:
# load_s(n) = 1/16 + n * 1024 / 2**21 = 1/16 + n/2048, recompute_s(n) = n/1024,
# equal at n = 128 (both 0.125 s).
BANDWIDTH = float(2**21)
LATENCY = 1 / 16
PREFILL = 1024.0
BYTES_PER_TOKEN = 1024
BREAK_EVEN = 128


def model(
    *, prefill: float = PREFILL, latency: float = LATENCY, alpha: float = 0.2, **pools: int
) -> CostModel:
    config = CostModelConfig(
        ewma_alpha=alpha,
        prior_prefill_tokens_per_s=prefill,
        tier_priors=(
            TierPrior(tier="storage", bandwidth_bytes_per_s=BANDWIDTH, latency_s=latency),
            DEFAULT_TIER_PRIORS[0],
        ),
    )
    return CostModel(config, bytes_per_token=pools or {"kv": BYTES_PER_TOKEN})


# ----------------------------------------------------------------------------- break-even


def test_exactly_at_break_even_loading_wins() -> None:
    decision = model().decide(Tier.STORAGE, BREAK_EVEN)
    assert decision.load_s == decision.recompute_s == 0.125
    assert decision.outcome is LoadOutcome.LOAD
    assert decision.load


@pytest.mark.parametrize(
    ("n_tokens", "outcome"),
    [
        (1, LoadOutcome.RECOMPUTE),
        (BREAK_EVEN - 1, LoadOutcome.RECOMPUTE),
        (BREAK_EVEN, LoadOutcome.LOAD),
        (BREAK_EVEN + 1, LoadOutcome.LOAD),
        (100_000, LoadOutcome.LOAD),
    ],
)
def test_one_token_either_side_of_break_even(n_tokens: int, outcome: LoadOutcome) -> None:
    assert model().decide("storage", n_tokens).outcome is outcome


@pytest.mark.parametrize(
    ("prefill", "latency", "outcome"),
    [
        (math.nextafter(PREFILL, math.inf), LATENCY, LoadOutcome.RECOMPUTE),  # recompute faster
        (math.nextafter(PREFILL, 0.0), LATENCY, LoadOutcome.LOAD),
        # One ulp of the 0.125 s sum (one ulp of 1/16 would round away in the addition).
        (PREFILL, LATENCY + math.ulp(0.125), LoadOutcome.RECOMPUTE),  # load slower
        (PREFILL, math.nextafter(LATENCY, 0.0), LoadOutcome.LOAD),
    ],
)
def test_epsilon_either_side_of_break_even(
    prefill: float, latency: float, outcome: LoadOutcome
) -> None:
    decision = model(prefill=prefill, latency=latency).decide("storage", BREAK_EVEN)
    assert decision.outcome is outcome
    assert (decision.load_s <= decision.recompute_s) == (outcome is LoadOutcome.LOAD)


def test_a_tier_slower_per_token_than_prefill_never_loads() -> None:
    slow = model(kv=4096)  # 4096 B/token at 2 MiB/s: 1/512 s per token vs 1/1024 to recompute
    assert all(not slow.decide("storage", n).load for n in (1, 128, 10**6))


def test_the_decision_carries_every_input() -> None:
    decision = model(kv=768, swa=256).decide("storage", 200, pools=None)
    assert decision.tier == "storage"
    assert (decision.n_tokens, decision.bytes_per_token, decision.nbytes) == (200, 1024, 204_800)
    assert (decision.bandwidth_bytes_per_s, decision.latency_s) == (BANDWIDTH, LATENCY)
    assert decision.prefill_tokens_per_s == PREFILL
    assert decision.source is EstimateSource.PRIOR
    assert decision.load_s == LATENCY + 204_800 / BANDWIDTH
    assert decision.recompute_s == 200 / PREFILL


def test_pools_select_the_bytes_a_hit_loads() -> None:
    cost = model(kv=768, swa=256)
    assert cost.decide("storage", 10, pools=["kv"]).bytes_per_token == 768
    assert cost.decide("storage", 10, pools={"kv", "swa"}).bytes_per_token == 1024
    assert cost.decide("storage", 10, pools="swa").bytes_per_token == 256
    assert cost.bytes_per_token == {"kv": 768, "swa": 256}


@settings(max_examples=200)
@given(
    bandwidth=st.floats(1e3, 1e12),
    latency=st.floats(0, 1),
    prefill=st.floats(1, 1e6),
    per_token=st.integers(1, 10**6),
    n=st.integers(1, 10**6),
)
def test_decisions_are_consistent_and_monotone(
    bandwidth: float, latency: float, prefill: float, per_token: int, n: int
) -> None:
    config = CostModelConfig(
        prior_prefill_tokens_per_s=prefill,
        tier_priors=(TierPrior(tier="t", bandwidth_bytes_per_s=bandwidth, latency_s=latency),),
    )
    cost = CostModel(config, bytes_per_token={"kv": per_token})
    decision = cost.decide("t", n)
    assert decision.load == (decision.load_s <= decision.recompute_s)
    # A longer hit only gets more attractive to load when loading is cheaper per token.
    if decision.load and per_token / bandwidth <= 1 / prefill:
        assert cost.decide("t", 2 * n).load


# ----------------------------------------------------------------------------- estimates


def test_priors_before_any_observation() -> None:
    cost = CostModel(CostModelConfig(), bytes_per_token={"kv": 1})
    assert cost.estimate("host") == (16.0 * 2**30, 50e-6, EstimateSource.PRIOR)
    assert cost.estimate(Tier.STORAGE) == (2.0**30, 1e-3, EstimateSource.PRIOR)
    assert cost.estimate("cxl") == (2.0**30, 1e-3, EstimateSource.PRIOR)  # default prior
    assert cost.prefill_tokens_per_s == 10_000.0
    assert cost.config == CostModelConfig()


def test_observations_of_varied_sizes_recover_latency_and_bandwidth() -> None:
    cost = model(alpha=0.25)
    for size in [2**20, 2**22] * 20:
        cost.observe("storage", size, 2**-10 + size / 2**30)
    bandwidth, latency, source = cost.estimate("storage")
    assert source is EstimateSource.FIT
    assert bandwidth == pytest.approx(2**30, rel=1e-9)
    assert latency == pytest.approx(2**-10, rel=1e-9)


@settings(max_examples=100)
@given(
    bandwidth=st.floats(1e6, 1e11),
    latency=st.floats(1e-6, 0.1),
    sizes=st.lists(st.integers(1, 2**32), min_size=2, max_size=30, unique=True),
)
def test_exact_observations_are_fitted(bandwidth: float, latency: float, sizes: list[int]) -> None:
    cost = CostModel(CostModelConfig(ewma_alpha=0.3), bytes_per_token={"kv": 1})
    for size in sizes:
        cost.observe("t", size, latency + size / bandwidth)
    fitted_bandwidth, fitted_latency, source = cost.estimate("t")
    mean = sum(sizes) / len(sizes)
    if source is EstimateSource.FIT:
        assert fitted_bandwidth == pytest.approx(bandwidth, rel=1e-4)
        assert fitted_latency == pytest.approx(latency, rel=1e-3, abs=1e-9)
    else:  # sizes too alike to separate the two: the observed size is still predicted
        assert source is EstimateSource.PARTIAL_FIT
        assert max(sizes) - min(sizes) < 0.1 * mean
    for size in (min(sizes), max(sizes)):
        predicted = fitted_latency + size / fitted_bandwidth
        assert predicted == pytest.approx(latency + size / bandwidth, rel=0.05)


def test_uniform_sizes_keep_the_prior_latency_and_predict_that_size_exactly() -> None:
    cost = model()
    for _ in range(5):
        cost.observe("storage", 2**20, 0.5)
    bandwidth, latency, source = cost.estimate("storage")
    assert source is EstimateSource.PARTIAL_FIT
    assert latency == LATENCY  # the prior, below half the mean time
    assert latency + 2**20 / bandwidth == pytest.approx(0.5, rel=1e-12)
    # A prior latency above half the observed time is capped there.
    for _ in range(50):
        cost.observe("storage", 2**20, 0.01)
    assert cost.estimate("storage")[1] == pytest.approx(0.005, rel=1e-3)


def test_a_negative_fitted_latency_is_clamped_to_zero() -> None:
    cost = model(alpha=0.5)
    for size, seconds in [(1_000_000, 0.001), (2_000_000, 0.003)] * 10:
        cost.observe("storage", size, seconds)
    bandwidth, latency, source = cost.estimate("storage")
    assert (latency, source) == (0.0, EstimateSource.FIT)
    assert bandwidth > 0


def test_moving_averages_follow_a_change() -> None:
    cost = model(alpha=0.2)
    for size in [2**20, 2**22] * 25:
        cost.observe("storage", size, 1e-3 + size / 2**30)
    for size in [2**20, 2**22] * 25:
        cost.observe("storage", size, 1e-3 + size / 2**28)  # the tier got 4x slower
    assert cost.estimate("storage")[0] == pytest.approx(2**28, rel=0.01)


def test_prefill_throughput_is_a_ratio_of_moving_averages() -> None:
    cost = model(alpha=0.5)
    assert cost.prefill_tokens_per_s == PREFILL
    cost.observe_prefill(1000, 0.1)
    assert cost.prefill_tokens_per_s == pytest.approx(10_000)
    cost.observe_prefill(3000, 0.2)
    assert cost.prefill_tokens_per_s == pytest.approx(2000 / 0.15)
    assert cost.decide("storage", 100).prefill_tokens_per_s == cost.prefill_tokens_per_s


# ----------------------------------------------------------------------------- stats


def test_stats_show_inputs_and_counts_by_outcome() -> None:
    cost = model(kv=768, swa=256)
    cost.observe("cxl", 4096, 0.001)
    decisions = [cost.decide("storage", n) for n in (1, 127, 128, 500)]
    decisions.append(cost.decide("host", 1000))
    stats = cost.stats()
    assert [t.tier for t in stats.tiers] == ["cxl", "host", "storage"]
    storage = stats.tiers[2]
    assert (storage.load_decisions, storage.recompute_decisions) == (2, 2)
    assert (storage.bandwidth_bytes_per_s, storage.latency_s) == (BANDWIDTH, LATENCY)
    assert (storage.source, storage.observations) == (EstimateSource.PRIOR, 0)
    assert (stats.tiers[0].observations, stats.tiers[0].source) == (1, EstimateSource.PARTIAL_FIT)
    assert (stats.load_decisions, stats.recompute_decisions) == (3, 2)
    assert stats.last_decision == decisions[-1]
    assert stats.bytes_per_token == (("kv", 768), ("swa", 256))
    assert (stats.prefill_tokens_per_s, stats.prefill_observations) == (PREFILL, 0)


# ----------------------------------------------------------------------------- refusals


def snapshot(cost: CostModel) -> dict[str, Any]:
    return copy.deepcopy(vars(cost))


REFUSED: list[tuple[str, Callable[[CostModel], object]]] = [
    ("seconds 0", lambda c: c.observe("storage", 10, 0.0)),
    ("seconds < 0", lambda c: c.observe("storage", 10, -1.0)),
    ("seconds nan", lambda c: c.observe("storage", 10, math.nan)),
    ("seconds inf", lambda c: c.observe("storage", 10, math.inf)),
    ("seconds bool", lambda c: c.observe("storage", 10, True)),
    ("seconds huge int", lambda c: c.observe("storage", 10, 10**400)),
    ("nbytes 0", lambda c: c.observe("storage", 0, 1.0)),
    ("nbytes float", lambda c: c.observe("storage", 1.5, 1.0)),  # type: ignore[arg-type]
    ("tier empty", lambda c: c.observe("", 10, 1.0)),
    ("tier not str", lambda c: c.observe(3, 10, 1.0)),  # type: ignore[arg-type]
    ("prefill tokens 0", lambda c: c.observe_prefill(0, 1.0)),
    ("prefill seconds 0", lambda c: c.observe_prefill(10, 0)),
    ("decide 0 tokens", lambda c: c.decide("storage", 0)),
    ("decide bad tier", lambda c: c.decide(" ", 10)),
    ("decide unknown pool", lambda c: c.decide("storage", 10, pools=["kv", "mamba"])),
    ("decide no pools", lambda c: c.decide("storage", 10, pools=[])),
    ("estimate bad tier", lambda c: c.estimate("")),
]


@pytest.mark.parametrize(("what", "call"), REFUSED, ids=[r[0] for r in REFUSED])
def test_refused_calls_change_nothing(what: str, call: Callable[[CostModel], object]) -> None:
    cost = model()
    cost.observe("storage", 2**20, 0.01)
    cost.observe_prefill(100, 0.1)
    cost.decide("storage", 64)
    before, stats = snapshot(cost), cost.stats()
    with pytest.raises(ConfigError):
        call(cost)
    assert snapshot(cost) == before
    assert cost.stats() == stats


# ----------------------------------------------------------------------------- config


def test_build_config_with_nested_priors() -> None:
    config = build_config(
        CostModelConfig,
        {
            "ewma_alpha": 0.5,
            "prior_prefill_tokens_per_s": 5000,
            "tier_priors": [{"tier": "host", "bandwidth_bytes_per_s": 10**10, "latency_s": 0}],
        },
    )
    assert config.tier_priors == (
        TierPrior(tier="host", bandwidth_bytes_per_s=1e10, latency_s=0.0),
    )
    assert config.prior_for("host").bandwidth_bytes_per_s == 1e10
    assert config.prior_for("storage").bandwidth_bytes_per_s == config.default_bandwidth_bytes_per_s


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"ewma_alpha": 0}, "ewma_alpha"),
        ({"ewma_alpha": 1.5}, "ewma_alpha"),
        ({"prior_prefill_tokens_per_s": 0}, "prior_prefill_tokens_per_s"),
        ({"default_latency_s": -1}, "default_latency_s"),
        ({"default_bandwidth_bytes_per_s": 0}, "default_bandwidth_bytes_per_s"),
        (
            {"tier_priors": [{"tier": "host", "bandwidth_bytes_per_s": 0, "latency_s": 0}]},
            "bandwidth_bytes_per_s",
        ),
    ],
)
def test_bad_config_is_refused(options: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as caught:
        build_config(CostModelConfig, options)
    assert caught.value.field == field


def test_a_tier_with_two_priors_is_refused() -> None:
    prior = TierPrior(tier="host", bandwidth_bytes_per_s=1.0, latency_s=0.0)
    with pytest.raises(ConfigError) as caught:
        CostModelConfig(tier_priors=(prior, prior))
    assert (caught.value.field, caught.value.value) == ("tier_priors", ["host"])


@pytest.mark.parametrize("pools", [{}, {"kv": 0}, {"kv": True}, {"": 4}, {"kv": 1.5}])
def test_bad_bytes_per_token_is_refused(pools: dict[str, int]) -> None:
    with pytest.raises(ConfigError) as caught:
        CostModel(CostModelConfig(), bytes_per_token=pools)
    assert caught.value.field.startswith("bytes_per_token")
