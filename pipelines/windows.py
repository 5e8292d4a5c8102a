"""Movie ticket sales in one-hour event-time windows: closed windows, the top 10 per hour, late events.

Operator state is a Delta table, `tickets_per_title_open_hours`: one row per (title, hour) still counting,
so any reader can query the hour in progress, and nothing depends on the number of partitions. One
streaming query reads `movie_ticket_sales_bronze`; each micro-batch is folded by `fold_windows`, a plain
function from (open hours before, the batch's sales, the watermark) to (open hours after, closed hours, late
sales, the next watermark). It is DataFrame work in the JVM: no Python runs per event, key or state call
(the transformWithState operator this replaces made a Python<->JVM round trip per state call: 188 s per
1M sales, 32x the all-time MERGE step).

The watermark is Spark's rule, kept by hand: the newest sale of the earlier batches minus the delay,
recorded with each batch's closing commit. A sale at or behind it is late: it goes to `late_events` (with the
watermark it missed) and still counts in movie_tickets_sold. An hour closes once the watermark reaches its
end (the timer firing); it closes in the batch whose sales move the watermark there, and its row is final.
The hours a batch closes are ranked in the same batch (`top_titles_hourly`).

Exactly once: every write of a batch is computed from the state as the previous batch left it (the open-hours
version its closing commit recorded, read by time travel), never from what this batch has half written.
The writes carry the query's (app id, batch id) as Delta's txn id, so a replay after a crash between any two
of them writes exactly what the uninterrupted batch would have: late_events, top_titles_hourly, the open
hours (an overwrite: they are few), and last `tickets_per_title_hourly`, the closing commit with the progress.
A lost checkpoint needs no rebuild: the query starts again after the last closing commit, under a new app id,
after undoing the rows an unfinished batch had added (`_undo_unfinished_batch`).
"""

from __future__ import annotations

import datetime as dt
import time
from dataclasses import dataclass
from pathlib import Path

from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F
from pyspark.sql.types import LongType, StringType, StructField, StructType, TimestampType

from pipelines import delta_sql, event_time
from pipelines.bronze import ensure_bronze_tables
from pipelines.checkpoints import checkpoint_for_run, new_app_id, set_aside, start_checkpoint
from pipelines.event_time import (
    LATE, LATE_SCHEMA, EventTimeBatches, FoldedBatch, Progress, append_batch, read_state, undo_late_rows, write_state,
)
from pipelines.faults import (
    WINDOWS_AFTER_LATE_COMMIT, WINDOWS_AFTER_OPEN_HOURS_COMMIT, WINDOWS_AFTER_TOP_COMMIT,
    WINDOWS_BEFORE_CLOSING_COMMIT, fault_point,
)
from pipelines.layout import StorageLayout
from pipelines.state import TOTAL_TYPE
from pipelines.streaming import (
    Continuous, StreamRunResult, TableVersions, commits_since, create_table_if_missing, require_writable, run_query,
    source_ready, storage_errors, table_id, table_version, writer_lock,
)
from pipelines.streams import MOVIE_TICKET_SALES

HOURLY = "tickets_per_title_hourly"
TOP = "top_titles_hourly"
OPEN_HOURS = "tickets_per_title_open_hours"
WINDOWS_QUERY = f"{HOURLY}_windows"
DEFAULT_WATERMARK_DELAY = dt.timedelta(minutes=10)
TOP_N = 10
HOUR_MS = 3_600_000

HOURLY_SCHEMA = StructType([
    StructField("title", StringType(), nullable=False),
    StructField("window_start", TimestampType(), nullable=False),
    StructField("window_end", TimestampType(), nullable=False),
    StructField("tickets_sold", LongType(), nullable=False),
    StructField("total_ticket_value", TOTAL_TYPE, nullable=False),
])
OPEN_HOURS_SCHEMA = HOURLY_SCHEMA  # an open hour is a row of tickets_per_title_hourly still counting
TOP_SCHEMA = StructType([
    StructField("window_start", TimestampType(), nullable=False),
    StructField("window_end", TimestampType(), nullable=False),
    StructField("rank", LongType(), nullable=False),
    StructField("title", StringType(), nullable=False),
    StructField("tickets_sold", LongType(), nullable=False),
])


