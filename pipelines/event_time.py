"""What the event-time steps share: the late_events table, their once-only appends, and the progress record
their closing commits carry.

Both event-time steps (windows.py in the sales stream, sessions.py in the payments stream) write late_events,
each under its own `stream` value, and each closes its part of a micro-batch with a commit to its own output
table, recording the watermark, the bronze version it has folded and its state tables' versions (`Progress`).
A batch replayed under the same app id is skipped table by table by Delta's txn ids; the rows of a batch that
died before its closing commit are undone when the stream starts (`undo_late_rows`), and folded again.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import LongType, StringType, StructField, StructType, TimestampType

from pipelines import delta_sql
from pipelines.faults import fault_point
from pipelines.errors import DefinitionChangedError
from pipelines.layout import StorageLayout
from pipelines.streaming import (
    BronzeRows, commits_since, history_rows, kept_on_disk, retry_on_conflict, table_version,
)

LATE = "late_events"
LATE_SCHEMA = StructType([
    StructField("stream", StringType(), nullable=False),
    StructField("event_id", StringType(), nullable=False),
    StructField("event_time", TimestampType(), nullable=False),
    StructField("watermark", TimestampType(), nullable=False),
    StructField("late_by_ms", LongType(), nullable=False),
    StructField("source_file", StringType()),
    StructField("line_number", LongType()),
])
# Commits searched for a query's unfinished late_events write: both queries append to the table.
_UNDO_WINDOW = 50
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)


def micros(ts: dt.datetime) -> int:
    """Epoch microseconds of a timestamp from Spark (naive datetimes are in the session zone, UTC here)."""
    if ts.tzinfo is None:
        ts = ts.replace(tzinfo=dt.timezone.utc)
    return (ts - _EPOCH) // dt.timedelta(microseconds=1)


def append_batch(frame: DataFrame, path: Path | str, app_id: str | None, batch_id: int,
                 metadata: dict | None = None) -> None:
    """Append once per (app id, batch): a replayed batch is skipped by Delta's txn ids."""
    writer = frame.write.format("delta").mode("append")
    if app_id is not None:
        writer = writer.option("txnAppId", app_id).option("txnVersion", batch_id)
    if metadata is not None:
        writer = writer.option("userMetadata", json.dumps(metadata))
    writer.save(str(path))


def read_state(spark: SparkSession, path: Path, version: int) -> DataFrame:
    """An operator-state table as a batch left it: the version its closing commit recorded, by time travel, so a
    replayed batch never reads what it had half written itself."""
    return spark.read.format("delta").option("versionAsOf", version).load(str(path))


def write_state(frame: DataFrame, path: Path, app_id: str, batch_id: int) -> int:
    """Replace an operator-state table once per (app id, batch); returns the version holding this batch's state.
    Each state table has one writer (its query), so after a replay that Delta skips, that version is the newest.
    Replaced whole: the state holds what is still open (hours, sessions) or active, not history."""
    (frame.write.format("delta").mode("overwrite").option("txnAppId", app_id).option("txnVersion", batch_id)
     .save(str(path)))
    return table_version(frame.sparkSession, path)


def state_table_figures(spark: SparkSession, path: Path) -> dict:
    """Rows and bytes of an operator-state table (`write_state` replaces it whole). When its newest commit is such
    a replacement, its metrics are the table's figures, read from the log's commit file (`history_rows`): two Spark
    jobs fewer per table and run, ~0.5 s over Connect. Otherwise (a first, empty version), asked of Spark."""
    newest = history_rows(spark, path, 1)
    if newest and newest[0]["operation"] == "WRITE" and newest[0]["operationParameters"].get("mode") == "Overwrite":
        metrics = newest[0]["operationMetrics"]
        if "numOutputRows" in metrics and "numOutputBytes" in metrics:
            return {"rows": int(metrics["numOutputRows"]), "bytes": int(metrics["numOutputBytes"])}
    return {"rows": spark.read.format("delta").load(str(path)).count(),
            "bytes": int(delta_sql.detail(spark, path)["sizeInBytes"] or 0)}


