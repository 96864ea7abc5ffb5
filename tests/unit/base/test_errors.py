from __future__ import annotations

import copy
import pickle

import pytest

from sglang_storage.errors import (
    BackendUnavailableError,
    CapacityError,
    ConfigError,
    CorruptObjectError,
    OperationCancelledError,
    OperationTimeoutError,
    StateError,
    StorageError,
)

ALL_ERRORS: list[StorageError] = [
    StorageError("plain failure"),
    ConfigError(owner="FileConfig", field="root", reason="must exist", value="/nope"),
    ConfigError(owner="FileConfig", field="root", reason="is required"),
    ConfigError(
        owner="HostPool", field="layout", reason="is not a choice", value=None, allowed="'a', 'b'"
    ),
    CapacityError(resource="host memory budget", requested=3 * 2**30, available=2**30),
    CapacityError(
        resource="KV host pool slots", requested=10, available=4, unit="slots", hint="add slots"
    ),
    BackendUnavailableError(backend="mooncake", reason="not installed"),
    CorruptObjectError(key="abc/0001", reason="checksum mismatch"),
    OperationTimeoutError(operation="batch_get of 64 pages", timeout_s=2.5),
    OperationCancelledError(operation="prefetch", reason="request aborted"),
    StateError(subject="SlotAllocator.free", reason="slots [3] are already free"),
]
ERROR_IDS = [f"{type(e).__name__}-{i}" for i, e in enumerate(ALL_ERRORS)]


# ---------------------------------------------------------------- hierarchy


@pytest.mark.parametrize(
    "cls",
    [
        ConfigError,
        CapacityError,
        BackendUnavailableError,
        CorruptObjectError,
        OperationTimeoutError,
        OperationCancelledError,
        StateError,
    ],
)
def test_every_error_is_a_storage_error(cls: type[StorageError]) -> None:
    assert issubclass(cls, StorageError)
    assert issubclass(cls, Exception)


def test_config_error_is_a_value_error() -> None:
    error = ConfigError(owner="X", field="y", reason="must be > 0", value=0)
    assert isinstance(error, ValueError)
    assert isinstance(error, StorageError)
    with pytest.raises(ValueError, match=r"X\.y"):
        raise error


def test_timeout_error_is_a_timeout_error() -> None:
    error = OperationTimeoutError(operation="get", timeout_s=1)
    assert isinstance(error, TimeoutError)
    assert isinstance(error, StorageError)
    with pytest.raises(TimeoutError):
        raise error


@pytest.mark.parametrize(
    "cls",
    [
        CapacityError,
        BackendUnavailableError,
        CorruptObjectError,
        OperationCancelledError,
        StateError,
    ],
)
def test_other_errors_are_not_value_or_timeout_errors(cls: type[StorageError]) -> None:
    assert not issubclass(cls, ValueError)
    assert not issubclass(cls, TimeoutError)


def test_storage_error_message() -> None:
    error = StorageError("something broke")
    assert error.message == "something broke"
    assert str(error) == "something broke"
    assert error.args == ("something broke",)


# ---------------------------------------------------------------- ConfigError


def test_config_error_fields_and_message() -> None:
    error = ConfigError(
        owner="FileConfig", field="page_size", reason="must be > 0", value=-3, allowed="1, 2, 4"
    )
    assert error.owner == "FileConfig"
    assert error.field == "page_size"
    assert error.reason == "must be > 0"
    assert error.value == -3
    assert error.has_value is True
    assert error.allowed == "1, 2, 4"
    assert str(error) == "FileConfig.page_size: must be > 0 (got -3); allowed: 1, 2, 4"
    assert error.message == str(error)


def test_config_error_value_is_shown_with_repr() -> None:
    error = ConfigError(owner="C", field="f", reason="is bad", value="64G")
    assert str(error) == "C.f: is bad (got '64G')"


def test_config_error_without_value() -> None:
    error = ConfigError(owner="FileConfig", field="root", reason="is required")
    assert error.has_value is False
    assert error.value is None
    assert error.allowed is None
    assert "(got" not in str(error)
    assert str(error) == "FileConfig.root: is required"


