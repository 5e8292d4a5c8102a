"""Windowed tables: `GROUP BY keys, window(event_time, size)`, tumbling windows closed by the watermark, with
their top N tables.

Operator state is a Delta table, `<table>_state`: one row per (key, window) still counting, with the aggregates'
partial columns (pipelines/state/tables.py), so any reader can query the window in progress, and nothing depends on the
number of partitions. A batch's bronze rows are folded by `fold_windows`, a plain function from (open windows
before, events, the watermark) to (open windows after, closed windows, late events, the next watermark): DataFrame
work in the JVM, no Python per event, key or state call.

A window closes once the watermark reaches its end (the timer firing): in the batch whose events move the
watermark there, and its row is final. The windows a batch closes are ranked in the same batch by the table's top
N tables (`top_rows`). Windows are aligned to the epoch, as Spark's `window()` without a start offset.

Exactly once (pipelines/event_time/watermark.py): every write of a batch is computed from the state as the previous batch
left it and names the batch (app id, batch id): late_events, each top N table, the open windows (an overwrite: they
are few), and last the table itself, the closing commit with the progress. When the stream starts, the rows of a batch
that died before that commit are undone (`undo_unfinished_batch`) and its bronze rows folded again.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from pyspark.sql import DataFrame, SparkSession, Window
from pyspark.sql import functions as F
from pyspark.sql.types import LongType, StructField, StructType, TimestampType

from pipelines.declare.aggregates import combined_columns, final_column, partial_columns
from pipelines.declare.specs import FIELD_TYPES, EventTimeTableSpec, StreamSpec, TopSpec
from pipelines.event_time.watermark import (
    NO_PROGRESS, EventTimeStage, FoldedBatch, append_batch, append_late, behind_watermark, closed_and_late,
    declared_columns, ensure_tables, kept_events, late_rows, newest_of_stream, next_watermark, partial_schema,
    resume, undo_late_rows, write_state,
)
from pipelines.faults import (
    WINDOWS_AFTER_LATE_COMMIT, WINDOWS_AFTER_STATE_COMMIT, WINDOWS_AFTER_TOP_COMMIT, WINDOWS_BEFORE_CLOSING_COMMIT,
    fault_point,
)
from pipelines.storage import delta_sql
from pipelines.storage.delta_log import commits_since, table_version
from pipelines.storage.frames import kept
from pipelines.storage.layout import StorageLayout

START = "_window_start"  # the open window's start, in the operator state


def state_schema(table: EventTimeTableSpec) -> StructType:
    """`<table>_state`: the keys, the window's start, the aggregates' partial columns."""
    field = {f.name: f for f in table.fields}
    return StructType([*(StructField(k, FIELD_TYPES[field[k].kind], nullable=not field[k].required)
                         for k in table.keys),
                       StructField(START, TimestampType(), nullable=False), *partial_schema(table)])


@dataclass(frozen=True)
class WindowsFold:
    """What one batch does to a windowed table: the state after it and what it emits."""

    open_windows: DataFrame  # rows of <table>_state after the batch
    closed: DataFrame  # rows of the table: the windows the new watermark has passed
    late: DataFrame  # rows of late_events
    watermark_ms: int  # the watermark after the batch: the next batch's, and the one that closed `closed`


def fold_windows(table: EventTimeTableSpec, spec: StreamSpec, open_windows: DataFrame, events: DataFrame,
                 watermark_ms: int, newest_ms: int | None = None) -> WindowsFold:
    """(open windows before, a batch of bronze events, the watermark before) -> the state after and the outputs.

    An event at or behind the watermark is late; the others add to their (key, window). The watermark then moves
    to the batch's newest event minus the delay (never back), and every window whose end it has reached closes;
    `newest_ms`: that event's time, when known (otherwise one Spark job asks).
    One pass over the batch for the on-time events (kept, small: per key and window); the late ones are read again
    when written."""
    kinds = {f.name: f.kind for f in table.fields}
    size_ms = table.size // dt.timedelta(milliseconds=1)
    stream_events, events = events, kept_events(table, events)
    at = F.col(table.event_time_field)
    behind = behind_watermark(table, watermark_ms)
    ms = F.unix_millis(at)
    on_time = kept(
        events.where(~behind).groupBy(*table.keys, F.timestamp_millis(ms - F.pmod(ms, F.lit(size_ms))).alias(START))
        .agg(*partial_columns(table.aggregates, kinds), F.max(ms).alias("_newest")))
    newest = newest_of_stream(table, stream_events, watermark_ms, lambda: on_time.agg(F.max("_newest")).first()[0],
                              newest_ms)
    after = next_watermark(watermark_ms, newest, spec.watermark_delay)
    state_columns = state_schema(table).fieldNames()
    counted = (open_windows.select(*state_columns).unionByName(on_time.drop("_newest"))
               .groupBy(*table.keys, START).agg(*combined_columns(table.aggregates, kinds))
               .select(*state_columns))
    passed = F.unix_millis(START) + F.lit(size_ms) <= F.lit(after)
    return WindowsFold(open_windows=counted.where(~passed), closed=closed_rows(table, counted.where(passed)),
                       late=late_rows(table, spec, events.where(behind), watermark_ms), watermark_ms=after)


def closed_rows(table: EventTimeTableSpec, windows: DataFrame) -> DataFrame:
    """Rows of the table from rows of its operator state: the declared columns, in order."""
    kinds = {f.name: f.kind for f in table.fields}
    aggregates = {a.name: a for a in table.aggregates}
    size_ms = table.size // dt.timedelta(milliseconds=1)
    return windows.select(*declared_columns(
        table, F.col(START), F.timestamp_millis(F.unix_millis(START) + F.lit(size_ms)),
        lambda column: final_column(aggregates[column.of], kinds)))


def top_rows(top: TopSpec, source: EventTimeTableSpec, closed: DataFrame) -> DataFrame:
    """The top N rows of every window in `closed` (rows of `source`), ranked by the declared order, which the
    loader made total."""
    def ordered(column: str, descending: bool, nulls_first: bool):
        c = F.col(column)
        if descending:
            return c.desc_nulls_first() if nulls_first else c.desc_nulls_last()
        return c.asc_nulls_first() if nulls_first else c.asc_nulls_last()
    by_rank = Window.partitionBy(source.column("start")).orderBy(*(ordered(*o) for o in top.order))
    return (closed.withColumn(top.rank_column, F.row_number().over(by_rank).cast(LongType()))
            .where(F.col(top.rank_column) <= top.n).select(*top.columns))


def undo_unfinished_batch(spark: SparkSession, layout: StorageLayout, table: EventTimeTableSpec,
                          marker: str) -> list[str]:
    """Undo what a batch wrote to late_events and the top N tables before it died without its closing commit: the
    stream folds its bronze rows again, under an app id of its own, before the query replays the batch. The step is
    a top N table's only writer, so that table is restored; late_events is shared (`undo_late_rows`). The open
    windows need nothing: the next batch reads the version the last closing commit recorded."""
    closing_version = table_version(spark, layout.table(table.name)) or 0
    undone = undo_late_rows(spark, layout, table.name, marker, closing_version)
    for top in table.tops:
        path = layout.table(top.name)
        latest = table_version(spark, path) or 0
        unfinished = [c["version"] for c in commits_since(spark, path, max(-1, latest - 5))
                      if int(c["user"].get(marker, -1)) > closing_version]
        if unfinished:
            delta_sql.restore(spark, path, min(unfinished) - 1)
            undone.append(f"{top.name} restored to version {min(unfinished) - 1}")
    return undone


class WindowsStage(EventTimeStage):
    """A windowed table's step of its stream's micro-batch: late events, the closed windows ranked by each top N,
    the open windows, then the closed windows as the closing commit."""

    before_closing_fault = WINDOWS_BEFORE_CLOSING_COMMIT

    def operator_state_schema(self) -> StructType:
        return state_schema(self.table)

    def fold_and_write(self, rows: DataFrame, newest_ms: int | None, app_id: str, batch_id: int, marker: dict,
                       late_possible: bool = True) -> FoldedBatch:
        spark, layout, table = rows.sparkSession, self.layout, self.table
        state_path = layout.table(table.state_table)
        before = self.state_before(spark)
        fold = fold_windows(table, self.spec, before, rows, self.last.watermark_ms, newest_ms)
        closed = kept(fold.closed)  # ranked, written and counted
        windows_closed, late_count = closed_and_late(closed, fold.late) if late_possible else (closed.count(), 0)
        if late_count:
            append_late(fold.late, layout, marker)
        fault_point(WINDOWS_AFTER_LATE_COMMIT)
        if windows_closed:
            for top in table.tops:
                append_batch(top_rows(top, table, closed), layout.table(top.name), marker)
        fault_point(WINDOWS_AFTER_TOP_COMMIT)
        version = write_state(fold.open_windows, state_path, marker)
        fault_point(WINDOWS_AFTER_STATE_COMMIT)
        return FoldedBatch(closed, version, fold.watermark_ms,
                           {"windows_closed": windows_closed, "late_events": late_count})


def windows_stage(spark: SparkSession, layout: StorageLayout, spec: StreamSpec, table: EventTimeTableSpec
                  ) -> WindowsStage:
    """The table's step as its last closing commit left it, for a run of its stream (which holds the stream's
    writer lock). The rows of a batch that died before its closing commit are undone first: the stream folds that
    batch's bronze rows again."""
    ensure_tables(spark, layout, spec, table, state_schema(table))
    stage = WindowsStage(layout, spec, table, NO_PROGRESS)
    return resume(spark, stage, undo_unfinished_batch(spark, layout, table, stage.marker))
