"""Test-wide rules: components that tests need, and what happens when one is missing.

A test that needs a component carries its marker:

- ``gpu``      CUDA (``torch.cuda.is_available()``);
- ``sglang``   the real SGLang 0.5.23 package;
- ``mooncake`` a runnable ``mooncake_master`` and the Mooncake client library;
- ``native``   the C extensions (``sglang_storage/storage/_pagehash.c``, ``_fileio.c``).

When the component is missing the test is skipped, and the reason says what is missing
and how to get it (``-ra`` lists every skip reason in the summary). Components named in
the comma-separated ``SGLANG_STORAGE_REQUIRE`` environment variable must be present: a
test that needs a missing required component fails instead. CI requires ``sglang``,
``mooncake`` and ``native``, so those tests can never pass by skipping there.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import os
from collections.abc import Callable, Iterator

import pytest
from hypothesis import settings
from sglang_storage_adapters import SUPPORTED_SGLANG_VERSION as SGLANG_VERSION
from support.mooncake import mooncake_master_path

pytest_plugins = ["pytester"]

# No per-example deadline: CI machines are shared and noisy, and a slow example is not a
# wrong one. Property tests bound their own input sizes instead.
settings.register_profile("sglang-storage", deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "sglang-storage"))

REQUIRE_ENV = "SGLANG_STORAGE_REQUIRE"


def _missing_gpu() -> str | None:
    import torch

    if torch.cuda.is_available():
        return None
    build = torch.version.cuda or "none"
    return f"CUDA is not available here (torch {torch.__version__}, CUDA build {build})"


def _missing_sglang() -> str | None:
    try:
        found = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return "SGLang is not installed (`make setup` installs it into .venv)"
    if found != SGLANG_VERSION:
        return f"SGLang {found} is installed; these tests are written against {SGLANG_VERSION}"
    try:
        importlib.import_module("sglang")
    except ImportError as error:
        return f"SGLang {found} is installed but does not import: {error}"
    return None


def _missing_mooncake() -> str | None:
    if mooncake_master_path() is None:
        return (
            "mooncake_master is not installed "
            "(pip install 'sglang-storage[mooncake-cpu]', or `make setup`)"
        )
    try:
        importlib.import_module("mooncake.store")
    except ImportError as error:
        hint = " (install the libibverbs1 system package)" if "libibverbs" in str(error) else ""
        return f"the Mooncake client does not import: {error}{hint}"
    return None


def _missing_native() -> str | None:
    from sglang_storage.storage import file, keys

    missing = [
        source
        for source, built in (("_pagehash.c", keys.NATIVE), ("_fileio.c", file.NATIVE_IO))
        if not built
    ]
    if not missing:
        return None
    return (
        f"sglang_storage was installed without its C extension(s) {', '.join(missing)} "
        "(in sglang_storage/storage/; they need gcc, OpenSSL's headers (libssl-dev) and "
        "xxhash.h (libxxhash-dev): `make setup`)"
    )


COMPONENTS: dict[str, Callable[[], str | None]] = {
    "gpu": _missing_gpu,
    "sglang": _missing_sglang,
    "mooncake": _missing_mooncake,
    "native": _missing_native,
}


@functools.cache
def missing(component: str) -> str | None:
    """Return why ``component`` is unavailable, or ``None`` when it is there (probed once)."""
    return COMPONENTS[component]()


def required_components() -> frozenset[str]:
    """Return the components ``SGLANG_STORAGE_REQUIRE`` names; an unknown name is an error."""
    names = frozenset(n.strip() for n in os.environ.get(REQUIRE_ENV, "").split(",") if n.strip())
    unknown = sorted(names - COMPONENTS.keys())
    if unknown:
        raise pytest.UsageError(
            f"{REQUIRE_ENV} names unknown component(s) {', '.join(unknown)}; "
            f"known: {', '.join(sorted(COMPONENTS))}"
        )
    return names


MARKERS = {
    "gpu": "needs CUDA; skipped with a reason where it is absent",
    "sglang": f"needs the real SGLang {SGLANG_VERSION} package",
    "mooncake": "needs a runnable mooncake_master and the Mooncake client",
    "native": "needs the C extensions (sglang_storage.storage._pagehash and _fileio)",
}


def pytest_configure(config: pytest.Config) -> None:
    for name, description in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {description}")
    required_components()  # reject a mistyped SGLANG_STORAGE_REQUIRE before collecting


def pytest_runtest_setup(item: pytest.Item) -> None:
    for component in COMPONENTS:
        if item.get_closest_marker(component) is None:
            continue
        component_or_skip(component)


def component_or_skip(component: str) -> None:
    """Skip (or, where required, fail) the calling test when ``component`` is missing."""
    reason = missing(component)
    if reason is None:
        return
    if component in required_components():
        pytest.fail(f"{component} is required here ({REQUIRE_ENV}) but missing: {reason}")
    pytest.skip(f"needs {component}: {reason}")


@pytest.fixture(scope="module", params=["native", "python"])
def page_key_chain(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run a module's page-key tests twice: on the C chain, then on the pure-Python one."""
    from sglang_storage.storage import keys

    if request.param == "native":
        component_or_skip("native")
        yield "native"
        return
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(keys, "_NATIVE_KEYS", None)
        patch.setattr(keys, "_NATIVE_CHAIN", None)
        yield "python"