def test_config_error_with_none_value_counts_as_given() -> None:
    error = ConfigError(owner="C", field="f", reason="must be set", value=None)
    assert error.has_value is True
    assert error.value is None
    assert str(error) == "C.f: must be set (got None)"


def test_config_error_empty_allowed_adds_no_hint() -> None:
    error = ConfigError(owner="C", field="f", reason="is bad", value=1, allowed="")
    assert str(error) == "C.f: is bad (got 1)"


def test_config_error_fields_are_keyword_only() -> None:
    with pytest.raises(TypeError):
        ConfigError("C", "f", "is bad")  # type: ignore[call-arg]


def test_renamed_owner_and_field() -> None:
    error = ConfigError(owner="Inner", field="size", reason="must be >= 0", value=-1, allowed="x")
    renamed = error.renamed(owner="Outer.inner", field="size[2]")
    assert isinstance(renamed, ConfigError)
    assert renamed is not error
    assert (renamed.owner, renamed.field) == ("Outer.inner", "size[2]")
    assert (renamed.reason, renamed.value, renamed.has_value, renamed.allowed) == (
        "must be >= 0",
        -1,
        True,
        "x",
    )
    assert str(renamed) == "Outer.inner.size[2]: must be >= 0 (got -1); allowed: x"
    # The original is untouched.
    assert str(error) == "Inner.size: must be >= 0 (got -1); allowed: x"


def test_renamed_keeps_what_is_not_given() -> None:
    error = ConfigError(owner="Inner", field="size", reason="must be >= 0", value=-1)
    only_owner = error.renamed(owner="Outer.inner")
    assert (only_owner.owner, only_owner.field) == ("Outer.inner", "size")
    only_field = error.renamed(field="sizes[0]")
    assert (only_field.owner, only_field.field) == ("Inner", "sizes[0]")
    same = error.renamed()
    assert str(same) == str(error)


def test_renamed_keeps_missing_value_missing() -> None:
    error = ConfigError(owner="Inner", field="root", reason="is required")
    renamed = error.renamed(owner="Outer.inner")
    assert renamed.has_value is False
    assert "(got" not in str(renamed)
    assert str(renamed) == "Outer.inner.root: is required"


def test_renamed_keeps_explicit_none_value() -> None:
    error = ConfigError(owner="Inner", field="f", reason="must be set", value=None)
    renamed = error.renamed(field="g")
    assert renamed.has_value is True
    assert str(renamed) == "Inner.g: must be set (got None)"


# ---------------------------------------------------------------- CapacityError


def test_capacity_error_bytes_message() -> None:
    error = CapacityError(
        resource="host memory budget",
        requested=3 * 2**30 + 2**29,
        available=2**30,
        hint="raise --hicache-size",
    )
    assert error.resource == "host memory budget"
    assert error.requested == 3 * 2**30 + 2**29
    assert error.available == 2**30
    assert error.unit == "bytes"
    assert error.hint == "raise --hicache-size"
    assert str(error) == (
        "host memory budget: requested 3758096384 bytes (3.50 GiB), "
        "only 1073741824 bytes (1.00 GiB) available; raise --hicache-size"
    )


def test_capacity_error_small_byte_counts_round_in_gib() -> None:
    error = CapacityError(resource="disk cap", requested=1536, available=0)
    assert str(error) == (
        "disk cap: requested 1536 bytes (0.00 GiB), only 0 bytes (0.00 GiB) available"
    )


def test_capacity_error_count_unit_message() -> None:
    error = CapacityError(resource="KV host pool slots", requested=10, available=4, unit="slots")
    assert error.unit == "slots"
    assert error.hint is None
    assert str(error) == "KV host pool slots: requested 10 slots, only 4 slots available"
    assert "GiB" not in str(error)


# ---------------------------------------------------------------- the others


def test_backend_unavailable_error() -> None:
    error = BackendUnavailableError(backend="mooncake", reason="mooncake is not installed")
    assert error.backend == "mooncake"
    assert error.reason == "mooncake is not installed"
    assert str(error) == "backend 'mooncake' is unavailable: mooncake is not installed"


