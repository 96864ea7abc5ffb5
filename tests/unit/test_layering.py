"""The import-linter contracts in pyproject.toml hold for the tree and catch each kind of violation.

Each case copies the packages and the contracts into a temporary directory, plants one
violation, and runs the real ``lint-imports`` on the copy.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
CONTRACTS = {
    contract["id"]: contract["name"]
    for contract in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"][
        "contracts"
    ]
}


def _copy_tree(destination: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "sglang_storage", destination / "sglang_storage", ignore=ignore)
    shutil.copytree(
        ROOT / "integrations" / "sglang_storage_adapters",
        destination / "integrations" / "sglang_storage_adapters",
        ignore=ignore,
    )
    shutil.copy(ROOT / "pyproject.toml", destination / "pyproject.toml")


def _env(tree: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tree), str(tree / "integrations")])
    return env


def _lint(tree: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--config", str(tree / "pyproject.toml")],
        cwd=tree,
        env=_env(tree),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    _copy_tree(tmp_path)
    # The copy, not the installed checkout, must be what lint-imports analyses.
    where = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sglang_storage, sglang_storage_adapters as a;"
            "print(sglang_storage.__file__); print(a.__file__)",
        ],
        cwd=tmp_path,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert all(Path(p).is_relative_to(tmp_path) for p in where), where
    return tmp_path


def test_tree_keeps_every_contract(tree: Path) -> None:
    result = _lint(tree)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"Contracts: {len(CONTRACTS)} kept, 0 broken." in result.stdout


def _append(path: Path, line: str) -> None:
    path.write_text(path.read_text() + f"\n{line}\n")


@pytest.mark.parametrize(
    ("module", "planted", "contract"),
    [
        pytest.param(
            "sglang_storage/memory/__init__.py",
            "from sglang_storage import managers  # noqa",
            "layers",
            id="memory-imports-managers",
        ),
        pytest.param(
            "sglang_storage/storage/__init__.py",
            "import sglang_storage.cli  # noqa",
            "layers",
            id="storage-imports-cli",
        ),
        pytest.param(
            "sglang_storage/errors.py",
            "import sglang_storage.config  # noqa",
            "layers",
            id="errors-imports-config",
        ),
        pytest.param(
            "sglang_storage/policy/__init__.py",
            "import sglang.srt.mem_cache.hicache_storage  # noqa",
            "no-sglang",
            id="policy-imports-sglang",
        ),
        pytest.param(
            "sglang_storage/managers/__init__.py",
            "import sglang_storage_adapters  # noqa",
            "adapters-on-top",
            id="managers-imports-adapters",
        ),
        pytest.param(
            "sglang_storage/units.py",
            "import torch  # noqa",
            "light-base",
            id="base-imports-torch",
        ),
    ],
)
def test_planted_violation_breaks_its_contract(
    tree: Path, module: str, planted: str, contract: str
) -> None:
    _append(tree / module, planted)
    result = _lint(tree)
    assert result.returncode != 0, result.stdout
    # The report wraps long contract names; compare with whitespace normalised.
    report = " ".join(result.stdout.split())
    assert f"{CONTRACTS[contract]} BROKEN" in report, result.stdout
    assert "Contracts: 3 kept, 1 broken." in report, result.stdout


def test_module_without_a_layer_breaks_the_exhaustive_contract(tree: Path) -> None:
    (tree / "sglang_storage" / "helpers.py").write_text('"""Placed in no layer."""\n')
    result = _lint(tree)
    assert result.returncode != 0, result.stdout
    assert "sglang_storage.helpers" in result.stdout + result.stderr, result.stdout
