"""What the windowed and session tables share: the watermark, late_events, their output columns, their once-only
writes, and the progress record their closing commits carry.

Each declared windowed or session table (pipelines/declare/sql.py) is its own step of its stream's micro-batch
(pipelines/event_time/windows.py, pipelines/event_time/sessions.py). A step folds the bronze rows added after the version its last
closing commit recorded, from its operator state as that commit left it (`<table>_state`, a Delta table any
reader can query, read by time travel), and writes: its late events (late_events, naming the table), what else
it owns (a windowed table's top N), its new state, then closes with a commit to the table itself carrying the
rows the watermark has closed and the progress (`Progress`: the watermark, the bronze version folded, the state
version). A batch replayed after its closing commit finds nothing to fold; the rows of a batch that died before
its closing commit are undone when the stream starts (`undo_late_rows`, the top N restored), and its bronze rows
folded again.

The watermark is Spark's rule, kept by hand, per table: the newest event of the earlier batches minus the
stream's `watermark_delay_minutes`. An event at or behind it is late: it goes to late_events (with the
watermark it missed) and still counts in the stream's state tables.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import LongType, StringType, StructField, StructType, TimestampType

from pipelines.declare.aggregates import kind_of, partial_fields
from pipelines.declare.specs import FIELD_TYPES, LATE_EVENTS, EventTimeTableSpec, OutputColumn, StreamSpec, TopSpec
from pipelines.errors import DefinitionChangedError
from pipelines.faults import fault_point
from pipelines.state.tables import DEFINITION_PROPERTY
from pipelines.storage import delta_sql
from pipelines.storage.delta_log import (
    BronzeRows, NewTable, commits_since, create_tables_if_missing, history_rows, newest_commit_with, retry_on_conflict,
    rows_written_by, table_properties, table_version,
)
from pipelines.storage.frames import frame_of_rows, kept
from pipelines.storage.layout import StorageLayout

LATE = LATE_EVENTS
LATE_SCHEMA = StructType([
    StructField("stream", StringType(), nullable=False),
    StructField("table_name", StringType(), nullable=False),  # the windowed or session table it was late for
    StructField("event_id", StringType(), nullable=False),
    StructField("event_time", TimestampType(), nullable=False),
    StructField("watermark", TimestampType(), nullable=False),
    StructField("late_by_ms", LongType(), nullable=False),
    StructField("source_file", StringType()),
    StructField("line_number", LongType()),
])
# Commits searched for a step's unfinished late_events write: every step appends to the table.
_UNDO_WINDOW = 50
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)


def micros(ts: dt.datetime) -> int:
    """Epoch microseconds of a timestamp from Spark (naive datetimes are in the session zone, UTC here)."""
    if ts.tzinfo is None:
        ts = ts.replace(tzinfo=dt.timezone.utc)
    return (ts - _EPOCH) // dt.timedelta(microseconds=1)


def output_schema(table: EventTimeTableSpec) -> StructType:
    """The declared columns, typed as Spark's query would type them."""
    field = {f.name: f for f in table.fields}
    aggregates = {a.name: a for a in table.aggregates}
    columns = []
    for c in table.columns:
        if c.role == "key":
            columns.append(StructField(c.name, FIELD_TYPES[field[c.name].kind], nullable=not field[c.name].required))
        elif c.role in ("start", "end"):
            columns.append(StructField(c.name, TimestampType(), nullable=False))
        else:
            a = aggregates[c.of]
            kind = kind_of(a)
            columns.append(StructField(c.name, kind.final_type(a, field),
                                       nullable=c.role == "previous" or not kind.never_null(a, field)))
    return StructType(columns)


def declared_columns(table: EventTimeTableSpec, start: Column, end: Column,
                     value_of: Callable[[OutputColumn], Column]) -> list[Column]:
    """The table's columns in the declared order, typed as `output_schema`: keys as they are, the window's or
    session's bounds as given, every other column by `value_of`."""
    typed = {f.name: f.dataType for f in output_schema(table)}
    bounds = {"start": start, "end": end}
    return [(F.col(c.name) if c.role == "key" else bounds[c.role] if c.role in bounds else value_of(c))
            .cast(typed[c.name]).alias(c.name) for c in table.columns]