def late_rows(emitted: DataFrame, stream: str) -> DataFrame:
    """Operator rows of kind "late" as rows of late_events."""
    return emitted.where(F.col("kind") == "late").select(
        F.lit(stream).alias("stream"), "event_id", "event_time",
        F.timestamp_millis("watermark_ms").alias("watermark"),
        (F.col("watermark_ms") - F.unix_millis("event_time")).alias("late_by_ms"), "source_file", "line_number")


def undo_late_rows(spark: SparkSession, layout: StorageLayout, stream: str, marker: str, closing_version: int) -> list[str]:
    """Delete the late_events rows of `stream` that commits marked `marker` > `closing_version` added:
    a batch that wrote them and died before its closing commit. The rows are deleted, not the table
    restored, because the other event-time query appends to it too."""
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
                .where(F.col("stream") == stream).select("event_id"))
    added = rows_at(unfinished[0]).subtract(rows_at(unfinished[0] - 1))
    for version in unfinished[1:]:
        added = added.union(rows_at(version).subtract(rows_at(version - 1)))
    added = kept_on_disk(added)
    count = added.count()
    # The stream name travels as a column of the source, not as SQL text.
    doomed = added.withColumn("stream", F.lit(stream))
    retry_on_conflict(lambda: delta_sql.merge(spark, path, doomed, on="t.stream = s.stream AND t.event_id = s.event_id",
                                              clauses="WHEN MATCHED THEN DELETE"), f"undo {LATE} rows of {stream}")
    return [f"{LATE}: {count} {stream} rows of unfinished version(s) {unfinished} deleted"]


@dataclass(frozen=True)
class Progress:
    """What an event-time query had reached at its last committed batch (recorded in each commit)."""

    watermark_ms: int
    bronze_version: int  # every bronze version up to this one was read
    # The versions of the query's operator-state tables this batch left, by table (None: a commit of an
    # earlier statetables, whose state was in RocksDB), and which batch of which app id committed.
    state_versions: dict[str, int] | None = None
    app_id: str | None = None
    batch_id: int | None = None


def last_progress(spark: SparkSession, path: Path, tables: str) -> Progress | None:
    """The watermark and bronze version of the newest batch committed to the query's closing table."""
    for commit in reversed(commits_since(spark, path, max(-1, (table_version(spark, path) or 0) - 10))):
        user = commit["user"]
        if "watermark_ms" in user:
            if user.get("bronze_version") is None:
                raise RuntimeError(
                    f"{path.name} version {commit['version']}: its batch ended inside a bronze version, so the "
                    f"query cannot restart exactly after it. Fix: restore {tables} to an earlier savepoint "
                    f"(docs/recovery.md), then run again.")
            state = user.get("state_versions")
            return Progress(int(user["watermark_ms"]), int(user["bronze_version"]),
                            {k: int(v) for k, v in state.items()} if state else None, user.get("app_id"),
                            int(user["batch_id"]) if user.get("batch_id") is not None else None)
    return None


@dataclass(frozen=True)
class FoldedBatch:
    """What a batch wrote before its closing commit, and what that commit carries."""

    closed: DataFrame  # the rows of the closing table: what the batch closed (hours, sessions)
    state_versions: dict[str, int]  # the operator-state tables' versions the batch left
    watermark_ms: int  # the watermark after the batch
    figures: dict  # counts for the commit's metadata (and Dagster's)


