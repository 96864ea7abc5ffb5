"""The adapters refuse to run against any SGLang but the one they were written for."""

from __future__ import annotations

import pickle

import pytest
from sglang_storage_adapters import (
    SUPPORTED_SGLANG_VERSION,
    IncompatibleSGLangError,
    check_sglang_version,
)

from sglang_storage.errors import StorageError


def test_supported_version_passes() -> None:
    check_sglang_version(SUPPORTED_SGLANG_VERSION)


@pytest.mark.parametrize("found", ["0.5.22", "0.5.23.post1", "0.6.0", ""])
def test_other_release_is_refused_with_both_versions(found: str) -> None:
    with pytest.raises(IncompatibleSGLangError) as error:
        check_sglang_version(found)
    assert isinstance(error.value, StorageError)
    assert (error.value.found, error.value.required) == (found, SUPPORTED_SGLANG_VERSION)
    assert f"SGLang {found} is installed" in str(error.value)
    assert f"need SGLang {SUPPORTED_SGLANG_VERSION}" in str(error.value)


def test_missing_sglang_is_refused_with_the_install_command() -> None:
    with pytest.raises(IncompatibleSGLangError, match="SGLang is not installed") as error:
        check_sglang_version(None)
    assert error.value.found is None
    assert "pip install 'sglang-storage[sglang]'" in str(error.value)


def test_error_pickles_with_its_fields() -> None:
    error = IncompatibleSGLangError(found="0.5.22", required=SUPPORTED_SGLANG_VERSION)
    copy = pickle.loads(pickle.dumps(error))
    assert (type(copy), copy.found, copy.required, str(copy)) == (
        IncompatibleSGLangError,
        "0.5.22",
        SUPPORTED_SGLANG_VERSION,
        str(error),
    )