def partial_schema(table: EventTimeTableSpec) -> list[StructField]:
    """The aggregates' partial columns as operator state holds them."""
    field = {f.name: f for f in table.fields}
    return [StructField(f.name, f.dataType) for f in partial_fields(table.aggregates, field)]


def top_schema(top: TopSpec, source: EventTimeTableSpec) -> StructType:
    fields = {f.name: f for f in output_schema(source)}
    return StructType([StructField(c, LongType(), nullable=False) if c == top.rank_column else fields[c]
                       for c in top.columns])


def definition_of(table: EventTimeTableSpec | TopSpec, delay: dt.timedelta) -> str:
    """What decides the table's rows: its keys, aggregates, columns, size or gap, TTL and the stream's watermark
    delay (or a top N's order and N), not its name or its SQL's spelling."""
    if isinstance(table, TopSpec):
        text = json.dumps({"source": table.source, "n": table.n, "order": table.order, "columns": table.columns})
    else:
        text = json.dumps({"stream": table.stream, "kind": table.kind, "keys": table.keys,
                           "aggregates": [[a.name, a.function, a.column, a.by, a.n] for a in table.aggregates],
                           "columns": [[c.name, c.role, c.of] for c in table.columns],
                           "size_s": table.size.total_seconds(), "delay_s": delay.total_seconds(),
                           "ttl_s": table.ttl.total_seconds() if table.ttl else None,
                           **({"where": table.where} if table.where else {})})
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def append_batch(frame: DataFrame, path: Path | str, metadata: dict) -> None:
    """Append a batch's rows, the commit carrying `metadata`. A replay appends nothing twice: the step's closing
    commit records the bronze version folded, and the writes of a batch that died before it are undone when the
    stream starts (the module's doc)."""
    frame.write.format("delta").mode("append").option("userMetadata", json.dumps(metadata)).save(str(path))


def append_late(frame: DataFrame, layout: StorageLayout, marker: dict) -> int:
    """Append a batch's late events; `marker` names the step that found them (late_events has a writer per windowed
    or session table: `undo_late_rows` tells them apart by it). Returns how many it appended, from its commit's
    metrics: no count of its own."""
    path = layout.table(LATE)
    append_batch(frame, path, marker)
    written = rows_written_by(frame.sparkSession, path, marker, _UNDO_WINDOW)
    # None: a commit buried under as many of other writers' since; counted instead.
    return frame.count() if written is None else written


def read_state(spark: SparkSession, path: Path, version: int | None, schema: StructType) -> DataFrame:
    """An operator-state table as a batch left it: the version its closing commit recorded, by time travel, so a
    replayed batch never reads what it had half written itself. None: no batch yet, no state."""
    if version is None:
        return frame_of_rows(spark, [], schema)
    return spark.read.format("delta").option("versionAsOf", version).load(str(path))


def write_state(frame: DataFrame, path: Path, metadata: dict) -> int:
    """Replace an operator-state table, the commit carrying `metadata`; returns the version holding this batch's
    state (each state table has one writer, its step). Replaced whole: the state holds what is still open (windows,
    sessions) or a key's last values. A version no closing commit records is never read (`read_state`). The
    metadata is passed as the writer's option, as every event-time commit's is: a state table's MERGE in another
    thread sets it as a session conf meanwhile (`micro_batch.StreamBatch.fold`), which an option overrides."""
    frame.write.format("delta").mode("overwrite").option("userMetadata", json.dumps(metadata)).save(str(path))
    return table_version(frame.sparkSession, path)


