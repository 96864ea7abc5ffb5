"""Backends against a dictionary model: hypothesis stateful tests of memory, file and hf3fs.

A :class:`~hypothesis.stateful.RuleBasedStateMachine` drives one real backend with random
sequences of batch puts, gets, ``exists``, ``prefix_hits``, deletes, namespace clears and,
for the durable ones, close-and-reopen, and checks every answer against a plain ``dict``
from key to bytes: a key that is stored reads back exactly, a key that is not is a miss, a
put of a stored key keeps the first bytes (keys name content), and a reopened store still
holds everything it acknowledged. ``hf3fs`` runs through its POSIX client on ``tmp_path``
(``allow_non_3fs``). Each key always has one size, so every read asks with the right spec.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from support.ledger import Ledger

from sglang_storage.core import (
    DataKind,
    GetOutcome,
    GetRequest,
    Namespace,
    ObjectKey,
    ObjectSpec,
    PutOutcome,
    PutRequest,
)
from sglang_storage.storage import (
    Backend,
    FileBackend,
    FileBackendConfig,
    Hf3fsBackend,
    Hf3fsBackendConfig,
    MemoryBackend,
)

LEDGER_AREA = "backend vs dict model (hypothesis)"

NAMESPACES = (
    Namespace(model="model-a", kind=DataKind.KV),
    Namespace(model="model-b", kind=DataKind.EMBEDDING),
)
NAMES = tuple(f"k{i}" for i in range(8))
KEYS = tuple(ns.key(name) for ns in NAMESPACES for name in NAMES)
SIZES = (1, 64, 300, 1000)


def _size(key: ObjectKey) -> int:
    return SIZES[KEYS.index(key) % len(SIZES)]


def _payload(key: ObjectKey, seed: int) -> bytes:
    return random.Random(f"{key}|{seed}").randbytes(_size(key))


def _spec(key: ObjectKey) -> ObjectSpec:
    return ObjectSpec.raw(_size(key))


Opener = Callable[[Path], Backend]


def _memory(root: Path) -> Backend:
    return MemoryBackend()


def _file(root: Path) -> Backend:
    return FileBackend(FileBackendConfig(root=root))


def _hf3fs(root: Path) -> Backend:
    root.mkdir(parents=True, exist_ok=True)
    config = Hf3fsBackendConfig(
        root=root,
        client="posix",
        allow_non_3fs=True,
        data_file_size=256 * 1024,
        data_files=2,
        io_threads=1,
    )
    return Hf3fsBackend(config)


BACKENDS: dict[str, tuple[Opener, bool]] = {
    "memory": (_memory, False),
    "file": (_file, True),
    "hf3fs": (_hf3fs, True),
}

unique_keys = st.lists(st.sampled_from(KEYS), min_size=1, max_size=6, unique=True)


def _machine(opener: Opener, durable: bool, tmp: Path, ledger: Ledger) -> type:
    roots = itertools.count()

    class BackendModel(RuleBasedStateMachine):
        """One backend and the dict it must behave like."""

        keys = Bundle("keys")

        def __init__(self) -> None:
            super().__init__()
            self.root = tmp / f"example-{next(roots)}"
            self.backend = opener(self.root)
            self.model: dict[ObjectKey, bytes] = {}

        def teardown(self) -> None:
            self.backend.close()

        @rule(keys=unique_keys, seed=st.integers(0, 3))
        def put(self, keys: list[ObjectKey], seed: int) -> None:
            requests = [
                PutRequest(key=k, spec=_spec(k), buffers=[bytearray(_payload(k, seed))])
                for k in keys
            ]
            results = self.backend.put_from(requests)
            ledger.operation()
            assert [r.key for r in results] == keys
            for key, result in zip(keys, results, strict=True):
                expected = PutOutcome.PRESENT if key in self.model else PutOutcome.STORED
                assert result.outcome is expected, (key, result)
                self.model.setdefault(key, _payload(key, seed))

        @rule(keys=unique_keys)
        def get(self, keys: list[ObjectKey]) -> None:
            buffers = [bytearray(_size(k)) for k in keys]
            requests = [
                GetRequest(key=k, spec=_spec(k), buffers=[b])
                for k, b in zip(keys, buffers, strict=True)
            ]
            results = self.backend.get_into(requests)
            ledger.operation()
            for key, buffer, result in zip(keys, buffers, results, strict=True):
                if key in self.model:
                    wrong = sum(a != b for a, b in zip(buffer, self.model[key], strict=True))
                    ledger.wrong(wrong if result.hit else 0)
                    assert result.outcome is GetOutcome.HIT, (key, result)
                    assert wrong == 0
                else:
                    assert result.outcome is GetOutcome.MISS, (key, result)
                    assert not any(buffer)

        @rule(keys=unique_keys)
        def exists(self, keys: list[ObjectKey]) -> None:
            ledger.operation()
            assert self.backend.exists(keys) == [k in self.model for k in keys]

        @rule(keys=st.lists(st.sampled_from(KEYS), min_size=0, max_size=8))
        def prefix_hits(self, keys: list[ObjectKey]) -> None:
            expected = next((i for i, k in enumerate(keys) if k not in self.model), len(keys))
            ledger.operation()
            assert self.backend.prefix_hits(keys) == expected

        @rule(keys=unique_keys)
        def delete(self, keys: list[ObjectKey]) -> None:
            self.backend.delete(keys)
            ledger.operation()
            for key in keys:
                self.model.pop(key, None)

        @rule(namespace=st.sampled_from(NAMESPACES))
        def clear(self, namespace: Namespace) -> None:
            self.backend.clear(namespace)
            ledger.operation()
            self.model = {k: v for k, v in self.model.items() if k.namespace != namespace}

        @precondition(lambda self: durable)
        @rule()
        def reopen(self) -> None:
            self.backend.close()
            self.backend = opener(self.root)
            ledger.operation()
            found = self.backend.exists(list(self.model))
            ledger.lost(found.count(False))
            assert all(found), "a reopened store lost acknowledged objects"

        @invariant()
        def holds_what_the_model_holds(self) -> None:
            everything = list(KEYS)
            assert self.backend.exists(everything) == [k in self.model for k in everything]

    return BackendModel


@pytest.mark.parametrize("name", list(BACKENDS))
def test_backend_behaves_like_a_dict(name: str, tmp_path: Path, ledger: Ledger) -> None:
    opener, durable = BACKENDS[name]
    machine = _machine(opener, durable, tmp_path, ledger)
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=60,
            stateful_step_count=25,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
            derandomize=True,
        ),
    )
    assert ledger.wrong_bytes == 0
    assert ledger.hangs == 0
    assert ledger.lost_durable == 0