class EventTimeStage:
    """The event-time step of a stream's micro-batch (windows.py, sessions.py). It folds the bronze rows added
    after the version its last closing commit recorded, from the state versions that commit recorded, writes
    what it emits (`fold_and_write`), then closes with a commit to the closing table that records the progress.
    Holds that progress, so a batch reads no table history; a batch with no new bronze rows costs nothing."""

    closing_table: str  # the table whose commit closes a batch
    closing_marker: str  # the key under which the batch's earlier commits name its closing commit's version
    before_closing_fault: str

    def __init__(self, layout: StorageLayout, last: Progress):
        self.layout, self.last = layout, last
        # Set when the stream starts: what it undid of a batch that died before this step closed, or why it built
        # its state from the tables.
        self.recovered: dict | None = None

    def fold_and_write(self, rows: DataFrame, app_id: str, batch_id: int, marker: dict) -> FoldedBatch:
        raise NotImplementedError

    def advance(self, spark: SparkSession, bronze: BronzeRows, app_id: str, batch_id: int) -> None:
        """Fold bronze up to version `bronze.through`, writing under the txn id (app id, batch id)."""
        through = bronze.through
        if through <= self.last.bronze_version:
            return
        rows = bronze.after(self.last.bronze_version)
        closing = self.layout.table(self.closing_table)
        # The version this batch's closing commit will have: until it exists, its earlier writes are unfinished.
        marker = {"app_id": app_id, "batch_id": batch_id,
                  self.closing_marker: (table_version(spark, closing) or 0) + 1}
        folded = self.fold_and_write(rows, app_id, batch_id, marker)
        progress = {"app_id": app_id, "batch_id": batch_id, "watermark_ms": folded.watermark_ms,
                    "bronze_version": through,
                    "rows_read": bronze.count_after(self.last.bronze_version),
                    "state_versions": folded.state_versions, **folded.figures}
        fault_point(self.before_closing_fault)
        append_batch(folded.closed, closing, app_id, batch_id, progress)
        self.last = Progress(folded.watermark_ms, through, folded.state_versions, app_id, batch_id)


SETTINGS_PROPERTY = "statetables.eventTimeSettings"  # what the step's rows were written under


def require_settings(spark: SparkSession, closing_table: Path, settings: str, option: str) -> None:
    """Refuse to go on under other settings than those the step's rows were written under (a watermark delay or a
    gap changes which events are late and how rows are cut): old rows and new ones would disagree. A new table
    gets the record before its first batch (later, the commit would shift the versions its batches record)."""
    found = delta_sql.properties(spark, closing_table).get(SETTINGS_PROPERTY)
    if found is None:
        if table_version(spark, closing_table) == 0:
            delta_sql.set_property(spark, closing_table, SETTINGS_PROPERTY, settings)
    elif found != settings:
        raise DefinitionChangedError(
            f"{closing_table.name} was written under {found}, the project file now says {settings}: rows already "
            f"written would follow other rules than new ones. Fix: put the old values back under `{option}:` in the "
            f"project file (a refresh of the {option} under new settings is not built).")


def resumed_stage(stage_of: Callable[[Progress], EventTimeStage], last: Progress | None,
                  first_state: Callable[[Progress | None], Progress], undone: list[str], *, kept: str,
                  events: str) -> EventTimeStage:
    """An event-time step as its last closing commit left it. Tables with no progress yet, or whose progress
    records no state versions (an earlier statetables kept `kept` in RocksDB), get their first state from
    `first_state`; `undone` says what the start undid of a batch that died before its closing commit."""
    legacy = last is not None and last.state_versions is None
    if last is None or legacy:
        last = first_state(last)
    stage = stage_of(last)
    if legacy:
        stage.recovered = {"problem": f"{stage.closing_table} was written by an earlier statetables, which kept "
                                      f"{kept} in RocksDB", "action": f"{kept} built once from the tables"}
    elif undone:
        stage.recovered = {"problem": f"a micro-batch died before its {stage.closing_table} commit",
                           "action": "; ".join(undone) + f"; its {events} folded again"}
    return stage


def rows_read(commits: list[dict]) -> int:
    """The bronze rows the batches of these closing commits read (what EventTimeBatches records)."""
    return sum(int(c["user"].get("rows_read", 0)) for c in commits)
