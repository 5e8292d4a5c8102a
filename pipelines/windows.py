"""Movie ticket sales in one-hour event-time windows: closed windows, the top 10 per hour, late events.

One streaming query reads `movie_ticket_sales_bronze` and keeps, per title, the counts of its open
windows in Spark's RocksDB state store (`transformWithState`, event-time mode). Spark's watermark (the
largest event time of earlier micro-batches minus the delay) closes a window: the window's event-time
timer fires, its row is emitted once and is final. An event whose window has already closed is emitted
as a late event with the watermark it missed.

Written by hand because Spark's windowed aggregation drops rows behind the watermark silently, and the
contract forbids that: the watermark column's metadata is taken off the rows before the operator (the
watermark itself, its timers and its eviction stay Spark's), so every row reaches `HourlyWindows`,
which decides what is late.

Each micro-batch writes three tables with Delta's idempotent appends (`txnAppId` / `txnVersion`), so a
replayed batch writes nothing twice; windows of one hour all close in the same batch (one watermark), so
that batch also ranks the hour. Every batch commits to `tickets_per_title_hourly`, even empty, with the
watermark and the bronze version it reached: that is how a lost checkpoint is rebuilt
(`rebuild_origin`), never reset to nothing.
"""

from __future__ import annotations

import datetime as dt
import time
from functools import partial
from pathlib import Path
from typing import Iterator

from pyspark.sql import DataFrame, Row, SparkSession, Window
from pyspark.sql import functions as F
from pyspark.sql.streaming import StatefulProcessor, StatefulProcessorHandle
from pyspark.sql.types import LongType, StringType, StructField, StructType, TimestampType

from pipelines.checkpoints import (
    batch_end_version, batch_watermark_ms, checkpoint_for_run, new_app_id, start_checkpoint,
)
from pipelines import event_time
from pipelines.event_time import LATE, LATE_SCHEMA, Progress, append_batch, late_rows, micros, undo_late_rows
from pipelines.faults import WINDOWS_BEFORE_CLOSING_COMMIT, fault_point
from pipelines import delta_sql
from pipelines.layout import StorageLayout
from pipelines.bronze import ensure_bronze_tables
from pipelines.streaming import (
    Continuous, StreamRunResult, TableVersions, commits_since, create_table_if_missing, require_writable, run_query,
    source_ready, storage_errors, table_id, table_version, writer_lock,
)
from pipelines.state import TOTAL_TYPE
from pipelines.streams import MOVIE_TICKET_SALES

HOURLY = "tickets_per_title_hourly"
TOP = "top_titles_hourly"
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
TOP_SCHEMA = StructType([
    StructField("window_start", TimestampType(), nullable=False),
    StructField("window_end", TimestampType(), nullable=False),
    StructField("rank", LongType(), nullable=False),
    StructField("title", StringType(), nullable=False),
    StructField("tickets_sold", LongType(), nullable=False),
])
# What the operator emits: a closed window (kind "window") or a late event (kind "late").
_EMITTED = StructType([
    StructField("kind", StringType()), StructField("title", StringType()),
    StructField("window_start_ms", LongType()), StructField("tickets_sold", LongType()),
    StructField("value_cents", LongType()), StructField("event_id", StringType()),
    StructField("event_time", TimestampType()), StructField("watermark_ms", LongType()),
    StructField("source_file", StringType()), StructField("line_number", LongType()),
])
_WINDOW_KEY = StructType([StructField("window_start_ms", LongType())])
_WINDOW_VALUE = StructType([StructField("tickets_sold", LongType()), StructField("value_cents", LongType())])
# The initial state of a rebuilt query: one row per open (title, window).
_INITIAL = StructType([StructField("title", StringType()), StructField("window_start_ms", LongType()),
                       StructField("tickets_sold", LongType()), StructField("value_cents", LongType())])


