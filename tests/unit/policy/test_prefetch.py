from __future__ import annotations

import math
import types
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_storage.config import build_config
from sglang_storage.errors import ConfigError
from sglang_storage.policy import (
    PREFETCH_STOP_POLICY_NAMES,
    SGLANG_PREFETCH_THRESHOLD_TOKENS,
    SGLANG_PREFETCH_TIMEOUT_BASE_S,
    SGLANG_PREFETCH_TIMEOUT_PER_KI_TOKEN_S,
    PrefetchStopConfig,
    PrefetchStopPolicy,
    PrefetchStopReason,
    make_prefetch_stop_policy,
)


class HandClock:
    """A clock the test moves by hand."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def sglang_timeout_s(tokens: int, page_size: int, base: float, per_ki_token: float) -> float:
    """SGLang 0.5.23's prefetch deadline, written exactly as its source computes it."""
    # sglang/srt/mem_cache/unified_cache/storage_attachment.py:291-293
    per_page = page_size / 1024 * per_ki_token
    # sglang/srt/mem_cache/unified_radix_cache.py:2264-2268
    pages = tokens // page_size
    return base + pages * per_page


def policy_for(
    name: str = "timeout", *, page_size: int = 64, clock: HandClock | None = None, **knobs: Any
) -> PrefetchStopPolicy:
    config = PrefetchStopConfig(name=name, **knobs)  # type: ignore[arg-type]
    return PrefetchStopPolicy(config, page_size=page_size, clock=clock or HandClock())


# ----------------------------------------------------------------------------- config


def test_defaults_are_sglangs() -> None:
    config = PrefetchStopConfig()
    assert config.name == "timeout"
    assert config.timeout_base_s == SGLANG_PREFETCH_TIMEOUT_BASE_S == 1.0
    assert config.timeout_per_ki_token_s == SGLANG_PREFETCH_TIMEOUT_PER_KI_TOKEN_S == 0.25
    assert config.timeout_max_s is None  # SGLang 0.5.23 has no cap
    assert config.threshold_tokens == SGLANG_PREFETCH_THRESHOLD_TOKENS == 256


def test_build_config_selects_by_name_and_coerces_numbers() -> None:
    config = build_config(
        PrefetchStopConfig,
        {
            "name": "timeout",
            "timeout_base_s": 2,
            "timeout_per_ki_token_s": 0.1,
            "timeout_max_s": 30,
        },
    )
    assert config == PrefetchStopConfig(
        name="timeout", timeout_base_s=2.0, timeout_per_ki_token_s=0.1, timeout_max_s=30.0
    )
    for name in PREFETCH_STOP_POLICY_NAMES:
        assert build_config(PrefetchStopConfig, {"name": name}).name == name


@pytest.mark.parametrize("name", ["deadline", "Timeout", "best-effort", ""])
def test_unknown_name_lists_the_allowed_names(name: str) -> None:
    with pytest.raises(ConfigError) as caught:
        build_config(PrefetchStopConfig, {"name": name})
    assert (caught.value.field, caught.value.value) == ("name", name)
    assert caught.value.allowed == "'best_effort', 'wait_complete', 'timeout'"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("timeout_base_s", -1.0),
        ("timeout_base_s", math.inf),
        ("timeout_per_ki_token_s", -0.1),
        ("timeout_max_s", 0.0),
        ("timeout_max_s", -5.0),
        ("threshold_tokens", -1),
        ("threshold_tokens", 1.5),
    ],
)
def test_bad_knobs_are_refused(field: str, value: object) -> None:
    with pytest.raises(ConfigError) as caught:
        PrefetchStopConfig(**{field: value})  # type: ignore[arg-type]
    assert caught.value.field == field


@pytest.mark.parametrize("page_size", [0, -64, True, 64.0])
def test_bad_page_size_is_refused(page_size: object) -> None:
    with pytest.raises(ConfigError) as caught:
        PrefetchStopPolicy(PrefetchStopConfig(), page_size=page_size)  # type: ignore[arg-type]
    assert caught.value.field == "page_size"


def test_factory_and_accessors() -> None:
    clock = HandClock(5.0)
    config = PrefetchStopConfig(name="best_effort")
    policy = make_prefetch_stop_policy(config, page_size=16, clock=clock)
    assert (policy.name, policy.config, policy.page_size) == ("best_effort", config, 16)
    assert policy.now() == 5.0


