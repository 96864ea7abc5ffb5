"""The replay's workload generator: deterministic per seed, growing contexts, shared prompts."""

from __future__ import annotations

import itertools
from collections import defaultdict

import attrs
import pytest

from sglang_storage.cli.workload import Turn, Workload, WorkloadConfig
from sglang_storage.errors import ConfigError
from sglang_storage.storage.keys import page_hashes

PAGE = 8
SMALL = WorkloadConfig(
    users=5,
    turns=3,
    system_prompts=2,
    system_tokens=40,
    context_tokens=30,
    prompt_tokens=12,
    answer_tokens=9,
    concurrency=2,
    seed=3,
)


def turns(config: WorkloadConfig = SMALL) -> list[Turn]:
    return list(Workload(config, page_size=PAGE))


def test_every_user_takes_every_turn_in_order() -> None:
    got = turns()
    assert len(got) == len(Workload(SMALL, page_size=PAGE)) == SMALL.total_turns == 15
    assert [t.index for t in got] == list(range(15))
    per_user: dict[int, list[int]] = defaultdict(list)
    for t in got:
        per_user[t.user].append(t.turn)
    assert per_user == {u: [0, 1, 2] for u in range(5)}


def test_the_context_grows_by_each_message_and_answer() -> None:
    c = SMALL
    by_user: dict[int, list[Turn]] = defaultdict(list)
    for t in turns():
        by_user[t.user].append(t)
    for history in by_user.values():
        for t in history:
            assert (
                t.prompt_len
                == c.system_tokens
                + c.context_tokens
                + (t.turn + 1) * (c.prompt_tokens)
                + t.turn * c.answer_tokens
            )
            assert t.answer_len == c.answer_tokens
        for before, after in itertools.pairwise(history):
            assert after.tokens[: len(before.tokens)] == before.tokens
            assert after.keys[: len(before.keys)] == before.keys
    assert max(len(t.tokens) for t in turns()) == c.max_tokens


def test_keys_are_sglang_page_hashes_of_the_full_pages() -> None:
    for t in turns():
        full = len(t.tokens) // PAGE * PAGE
        assert list(t.keys) == page_hashes(list(t.tokens[:full]), PAGE)
        assert all(0 <= token < SMALL.vocab_size for token in t.tokens)


def test_system_prompts_are_shared_across_users() -> None:
    first = {t.user: t for t in turns() if t.turn == 0}
    shared_pages = SMALL.system_tokens // PAGE
    by_prompt: dict[int, set[tuple[str, ...]]] = defaultdict(set)
    for t in first.values():
        by_prompt[t.system_prompt].add(t.keys[:shared_pages])
        assert t.keys[shared_pages] != next(
            o.keys[shared_pages] for o in first.values() if o.user != t.user
        )
    assert all(len(prefixes) == 1 for prefixes in by_prompt.values())
    assert len(by_prompt) == 2  # both prompts used with this seed


def test_at_most_concurrency_conversations_are_open_at_once() -> None:
    got = turns()
    last = {t.user: t.index for t in got}
    first = {t.user: t.index for t in reversed(got)}
    for t in got:
        open_now = sum(first[u] <= t.index <= last[u] for u in first)
        assert open_now <= SMALL.concurrency
    # and the turns of the open conversations do interleave
    assert [t.user for t in got] != sorted(t.user for t in got)


def test_same_seed_same_turns_other_seed_other_turns() -> None:
    assert turns() == turns()
    again = Workload(SMALL, page_size=PAGE)
    assert list(again) == list(again)  # iterating twice repeats
    other = turns(attrs.evolve(SMALL, seed=4))
    assert [t.keys for t in other] != [t.keys for t in turns()]


def test_unique_tokens_counts_the_shared_prompts_once() -> None:
    got = turns()
    last_turns = [t for t in got if t.turn == SMALL.turns - 1]
    users_own = sum(len(t.tokens) - SMALL.system_tokens for t in last_turns)
    prompts = {t.system_prompt for t in last_turns}
    assert SMALL.unique_tokens == users_own + len(prompts) * SMALL.system_tokens


@pytest.mark.parametrize(
    ("field", "value"),
    [("users", 0), ("turns", -1), ("prompt_tokens", 0), ("vocab_size", 1), ("seed", -1)],
)
def test_bad_sizes_are_config_errors(field: str, value: int) -> None:
    with pytest.raises(ConfigError, match=field):
        WorkloadConfig(**{field: value})


def test_bad_page_size_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="page_size"):
        Workload(SMALL, page_size=0)