def test_corrupt_object_error() -> None:
    error = CorruptObjectError(key="layer0/page17", reason="checksum mismatch")
    assert error.key == "layer0/page17"
    assert error.reason == "checksum mismatch"
    assert str(error) == "object 'layer0/page17' is corrupt: checksum mismatch"


@pytest.mark.parametrize(
    ("timeout_s", "shown"), [(2.5, "2.5 s"), (30, "30 s"), (0.001, "0.001 s"), (1.0, "1 s")]
)
def test_operation_timeout_error(timeout_s: float, shown: str) -> None:
    error = OperationTimeoutError(operation="batch_get of 64 pages", timeout_s=timeout_s)
    assert error.operation == "batch_get of 64 pages"
    assert error.timeout_s == timeout_s
    assert str(error) == f"batch_get of 64 pages timed out after {shown}"


def test_operation_cancelled_error() -> None:
    error = OperationCancelledError(operation="prefetch of 8 pages", reason="request aborted")
    assert error.operation == "prefetch of 8 pages"
    assert error.reason == "request aborted"
    assert str(error) == "prefetch of 8 pages was cancelled: request aborted"


def test_state_error() -> None:
    error = StateError(subject="SlotAllocator.free", reason="slots [3, 9] are already free")
    assert error.subject == "SlotAllocator.free"
    assert error.reason == "slots [3, 9] are already free"
    assert str(error) == "SlotAllocator.free: slots [3, 9] are already free"


# ---------------------------------------------------------------- pickle / deepcopy


def _public_state(error: BaseException) -> dict[str, object]:
    return dict(vars(error))


@pytest.mark.parametrize("error", ALL_ERRORS, ids=ERROR_IDS)
def test_pickle_round_trip(error: StorageError) -> None:
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        restored = pickle.loads(pickle.dumps(error, protocol=protocol))
        assert type(restored) is type(error)
        assert str(restored) == str(error)
        assert restored.message == error.message
        assert restored.args == error.args
        assert _public_state(restored) == _public_state(error)


@pytest.mark.parametrize("error", ALL_ERRORS, ids=ERROR_IDS)
def test_deepcopy_round_trip(error: StorageError) -> None:
    restored = copy.deepcopy(error)
    assert restored is not error
    assert type(restored) is type(error)
    assert str(restored) == str(error)
    assert _public_state(restored) == _public_state(error)


def test_pickled_config_error_keeps_fields_and_renames() -> None:
    error = ConfigError(owner="Inner", field="size", reason="must be >= 0", value=-1, allowed="x")
    restored = pickle.loads(pickle.dumps(error))
    assert (restored.owner, restored.field, restored.reason) == ("Inner", "size", "must be >= 0")
    assert (restored.value, restored.has_value, restored.allowed) == (-1, True, "x")
    assert str(restored.renamed(owner="Outer.inner")) == (
        "Outer.inner.size: must be >= 0 (got -1); allowed: x"
    )


def test_pickled_config_error_without_value_stays_without_value() -> None:
    error = ConfigError(owner="C", field="root", reason="is required")
    restored = pickle.loads(pickle.dumps(error))
    assert restored.has_value is False
    assert restored.value is None
    assert "(got" not in str(restored)
    assert "(got" not in str(restored.renamed(owner="D"))


def test_pickled_errors_are_still_caught_by_their_bases() -> None:
    restored_timeout = pickle.loads(pickle.dumps(OperationTimeoutError(operation="x", timeout_s=1)))
    with pytest.raises(TimeoutError, match="x timed out after 1 s"):
        raise restored_timeout
    restored_config = pickle.loads(pickle.dumps(ConfigError(owner="C", field="f", reason="r")))
    with pytest.raises(ValueError, match=r"^C\.f: r$"):
        raise restored_config


def test_pickle_keeps_extra_attributes_set_later() -> None:
    error = CorruptObjectError(key="k", reason="truncated header")
    error.attempt = 3  # type: ignore[attr-defined]
    restored = pickle.loads(pickle.dumps(error))
    assert restored.attempt == 3
    assert restored.key == "k"