# ----------------------------------------------------------------------------- timeout formula

DEFAULTS = (SGLANG_PREFETCH_TIMEOUT_BASE_S, SGLANG_PREFETCH_TIMEOUT_PER_KI_TOKEN_S)
ISSUE = (2.0, 0.1)  # the issue's figures, with its 30 s cap

# (tokens, page_size, base, per_ki_token, cap, expected seconds)
TIMEOUT_TABLE: list[tuple[int, int, float, float, float | None, float]] = [
    (0, 64, *DEFAULTS, None, 1.0),
    (63, 64, *DEFAULTS, None, 1.0),  # a partial page adds nothing
    (64, 64, *DEFAULTS, None, 1.015625),
    (1000, 64, *DEFAULTS, None, 1.234375),  # 15 whole pages, not 1000/1024 of 0.25
    (1024, 64, *DEFAULTS, None, 1.25),
    (1024, 1, *DEFAULTS, None, 1.25),
    (1024, 16, *DEFAULTS, None, 1.25),
    (4096, 64, *DEFAULTS, None, 2.0),
    (131072, 64, *DEFAULTS, None, 33.0),  # no cap in SGLang
    (1_000_000, 256, *DEFAULTS, None, 1.0 + 3906 * 0.0625),
    (1024, 64, *ISSUE, 30.0, 2.1),
    (10240, 64, *ISSUE, 30.0, 3.0),
    (280_000, 64, *ISSUE, 30.0, 29.34375),
    (300_000, 64, *ISSUE, 30.0, 30.0),  # uncapped: 31.296875
    (131072, 64, *DEFAULTS, 30.0, 30.0),
]


@pytest.mark.parametrize(
    ("tokens", "page_size", "base", "per_ki", "cap", "expected"), TIMEOUT_TABLE
)
def test_timeout_formula_table(
    tokens: int, page_size: int, base: float, per_ki: float, cap: float | None, expected: float
) -> None:
    policy = policy_for(
        page_size=page_size, timeout_base_s=base, timeout_per_ki_token_s=per_ki, timeout_max_s=cap
    )
    sglang = sglang_timeout_s(tokens, page_size, base, per_ki)
    # Bit-for-bit SGLang's float when uncapped; the cap only ever lowers it.
    assert policy.timeout_s(tokens) == (sglang if cap is None else min(sglang, cap))
    assert policy.timeout_s(tokens) == pytest.approx(expected, rel=1e-12)


@settings(max_examples=200)
@given(
    tokens=st.integers(0, 10**7),
    page_size=st.sampled_from([1, 16, 32, 64, 128, 256]),
    base=st.floats(0, 100),
    per_ki=st.floats(0, 10),
    cap=st.none() | st.floats(0.001, 1000),
)
def test_timeout_matches_sglang_formula_and_is_monotone(
    tokens: int, page_size: int, base: float, per_ki: float, cap: float | None
) -> None:
    policy = policy_for(
        page_size=page_size, timeout_base_s=base, timeout_per_ki_token_s=per_ki, timeout_max_s=cap
    )
    sglang = sglang_timeout_s(tokens, page_size, base, per_ki)
    assert policy.timeout_s(tokens) == (sglang if cap is None else min(sglang, cap))
    assert policy.timeout_s(tokens + page_size) >= policy.timeout_s(tokens)
    assert policy.timeout_s(tokens) >= min(base, cap if cap is not None else base)


# ----------------------------------------------------------------------------- decisions

R = PrefetchStopReason