class HourlyWindows(StatefulProcessor):
    """Per title, the open one-hour windows of its sales; emits each window once, when it closes.

    - map state `open_windows`: window start → (tickets, value in cents), one entry per open window;
    - one event-time timer per title, for the open window that ends first: Spark fires it once the
      watermark reaches that end (timers fire strictly below the watermark, so it is set 1 ms before);
      every window the watermark has passed is then emitted and forgotten, and the timer set for the
      next, so state holds open windows only and needs no TTL;
    - `closed_through_ms`: after a rebuild Spark's watermark starts again from nothing; the watermark
      the lost checkpoint had reached keeps deciding what is late until Spark's passes it.

    An event is late when its event time is at or behind the watermark, Spark's own rule for the rows
    its stateful operators drop. A window can then take no event after the watermark passed its end.
    """

    def __init__(self, closed_through_ms: int = 0):
        self.closed_through_ms = closed_through_ms

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.handle = handle
        self.open_windows = handle.getMapState("open_windows", _WINDOW_KEY, _WINDOW_VALUE)

    def _open(self) -> dict[int, tuple[int, int]]:
        return {start: tuple(value) for (start,), value in self.open_windows.iterator()}

    def _add(self, sums: dict[int, list[int]]) -> None:
        """Every state call is a round trip to the JVM: the open windows are read in one call, each
        changed window written once, and one timer is set, for the window that closes first."""
        open_now = self._open()
        for start, (tickets, cents) in sums.items():
            current = open_now.get(start, (0, 0))
            open_now[start] = (current[0] + tickets, current[1] + cents)
            self.open_windows.updateValue((start,), open_now[start])
        self.handle.registerTimer(min(open_now) + HOUR_MS - 1)

    def handleInputRows(self, key, rows, timerValues) -> Iterator[Row]:
        watermark_ms = max(timerValues.getCurrentWatermarkInMs(), self.closed_through_ms)
        batch: dict[int, list[int]] = {}  # one state update per window, not per event
        for row in rows:
            event_us = micros(row.sale_ts)
            if event_us <= watermark_ms * 1000:
                yield Row(kind="late", title=key[0], window_start_ms=None, tickets_sold=None, value_cents=None,
                          event_id=row.event_id, event_time=row.sale_ts, watermark_ms=watermark_ms,
                          source_file=row.source_file, line_number=row.line_number)
                continue
            event_ms = event_us // 1000
            sums = batch.setdefault(event_ms - event_ms % HOUR_MS, [0, 0])
            sums[0] += 1
            sums[1] += int(row.ticket_total_value * 100)  # DECIMAL(18,2): exact in cents
        if batch:
            self._add(batch)

    def handleExpiredTimer(self, key, timerValues, expiredTimerInfo) -> Iterator[Row]:
        watermark_ms = timerValues.getCurrentWatermarkInMs()
        open_now = self._open()
        closing = sorted(start for start in open_now if start + HOUR_MS - 1 < watermark_ms)
        for start in closing:
            self.open_windows.removeKey((start,))
            yield Row(kind="window", title=key[0], window_start_ms=start, tickets_sold=open_now[start][0],
                      value_cents=open_now[start][1], event_id=None, event_time=None, watermark_ms=watermark_ms,
                      source_file=None, line_number=None)
        rest = set(open_now) - set(closing)
        if closing and rest:  # the next window to close; a timer that closed nothing had been replaced
            self.handle.registerTimer(min(rest) + HOUR_MS - 1)

    def handleInitialState(self, key, initialState, timerValues) -> None:
        self._add({initialState.window_start_ms: [initialState.tickets_sold, initialState.value_cents]})

    def close(self) -> None:
        pass


def _closed_windows(windows: DataFrame) -> DataFrame:
    """Operator rows of kind "window" (or rebuilt ones) as rows of `tickets_per_title_hourly`."""
    return windows.select(
        "title", F.timestamp_millis("window_start_ms").alias("window_start"),
        F.timestamp_millis(F.col("window_start_ms") + HOUR_MS).alias("window_end"),
        F.col("tickets_sold"), (F.col("value_cents").cast(TOTAL_TYPE) / 100).cast(TOTAL_TYPE).alias("total_ticket_value"))


