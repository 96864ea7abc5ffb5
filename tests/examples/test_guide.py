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
