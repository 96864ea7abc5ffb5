from __future__ import annotations

import itertools

import pytest

from sglang_storage.config import build_config
from sglang_storage.errors import ConfigError
from sglang_storage.policy import (
    SGLANG_SELECTIVE_WRITE_THRESHOLD,
    WRITE_POLICY_NAMES,
    EvictAction,
    WritePolicy,
    WritePolicyConfig,
    WriteReason,
    make_write_policy,
)


def sglang_hit(policy: str, hit_count: int, backuped: bool) -> tuple[bool, int]:
    """SGLang 0.5.23's hit rule, written as its source has it: (write now, new hit count).

    Threshold: sglang/srt/mem_cache/unified_radix_cache.py:558-564 and
    unified_cache/storage_attachment.py:401-404. Rule: UnifiedTreeCore._inc_hit_count_and_check,
    unified_cache/unified_tree_core.py:1104-1122 (an enabled HiCache, no external linker).
    """
    write_through_threshold = 1 if policy == "write_through" else 2
    is_write_back = policy == "write_back"
    if is_write_back:
        return False, hit_count
    hit_count += 1
    return (not backuped and hit_count >= write_through_threshold), hit_count


def sglang_evict(policy: str, backuped: bool) -> EvictAction:
    """UnifiedTreeCore.evict_device_leaf, unified_tree_core.py:1788-1823."""
    if not backuped:
        return EvictAction.WRITE_BACK if policy == "write_back" else EvictAction.DROP
    return EvictAction.DEMOTE


@pytest.mark.parametrize(
    ("name", "hits_before", "backed_up"),
    list(itertools.product(WRITE_POLICY_NAMES, range(6), (False, True))),
)
def test_hits_follow_sglang_exhaustively(name: str, hits_before: int, backed_up: bool) -> None:
    policy = make_write_policy(WritePolicyConfig(name=name))  # type: ignore[arg-type]
    decision = policy.on_hit(hits_before, backed_up=backed_up)
    assert (decision.write, decision.hit_count) == sglang_hit(name, hits_before, backed_up)


@pytest.mark.parametrize(
    ("name", "backed_up"), list(itertools.product(WRITE_POLICY_NAMES, (False, True)))
)
def test_evictions_follow_sglang(name: str, backed_up: bool) -> None:
    policy = WritePolicy(WritePolicyConfig(name=name))  # type: ignore[arg-type]
    assert policy.on_evict(backed_up=backed_up) is sglang_evict(name, backed_up)


def test_reasons() -> None:
    through = WritePolicy(WritePolicyConfig(name="write_through"))
    assert through.on_hit(0, backed_up=False).reason is WriteReason.THRESHOLD_REACHED
    assert through.on_hit(0, backed_up=True).reason is WriteReason.ALREADY_BACKED_UP
    selective = WritePolicy(WritePolicyConfig(name="write_through_selective"))
    assert selective.on_hit(0, backed_up=False).reason is WriteReason.BELOW_THRESHOLD
    assert selective.on_hit(1, backed_up=False).reason is WriteReason.THRESHOLD_REACHED
    back = WritePolicy(WritePolicyConfig(name="write_back"))
    decision = back.on_hit(7, backed_up=False)
    assert (decision.reason, decision.hit_count, decision.write) == (
        WriteReason.DEFERRED_TO_EVICTION,
        7,
        False,
    )


@pytest.mark.parametrize("threshold", [1, 2, 3, 10])
def test_selective_threshold_is_configurable(threshold: int) -> None:
    policy = WritePolicy(
        WritePolicyConfig(name="write_through_selective", selective_threshold=threshold)
    )
    assert policy.threshold == threshold
    count, writes = 0, []
    for _ in range(threshold + 2):
        decision = policy.on_hit(count, backed_up=False)
        count = decision.hit_count
        writes.append(decision.write)
    # Not backed up, so it keeps asking; the first write comes at exactly `threshold` hits.
    assert writes.index(True) == threshold - 1
    assert not any(writes[: threshold - 1])


def test_thresholds_and_defaults() -> None:
    assert WritePolicyConfig() == WritePolicyConfig(
        name="write_through", selective_threshold=SGLANG_SELECTIVE_WRITE_THRESHOLD
    )
    assert SGLANG_SELECTIVE_WRITE_THRESHOLD == 2
    thresholds = {n: WritePolicy(WritePolicyConfig(name=n)).threshold for n in WRITE_POLICY_NAMES}  # type: ignore[arg-type]
    assert thresholds == {"write_through": 1, "write_through_selective": 2, "write_back": None}
    config = WritePolicyConfig(name="write_back")
    assert (WritePolicy(config).name, WritePolicy(config).config) == ("write_back", config)


def test_build_config_selects_by_name() -> None:
    config = build_config(
        WritePolicyConfig, {"name": "write_through_selective", "selective_threshold": 3}
    )
    assert config == WritePolicyConfig(name="write_through_selective", selective_threshold=3)


@pytest.mark.parametrize("name", ["write-through", "writeback", "lru", ""])
def test_unknown_name_lists_the_allowed_names(name: str) -> None:
    with pytest.raises(ConfigError) as caught:
        build_config(WritePolicyConfig, {"name": name})
    assert (caught.value.field, caught.value.value) == ("name", name)
    assert caught.value.allowed == "'write_through', 'write_through_selective', 'write_back'"


@pytest.mark.parametrize("threshold", [0, -1, True, 2.0])
def test_bad_threshold_is_refused(threshold: object) -> None:
    with pytest.raises(ConfigError) as caught:
        WritePolicyConfig(name="write_through_selective", selective_threshold=threshold)  # type: ignore[arg-type]
    assert caught.value.field == "selective_threshold"


@pytest.mark.parametrize("hits_before", [-1, True, 1.0])
def test_bad_hit_count_is_refused(hits_before: object) -> None:
    with pytest.raises(ConfigError) as caught:
        WritePolicy(WritePolicyConfig()).on_hit(hits_before, backed_up=False)  # type: ignore[arg-type]
    assert caught.value.field == "hits_before"
