"""Errors that name the problem and the fix, raised before any data is touched."""


class ConfigurationError(Exception):
    """Bad configuration: unknown stream, path outside the storage root, missing Java or jars."""


class StreamBusyError(Exception):
    """Another process is already advancing this stream (one writer per stream)."""