# (policy, finished, completed tokens of 1024, elapsed s, reason) with the default 1.25 s
# deadline for 1024 tokens at page size 64.
DECISION_TABLE: list[tuple[str, bool, int, float, PrefetchStopReason]] = [
    (name, True, completed, elapsed, R.FINISHED)
    for name in PREFETCH_STOP_POLICY_NAMES
    for completed in (0, 512, 1024)
    for elapsed in (0.0, 1.25, 99.0)
] + [
    *[("best_effort", False, c, e, R.BEST_EFFORT) for c in (0, 1024) for e in (0.0, 99.0)],
    *[("wait_complete", False, c, e, R.WAIT_COMPLETE) for c in (0, 1024) for e in (0.0, 99.0)],
    ("timeout", False, 0, 0.0, R.WITHIN_DEADLINE),
    ("timeout", False, 512, 1.0, R.WITHIN_DEADLINE),
    ("timeout", False, 512, 1.25, R.WITHIN_DEADLINE),  # SGLang: elapsed > timeout, strictly
    ("timeout", False, 512, 1.2500001, R.DEADLINE_EXPIRED),
    ("timeout", False, 0, 99.0, R.DEADLINE_EXPIRED),
    ("timeout", False, 1024, 99.0, R.DATA_LANDED),  # cutting would salvage nothing
    ("timeout", False, 1024, 0.0, R.DATA_LANDED),
]


@pytest.mark.parametrize(("name", "finished", "completed", "elapsed", "reason"), DECISION_TABLE)
def test_decision_table(
    name: str, finished: bool, completed: int, elapsed: float, reason: PrefetchStopReason
) -> None:
    clock = HandClock(100.0)
    policy = policy_for(name, clock=clock)
    clock.now += elapsed
    decision = policy.decide(
        started_at=100.0, n_tokens=1024, completed_tokens=completed, finished=finished
    )
    assert decision.reason is reason
    assert decision.terminate == (reason in {R.FINISHED, R.BEST_EFFORT, R.DEADLINE_EXPIRED})
    assert decision.elapsed_s == pytest.approx(elapsed)
    assert decision.timeout_s == (1.25 if name == "timeout" else None)


def test_a_shrunken_hit_counts_as_landed_once_its_tokens_arrive() -> None:
    clock = HandClock()
    policy = policy_for(clock=clock)
    clock.now += 50.0
    landed = policy.decide(started_at=100.0, n_tokens=1024, completed_tokens=512, hit_tokens=512)
    assert landed.reason is R.DATA_LANDED
    waiting = policy.decide(started_at=100.0, n_tokens=1024, completed_tokens=448, hit_tokens=512)
    assert waiting.reason is R.DEADLINE_EXPIRED
    # By default the hit is the requested tokens in whole pages, like SGLang's hash chain.
    partial = policy.decide(started_at=100.0, n_tokens=100, completed_tokens=64)
    assert partial.reason is R.DATA_LANDED


def test_the_deadline_follows_the_injected_clock() -> None:
    clock = HandClock(0.0)
    policy = policy_for(page_size=64, clock=clock)
    started = policy.now()
    seen = []
    for step in range(8):
        clock.now = step * 0.25
        seen.append(policy.decide(started_at=started, n_tokens=2048, completed_tokens=0).terminate)
    # deadline 1.5 s: polls at 0 .. 1.5 wait, 1.75 terminates
    assert seen == [False] * 7 + [True]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"started_at": 101.0}, "started_at"),
        ({"started_at": math.nan}, "started_at"),
        ({"n_tokens": -1}, "n_tokens"),
        ({"completed_tokens": -1}, "completed_tokens"),
        ({"completed_tokens": 1.0}, "completed_tokens"),
        ({"hit_tokens": -64}, "hit_tokens"),
    ],
)
def test_bad_decide_arguments_are_refused(kwargs: dict[str, Any], field: str) -> None:
    policy = policy_for(clock=HandClock(100.0))
    arguments: dict[str, Any] = {"started_at": 99.0, "n_tokens": 64, "completed_tokens": 0}
    with pytest.raises(ConfigError) as caught:
        policy.decide(**(arguments | kwargs))
    assert caught.value.field == field


# ----------------------------------------------------------------------------- admission


@pytest.mark.parametrize(
    ("threshold", "page_size", "hit", "admitted"),
    [
        (256, 64, 255, False),  # cut to 192 whole-page tokens
        (256, 64, 256, True),
        (256, 64, 300, True),
        (250, 64, 255, False),
        (250, 64, 256, True),
        (0, 64, 63, False),  # max(threshold, page_size): never less than a page
        (0, 64, 64, True),
        (16, 64, 63, False),
        (256, 1, 255, False),
        (256, 1, 256, True),
        (1000, 256, 1023, False),
        (1000, 256, 1024, True),
    ],
)
def test_admission_table(threshold: int, page_size: int, hit: int, admitted: bool) -> None:
    policy = policy_for(page_size=page_size, threshold_tokens=threshold)
    assert policy.threshold_tokens == max(threshold, page_size)
    assert policy.admits(hit) is admitted