def top_titles(hourly: DataFrame) -> DataFrame:
    """The TOP_N titles of every hour in `hourly`; ties broken by tickets, then value, then title."""
    by_rank = Window.partitionBy("window_start").orderBy(
        F.col("tickets_sold").desc(), F.col("total_ticket_value").desc(), F.col("title").asc())
    return (hourly.withColumn("rank", F.row_number().over(by_rank).cast(LongType()))
            .where(F.col("rank") <= TOP_N).select(*TOP_SCHEMA.fieldNames()))


def _commit_outputs(layout: StorageLayout, hourly: DataFrame, late: DataFrame | None, *, has_windows: bool,
                    app_id: str | None, batch_id: int, progress: dict) -> None:
    """Late events, the closed hours ranked, then the closed windows: this last commit, made on every
    batch, says the batch is done and what it reached (`progress`). A batch that died before it is
    replayed under the same app id (its first two writes are then skipped), or, if the checkpoint was
    lost too, undone by `_undo_unfinished_batch`."""
    hourly_path = layout.table(HOURLY)
    # The version this batch's closing commit will have: until it exists, these writes are unfinished.
    closing_version = (table_version(hourly.sparkSession, hourly_path) or 0) + 1
    marker = {"app_id": app_id, "batch_id": batch_id, "hourly_version": closing_version}
    if late is not None:
        append_batch(late, layout.table(LATE), app_id, batch_id, marker)
    if has_windows:
        append_batch(top_titles(hourly), layout.table(TOP), app_id, batch_id, marker)
    fault_point(WINDOWS_BEFORE_CLOSING_COMMIT)
    append_batch(hourly, hourly_path, app_id, batch_id, progress)


def _undo_unfinished_batch(spark: SparkSession, layout: StorageLayout) -> list[str]:
    """Undo what a batch wrote to late_events and top_titles_hourly before it died without its
    tickets_per_title_hourly commit. Only a restart (checkpoint lost) needs this: it writes the batch
    again under a new app id, which Delta's txn ids cannot match. This query is top_titles_hourly's only
    writer, so that table is restored; late_events is shared (`undo_late_rows`)."""
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


def write_windows(emitted: DataFrame, batch_id: int, *, layout: StorageLayout, checkpoint: Path,
                  app_id: str, stream: str, closed_through_ms: int) -> None:
    """foreachBatch body: the windows that closed, their hours ranked, the late events."""
    emitted = emitted.localCheckpoint()  # read up to four times below; the operator must run once
    kinds = dict(emitted.groupBy("kind").count().collect())
    late = late_rows(emitted, stream) if kinds.get("late") else None
    hourly = _closed_windows(emitted.where(F.col("kind") == "window"))
    # The watermark that decided this batch (Spark's, or the one a restart kept, whichever is ahead).
    watermark = max(batch_watermark_ms(checkpoint, batch_id), closed_through_ms)
    progress = {"app_id": app_id, "batch_id": batch_id, "watermark_ms": watermark,
                "bronze_version": batch_end_version(checkpoint, batch_id),
                "windows_closed": kinds.get("window", 0), "late_events": kinds.get("late", 0)}
    _commit_outputs(layout, hourly, late, has_windows=bool(kinds.get("window")), app_id=app_id,
                    batch_id=batch_id, progress=progress)


def ensure_window_tables(spark: SparkSession, layout: StorageLayout) -> None:
    for name, schema in ((HOURLY, HOURLY_SCHEMA), (TOP, TOP_SCHEMA), (LATE, LATE_SCHEMA)):
        create_table_if_missing(spark, layout.table(name), schema)


def last_progress(spark: SparkSession, layout: StorageLayout) -> Progress | None:
    """The watermark and bronze version of the newest batch committed to `tickets_per_title_hourly`."""
    return event_time.last_progress(spark, layout.table(HOURLY), f"{HOURLY}, {TOP} and {LATE}")


