"""Managers own no threads, no queues and no CUDA streams: checked on their source (AST).

Asynchrony belongs to the transfer layer (the pipelines' workers, streams and handles); a
manager composes pools, pipelines, a backend and policies and returns finished work as
values. So no module of :mod:`sglang_storage.managers` may

- import ``queue``, ``_thread``, ``concurrent.futures``, ``asyncio``, ``multiprocessing``,
  ``sched`` or ``torch.multiprocessing`` (any form of import, any alias);
- refer to ``threading.Thread`` or ``threading.Timer`` (an import, a call, a base class);
- create a CUDA stream (``torch.cuda.Stream(...)``, ``torch.Stream(...)``).

``threading.Lock``, ``RLock``, ``Condition`` and ``Event`` are allowed. Every module present
when the test runs is checked, so a new manager is covered without editing this file.

Run as a script (``python tests/unit/managers/test_managers_own_no_threads.py``) to print
each manager module's line count and any violation.
"""

from __future__ import annotations

import ast
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest

MANAGERS = Path(__file__).resolve().parents[3] / "sglang_storage" / "managers"

FORBIDDEN_MODULES = (
    "queue",
    "_thread",
    "concurrent.futures",
    "asyncio",
    "multiprocessing",
    "sched",
    "torch.multiprocessing",
)
"""Importing any of these (or a submodule) is a violation."""

FORBIDDEN_NAMES = ("threading.Thread", "threading.Timer")
"""Any reference to these is a violation."""

FORBIDDEN_CALLS = ("torch.cuda.Stream", "torch.cuda.streams.Stream", "torch.Stream")
"""Calling these (creating a stream) is a violation; annotations may name them."""


@attrs.frozen
class Violation:
    """One forbidden construct at ``path:line``."""

    path: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.what}"


def _forbidden_module(name: str) -> str | None:
    for module in FORBIDDEN_MODULES:
        if name == module or name.startswith(f"{module}."):
            return module
    return None


class _Checker(ast.NodeVisitor):
    """Resolves names through the module's imports and records forbidden uses."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.aliases: dict[str, str] = {}
        """Local name -> the dotted name it was imported as."""
        self.found: list[Violation] = []

    def _report(self, node: ast.AST, what: str) -> None:
        self.found.append(Violation(self.path, getattr(node, "lineno", 0), what))

    def _qualified(self, node: ast.expr) -> str | None:
        """``a.b.c`` with ``a`` replaced by what it was imported as, or None."""
        if isinstance(node, ast.Name):
            return self.aliases.get(node.id)
        if isinstance(node, ast.Attribute):
            base = self._qualified(node.value)
            return None if base is None else f"{base}.{node.attr}"
        return None

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            module = _forbidden_module(alias.name)
            if module is not None:
                self._report(node, f"imports {alias.name} (no {module} in managers)")
            if alias.asname is not None:
                self.aliases[alias.asname] = alias.name
            else:
                top = alias.name.split(".")[0]
                self.aliases[top] = top

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level or node.module is None:
            return
        for alias in node.names:
            full = f"{node.module}.{alias.name}"
            module = _forbidden_module(node.module) or _forbidden_module(full)
            if module is not None:
                self._report(node, f"imports {full} (no {module} in managers)")
            elif full in FORBIDDEN_NAMES:
                self._report(node, f"imports {full} (managers start no threads)")
            self.aliases[alias.asname or alias.name] = full

    def visit_Name(self, node: ast.Name) -> None:
        self._check_reference(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if not self._check_reference(node):
            self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        name = self._qualified(node.func)
        if name in FORBIDDEN_CALLS:
            self._report(node, f"creates a CUDA stream ({name}); streams belong to transfer")
        self.generic_visit(node)

    def _check_reference(self, node: ast.Name | ast.Attribute) -> bool:
        name = self._qualified(node)
        if name in FORBIDDEN_NAMES:
            self._report(node, f"uses {name} (managers start no threads)")
            return True
        module = None if name is None else _forbidden_module(name)
        if module is not None and isinstance(node, ast.Attribute):
            self._report(node, f"uses {name} (no {module} in managers)")
            return True
        return False


def violations(source: str, path: str = "<source>") -> list[Violation]:
    """Every forbidden construct in ``source``, in line order."""
    checker = _Checker(path)
    checker.visit(ast.parse(source, filename=path))
    # A reference reported once as an import need not be reported again at each use.
    unique = {(v.line, v.what): v for v in checker.found}
    return sorted(unique.values(), key=lambda v: (v.line, v.what))


def manager_modules() -> list[Path]:
    """The Python modules of ``sglang_storage/managers`` (subpackages included)."""
    return sorted(MANAGERS.rglob("*.py"))


def manager_line_counts() -> dict[str, int]:
    """Lines per manager module, by path relative to the repository root."""
    root = MANAGERS.parents[1]
    return {
        str(path.relative_to(root)): len(path.read_text().splitlines())
        for path in manager_modules()
    }


def _relative(path: Path) -> str:
    return str(path.relative_to(MANAGERS.parents[1]))


# ------------------------------------------------------------------ the check


def _cases() -> Iterator[object]:
    for path in manager_modules():
        yield pytest.param(path, id=_relative(path))


@pytest.mark.parametrize("path", list(_cases()))
def test_manager_module_owns_no_threads_or_queues(path: Path) -> None:
    found = violations(path.read_text(), _relative(path))
    assert not found, "managers own no threads, queues or streams:\n" + "\n".join(
        str(v) for v in found
    )


def test_the_managers_package_exists() -> None:
    assert (MANAGERS / "__init__.py").is_file()
    assert manager_modules(), "no module to check"


def test_line_counts(capsys: pytest.CaptureFixture[str]) -> None:
    """Not a limit: prints each module's size for the report (``pytest -s`` shows it)."""
    counts = manager_line_counts()
    assert counts
    with capsys.disabled():
        print()
        for path, lines in counts.items():
            print(f"{lines:6d}  {path}")


