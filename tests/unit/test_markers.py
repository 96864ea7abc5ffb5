"""The component markers skip with a reason, and fail instead where a component is required.

Runs a small suite in a subprocess with this repository's conftest, whose component
probes are replaced by fixed answers so the outcome does not depend on this machine.
"""

from __future__ import annotations

from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]

SUITE = """
import pytest

@pytest.mark.gpu
def test_needs_gpu():
    pass

@pytest.mark.sglang
def test_needs_sglang():
    pass

def test_needs_nothing():
    pass
"""

OVERRIDE = """
COMPONENTS["gpu"] = lambda: "simulated: no CUDA on this machine"
COMPONENTS["sglang"] = lambda: None
"""


@pytest.fixture
def suite(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    monkeypatch.setenv("PYTHONPATH", str(TESTS))  # the conftest imports `support`
    monkeypatch.delenv("SGLANG_STORAGE_REQUIRE", raising=False)
    pytester.makeconftest((TESTS / "conftest.py").read_text() + OVERRIDE)
    pytester.makepyfile(test_suite=SUITE)
    return pytester


def test_missing_component_skips_and_reports_why(suite: pytest.Pytester) -> None:
    result = suite.runpytest_subprocess("-ra", "--strict-markers", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, skipped=1)
    result.stdout.fnmatch_lines(["SKIPPED*needs gpu: simulated: no CUDA on this machine"])


def test_missing_required_component_fails(
    suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SGLANG_STORAGE_REQUIRE", "gpu, sglang")
    result = suite.runpytest_subprocess("-ra", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(
        ["*gpu is required here (SGLANG_STORAGE_REQUIRE) but missing: simulated: no CUDA*"]
    )


def test_unknown_required_component_is_a_usage_error(
    suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SGLANG_STORAGE_REQUIRE", "sglang,mooncak")
    result = suite.runpytest_subprocess("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["*unknown component(s) mooncak; known: gpu, mooncake, native, sglang*"]
    )
