"""What a stream is: its fields and their rules, its state tables, its windowed and session tables (all data).

The project file (`statetables.yaml`, read by pipelines/declare/project.py) declares them; validation, bronze, the
MERGE and the checks are written once for every stream.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

from pyspark.sql.types import BooleanType, DecimalType, LongType, StringType, TimestampType

FieldKind = Literal["string", "decimal", "timestamp", "integer", "boolean"]
AggregateFunction = Literal["count", "sum", "min", "max", "avg", "min_by", "max_by"]
EventTimeKind = Literal["window", "session"]
# What a field of each kind is kept as (bronze, and the state tables' keys and MIN/MAX columns).
FIELD_TYPES = {"string": StringType(), "decimal": DecimalType(18, 2), "timestamp": TimestampType(),
               "integer": LongType(), "boolean": BooleanType()}


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


KAFKA_OPTIONS = {  # option → its allowed values (None: any text)
    "security.protocol": ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"),
    "sasl.mechanism": ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"),
    "sasl.username": None, "sasl.password": None, "ssl.ca.location": None,
}
KAFKA_SECRETS = ("sasl.username", "sasl.password")  # from the environment only
_VARIABLE = re.compile(r"^\$\{([A-Za-z_][A-Za-z0-9_]*)\}$")


def _from_environment(value: str, option: str) -> str:
    """`${NAME}` → $NAME (an error naming it when unset); any other value as written."""
    match = _VARIABLE.match(value)
    if match is None:
        return value
    found = os.environ.get(match.group(1))
    if found is None:
        from pipelines.errors import ConfigurationError
        raise ConfigurationError(f"kafka option {option} is ${{{match.group(1)}}}, and {match.group(1)} is not set. "
                                 f"Fix: export {match.group(1)} in the environment of the runs (never in the file).")
    return found


LATE_EVENTS = "late_events"  # the events behind a windowed or session table's watermark, of every stream
KAFKA_BOOTSTRAP_ENV = "STATETABLES_KAFKA_BOOTSTRAP_SERVERS"


@dataclass(frozen=True)
class KafkaTopic:
    """A Kafka topic the project file names: a stream's source, or a state table's changelog topic. The brokers are
    the project file's `kafka: bootstrap_servers`, unless $STATETABLES_KAFKA_BOOTSTRAP_SERVERS names others (one
    project file, several deployments)."""

    topic: str
    bootstrap_servers: str | None = None
    max_records_per_batch: int | None = None  # a source: at most this many records a micro-batch (None: no limit)
    # The project file's `kafka: options:` (security.protocol, sasl.*, ssl.ca.location), values as written: a secret
    # is `${VARIABLE}`, read from the environment when a client is made (KAFKA_OPTIONS says which are allowed).
    options: tuple[tuple[str, str], ...] = ()

    def client_options(self) -> dict[str, str]:
        """The options as librdkafka (confluent-kafka) takes them, variables read from the environment."""
        return {name: _from_environment(value, name) for name, value in self.options}

    def spark_options(self) -> dict[str, str]:
        """The same for Spark's Kafka source and sink (the Java client, `kafka.`-prefixed): a user name and password
        become the JAAS login its SASL mechanism needs, a PEM CA file a PEM truststore."""
        given = self.client_options()
        options = {f"kafka.{k}": v for k, v in given.items()
                   if k not in ("sasl.username", "sasl.password", "ssl.ca.location")}
        if "sasl.username" in given:
            mechanism = given.get("sasl.mechanism", "PLAIN").upper()
            module = ("org.apache.kafka.common.security.plain.PlainLoginModule" if mechanism == "PLAIN"
                      else "org.apache.kafka.common.security.scram.ScramLoginModule")
            quoted = {k: given.get(k, "").replace("\\", "\\\\").replace('"', '\\"')
                      for k in ("sasl.username", "sasl.password")}
            options["kafka.sasl.jaas.config"] = (f'{module} required username="{quoted["sasl.username"]}" '
                                                 f'password="{quoted["sasl.password"]}";')
        if "ssl.ca.location" in given:
            options.update({"kafka.ssl.truststore.type": "PEM", "kafka.ssl.truststore.location": given["ssl.ca.location"]})
        return options

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
    by `by`; with `n` (windowed and session tables only), MIN_BY/MAX_BY keep the `n` values of the least or
    greatest `by`, as a list ordered from the extreme one."""

    name: str
    function: AggregateFunction
    column: str | None = None
    by: str | None = None
    n: int | None = None


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
    ttl: timedelta | None = None  # keys idle this long in event time are deleted (pipelines/state/expiry.py)
    fields: tuple[FieldRule, ...] = ()  # the stream's, which decide the columns' types
    # Set by the loader from the aggregates, for the checks and the TTL: the column that counts every event
    # (COUNT(*) or COUNT of a required field), the SUM of a required decimal field and that field, the MAX of
    # the stream's event time.
    count_column: str | None = None
    sum_column: str | None = None
    summed_field: str | None = None
    last_ts_column: str | None = None
    changelog_topic: KafkaTopic | None = None  # its changes also go to this compacted topic (changelog_topic.py)
    where: str | None = None  # the declared WHERE over the stream's fields, as Spark SQL: the rows it counts

    def field(self, name: str) -> FieldRule:
        return next(f for f in self.fields if f.name == name)

    @property
    def key(self) -> str:
        """The one key column, for what needs one (TTL); the loader refuses those on multi-key tables."""
        if len(self.keys) != 1:
            raise ValueError(f"{self.name} has {len(self.keys)} key columns")
        return self.keys[0]


