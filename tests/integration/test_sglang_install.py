"""The venv holds the real SGLang 0.5.23, importable on CPU, with the pins it requires.

The modules below are the seams later adapters plug into; each must import here, on a
CPU-only machine, from SGLang installed without deps plus ci/sglang-cpu-requirements.txt.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from sglang_storage_adapters import SUPPORTED_SGLANG_VERSION, require_supported_sglang

pytestmark = pytest.mark.sglang

ROOT = Path(__file__).resolve().parents[2]

SEAMS = [
    "sglang.srt.mem_cache.hicache_storage",
    "sglang.srt.mem_cache.storage.backend_factory",
    "sglang.srt.managers.cache_controller",
    "sglang.srt.mem_cache.memory_pool_host",
    "sglang.srt.disaggregation.decode_kvcache_offload_manager",
    "sglang.srt.mem_cache.embedding_cache_controller",
    "sglang.srt.server_args",
    "sglang.srt.plugins",
]


def test_sglang_is_the_supported_release() -> None:
    import sglang

    assert sglang.__version__ == SUPPORTED_SGLANG_VERSION
    assert require_supported_sglang() == SUPPORTED_SGLANG_VERSION


@pytest.mark.parametrize("module", SEAMS)
def test_seam_module_imports_on_cpu(module: str) -> None:
    importlib.import_module(module)


def _constraints() -> dict[str, Requirement]:
    pins: dict[str, Requirement] = {}
    for line in (ROOT / "ci" / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            requirement = Requirement(line)
            pins[re.sub(r"[-_.]+", "-", requirement.name).lower()] = requirement
    return pins


def test_every_installed_package_satisfies_the_constraints() -> None:
    """pip kept SGLang's pins (torch above all) while installing SGLang's import set."""
    checked = []
    for name, requirement in _constraints().items():
        if requirement.marker is not None and not requirement.marker.evaluate():
            continue
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        assert requirement.specifier.contains(installed, prereleases=True), (
            f"{name} {installed} breaks the constraint {requirement}"
        )
        checked.append(name)
    assert {"torch", "torchvision", "transformers", "sglang"} <= set(checked)


def test_constraints_cover_sglang_own_pins() -> None:
    """ci/constraints.txt carries every version pin in SGLang's metadata, unchanged."""
    pins = _constraints()
    metadata = importlib.metadata.metadata("sglang").get_all("Requires-Dist") or []
    for line in metadata:
        requirement = Requirement(line)
        if requirement.marker is not None and "extra" in str(requirement.marker):
            continue
        if not requirement.specifier:
            continue
        ours = pins.get(re.sub(r"[-_.]+", "-", requirement.name).lower())
        assert ours is not None, f"SGLang pins {requirement}; ci/constraints.txt lacks it"
        assert ours.specifier == requirement.specifier, (ours, requirement)
