"""``docs/extending.md`` quotes only code that exists: every code block is an excerpt.

Each fenced block's first line is a comment naming a file of the repository
(``# tests/examples/draft_cache.py``); a ``# ...`` line separates omitted parts. Each part
must appear in that file as consecutive lines, in order, up to a common indentation.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "extending.md"
FENCE = re.compile(r"^```[a-z]*\n(.*?)^```$", re.MULTILINE | re.DOTALL)
OMISSION = "# ..."


def blocks() -> list[str]:
    return FENCE.findall(GUIDE.read_text())


def find_part(part: list[str], lines: list[str], start: int) -> int | None:
    """The index just past the first match of ``part`` in ``lines[start:]``, or None."""
    wanted = textwrap.dedent("\n".join(part))
    for begin in range(start, len(lines) - len(part) + 1):
        window = "\n".join(lines[begin : begin + len(part)])
        if textwrap.dedent(window) == wanted:
            return begin + len(part)
    return None


def test_the_guide_has_code() -> None:
    assert len(blocks()) >= 10


@pytest.mark.parametrize("block", blocks(), ids=lambda b: b.splitlines()[0])
def test_each_block_is_an_excerpt_of_the_file_it_names(block: str) -> None:
    first, *body = block.rstrip("\n").split("\n")
    assert first.startswith("# "), f"a block must name its file on its first line:\n{block}"
    source = ROOT / first[2:].strip()
    assert source.is_file(), f"{first}: no such file"
    lines = source.read_text().splitlines()
    parts: list[list[str]] = [[]]
    for line in body:
        if line.strip() == OMISSION:
            parts.append([])
        else:
            parts[-1].append(line)
    position = 0
    for part in parts:
        assert part, f"{first}: an empty excerpt"
        found = find_part(part, lines, position)
        assert found is not None, f"{first}: not found in order in the file:\n" + "\n".join(part)
        position = found


def _guide() -> str:
    return " ".join(GUIDE.read_text().split())


def test_every_capability_is_explained() -> None:
    import attrs

    from sglang_storage.storage import Capabilities

    text = _guide()
    for field in attrs.fields(Capabilities):
        assert f"`{field.name}" in text, f"the guide does not explain Capabilities.{field.name}"


def test_every_capacity_index_call_is_explained() -> None:
    from sglang_storage.storage.capacity import CapacityIndex

    text = _guide()
    calls = [name for name in vars(CapacityIndex) if not name.startswith("_")]
    assert calls
    for name in calls:
        assert f"`{name}" in text, f"the guide does not explain CapacityIndex.{name}"


def test_the_tests_the_guide_names_exist() -> None:
    named = re.findall(r"`(tests/[\w/]+\.py)` `(test_\w+)`", _guide())
    assert len(named) >= 2  # the tests a new data kind must extend
    for path, test in named:
        assert f"def {test}(" in (ROOT / path).read_text(), f"{path} has no {test}"
    text = _guide()
    for test in re.findall(r"\(`(test_\w+)`\)", text):
        assert any(f"def {test}(" in p.read_text() for p in (ROOT / "tests").rglob("*.py")), test


def test_the_paths_the_guide_names_exist() -> None:
    paths = set(
        re.findall(r"`((?:sglang_storage|integrations|tests|patches|docs)/[\w/.-]+)`", _guide())
    )
    assert paths
    for path in sorted(paths):
        assert (ROOT / path).exists(), f"the guide names {path}, which does not exist"


def test_the_guide_says_how_to_wire_a_manager_and_run_the_suite_outside() -> None:
    text = _guide()
    assert "Wiring a new manager into SGLang" in text
    assert "INSTALLERS" in text
    assert "sglang_storage/cli/settings.py" in text
    assert "From outside this repository" in text
    assert "from support.backend_conformance import BackendConformance" in text