@dataclass(frozen=True)
class OutputColumn:
    """One column of a windowed or session table, in the declared order: a GROUP BY key (`key`), an aggregate
    (`aggregate`, `of` its name), the window's or session's bounds (`start`, `end`: `window.start`,
    `session_window.end`), the previous session's value of an aggregate (`previous`: LAG(agg) OVER (PARTITION BY
    keys ORDER BY the session's start)) or an aggregate's running sum over the key's sessions ending on the same
    UTC day (`day_total`: SUM(agg) OVER (PARTITION BY keys, DATE(MAX(event time)) ORDER BY the start))."""

    name: str
    role: Literal["key", "aggregate", "start", "end", "previous", "day_total"]
    of: str | None = None


@dataclass(frozen=True)
class TopSpec:
    """The top N rows of every window of a windowed table (`source`), as declared: `SELECT columns FROM (SELECT
    ..., ROW_NUMBER() OVER (PARTITION BY <window start> ORDER BY order) AS rank FROM source) WHERE rank <= n`."""

    name: str
    source: str
    n: int
    order: tuple[tuple[str, bool, bool], ...]  # (column, descending, nulls first); total, the loader checks
    rank_column: str
    columns: tuple[str, ...]  # in the declared order, the rank among them or not
    sql: str = ""
    line: int = 0


@dataclass(frozen=True)
class EventTimeTableSpec:
    """A windowed table (`GROUP BY keys, window(event_time, size)`) or a session table (`GROUP BY keys,
    session_window(event_time, gap)`) of a stream, as declared: its rows are written once the stream's watermark
    passes a window's end or a session's gap after its last event, and are final then (pipelines/event_time/windows.py,
    pipelines/event_time/sessions.py)."""

    name: str
    stream: str
    kind: EventTimeKind
    keys: tuple[str, ...]
    aggregates: tuple[Aggregate, ...]
    size: timedelta  # the window's size, or the session's gap
    columns: tuple[OutputColumn, ...]
    event_time_field: str
    fields: tuple[FieldRule, ...] = ()
    sql: str = ""
    line: int = 0
    ttl: timedelta | None = None  # sessions: a key idle this long forgets its previous session and day totals
    tops: tuple[TopSpec, ...] = ()  # windows: the top-N tables ranking its windows
    where: str | None = None  # the declared WHERE over the stream's fields, as Spark SQL: the events it keeps

    def field(self, name: str) -> FieldRule:
        return next(f for f in self.fields if f.name == name)

    def column(self, role: str) -> str | None:
        """The name of the first column of this role (`start`, `end`), if declared."""
        return next((c.name for c in self.columns if c.role == role), None)

    @property
    def state_table(self) -> str:
        """Its operator state: the open windows or sessions (and a session table's per-key values)."""
        return f"{self.name}_state"


@dataclass(frozen=True)
class StreamSpec:
    name: str
    id_field: str
    event_time_field: str
    fields: tuple[FieldRule, ...]
    state_tables: tuple[StateTableSpec, ...] = ()
    dedup_horizon: timedelta = timedelta(days=7)
    max_ahead: timedelta = timedelta(days=1)  # how far after its ingestion an event's time may lie
    watermark_delay: timedelta = timedelta(minutes=10)  # the windowed and session tables' watermark lag
    event_time_tables: tuple[EventTimeTableSpec, ...] = ()
    line: int = 0  # where the project file declares it
    topic: KafkaTopic | None = None  # read from this topic (pipelines/ingest/kafka_source.py); None: the landing folder

    @property
    def bronze_table(self) -> str:
        return f"{self.name}_bronze"

    @property
    def quarantine_table(self) -> str:
        return f"{self.name}_quarantine"

    @property
    def files_table(self) -> str:
        """The ledger of landing content (pipelines/ingest/landing.py)."""
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
