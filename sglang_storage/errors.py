"""The errors sglang_storage raises.

Every failure the subsystem reports is a :class:`StorageError`; callers that must not
crash catch that one type. Each subclass names one kind of failure and carries the facts
of the failure as attributes, so callers branch on type and fields, never on message text:

- :class:`ConfigError` - a configuration or argument value is invalid (which field, what
  was given, why, what is allowed). Also a ``ValueError``.
- :class:`CapacityError` - a bounded resource (memory budget, slots, disk cap) cannot hold
  what was asked for.
- :class:`BackendUnavailableError` - a backend or one of its dependencies cannot be used
  (not installed, not reachable, closed).
- :class:`CorruptObjectError` - a stored object failed its integrity check; the data was
  not returned.
- :class:`BackendIOError` - one I/O operation of a backend failed (an ``OSError``, a
  vendor error code); the backend itself is still usable.
- :class:`OperationTimeoutError` - an operation did not finish within its deadline. Also a
  ``TimeoutError``.
- :class:`OperationCancelledError` - an operation was cancelled before it finished.
- :class:`StateError` - an operation does not fit the current state of what it acts on
  (freeing a slot twice, freeing a slot an in-flight transfer pins, an unknown key).

Lower-level exceptions (``OSError``, vendor error codes) are translated into these at the
layer that meets them; layers above never see them. All errors pickle with their fields,
so they cross process boundaries (worker processes, TP ranks) intact.
"""

from __future__ import annotations

from typing import Any, Final

__all__ = [
    "BackendIOError",
    "BackendUnavailableError",
    "CapacityError",
    "ConfigError",
    "CorruptObjectError",
    "OperationCancelledError",
    "OperationTimeoutError",
    "StateError",
    "StorageError",
]


class _Unset:
    """Marker for 'no value given' where ``None`` is a legitimate value."""

    def __repr__(self) -> str:
        return "<unset>"


_UNSET: Final = _Unset()


def _restore(cls: type[StorageError], args: tuple[Any, ...], state: dict[str, Any]) -> StorageError:
    error = cls.__new__(cls)
    Exception.__init__(error, *args)
    error.__dict__.update(state)
    return error


class StorageError(Exception):
    """Base of every error raised by sglang_storage.

    Args:
        message: The complete, human-readable description of the failure.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __reduce__(self) -> tuple[Any, ...]:
        return (_restore, (type(self), self.args, dict(self.__dict__)))


class ConfigError(StorageError, ValueError):
    """A configuration or argument value is invalid.

    Args:
        owner: What the value configures (a config class or the function taking it).
        field: The name of the offending field, option or argument.
        reason: Why the value is rejected, phrased as the rule it breaks ("must be > 0").
        value: The value that was given; omit when there was none (a missing option).
        allowed: What would be accepted, when that is a short list or range.
    """

    def __init__(
        self,
        *,
        owner: str,
        field: str,
        reason: str,
        value: object = _UNSET,
        allowed: str | None = None,
    ) -> None:
        self.owner = owner
        self.field = field
        self.reason = reason
        self.value = None if isinstance(value, _Unset) else value
        self.has_value = not isinstance(value, _Unset)
        self.allowed = allowed
        given = f" (got {value!r})" if self.has_value else ""
        hint = f"; allowed: {allowed}" if allowed else ""
        super().__init__(f"{owner}.{field}: {reason}{given}{hint}")

    def renamed(self, *, owner: str | None = None, field: str | None = None) -> ConfigError:
        """Return this error as reported under another owner or field name.

        Used where a value is checked in one place but was written under another name,
        such as an element of a tuple option or an option of a nested config.
        """
        return ConfigError(
            owner=self.owner if owner is None else owner,
            field=self.field if field is None else field,
            reason=self.reason,
            value=self.value if self.has_value else _UNSET,
            allowed=self.allowed,
        )


class CapacityError(StorageError):
    """A bounded resource cannot hold what was asked of it.

    Args:
        resource: The resource that is short ("host memory budget", "KV host pool slots").
        requested: How much was asked for, in ``unit``.
        available: How much can be had, in ``unit``.
        unit: ``"bytes"`` (shown exactly and in GiB in the message) or a count noun
            such as ``"slots"``.
        hint: What the user can change to make it fit.
    """

    def __init__(
        self,
        *,
        resource: str,
        requested: int,
        available: int,
        unit: str = "bytes",
        hint: str | None = None,
    ) -> None:
        self.resource = resource
        self.requested = requested
        self.available = available
        self.unit = unit
        self.hint = hint
        want, have = _amount(requested, unit), _amount(available, unit)
        tail = f"; {hint}" if hint else ""
        super().__init__(f"{resource}: requested {want}, only {have} available{tail}")


class BackendUnavailableError(StorageError):
    """A backend, or something it depends on, cannot be used right now.

    Args:
        backend: The backend's registered name ("file", "mooncake", ...).
        reason: What is missing or failing and, where known, how to fix it.
    """

    def __init__(self, *, backend: str, reason: str) -> None:
        self.backend = backend
        self.reason = reason
        super().__init__(f"backend {backend!r} is unavailable: {reason}")


class BackendIOError(StorageError):
    """One I/O operation of a backend failed; the backend stays usable.

    Args:
        backend: The backend's registered name.
        operation: What was being done ("write of kv/tp0of2/ab12...").
        reason: The underlying failure ("[Errno 5] Input/output error").
        code: The underlying error number or vendor code, when there is one.
    """

    def __init__(
        self, *, backend: str, operation: str, reason: str, code: int | None = None
    ) -> None:
        self.backend = backend
        self.operation = operation
        self.reason = reason
        self.code = code
        super().__init__(f"backend {backend!r}: {operation} failed: {reason}")


class CorruptObjectError(StorageError):
    """A stored object failed its integrity check; none of its bytes were returned.

    Args:
        key: The object's key, as the backend displays it.
        reason: Which check failed ("checksum mismatch", "truncated header", ...).
    """

    def __init__(self, *, key: str, reason: str) -> None:
        self.key = key
        self.reason = reason
        super().__init__(f"object {key!r} is corrupt: {reason}")


class OperationTimeoutError(StorageError, TimeoutError):
    """An operation did not finish within its deadline.

    Args:
        operation: What was being done ("batch_get of 64 pages from 'mooncake'").
        timeout_s: The deadline that expired, in seconds.
    """

    def __init__(self, *, operation: str, timeout_s: float) -> None:
        self.operation = operation
        self.timeout_s = timeout_s
        super().__init__(f"{operation} timed out after {timeout_s:g} s")


class OperationCancelledError(StorageError):
    """An operation was cancelled before it finished.

    Args:
        operation: What was being done.
        reason: Who or what cancelled it.
    """

    def __init__(self, *, operation: str, reason: str) -> None:
        self.operation = operation
        self.reason = reason
        super().__init__(f"{operation} was cancelled: {reason}")


class StateError(StorageError):
    """An operation does not fit the current state of the thing it acts on.

    Nothing was changed: the operation is refused as a whole.

    Args:
        subject: What was acted on ("SlotAllocator.free", "LRU eviction policy").
        reason: Which state rule the operation breaks, naming the offending items
            ("slots [3, 9] are already free").
    """

    def __init__(self, *, subject: str, reason: str) -> None:
        self.subject = subject
        self.reason = reason
        super().__init__(f"{subject}: {reason}")


def _amount(quantity: int, unit: str) -> str:
    if unit == "bytes":
        # Exact count first (what the user compares against), then a readable size.
        return f"{quantity} bytes ({quantity / 2**30:.2f} GiB)"
    return f"{quantity} {unit}"
