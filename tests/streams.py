"""Running a stream in tests: `advance_stream` with its settings as keywords."""

from __future__ import annotations

from pipelines.layout import StorageLayout
from pipelines.stream_query import StreamSettings, advance_stream
from pipelines.streaming import StreamRunResult
from pipelines.streams import StreamSpec


def advance(spark, layout: StorageLayout, spec: StreamSpec, **settings) -> StreamRunResult:
    """One run of the stream's query (`event_time=False` leaves out the windows or sessions, which tests of
    other steps do not need)."""
    return advance_stream(spark, layout, spec, StreamSettings(**settings))