def state_table_figures(spark: SparkSession, path: Path) -> dict:
    """Rows and bytes of an operator-state table (`write_state` replaces it whole). When its newest commit is such
    a replacement, its metrics are the table's figures, read from the log's commit file (`history_rows`): two Spark
    jobs fewer per table and run. Otherwise (a first, empty version), asked of Spark."""
    newest = history_rows(spark, path, 1)
    if newest and newest[0]["operation"] == "WRITE" and newest[0]["operationParameters"].get("mode") == "Overwrite":
        metrics = newest[0]["operationMetrics"]
        if "numOutputRows" in metrics and "numOutputBytes" in metrics:
            return {"rows": int(metrics["numOutputRows"]), "bytes": int(metrics["numOutputBytes"])}
    return {"rows": spark.read.format("delta").load(str(path)).count(),
            "bytes": int(delta_sql.detail(spark, path)["sizeInBytes"] or 0)}


def kept_events(table: EventTimeTableSpec, events: DataFrame) -> DataFrame:
    """The events the table's WHERE keeps (all without one): the others are neither counted nor late for it."""
    return events.where(F.expr(table.where)) if table.where else events


def newest_of_stream(table: EventTimeTableSpec, events: DataFrame, watermark_ms: int,
                     newest_kept_ms: Callable[[], int | None], newest_known_ms: int | None = None) -> int | None:
    """The newest on-time event of the batch, in ms: the watermark is the stream's, as Spark's is set on the stream
    before any filter, so with a WHERE the events it drops move it too (one more job, for such tables only).

    `newest_known_ms`, the newest of all the batch's events, stands for it when given (no job): an event behind the
    watermark is older than the watermark, and so moves it no more than the on-time ones. `newest_kept_ms` asks
    Spark for the newest the table kept: what it held open before the batch is never a delay past the watermark."""
    if newest_known_ms is not None:
        return newest_known_ms
    if not table.where:
        return newest_kept_ms()
    found = (events.where(~behind_watermark(table, watermark_ms))
             .agg(F.max(F.unix_millis(table.event_time_field))).first()[0])
    return max((m for m in (found, newest_kept_ms()) if m is not None), default=None)


def behind_watermark(table: EventTimeTableSpec, watermark_ms: int) -> Column:
    """Late: at or behind the watermark (Spark's rule for the rows its stateful operators drop)."""
    return F.unix_micros(F.col(table.event_time_field)) <= F.lit(watermark_ms * 1000)


def late_rows(table: EventTimeTableSpec, spec: StreamSpec, late: DataFrame, watermark_ms: int) -> DataFrame:
    """Bronze rows behind the watermark as rows of late_events."""
    at = F.col(table.event_time_field)
    return late.select(
        F.lit(spec.name).alias("stream"), F.lit(table.name).alias("table_name"), F.col(spec.id_field).alias("event_id"),
        at.alias("event_time"), F.timestamp_millis(F.lit(watermark_ms)).alias("watermark"),
        (F.lit(watermark_ms) - F.unix_millis(at)).alias("late_by_ms"), "source_file", "line_number")


def closed_and_late(closed: DataFrame, late: DataFrame) -> tuple[int, int]:
    """How many rows a batch closes and how many of its events are late, in one Spark query (as two counts they
    were two queries, each planned and run on its own)."""
    sides = closed.select(F.lit(1).alias("_closed")).unionByName(late.select(F.lit(0).alias("_closed")))
    found = sides.agg(F.sum("_closed").alias("closed"), F.count("*").alias("rows")).first()
    closed_rows = int(found["closed"] or 0)
    return closed_rows, int(found["rows"]) - closed_rows


