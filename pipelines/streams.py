"""What a stream is: its fields and their rules, its state tables, its event-time options (all data).

The project file (`statetables.yaml`, read by pipelines/project.py) declares them; validation, bronze, the
MERGE and the checks are written once for every stream.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

FieldKind = Literal["string", "decimal", "timestamp", "integer", "boolean"]
AggregateFunction = Literal["count", "sum", "min", "max", "avg", "min_by", "max_by"]


@dataclass(frozen=True)
class FieldRule:
    """One field of a stream: its JSON type and the rule its value must keep."""

    name: str
    kind: FieldKind
    required: bool = True
    max_length: int | None = None  # strings: characters after trimming
    trim: bool = False  # strings: stored trimmed (titles)
    min_value: str | None = None  # decimals and integers: lower bound, as exact text
    min_inclusive: bool = True
    max_value: str | None = None  # decimals and integers: upper bound, as exact text
    max_inclusive: bool = True


KAFKA_BOOTSTRAP_ENV = "STATETABLES_KAFKA_BOOTSTRAP_SERVERS"


@dataclass(frozen=True)
class KafkaTopic:
    """A Kafka topic the project file names: a stream's source, or a state table's changelog topic. The brokers are
    the project file's `kafka: bootstrap_servers`, unless $STATETABLES_KAFKA_BOOTSTRAP_SERVERS names others (one
    project file, several deployments)."""

    topic: str
    bootstrap_servers: str | None = None
    max_records_per_batch: int | None = None  # a source: at most this many records a micro-batch (None: no limit)

    @property
    def servers(self) -> str:
        servers = os.environ.get(KAFKA_BOOTSTRAP_ENV) or self.bootstrap_servers
        if not servers:
            from pipelines.errors import ConfigurationError
            raise ConfigurationError(
                f"Topic {self.topic} has no brokers to read or write it. Fix: add `kafka: {{bootstrap_servers: "
                f"host:port}}` to the project file, or set {KAFKA_BOOTSTRAP_ENV}.")
        return servers


@dataclass(frozen=True)
class Aggregate:
    """One aggregate column of a state table: `function(column)` (`column` None: COUNT(*)); MIN_BY/MAX_BY order
    by `by`."""

    name: str
    function: AggregateFunction
    column: str | None = None
    by: str | None = None


@dataclass(frozen=True)
class StateTableSpec:
    """A keyed aggregate kept by MERGE, as declared: `CREATE TABLE name AS SELECT keys..., aggregates... FROM
    stream GROUP BY keys...` (`sql`, at `line` of the project file)."""

    name: str
    stream: str
    keys: tuple[str, ...]
    aggregates: tuple[Aggregate, ...]
    sql: str = ""
    line: int = 0
    ttl: timedelta | None = None  # keys idle this long in event time are deleted (pipelines/expiry.py)
    fields: tuple[FieldRule, ...] = ()  # the stream's, which decide the columns' types
    # Set by the loader from the aggregates, for the checks and the TTL: the column that counts every event
    # (COUNT(*) or COUNT of a required field), the SUM of a required decimal field and that field, the MAX of
    # the stream's event time.
    count_column: str | None = None
    sum_column: str | None = None
    summed_field: str | None = None
    last_ts_column: str | None = None
    changelog_topic: KafkaTopic | None = None  # its changes also go to this compacted topic (changelog_topic.py)

    def field(self, name: str) -> FieldRule:
        return next(f for f in self.fields if f.name == name)

    @property
    def key(self) -> str:
        """The one key column, for what needs one (TTL); the loader refuses those on multi-key tables."""
        if len(self.keys) != 1:
            raise ValueError(f"{self.name} has {len(self.keys)} key columns")
        return self.keys[0]


@dataclass(frozen=True)
class WindowOptions:
    """Hourly event-time windows with a top 10 (pipelines/windows.py)."""

    watermark_delay: timedelta = timedelta(minutes=10)


@dataclass(frozen=True)
class SessionOptions:
    """Event-time sessions per key (pipelines/sessions.py)."""

    watermark_delay: timedelta = timedelta(minutes=10)
    gap: timedelta = timedelta(minutes=30)
    state_ttl: timedelta = timedelta(days=30)


@dataclass(frozen=True)
class StreamSpec:
    name: str
    id_field: str
    event_time_field: str
    fields: tuple[FieldRule, ...]
    state_tables: tuple[StateTableSpec, ...] = ()
    dedup_horizon: timedelta = timedelta(days=7)
    max_ahead: timedelta = timedelta(days=1)  # how far after its ingestion an event's time may lie
    windows: WindowOptions | None = None
    sessions: SessionOptions | None = None
    line: int = 0  # where the project file declares it
    topic: KafkaTopic | None = None  # read from this topic (pipelines/kafka_source.py); None: the landing folder

    @property
    def bronze_table(self) -> str:
        return f"{self.name}_bronze"

    @property
    def quarantine_table(self) -> str:
        return f"{self.name}_quarantine"

    @property
    def files_table(self) -> str:
        """The ledger of landing content (pipelines/source.py)."""
        return f"{self.name}_files"

    @property
    def field_names(self) -> list[str]:
        return [f.name for f in self.fields]

    def field(self, name: str) -> FieldRule:
        return next(f for f in self.fields if f.name == name)

    @property
    def value_field(self) -> str | None:
        """The decimal field whose running total bronze commits carry for the per-run checks: the first required
        decimal field a state table sums (None: bronze carries the event count only)."""
        return next((t.summed_field for t in self.state_tables if t.summed_field), None)


def stream_spec(name: str) -> StreamSpec:
    """The declared stream by name (the project file); an unknown name fails with the list of known ones."""
    from pipelines.project import project
    return project().stream(name)


def streams() -> dict[str, StreamSpec]:
    """Every declared stream, in the project file's order."""
    from pipelines.project import project
    return project().streams


def windows_stream() -> StreamSpec:
    """The stream whose `windows:` the project file declares (the loader allows one)."""
    return next(s for s in streams().values() if s.windows is not None)


def sessions_stream() -> StreamSpec:
    """The stream whose `sessions:` the project file declares (the loader allows one)."""
    return next(s for s in streams().values() if s.sessions is not None)
