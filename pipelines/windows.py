"""Movie ticket sales in one-hour event-time windows: closed windows, the top 10 per hour, late events.

Operator state is a Delta table, `tickets_per_title_open_hours`: one row per (title, hour) still counting,
so any reader can query the hour in progress, and nothing depends on the number of partitions. The windows
are a step of the sales stream's micro-batch (pipelines/stream_query.py): the bronze rows it has not folded
yet are folded by `fold_windows`, a plain function from (open hours before, sales, the watermark) to (open
hours after, closed hours, late sales, the next watermark). It is DataFrame work in the JVM: no Python runs
per event, key or state call (the transformWithState operator this replaces made a Python<->JVM round trip
per state call: 188 s per 1M sales, 32x the all-time MERGE step).

The watermark is Spark's rule, kept by hand: the newest sale of the earlier batches minus the delay,
recorded with each batch's closing commit. A sale at or behind it is late: it goes to `late_events` (with the
watermark it missed) and still counts in movie_tickets_sold. An hour closes once the watermark reaches its
end (the timer firing); it closes in the batch whose sales move the watermark there, and its row is final.
The hours a batch closes are ranked in the same batch (`top_titles_hourly`).

Exactly once: every write of a batch is computed from the state as the previous batch left it (the open-hours
version its closing commit recorded, read by time travel), never from what this batch has half written.
The writes carry the stream's (app id, batch id) as Delta's txn id, so a replay after a crash between any two
of them writes exactly what the uninterrupted batch would have: late_events, top_titles_hourly, the open
hours (an overwrite: they are few), and last `tickets_per_title_hourly`, the closing commit with the progress
(the bronze version folded). When the stream starts, the rows of a batch that died before that commit are
undone (`_undo_unfinished_batch`) and its bronze rows folded again.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F
from pyspark.sql.types import LongType, StringType, StructField, StructType, TimestampType

from pipelines import delta_sql, event_time
from pipelines.checkpoints import new_app_id
from pipelines.event_time import (
    LATE, LATE_SCHEMA, EventTimeStage, FoldedBatch, Progress, append_batch, read_state, require_settings,
    resumed_stage, undo_late_rows, write_state,
)
from pipelines.faults import (
    WINDOWS_AFTER_LATE_COMMIT, WINDOWS_AFTER_OPEN_HOURS_COMMIT, WINDOWS_AFTER_TOP_COMMIT,
    WINDOWS_BEFORE_CLOSING_COMMIT, fault_point,
)
from pipelines.layout import StorageLayout
from pipelines.state import TOTAL_TYPE
from pipelines.streaming import commits_since, create_table_if_missing, kept_on_disk, table_version
from pipelines.streams import windows_stream

HOURLY = "tickets_per_title_hourly"
TOP = "top_titles_hourly"
OPEN_HOURS = "tickets_per_title_open_hours"
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
    spec = windows_stream()
    at = F.col(spec.event_time_field)
    behind = F.unix_micros(at) <= F.lit(watermark_ms * 1000)
    late = sales.where(behind).select(
        F.lit(spec.name).alias("stream"), F.col(spec.id_field).alias("event_id"), at.alias("event_time"),
        F.timestamp_millis(F.lit(watermark_ms)).alias("watermark"),
        (F.lit(watermark_ms) - F.unix_millis(at)).alias("late_by_ms"), "source_file", "line_number")
    # One pass over the batch, kept: what it adds per (title, hour), and its newest on-time sale. A late sale
    # is at or behind the watermark, so it could not move it: the newest on-time sale is the newest that counts.
    on_time = kept_on_disk(sales.where(~behind).groupBy("title", hour_of(at).alias("window_start"))
               .agg(F.count("*").alias("tickets_sold"), F.sum(spec.value_field).alias("total_ticket_value"),
                    F.max(F.unix_millis(at)).alias("_newest")))
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
    tickets_per_title_hourly commit: the stream folds its bronze rows again, under an app id of its own, which
    Delta's txn ids cannot match. The sales stream is top_titles_hourly's only writer, so that table is
    restored; late_events is shared (`undo_late_rows`). The open hours need nothing: the next batch reads the
    version the last closing commit recorded."""
    hourly_version = table_version(spark, layout.table(HOURLY)) or 0
    undone = undo_late_rows(spark, layout, windows_stream().name, "hourly_version", hourly_version)
    path = layout.table(TOP)
    latest = table_version(spark, path) or 0
    unfinished = [c["version"] for c in commits_since(spark, path, max(-1, latest - 5))
                  if int(c["user"].get("hourly_version", -1)) > hourly_version]
    if unfinished:
        delta_sql.restore(spark, path, min(unfinished) - 1)
        undone.append(f"{TOP} restored to version {min(unfinished) - 1}")
    return undone


