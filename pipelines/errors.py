"""Errors that name the problem and the fix, raised before any data is touched."""

import difflib


class ConfigurationError(Exception):
    """Bad configuration: unknown stream, path outside the storage root, missing Java or jars."""


class StreamBusyError(Exception):
    """Another process is already advancing this stream (one writer per stream)."""


class StorageError(RuntimeError):
    """The storage root cannot be written (read-only, full, permissions); nothing was written."""


class ConcurrentWriterError(RuntimeError):
    """Another writer kept changing a table while a micro-batch tried to commit; nothing was written."""


class SavepointError(RuntimeError):
    """A savepoint cannot be taken or restored now; the message says why and what to do."""


class ExpiryHistoryError(RuntimeError):
    """A state table's expired rows can no longer be read back exactly; nothing was written."""


class ChangelogError(RuntimeError):
    """The changelog cannot follow its state table (the table was deleted and created again)."""


class EngineUnavailableError(RuntimeError):
    """The Spark Connect server a run is configured for does not answer; nothing was written."""


class DefinitionChangedError(ConfigurationError):
    """A state table's declaration changed in a way that changes rows already written; nothing was written."""


STORAGE_FAULTS = ("No space left on device", "Read-only file system", "Permission denied",
                  "Operation not permitted", "Disk quota exceeded")


def storage_fault(exc: BaseException) -> str | None:
    """The storage cause named in an error (read-only, full, permissions), if it is one."""
    text = str(exc)
    return next((fault for fault in STORAGE_FAULTS if fault in text), None)


def did_you_mean(name: str, known) -> str:
    """` (did you mean 'x'?)` for a name close to a known one (a typo), else nothing."""
    close = difflib.get_close_matches(str(name), [str(k) for k in known], n=1, cutoff=0.75)
    return f" (did you mean {close[0]!r}?)" if close else ""