def hour_of(moment: Column) -> Column:
    """The UTC hour a timestamp falls in, by arithmetic on epoch ms: no session time zone can move it."""
    ms = F.unix_millis(moment)
    return F.timestamp_millis(ms - F.pmod(ms, F.lit(HOUR_MS)))


@dataclass(frozen=True)
class WindowsFold:
    """What one batch does to the windows: the state after it and what it emits."""

    open_hours: DataFrame  # rows of tickets_per_title_open_hours after the batch
    closed: DataFrame  # rows of tickets_per_title_hourly: the hours the new watermark has passed
    late: DataFrame  # rows of late_events
    watermark_ms: int  # the watermark after the batch: the next batch's, and the one that closed `closed`


def fold_windows(open_hours: DataFrame, sales: DataFrame, watermark_ms: int, delay: dt.timedelta) -> WindowsFold:
    """(open hours before, a batch of bronze sales, the watermark before) -> the state after and the outputs.

    A sale at or behind the watermark is late (Spark's rule for the rows its stateful operators drop); the
    others add to their (title, hour). The watermark then moves to the batch's newest sale minus the delay
    (never back), and every hour whose end it has reached is closed. One pass over the batch for the on-time
    sales (kept, small: per title and hour); the late ones are read again when written."""
    spec = MOVIE_TICKET_SALES
    at = F.col(spec.event_time_field)
    behind = F.unix_micros(at) <= F.lit(watermark_ms * 1000)
    late = sales.where(behind).select(
        F.lit(spec.name).alias("stream"), F.col(spec.id_field).alias("event_id"), at.alias("event_time"),
        F.timestamp_millis(F.lit(watermark_ms)).alias("watermark"),
        (F.lit(watermark_ms) - F.unix_millis(at)).alias("late_by_ms"), "source_file", "line_number")
    # One pass over the batch, kept: what it adds per (title, hour), and its newest on-time sale. A late sale
    # is at or behind the watermark, so it could not move it: the newest on-time sale is the newest that counts.
    on_time = (sales.where(~behind).groupBy("title", hour_of(at).alias("window_start"))
               .agg(F.count("*").alias("tickets_sold"), F.sum(spec.value_field).alias("total_ticket_value"),
                    F.max(F.unix_millis(at)).alias("_newest"))
               .localCheckpoint())
    newest = on_time.agg(F.max("_newest")).first()[0]
    after = watermark_ms if newest is None else max(watermark_ms, newest - delay // dt.timedelta(milliseconds=1))
    counted = (open_hours.select("title", "window_start", "tickets_sold", "total_ticket_value")
               .unionByName(on_time.drop("_newest"))
               .groupBy("title", "window_start")
               .agg(F.sum("tickets_sold").cast(LongType()).alias("tickets_sold"),
                    F.sum("total_ticket_value").cast(TOTAL_TYPE).alias("total_ticket_value"))
               .withColumn("window_end", F.timestamp_millis(F.unix_millis("window_start") + HOUR_MS))
               .select(*HOURLY_SCHEMA.fieldNames()))
    passed = F.unix_millis("window_end") <= F.lit(after)
    return WindowsFold(open_hours=counted.where(~passed), closed=counted.where(passed), late=late, watermark_ms=after)


def top_titles(hourly: DataFrame) -> DataFrame:
    """The TOP_N titles of every hour in `hourly`; ties broken by tickets, then value, then title."""
    by_rank = Window.partitionBy("window_start").orderBy(
        F.col("tickets_sold").desc(), F.col("total_ticket_value").desc(), F.col("title").asc())
    return (hourly.withColumn("rank", F.row_number().over(by_rank).cast(LongType()))
            .where(F.col("rank") <= TOP_N).select(*TOP_SCHEMA.fieldNames()))


def _undo_unfinished_batch(spark: SparkSession, layout: StorageLayout) -> list[str]:
    """Undo what a batch wrote to late_events and top_titles_hourly before it died without its
    tickets_per_title_hourly commit. Only a restart (checkpoint lost) needs this: it writes the batch
    again under a new app id, which Delta's txn ids cannot match. This query is top_titles_hourly's only
    writer, so that table is restored; late_events is shared (`undo_late_rows`). The open hours need
    nothing: the next batch reads the version the last closing commit recorded."""
    hourly_version = table_version(spark, layout.table(HOURLY)) or 0
    undone = undo_late_rows(spark, layout, MOVIE_TICKET_SALES.name, "hourly_version", hourly_version)
    path = layout.table(TOP)
    latest = table_version(spark, path) or 0
    unfinished = [c["version"] for c in commits_since(spark, path, max(-1, latest - 5))
                  if int(c["user"].get("hourly_version", -1)) > hourly_version]
    if unfinished:
        delta_sql.restore(spark, path, min(unfinished) - 1)
        undone.append(f"{TOP} restored to version {min(unfinished) - 1}")
    return undone


class WindowsBatches(EventTimeBatches):
    """The windows query's foreachBatch body: late sales, the closed hours ranked, the open hours, then the
    closed hours as the closing commit."""

    closing_table, closing_marker, before_closing_fault = HOURLY, "hourly_version", WINDOWS_BEFORE_CLOSING_COMMIT

    def __init__(self, layout: StorageLayout, checkpoint: Path, app_id: str, last: Progress, delay: dt.timedelta):
        super().__init__(layout, checkpoint, app_id, last)
        self.delay = delay

    def fold_and_write(self, batch: DataFrame, batch_id: int, marker: dict) -> FoldedBatch:
        spark, layout, spec = batch.sparkSession, self.layout, MOVIE_TICKET_SALES
        sales = batch.select("title", spec.event_time_field, spec.value_field, spec.id_field, "source_file",
                             "line_number")
        before = read_state(spark, layout.table(OPEN_HOURS), self.last.state_versions[OPEN_HOURS])
        fold = fold_windows(before, sales, self.last.watermark_ms, self.delay)
        closed = fold.closed.localCheckpoint()  # ranked, written and counted
        windows_closed, late_count = closed.count(), fold.late.count()
        if late_count:
            append_batch(fold.late, layout.table(LATE), self.app_id, batch_id, marker)
        fault_point(WINDOWS_AFTER_LATE_COMMIT)
        if windows_closed:
            append_batch(top_titles(closed), layout.table(TOP), self.app_id, batch_id, marker)
        fault_point(WINDOWS_AFTER_TOP_COMMIT)
        versions = {OPEN_HOURS: write_state(fold.open_hours, layout.table(OPEN_HOURS), self.app_id, batch_id)}
        fault_point(WINDOWS_AFTER_OPEN_HOURS_COMMIT)
        return FoldedBatch(closed, versions, fold.watermark_ms,
                           {"windows_closed": windows_closed, "late_events": late_count})


def ensure_window_tables(spark: SparkSession, layout: StorageLayout) -> None:
    for name, schema in ((HOURLY, HOURLY_SCHEMA), (TOP, TOP_SCHEMA), (LATE, LATE_SCHEMA),
                         (OPEN_HOURS, OPEN_HOURS_SCHEMA)):
        create_table_if_missing(spark, layout.table(name), schema)


def last_progress(spark: SparkSession, layout: StorageLayout) -> Progress | None:
    """The watermark, bronze version and open-hours version of the newest batch committed to `tickets_per_title_hourly`."""
    return event_time.last_progress(spark, layout.table(HOURLY), f"{HOURLY}, {TOP} and {LATE}")


def _open_hours_from_bronze(spark: SparkSession, layout: StorageLayout, last: Progress,
                            delay: dt.timedelta) -> WindowsFold:
    """Tables of an earlier statetables, which kept the open hours in RocksDB: the hours open at the last
    committed batch, built once from bronze (up to its version, minus late sales), then folded with no sales
    at the watermark the next batch would have had (the newest sale read minus the delay), as that batch would."""
    spec = MOVIE_TICKET_SALES
    empty_hours = spark.createDataFrame([], OPEN_HOURS_SCHEMA)
    sales = (spark.read.format("delta").option("versionAsOf", last.bronze_version)
             .load(str(layout.table(spec.bronze_table))))
    late = spark.read.format("delta").load(str(layout.table(LATE))).where(F.col("stream") == spec.name)
    on_time = sales.join(late.select(F.col("event_id").alias(spec.id_field)), spec.id_field, "left_anti")
    # Every hour of every on-time sale (watermark 0 and no delay bound: nothing late, nothing closes) ...
    every_hour = fold_windows(empty_hours, on_time, 0, dt.timedelta(days=366_000)).open_hours
    still_open = every_hour.where(F.unix_millis("window_end") > F.lit(last.watermark_ms))
    newest = sales.agg(F.max(F.unix_millis(spec.event_time_field))).first()[0] or 0
    # ... of which those the next watermark passes close now.
    return fold_windows(still_open.localCheckpoint(), on_time.limit(0),
                        max(last.watermark_ms, newest - delay // dt.timedelta(milliseconds=1)), delay)


def _restart(spark: SparkSession, layout: StorageLayout, last: Progress | None, app_id: str, reason: str,
             delay: dt.timedelta) -> Progress:
    """Start the windows query again after the last committed batch, under a new app id. Its state is
    the open-hours version that batch recorded; an unfinished batch's rows are undone first. Recorded as
    batch -1 of `app_id` (a commit of tickets_per_title_hourly, so the checkpoint verdict can tell it
    is in effect)."""
    last = last or Progress(watermark_ms=0, bronze_version=-1, state_versions={})
    undone = _undo_unfinished_batch(spark, layout)
    restart_id = f"{app_id}/restart"  # a txn id of its own: Delta commits an empty append only when it carries one
    closed, versions, watermark = spark.createDataFrame([], HOURLY_SCHEMA), last.state_versions, last.watermark_ms
    if not versions:
        fold = (_open_hours_from_bronze(spark, layout, last, delay) if last.bronze_version >= 0 else
                WindowsFold(spark.createDataFrame([], OPEN_HOURS_SCHEMA), closed, None, watermark))
        closed, watermark = fold.closed.localCheckpoint(), fold.watermark_ms
        versions = {OPEN_HOURS: write_state(fold.open_hours, layout.table(OPEN_HOURS), restart_id, 0)}
        if not closed.isEmpty():
            append_batch(top_titles(closed), layout.table(TOP), restart_id, 0,
                         {"hourly_version": (table_version(spark, layout.table(HOURLY)) or 0) + 1})
    progress = {"app_id": app_id, "batch_id": -1, "watermark_ms": watermark, "bronze_version": last.bronze_version,
                "state_versions": versions, "windows_closed": closed.count(), "late_events": 0,
                "restarted_because": reason, "undone": undone}
    append_batch(closed, layout.table(HOURLY), restart_id, 0, progress)
    return Progress(watermark, last.bronze_version, versions, app_id, -1)


def _operator_state(spark: SparkSession, layout: StorageLayout) -> dict:
    detail = delta_sql.detail(spark, layout.table(OPEN_HOURS))
    rows = spark.read.format("delta").load(str(layout.table(OPEN_HOURS))).count()
    return {"rows": rows, "bytes": int(detail["sizeInBytes"] or 0)}


def update_windows(spark: SparkSession, layout: StorageLayout, *,
                   watermark_delay: dt.timedelta = DEFAULT_WATERMARK_DELAY,
                   lock_timeout_s: float = 60.0, continuous: Continuous | None = None) -> StreamRunResult:
    """Fold every bronze sale not yet seen into the hourly windows; write the windows that closed.

    Without a trusted checkpoint (first run, lost, corrupt) the query starts again after the last
    committed batch (`_restart`), from the state the tables hold.

    >>> update_windows(spark, StorageLayout.under("data")).micro_batches
    """
    spec = MOVIE_TICKET_SALES
    started = time.monotonic()
    if watermark_delay < dt.timedelta(0):
        raise ValueError(f"watermark delay {watermark_delay} is negative. Fix: give a delay of 0 or more.")
    checkpoint = layout.checkpoint(WINDOWS_QUERY)
    hourly_path, bronze_path = layout.table(HOURLY), layout.table(spec.bronze_table)
    names = (HOURLY, TOP, LATE, OPEN_HOURS)
    require_writable([layout.locks, hourly_path.parent, layout.checkpoints_root])
    with writer_lock(layout.locks, WINDOWS_QUERY, lock_timeout_s), storage_errors():
        ensure_bronze_tables(spark, layout, spec)
        ensure_window_tables(spark, layout)
        before = {name: table_version(spark, layout.table(name)) for name in names}
        bronze_id = table_id(spark, bronze_path)
        last = last_progress(spark, layout)
        verdict, moved = checkpoint_for_run(spark, checkpoint, layout.set_aside_checkpoints, [hourly_path],
                                            source_table_id=bronze_id)
        origin, problem, recovery = verdict.origin, verdict.problem, None
        if origin is not None and last is not None and last.state_versions is None:
            origin, moved = None, set_aside(checkpoint, layout.set_aside_checkpoints)
            problem = f"{checkpoint} kept the open hours in RocksDB state (an earlier statetables)"
        if origin is None:
            reason = problem or (f"{checkpoint} is missing, but {HOURLY} holds batches written from an "
                                         f"earlier checkpoint" if last else "no checkpoint yet")
            app_id = new_app_id(WINDOWS_QUERY)
            last = _restart(spark, layout, last, app_id, reason, watermark_delay)
            origin = start_checkpoint(checkpoint, WINDOWS_QUERY, reason, app_id=app_id,
                                      source_start_version=last.bronze_version + 1, source_table_id=bronze_id)
            if problem or moved or last.bronze_version >= 0:
                recovery = {"problem": reason, "set_aside": str(moved) if moved else None,
                            "action": f"restarted {WINDOWS_QUERY} after bronze version {last.bronze_version} from "
                                      f"the open hours in {OPEN_HOURS} (version {last.state_versions[OPEN_HOURS]})"}
        batches = rows = 0
        has_offsets = any((checkpoint / "offsets").glob("[0-9]*"))
        start_version = origin.source_start_version
        if source_ready(lambda: has_offsets or start_version is None
                        or start_version <= table_version(spark, bronze_path), continuous):
            events = spark.readStream.format("delta").option("maxFilesPerTrigger", 1_000_000)  # whole versions
            if start_version is not None:
                events = events.option("startingVersion", start_version)
            on_batch = WindowsBatches(layout, checkpoint, origin.app_id, last, watermark_delay)
            batches, _ = run_query(events.load(str(bronze_path)), query_name=WINDOWS_QUERY,
                                      checkpoint_dir=checkpoint, on_batch=on_batch, continuous=continuous)
        commits = commits_since(spark, hourly_path, before[HOURLY])
        return StreamRunResult(
            query_name=WINDOWS_QUERY, micro_batches=batches, rows_read=event_time.rows_read(commits),
            duration_s=time.monotonic() - started,
            versions={name: TableVersions(before[name], table_version(spark, layout.table(name))) for name in names},
            commits={HOURLY: commits},
            recovery=recovery,
            operator_state=_operator_state(spark, layout),
        )
