"""A seeded multi-turn chat workload for ``sglang-storage replay``: pure, no I/O.

Users hold conversations of several turns. Every conversation starts with one of a few
system prompts shared by all users, followed by a long per-user context (a document, a
code base); each turn adds a new user message, and the model's answer is appended before
the next turn, so the input grows turn by turn. A limited number of conversations are
active at once and their turns interleave in a seeded order, so between two turns of one
user other users' turns push its pages down the tiers.

Contract:

- :class:`WorkloadConfig` - every size, validated on construction.
- :class:`Workload` - iterates the :class:`Turn` s; the same config and page size give the
  same turns, tokens and keys, whatever else runs.
- :class:`Turn` - one request: the whole input (system prompt, context, history and the
  new message), the answer, and the storage key of every full page of both
  (SGLang's page hash chain, :func:`~sglang_storage.storage.keys.page_hashes`).
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import attrs

from sglang_storage.config import int_in_range, non_negative_int, positive_int, require_int
from sglang_storage.storage.keys import page_hashes

__all__ = ["Turn", "Workload", "WorkloadConfig"]


@attrs.frozen(kw_only=True)
class WorkloadConfig:
    """The sizes of a generated workload; validated on construction."""

    users: int = attrs.field(default=12, validator=positive_int)
    """Conversations in the run."""
    turns: int = attrs.field(default=4, validator=positive_int)
    """Turns (requests) per conversation."""
    system_prompts: int = attrs.field(default=3, validator=positive_int)
    """Distinct system prompts, shared across users (each user is given one)."""
    system_tokens: int = attrs.field(default=512, validator=non_negative_int)
    """Tokens of each system prompt."""
    context_tokens: int = attrs.field(default=1024, validator=non_negative_int)
    """Tokens of each user's own long context, sent with the first turn."""
    prompt_tokens: int = attrs.field(default=96, validator=positive_int)
    """Tokens of each new user message."""
    answer_tokens: int = attrs.field(default=160, validator=non_negative_int)
    """Tokens of each answer (decoded, then part of the next turn's input)."""
    concurrency: int = attrs.field(default=6, validator=positive_int)
    """Conversations active at once; their turns interleave."""
    vocab_size: int = attrs.field(default=32000, validator=int_in_range(2, 2**32))
    """Token ids are drawn from ``[0, vocab_size)``."""
    seed: int = attrs.field(default=0, validator=non_negative_int)
    """Seeds every random choice."""

    @property
    def total_turns(self) -> int:
        """Requests in the run."""
        return self.users * self.turns

    @property
    def max_tokens(self) -> int:
        """Tokens of the longest request, answer included (a user's last turn)."""
        return (
            self.system_tokens
            + self.context_tokens
            + self.turns * (self.prompt_tokens + self.answer_tokens)
        )

    @property
    def unique_tokens(self) -> int:
        """Distinct token positions in the run (shared system prompts counted once)."""
        per_user = self.max_tokens - self.system_tokens
        return self.users * per_user + min(self.system_prompts, self.users) * self.system_tokens


@attrs.frozen(kw_only=True)
class Turn:
    """One request of the workload."""

    index: int
    """Position in the run, from 0."""
    user: int
    """The conversation, from 0."""
    turn: int
    """The turn within the conversation, from 0."""
    system_prompt: int
    """The shared system prompt the conversation starts with."""
    prompt_len: int
    """Tokens of the input: ``tokens[:prompt_len]``."""
    tokens: tuple[int, ...] = attrs.field(repr=False)
    """The input, then the answer."""
    keys: tuple[str, ...] = attrs.field(repr=False)
    """The storage key of every full page of ``tokens``."""

    @property
    def answer_len(self) -> int:
        """Tokens of the answer."""
        return len(self.tokens) - self.prompt_len


@attrs.define
class _Session:
    user: int
    system_prompt: int
    rng: random.Random
    tokens: list[int]
    keys: list[str]
    turn: int = 0


class Workload:
    """The turns of a :class:`WorkloadConfig`, keyed for pages of ``page_size`` tokens.

    Iterating generates the turns lazily (only the active conversations are held); every
    iteration yields the same turns.

    Raises:
        ConfigError: ``page_size`` is not an int >= 1.
    """

    def __init__(self, config: WorkloadConfig, *, page_size: int) -> None:
        require_int(page_size, owner="Workload", field="page_size", low=1)
        self._config = config
        self._page_size = page_size

    @property
    def config(self) -> WorkloadConfig:
        """The sizes."""
        return self._config

    @property
    def page_size(self) -> int:
        """Tokens per page the keys are computed for."""
        return self._page_size

    def __len__(self) -> int:
        return self._config.total_turns

    def __iter__(self) -> Iterator[Turn]:
        c = self._config
        seed = c.seed
        prompts = [
            _draw(random.Random(f"{seed}/system/{i}"), c.system_tokens, c.vocab_size)
            for i in range(c.system_prompts)
        ]
        schedule = random.Random(f"{seed}/schedule")
        waiting = iter(range(c.users))
        active: list[_Session] = []
        index = 0
        while True:
            while len(active) < c.concurrency:
                user = next(waiting, None)
                if user is None:
                    break
                rng = random.Random(f"{seed}/user/{user}")
                system = rng.randrange(c.system_prompts)
                tokens = [*prompts[system], *_draw(rng, c.context_tokens, c.vocab_size)]
                active.append(
                    _Session(user=user, system_prompt=system, rng=rng, tokens=tokens, keys=[])
                )
            if not active:
                return
            session = active[schedule.randrange(len(active))]
            yield self._next_turn(session, index)
            index += 1
            if session.turn == c.turns:
                active.remove(session)

    def _next_turn(self, session: _Session, index: int) -> Turn:
        c, page = self._config, self._page_size
        session.tokens += _draw(session.rng, c.prompt_tokens, c.vocab_size)
        prompt_len = len(session.tokens)
        session.tokens += _draw(session.rng, c.answer_tokens, c.vocab_size)
        hashed = len(session.keys) * page
        full = len(session.tokens) // page * page
        if full > hashed:
            prior = session.keys[-1] if session.keys else None
            session.keys += page_hashes(session.tokens[hashed:full], page, prior)
        turn = Turn(
            index=index,
            user=session.user,
            turn=session.turn,
            system_prompt=session.system_prompt,
            prompt_len=prompt_len,
            tokens=tuple(session.tokens),
            keys=tuple(session.keys),
        )
        session.turn += 1
        return turn


def _draw(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [int(rng.random() * vocab) for _ in range(n)]