def next_watermark(watermark_ms: int, newest_ms: int | None, delay: dt.timedelta) -> int:
    """The newest on-time event minus the delay, never back. A late event is at or behind the watermark, so it
    could not move it."""
    if newest_ms is None:
        return watermark_ms
    return max(watermark_ms, newest_ms - delay // dt.timedelta(milliseconds=1))


def undo_late_rows(spark: SparkSession, layout: StorageLayout, table: str, marker: str,
                   closing_version: int) -> list[str]:
    """Delete the late_events rows for `table` that commits marked `marker` > `closing_version` added: a batch
    that wrote them and died before its closing commit. The rows are deleted, not the table restored, because the
    other steps append to it too."""
    path = layout.table(LATE)
    latest = table_version(spark, path)
    if latest is None:
        return []
    unfinished = [c["version"] for c in commits_since(spark, path, max(-1, latest - _UNDO_WINDOW))
                  if int(c["user"].get(marker, -1)) > closing_version]
    if not unfinished:
        return []

    def rows_at(version: int) -> DataFrame:
        return (spark.read.format("delta").option("versionAsOf", version).load(str(path))
                .where(F.col("table_name") == table).select("event_id"))
    added = rows_at(unfinished[0]).subtract(rows_at(unfinished[0] - 1))
    for version in unfinished[1:]:
        added = added.union(rows_at(version).subtract(rows_at(version - 1)))
    added = kept(added)
    count = added.count()
    # The table's name travels as a column of the source, not as SQL text.
    doomed = added.withColumn("table_name", F.lit(table))
    retry_on_conflict(lambda: delta_sql.merge(
        spark, path, doomed, on="t.table_name = s.table_name AND t.event_id = s.event_id",
        clauses="WHEN MATCHED THEN DELETE"), f"undo {LATE} rows of {table}")
    return [f"{LATE}: {count} rows for {table} of unfinished version(s) {unfinished} deleted"]


@dataclass(frozen=True)
class Progress:
    """What a step had reached at its last committed batch (recorded in each closing commit)."""

    watermark_ms: int
    bronze_version: int  # every bronze version up to this one was read
    state_version: int | None  # the version of the step's operator state this batch left (None: no batch yet)
    app_id: str | None = None
    batch_id: int | None = None


NO_PROGRESS = Progress(watermark_ms=0, bronze_version=-1, state_version=None)


def last_progress(spark: SparkSession, table: EventTimeTableSpec, layout: StorageLayout) -> Progress | None:
    """The progress of the newest batch committed to the table; None when no batch has closed. A table written
    by an earlier statetables (its progress names no `<table>_state` version) is refused, naming the refresh."""
    found = newest_commit_with(spark, layout.table(table.name), "watermark_ms", 10)
    if found is None:
        return None
    version, user = found
    state = (user.get("state_versions") or {}).get(table.state_table)
    if state is None or user.get("bronze_version") is None:
        raise DefinitionChangedError(
            f"{table.name} version {version} was written by an earlier statetables, whose operator state this one "
            f"does not read. Fix: `statetables refresh {table.name}` rebuilds it from bronze in one commit.")
    return Progress(int(user["watermark_ms"]), int(user["bronze_version"]), int(state), user.get("app_id"),
                    int(user["batch_id"]) if user.get("batch_id") is not None else None)


@dataclass(frozen=True)
class FoldedBatch:
    """What a batch wrote before its closing commit, and what that commit carries."""

    closed: DataFrame  # the rows of the table: the windows or sessions the watermark closed
    state_version: int  # the operator-state version the batch left
    watermark_ms: int  # the watermark after the batch
    figures: dict  # counts for the commit's metadata (and Dagster's)


class EventTimeStage:
    """The step of one windowed or session table in its stream's micro-batch (windows.py, sessions.py). It folds
    the bronze rows added after the version its last closing commit recorded, writes what it emits
    (`fold_and_write`), then closes with a commit to the table that records the progress. Holds that progress, so
    a batch reads no table history; a batch with no new bronze rows costs nothing."""

    before_closing_fault: str  # the fault point before the closing commit

    def __init__(self, layout: StorageLayout, spec: StreamSpec, table: EventTimeTableSpec, last: Progress):
        self.layout, self.spec, self.table, self.last = layout, spec, table, last
        # Set when the stream starts: what it undid of a batch that died before this step closed.
        self.recovered: dict | None = None
        # Set during a large batch: the operator state read and kept while the batch ingests (`read_state_ahead`).
        self.state_ahead: Future | None = None

    def operator_state_schema(self) -> StructType:
        """The schema of the step's operator state."""
        raise NotImplementedError

    def read_state_ahead(self, spark: SparkSession) -> tuple[int | None, DataFrame | None]:
        """The operator state the next fold starts from, kept, with its version (None: no batch yet, nothing to
        read): read beside the batch's ingest, whose driver leaves the cores idle between its jobs, so that the
        fold does not read and plan it after."""
        version = self.last.state_version
        if version is None:
            return None, None
        return version, kept(read_state(spark, self.layout.table(self.table.state_table), version,
                                        self.operator_state_schema()))

    def state_before(self, spark: SparkSession) -> DataFrame:
        """The operator state as the last closing commit left it (`read_state`): the frame read ahead when it holds
        that version (another copy of the step may have closed since: `advance`)."""
        ahead, self.state_ahead = self.state_ahead, None
        if ahead is not None:
            version, frame = ahead.result()
            if frame is not None and version == self.last.state_version:
                return frame
        return read_state(spark, self.layout.table(self.table.state_table), self.last.state_version,
                          self.operator_state_schema())

    @property
    def marker(self) -> str:
        """The key under which a batch's earlier commits name its closing commit's version."""
        return f"{self.table.name}_version"

    def fold_and_write(self, rows: DataFrame, newest_ms: int | None, app_id: str, batch_id: int, marker: dict,
                       late_possible: bool = True) -> FoldedBatch:
        """Fold `rows` (their newest event time `newest_ms` when known: `BronzeRows.newest_ms`) and write what the
        batch emits before its closing commit. Not `late_possible`: the rows' oldest event time is known to be
        after the watermark, so none is late."""
        raise NotImplementedError

    def advance(self, spark: SparkSession, bronze: BronzeRows, app_id: str, batch_id: int) -> None:
        """Fold bronze up to version `bronze.through`, each commit naming the batch (app id, batch id)."""
        through = bronze.through
        # Asked again at each batch: another copy of it may have closed since the run started (a killed run's
        # query that went on in a Spark Connect server, until the fence stopped it: docs/recovery.md).
        if (found := last_progress(spark, self.table, self.layout)) is not None \
                and found.bronze_version > self.last.bronze_version:
            self.last = found
        if through <= self.last.bronze_version:
            return
        rows = bronze.after(self.last.bronze_version)
        closing = self.layout.table(self.table.name)
        # The version this batch's closing commit will have: until it exists, its earlier writes are unfinished.
        marker = {"app_id": app_id, "batch_id": batch_id, self.marker: (table_version(spark, closing) or 0) + 1}
        oldest_ms = bronze.oldest_ms(self.last.bronze_version)
        folded = self.fold_and_write(rows, bronze.newest_ms(self.last.bronze_version), app_id, batch_id, marker,
                                     late_possible=oldest_ms is None or oldest_ms <= self.last.watermark_ms)
        progress = {"app_id": app_id, "batch_id": batch_id, "watermark_ms": folded.watermark_ms,
                    "bronze_version": through, "rows_read": bronze.count_after(self.last.bronze_version),
                    "state_versions": {self.table.state_table: folded.state_version}, **folded.figures}
        fault_point(self.before_closing_fault)
        append_batch(folded.closed, closing, progress)
        self.last = Progress(folded.watermark_ms, through, folded.state_version, app_id, batch_id)


def require_definition(spark: SparkSession, path: Path, table: EventTimeTableSpec | TopSpec,
                       delay: dt.timedelta) -> None:
    """Refuse to go on under another definition than the one the table's rows were written under (a window size,
    gap, watermark delay, key or aggregate changes which events are late and how rows are cut): old rows and new
    ones would disagree. A table with no rows yet takes the current definition."""
    wanted = definition_of(table, delay)
    found = table_properties(spark, path).get(DEFINITION_PROPERTY)
    if found == wanted:
        return
    if found is not None and (table_version(spark, path) or 0) > 0:
        name = table.source if isinstance(table, TopSpec) else table.name
        raise DefinitionChangedError(
            f"{table.name} holds rows of another definition than the project file's (line {table.line}: "
            f"{table.sql}); its window, gap, watermark, keys or aggregates changed. Fix: `statetables refresh "
            f"{name}` rebuilds it from bronze under the new definition, in one commit; or put the old SQL back.")
    delta_sql.set_property(spark, path, DEFINITION_PROPERTY, wanted)


def recorded_changes(layout: StorageLayout, spec: StreamSpec) -> list[str]:
    """The stream's windowed and session tables whose recorded definition is not the declared one (read from
    their logs without Spark, when the code location loads)."""
    from pipelines.state.tables import recorded_definition
    changed = []
    for table in spec.event_time_tables:
        for declared in (table, *table.tops):
            found = recorded_definition(layout.table(declared.name))
            if found is not None and found != definition_of(declared, spec.watermark_delay):
                changed.append(f"{declared.name} (line {declared.line}): its rows were written under another "
                               f"definition. Fix: `statetables refresh {table.name}` rebuilds it from bronze under "
                               f"the new one (or put the old SQL back)")
    return changed


def event_time_new_tables(layout: StorageLayout, spec: StreamSpec, table: EventTimeTableSpec,
                          state_schema: StructType) -> list[NewTable]:
    """The table, its operator state, its top N tables and late_events; the table and its top N record their
    definition at creation."""
    return [NewTable(layout.table(LATE), LATE_SCHEMA),
            NewTable(layout.table(table.name), output_schema(table),
                     properties={DEFINITION_PROPERTY: definition_of(table, spec.watermark_delay)}),
            # Operator state is read whole, so no statistics but the row count: they were a third of its write
            # (82k rows: 0.59 s, 0.39 s without).
            NewTable(layout.table(table.state_table), state_schema, change_data_feed=False,
                     properties={"delta.dataSkippingNumIndexedCols": "0"}),
            *(NewTable(layout.table(top.name), top_schema(top, table),
                       properties={DEFINITION_PROPERTY: definition_of(top, spec.watermark_delay)}) for top in table.tops)]


def ensure_tables(spark: SparkSession, layout: StorageLayout, spec: StreamSpec, table: EventTimeTableSpec,
                  state_schema: StructType) -> None:
    """`event_time_new_tables`, created if missing."""
    late = layout.table(LATE)
    if table_version(spark, late) is not None and \
            "table_name" not in spark.read.format("delta").load(str(late)).schema.fieldNames():
        # Written by an earlier statetables, before late events named their table: their rows keep NULL there.
        delta_sql.add_column(spark, late, "table_name", "STRING")
    create_tables_if_missing(spark, event_time_new_tables(layout, spec, table, state_schema))


def resume(spark: SparkSession, stage: EventTimeStage, undone: list[str]) -> EventTimeStage:
    """`stage` at the progress its table's last closing commit recorded (none yet: from the start), after the
    checks that its rows were written under the declared definition; `undone`: what the start undid of a batch
    that died before its closing commit."""
    stage.last = _resumed(spark, stage.layout, stage.spec, stage.table)
    if undone:
        stage.recovered = {"problem": f"a micro-batch died before its {stage.table.name} commit",
                           "action": "; ".join(undone) + "; its events folded again"}
    return stage


def _resumed(spark: SparkSession, layout: StorageLayout, spec: StreamSpec, table: EventTimeTableSpec
             ) -> Progress:
    require_definition(spark, layout.table(table.name), table, spec.watermark_delay)
    for top in table.tops:
        require_definition(spark, layout.table(top.name), top, spec.watermark_delay)
    last = last_progress(spark, table, layout)
    path = layout.table(table.name)
    # Commits without rows (a recorded definition) are no progress to lose; rows without progress are.
    if last is None and any(int(c["metrics"].get("numOutputRows", 0)) > 0 for c in commits_since(spark, path, 0)):
        raise DefinitionChangedError(
            f"{table.name} has commits but none records its progress (written by an earlier statetables, or by "
            f"hand). Fix: `statetables refresh {table.name}` rebuilds it from bronze in one commit.")
    return last or NO_PROGRESS


def rows_read(commits: list[dict]) -> int:
    """The bronze rows the batches of these closing commits read."""
    return sum(int(c["user"].get("rows_read", 0)) for c in commits)