# ------------------------------------------------------------------ the checker itself


BAD = {
    "import queue": "imports queue",
    "import queue as q": "imports queue",
    "from queue import Queue": "imports queue.Queue",
    "import concurrent.futures": "imports concurrent.futures",
    "from concurrent.futures import ThreadPoolExecutor": "imports concurrent.futures",
    "from concurrent import futures": "imports concurrent.futures",
    "import asyncio": "imports asyncio",
    "from asyncio import Queue": "imports asyncio",
    "import multiprocessing.pool": "imports multiprocessing.pool",
    "from multiprocessing import Process": "imports multiprocessing",
    "import sched": "imports sched",
    "import _thread": "imports _thread",
    "import torch.multiprocessing as mp": "imports torch.multiprocessing",
    "from torch import multiprocessing": "imports torch.multiprocessing",
    "import torch\nctx = torch.multiprocessing.get_context('spawn')": "uses torch.multiprocessing",
    "from threading import Thread": "imports threading.Thread",
    "from threading import Timer as T": "imports threading.Timer",
    "import threading\nthreading.Thread(target=print).start()": "uses threading.Thread",
    "import threading as th\nt = th.Timer(1.0, print)": "uses threading.Timer",
    "import threading\nclass Worker(threading.Thread):\n    pass": "uses threading.Thread",
    "import torch\ns = torch.cuda.Stream()": "creates a CUDA stream",
    "import torch\ns = torch.Stream(device='cuda')": "creates a CUDA stream",
    "from torch import cuda\ns = cuda.Stream()": "creates a CUDA stream",
    "from torch.cuda import Stream\ns = Stream()": "creates a CUDA stream",
    "def f():\n    import queue\n    return queue": "imports queue",
}

GOOD = [
    "import threading\nlock = threading.Lock()\ncond = threading.Condition(lock)",
    "import threading\nevent = threading.Event()\nrlock = threading.RLock()",
    "from threading import Lock, RLock, Condition, Event",
    "import torch\ndef f(stream: torch.cuda.Stream | None) -> None: ...",
    "import torch\nx = torch.cuda.current_stream()",
    "Thread = 1\nqueue = []\nqueue.append(Thread)",  # local names, not the modules
    "from sglang_storage.transfer import StoragePipeline\nStoragePipeline.completions",
    "import typing\nx: typing.Any = None",
]


@pytest.mark.parametrize(("source", "expected"), list(BAD.items()), ids=list(BAD))
def test_checker_finds_each_forbidden_construct(source: str, expected: str) -> None:
    found = violations(source, "bad.py")
    assert found, f"not caught:\n{source}"
    assert any(expected in v.what for v in found), [str(v) for v in found]
    assert all(str(v).startswith(f"bad.py:{v.line}: ") for v in found)


@pytest.mark.parametrize("source", GOOD)
def test_checker_allows_locks_and_annotations(source: str) -> None:
    assert violations(source) == []


def test_checker_names_file_and_line() -> None:
    source = textwrap.dedent(
        """\
        import threading


        def start() -> None:
            threading.Thread(target=print).start()
        """
    )
    assert [str(v) for v in violations(source, "managers/x.py")] == [
        "managers/x.py:5: uses threading.Thread (managers start no threads)"
    ]


def main() -> int:
    """Print each manager module's line count and any violation; exit 1 on a violation."""
    failed = 0
    total = 0
    for path, lines in manager_line_counts().items():
        total += lines
        found = violations((MANAGERS.parents[1] / path).read_text(), path)
        print(f"{lines:6d}  {path}" + ("" if not found else f"  ({len(found)} violations)"))
        for violation in found:
            print(f"        {violation}")
        failed += len(found)
    print(f"{total:6d}  total")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