class WindowsStage(EventTimeStage):
    """The windows step of a sales micro-batch: late sales, the closed hours ranked, the open hours, then the
    closed hours as the closing commit."""

    closing_table, closing_marker, before_closing_fault = HOURLY, "hourly_version", WINDOWS_BEFORE_CLOSING_COMMIT

    def __init__(self, layout: StorageLayout, last: Progress, delay: dt.timedelta):
        super().__init__(layout, last)
        self.delay = delay

    def fold_and_write(self, rows: DataFrame, app_id: str, batch_id: int, marker: dict) -> FoldedBatch:
        spark, layout, spec = rows.sparkSession, self.layout, windows_stream()
        sales = rows.select("title", spec.event_time_field, spec.value_field, spec.id_field, "source_file",
                            "line_number")
        before = read_state(spark, layout.table(OPEN_HOURS), self.last.state_versions[OPEN_HOURS])
        fold = fold_windows(before, sales, self.last.watermark_ms, self.delay)
        closed = kept_on_disk(fold.closed)  # ranked, written and counted
        windows_closed, late_count = closed.count(), fold.late.count()
        if late_count:
            append_batch(fold.late, layout.table(LATE), app_id, batch_id, marker)
        fault_point(WINDOWS_AFTER_LATE_COMMIT)
        if windows_closed:
            append_batch(top_titles(closed), layout.table(TOP), app_id, batch_id, marker)
        fault_point(WINDOWS_AFTER_TOP_COMMIT)
        versions = {OPEN_HOURS: write_state(fold.open_hours, layout.table(OPEN_HOURS), app_id, batch_id)}
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
    spec = windows_stream()
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
    return fold_windows(kept_on_disk(still_open), on_time.limit(0),
                        max(last.watermark_ms, newest - delay // dt.timedelta(milliseconds=1)), delay)


def _first_state(spark: SparkSession, layout: StorageLayout, last: Progress | None, delay: dt.timedelta) -> Progress:
    """The open hours of tables that have none yet: empty for new tables; for tables of an earlier statetables
    (open hours in RocksDB), built once from bronze. Recorded as batch -1 of an app id of its own, a commit of
    tickets_per_title_hourly carrying the progress."""
    last = last or Progress(watermark_ms=0, bronze_version=-1, state_versions={})
    start_id = new_app_id(f"{windows_stream().name}/windows-state")
    closed, watermark = spark.createDataFrame([], HOURLY_SCHEMA), last.watermark_ms
    fold = (_open_hours_from_bronze(spark, layout, last, delay) if last.bronze_version >= 0 else
            WindowsFold(spark.createDataFrame([], OPEN_HOURS_SCHEMA), closed, None, watermark))
    closed, watermark = kept_on_disk(fold.closed), fold.watermark_ms
    # A txn id of its own: Delta commits an empty append only when it carries one.
    versions = {OPEN_HOURS: write_state(fold.open_hours, layout.table(OPEN_HOURS), start_id, 0)}
    if not closed.isEmpty():
        append_batch(top_titles(closed), layout.table(TOP), start_id, 0,
                     {"hourly_version": (table_version(spark, layout.table(HOURLY)) or 0) + 1})
    progress = {"app_id": start_id, "batch_id": -1, "watermark_ms": watermark, "bronze_version": last.bronze_version,
                "state_versions": versions, "windows_closed": closed.count(), "late_events": 0,
                "started_because": "an earlier statetables kept the open hours in RocksDB" if last.bronze_version >= 0
                else "new tables"}
    append_batch(closed, layout.table(HOURLY), start_id, 0, progress)
    return Progress(watermark, last.bronze_version, versions, start_id, -1)


def windows_stage(spark: SparkSession, layout: StorageLayout, delay: dt.timedelta = DEFAULT_WATERMARK_DELAY
                  ) -> WindowsStage:
    """The windows step as the last closing commit left it, for a run of the sales stream (which holds the
    stream's writer lock). The rows of a batch that died before its closing commit are undone first: the
    stream folds that batch's bronze rows again."""
    if delay < dt.timedelta(0):
        raise ValueError(f"watermark delay {delay} is negative. Fix: give a delay of 0 or more.")
    ensure_window_tables(spark, layout)
    require_settings(spark, layout.table(HOURLY), f"watermark-delay-{delay.total_seconds():g}s", "windows")
    undone = _undo_unfinished_batch(spark, layout)
    return resumed_stage(lambda last: WindowsStage(layout, last, delay), last_progress(spark, layout),
                         lambda last: _first_state(spark, layout, last, delay), undone,
                         kept=f"the open hours ({OPEN_HOURS})", events="sales")


def state_figures(spark: SparkSession, layout: StorageLayout) -> dict:
    return event_time.state_table_figures(spark, layout.table(OPEN_HOURS))