@settings(max_examples=200)
@given(
    threshold=st.integers(0, 4096),
    page_size=st.sampled_from([1, 16, 64, 256]),
    hit=st.integers(0, 10_000),
)
def test_admission_is_sglangs_rule(threshold: int, page_size: int, hit: int) -> None:
    policy = policy_for(page_size=page_size, threshold_tokens=threshold)
    # cache_controller.py:623 and unified_radix_cache.py:2150 (page-aligned key length)
    prefetch_threshold = max(threshold, page_size)
    page_aligned = hit // page_size * page_size
    assert policy.admits(hit) == (not page_aligned < prefetch_threshold)


def test_bad_hit_length_is_refused() -> None:
    with pytest.raises(ConfigError):
        policy_for().admits(-1)
    with pytest.raises(ConfigError):
        policy_for().timeout_s(-1)


# ----------------------------------------------------------------------------- real SGLang


@pytest.mark.sglang
@pytest.mark.parametrize(
    ("tokens", "page_size", "base", "per_ki"),
    [(t, p, b, k) for t, p, b, k, _, _ in TIMEOUT_TABLE],
)
def test_timeout_and_verdicts_match_sglangs_own_code(
    monkeypatch: pytest.MonkeyPatch, tokens: int, page_size: int, base: float, per_ki: float
) -> None:
    # SGLang's methods read a handful of attributes; a duck-typed `self` runs them without
    # building a cache. Its wait timer reads time.perf_counter, which we drive by hand.
    from sglang.srt.mem_cache.unified_cache.storage_attachment import StorageAttachment
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    from sglang.srt.utils import poll_timer

    now = [100.0]
    monkeypatch.setattr(poll_timer, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))

    class Cache:
        _start_storage_prefetch_wait = UnifiedRadixCache._start_storage_prefetch_wait
        _prefetch_deadline_expired = UnifiedRadixCache._prefetch_deadline_expired
        _can_terminate_prefetch = UnifiedRadixCache._can_terminate_prefetch

        def __init__(self) -> None:
            self.enable_storage = True
            self.page_size = page_size
            self.pp_rank = 0
            self.prefetch_stop_policy = "timeout"
            self._storage_prefetch_wait: dict[str, Any] = {}

        def _all_reduce(self, tensor: object, op: object) -> None:
            pass

    cache = Cache()
    StorageAttachment(cache).apply_runtime_config(
        storage_backend=None,
        prefetch_threshold=256,
        prefetch_timeout_base=base,
        prefetch_timeout_per_ki_token=per_ki,
        hicache_storage_pass_prefix_keys=False,
        enable_storage=True,
        enable_storage_metrics=False,
        extra_metric_labels=None,
    )
    pages = tokens // page_size
    operation = types.SimpleNamespace(
        handle="req",
        stats_requested_tokens=tokens,
        host_indices=object(),
        hash_value=["h"] * pages,
        completed_tokens=0,
    )
    cache._start_storage_prefetch_wait(operation)
    sglang_timeout = cache._storage_prefetch_wait["req"].timeout_s

    clock = HandClock(100.0)
    policy = policy_for(
        page_size=page_size, clock=clock, timeout_base_s=base, timeout_per_ki_token_s=per_ki
    )
    assert policy.timeout_s(tokens) == sglang_timeout

    for elapsed in (0.0, sglang_timeout / 2, sglang_timeout, sglang_timeout + 1e-6, 1e4):
        for completed in sorted({0, pages * page_size // 2, pages * page_size}):
            now[0] = clock.now = 100.0 + elapsed
            operation.completed_tokens = completed
            ours = policy.decide(started_at=100.0, n_tokens=tokens, completed_tokens=completed)
            assert ours.terminate == cache._can_terminate_prefetch(operation), (elapsed, completed)

    for name in ("best_effort", "wait_complete"):
        cache.prefetch_stop_policy = name
        ours = policy_for(name).decide(started_at=100.0, n_tokens=tokens, completed_tokens=0)
        assert ours.terminate == cache._can_terminate_prefetch(operation)