def _open_windows(spark: SparkSession, layout: StorageLayout, through_version: int, after_ms: int) -> DataFrame:
    """(title, window start, tickets, cents) of the windows ending after `after_ms` over the sales of
    bronze up to `through_version` that were not late: what the operator held open at that point."""
    spec = MOVIE_TICKET_SALES
    sales = (spark.read.format("delta").option("versionAsOf", through_version)
             .load(str(layout.table(spec.bronze_table))))
    late = spark.read.format("delta").load(str(layout.table(LATE))).where(F.col("stream") == spec.name)
    event_ms = F.unix_millis(spec.event_time_field)
    return (sales.join(late.select(F.col("event_id").alias(spec.id_field)), spec.id_field, "left_anti")
            .withColumn("window_start_ms", event_ms - F.pmod(event_ms, F.lit(HOUR_MS)))
            .where(F.col("window_start_ms") + HOUR_MS > after_ms)
            .groupBy("title", "window_start_ms")
            .agg(F.count("*").alias("tickets_sold"),
                 F.sum((F.col(spec.value_field) * 100).cast(LongType())).alias("value_cents")))


def _restart(spark: SparkSession, layout: StorageLayout, last: Progress | None, app_id: str, reason: str,
             delay: dt.timedelta) -> Progress:
    """Start the windows again after the last committed batch, exactly where it left them.

    The watermark the next batch would have had is the newest sale read so far minus the delay; the
    windows it closes are written now (no sale can join them: it would be behind that watermark), so
    what the old checkpoint would have written next is written, once. Recorded as batch -1 of `app_id`.
    """
    spec = MOVIE_TICKET_SALES
    last = last or Progress(watermark_ms=0, bronze_version=-1)
    undone = _undo_unfinished_batch(spark, layout)
    watermark = last.watermark_ms
    has_windows = False
    hourly = spark.createDataFrame([], HOURLY_SCHEMA)
    if last.bronze_version >= 0:
        newest = (spark.read.format("delta").option("versionAsOf", last.bronze_version)
                  .load(str(layout.table(spec.bronze_table))).agg(F.max(F.unix_millis(spec.event_time_field))).first()[0])
        if newest is not None:
            watermark = max(watermark, newest - delay // dt.timedelta(milliseconds=1))
        closing = (_open_windows(spark, layout, last.bronze_version, last.watermark_ms)
                   .where(F.col("window_start_ms") + HOUR_MS <= watermark)).localCheckpoint()
        has_windows = not closing.isEmpty()
        hourly = _closed_windows(closing)
    progress = {"app_id": app_id, "batch_id": -1, "watermark_ms": watermark, "bronze_version": last.bronze_version,
                "windows_closed": hourly.count() if has_windows else 0, "late_events": 0, "restarted_because": reason,
                "undone": undone}
    # A txn id of its own: Delta commits an empty append only when it carries one, and this record must exist.
    _commit_outputs(layout, hourly, None, has_windows=has_windows, app_id=f"{app_id}/restart", batch_id=0,
                    progress=progress)
    return Progress(watermark, last.bronze_version)


def update_windows(spark: SparkSession, layout: StorageLayout, *,
                   watermark_delay: dt.timedelta = DEFAULT_WATERMARK_DELAY,
                   lock_timeout_s: float = 60.0, continuous: Continuous | None = None) -> StreamRunResult:
    """Fold every bronze sale not yet seen into the hourly windows; write the windows that closed.

    Without a trusted checkpoint (first run, lost, corrupt) the query starts again after the last
    committed batch (`_restart`); the windows it held open come back as the operator's initial state.

    >>> update_windows(spark, StorageLayout.under("data")).micro_batches
    """
    spec = MOVIE_TICKET_SALES
    started = time.monotonic()
    if watermark_delay < dt.timedelta(0):
        raise ValueError(f"watermark delay {watermark_delay} is negative. Fix: give a delay of 0 or more.")
    checkpoint = layout.checkpoint(WINDOWS_QUERY)
    hourly_path, bronze_path = layout.table(HOURLY), layout.table(spec.bronze_table)
    require_writable([layout.locks, hourly_path.parent, layout.checkpoints_root])
    with writer_lock(layout.locks, WINDOWS_QUERY, lock_timeout_s), storage_errors():
        ensure_bronze_tables(spark, layout, spec)
        ensure_window_tables(spark, layout)
        before = {name: table_version(spark, layout.table(name)) for name in (HOURLY, TOP, LATE)}
        bronze_id = table_id(spark, bronze_path)
        verdict, moved = checkpoint_for_run(spark, checkpoint, layout.set_aside_checkpoints, [hourly_path],
                                            source_table_id=bronze_id, stateful=True)
        origin, recovery = verdict.origin, None
        if origin is None:
            last = last_progress(spark, layout)
            reason = verdict.problem or (f"{checkpoint} is missing, but {HOURLY} holds batches written from an "
                                         f"earlier checkpoint" if last else "no checkpoint yet")
            app_id = new_app_id(WINDOWS_QUERY)
            start = _restart(spark, layout, last, app_id, reason, watermark_delay)
            origin = start_checkpoint(checkpoint, WINDOWS_QUERY, reason, app_id=app_id,
                                      source_start_version=start.bronze_version + 1, source_table_id=bronze_id,
                                      closed_through_ms=start.watermark_ms)
            if verdict.problem or moved or last:
                closed = dt.datetime.fromtimestamp(start.watermark_ms / 1000, dt.timezone.utc)
                recovery = {"problem": reason, "set_aside": str(moved) if moved else None,
                            "action": f"restarted {WINDOWS_QUERY} after bronze version {start.bronze_version}: "
                                      f"windows up to {closed:%Y-%m-%d %H:%M:%S} written, later ones rebuilt "
                                      f"from bronze as the operator's initial state"}
        closed_through = origin.closed_through_ms or 0
        initial = None
        if not any((checkpoint / "commits").glob("[0-9]*")) and origin.source_start_version:
            # Until its first batch commits, a restarted query takes its initial state on every start.
            initial = _open_windows(spark, layout, origin.source_start_version - 1, closed_through)
        batches = rows = 0
        reports: list = []
        has_offsets = any((checkpoint / "offsets").glob("[0-9]*"))
        start_version = origin.source_start_version
        if source_ready(lambda: has_offsets or start_version is None
                        or start_version <= table_version(spark, bronze_path), continuous):
            events = spark.readStream.format("delta").option("maxFilesPerTrigger", 1_000_000)  # whole versions
            if start_version is not None:
                events = events.option("startingVersion", start_version)
            # The watermark and its timers are Spark's; the column it is set on is dropped before the
            # operator, so that Spark does not drop the late rows there (module docstring).
            sales = (events.load(str(bronze_path))
                     .withColumn("_event_time", F.col(spec.event_time_field))
                     .withWatermark("_event_time", f"{int(watermark_delay.total_seconds())} seconds")
                     .select("title", spec.event_time_field, spec.value_field, spec.id_field, "source_file",
                             "line_number"))
            emitted = sales.groupBy("title").transformWithState(
                HourlyWindows(closed_through), _EMITTED, "Append", "EventTime",
                initialState=initial.groupBy("title") if initial is not None else None)
            on_batch = partial(write_windows, layout=layout, checkpoint=checkpoint, app_id=origin.app_id,
                               stream=spec.name, closed_through_ms=closed_through)
            batches, rows = run_query(emitted, query_name=WINDOWS_QUERY, checkpoint_dir=checkpoint,
                                              on_batch=on_batch, progress=reports,
                                      continuous=continuous)
        return StreamRunResult(
            query_name=WINDOWS_QUERY, micro_batches=batches, rows_read=rows,
            duration_s=time.monotonic() - started,
            versions={name: TableVersions(before[name], table_version(spark, layout.table(name)))
                      for name in (HOURLY, TOP, LATE)},
            commits={HOURLY: commits_since(spark, hourly_path, before[HOURLY])},
            recovery=recovery,
            operator_state=event_time.operator_state(reports),
        )
