"""Payments in per-customer activity sessions: `customer_activity`, one row per closed session.

A session is a customer's payments with less than 30 minutes between one and the next: exactly 30
minutes apart is two sessions (not Spark's `session_window`, which merges at exactly the gap). It closes
once the watermark (newest payment of the earlier batches minus the delay) is 30 minutes past its last
payment: no payment still to come can join it. Its row says when it started and ended, how many payments
and how much, the last five payment ids, when the customer's previous session ended, and how much the
customer spent that day.

Operator state is two Delta tables, so any reader can query a customer's open session, and nothing depends
on the number of partitions:
- `customer_open_sessions` (list state): one row per open session, with its count, amount and last five
  payments. Sessions, not payments: a payment arriving out of order within the watermark can join two open
  sessions into one, and the rows hold what that needs (first and last payment);
- `customer_last_sessions` (value state): per customer, the newest closed session's end and the spend on
  its UTC day. A later session only ever closes on that day or after, so that day's total is all of the
  "spend per day" map state a session can still need.
The timers are a watermark rule: a session closes in the batch whose watermark is a gap past its end.

The sessions are a step of the payments stream's micro-batch (pipelines/stream_query.py): the bronze rows it
has not folded yet are folded by `fold_sessions`, a plain function from (state before, payments, the
watermark) to (state after, closed sessions, late payments, the next watermark): window functions over the
open sessions and the new payments, in the JVM. No Python runs per payment, customer or state call (the
transformWithState operator this replaces made a Python<->JVM round trip per state call: 313 s per 1M
payments, 51x the all-time MERGE step).

TTL, D days of event time (default 30): a session starting D or more after the customer's previous session
ended has forgotten it (no previous session, a fresh day total); customers idle that long with nothing open
leave `customer_last_sessions`. Event time makes the rule exact and repeatable: a replay writes the same rows.
Late payments go to late_events (`stream` = payments) and still count in payments_per_customer.

Exactly once as in windows.py: every write of a batch is computed from the state versions the previous
batch's closing commit recorded, and carries the stream's txn id (app id, batch id): late_events, the open
sessions, the last sessions, then customer_activity, the closing commit with the progress.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from pyspark.sql import DataFrame, SparkSession, Window
from pyspark.sql import functions as F
from pyspark.sql.types import ArrayType, LongType, StringType, StructField, StructType, TimestampType

from pipelines import event_time
from pipelines.checkpoints import new_app_id
from pipelines.event_time import (
    LATE, LATE_SCHEMA, EventTimeStage, FoldedBatch, Progress, append_batch, read_state, require_settings,
    resumed_stage, undo_late_rows, write_state,
)
from pipelines.faults import (
    SESSIONS_AFTER_LAST_SESSIONS_COMMIT, SESSIONS_AFTER_LATE_COMMIT, SESSIONS_AFTER_OPEN_SESSIONS_COMMIT,
    SESSIONS_BEFORE_CLOSING_COMMIT, fault_point,
)
from pipelines.layout import StorageLayout
from pipelines.state import TOTAL_TYPE
from pipelines.streaming import create_table_if_missing, kept_on_disk, table_version
from pipelines.streams import sessions_stream

ACTIVITY = "customer_activity"
OPEN_SESSIONS = "customer_open_sessions"
LAST_SESSIONS = "customer_last_sessions"
SESSION_GAP = dt.timedelta(minutes=30)
DEFAULT_WATERMARK_DELAY = dt.timedelta(minutes=10)
DEFAULT_STATE_TTL = dt.timedelta(days=30)
LAST_PAYMENTS = 5
_DAY_US = 86_400_000_000
_US = dt.timedelta(microseconds=1)

ACTIVITY_SCHEMA = StructType([
    StructField("customer_id", StringType(), nullable=False),
    StructField("session_start", TimestampType(), nullable=False),  # its first payment
    StructField("session_end", TimestampType(), nullable=False),  # its last payment
    StructField("payment_count", LongType(), nullable=False),
    StructField("total_amount", TOTAL_TYPE, nullable=False),
    StructField("last_payment_ids", ArrayType(StringType(), containsNull=False), nullable=False),  # newest first
    StructField("previous_session_end", TimestampType()),  # null: none, or idle longer than the TTL
    StructField("day_amount", TOTAL_TYPE, nullable=False),  # spent on session_end's UTC day so far
])
_PAYMENT = StructType([StructField("paid_at", TimestampType()), StructField("payment_id", StringType())])
OPEN_SESSIONS_SCHEMA = StructType([
    StructField("customer_id", StringType(), nullable=False),
    StructField("session_start", TimestampType(), nullable=False),
    StructField("session_end", TimestampType(), nullable=False),
    StructField("payment_count", LongType(), nullable=False),
    StructField("total_amount", TOTAL_TYPE, nullable=False),
    StructField("last_payments", ArrayType(_PAYMENT, containsNull=False), nullable=False),  # newest first
])
LAST_SESSIONS_SCHEMA = StructType([
    StructField("customer_id", StringType(), nullable=False),
    StructField("session_end", TimestampType(), nullable=False),
    StructField("day_amount", TOTAL_TYPE, nullable=False),  # spent on session_end's UTC day
])


@dataclass(frozen=True)
class SessionSettings:
    """How sessions are cut and kept (resource/asset config)."""

    watermark_delay: dt.timedelta = DEFAULT_WATERMARK_DELAY
    state_ttl: dt.timedelta = DEFAULT_STATE_TTL
    gap: dt.timedelta = SESSION_GAP

    def __post_init__(self):
        if self.watermark_delay < dt.timedelta(0):
            raise ValueError(f"watermark delay {self.watermark_delay} is negative. Fix: give a delay of 0 or more.")
        if self.state_ttl < dt.timedelta(milliseconds=1):
            raise ValueError(f"state TTL {self.state_ttl} is not positive. Fix: give a TTL of at least 1 ms "
                             f"(default {DEFAULT_STATE_TTL.days} days).")


@dataclass(frozen=True)
class SessionsFold:
    """What one batch does to the sessions: the state after it and what it emits."""

    open_sessions: DataFrame  # rows of customer_open_sessions after the batch
    last_sessions: DataFrame  # rows of customer_last_sessions after the batch
    closed: DataFrame  # rows of customer_activity: the sessions the new watermark has closed
    late: DataFrame  # rows of late_events
    watermark_ms: int  # the watermark after the batch


def _micros(column: str):
    return F.unix_micros(F.col(column))


def fold_sessions(open_sessions: DataFrame, last_sessions: DataFrame, payments: DataFrame, watermark_ms: int,
                  settings: SessionSettings) -> SessionsFold:
    """(open and last sessions before, a batch of bronze payments, the watermark before) -> the state after and
    the outputs. One pass over the batch, for the sessions after it (kept, as are the closed ones); late
    payments are read again when written.

    A payment at or behind the watermark is late. The others join the customers' open sessions: per customer,
    in event-time order, a piece (an open session, or a payment) less than the gap after the latest end before
    it joins that session. The watermark then moves to the newest payment minus the delay (never back), and
    every session it is a gap past closes, oldest first, each knowing the previous one's end and the day's
    spend so far; the TTL's rule forgets both."""
    spec = sessions_stream()
    gap_us, ttl_us = settings.gap // _US, settings.state_ttl // _US
    at = F.col(spec.event_time_field)
    behind = F.unix_micros(at) <= F.lit(watermark_ms * 1000)
    late = payments.where(behind).select(
        F.lit(spec.name).alias("stream"), F.col(spec.id_field).alias("event_id"), at.alias("event_time"),
        F.timestamp_millis(F.lit(watermark_ms)).alias("watermark"),
        (F.lit(watermark_ms) - F.unix_millis(at)).alias("late_by_ms"), "source_file", "line_number")
    arrived = payments.where(~behind).select(
        "customer_id", at.alias("session_start"), at.alias("session_end"), F.lit(1).cast(LongType()).alias("payment_count"),
        F.col(spec.value_field).cast(TOTAL_TYPE).alias("total_amount"),
        F.array(F.struct(at.alias("paid_at"), F.col(spec.id_field).alias("payment_id"))).alias("last_payments"))
    pieces = open_sessions.select(*OPEN_SESSIONS_SCHEMA.fieldNames()).unionByName(arrived)
    in_order = Window.partitionBy("customer_id").orderBy("session_start", "session_end")
    latest_end = F.max(_micros("session_end")).over(in_order.rowsBetween(Window.unboundedPreceding, -1))
    starts = F.when(latest_end.isNull() | (_micros("session_start") - latest_end >= gap_us), 1).otherwise(0)
    sessions = kept_on_disk(pieces.withColumn("_starts", starts)
                .withColumn("_session", F.sum("_starts").over(in_order.rowsBetween(Window.unboundedPreceding, 0)))
                .groupBy("customer_id", "_session")
                .agg(F.min("session_start").alias("session_start"), F.max("session_end").alias("session_end"),
                     F.sum("payment_count").cast(LongType()).alias("payment_count"),
                     F.sum("total_amount").cast(TOTAL_TYPE).alias("total_amount"),
                     F.slice(F.sort_array(F.flatten(F.collect_list("last_payments")), asc=False), 1, LAST_PAYMENTS)
                     .alias("last_payments"))
                .drop("_session"))  # the closed rows, the open ones and the kept state all read it
    # The newest on-time payment (or open session's end, which an earlier batch's watermark has allowed for);
    # a late payment is at or behind the watermark, so it could not move it.
    newest = sessions.agg(F.max(F.unix_millis("session_end"))).first()[0]
    after = (watermark_ms if newest is None
             else max(watermark_ms, newest - settings.watermark_delay // dt.timedelta(milliseconds=1)))
    closes = _micros("session_end") + gap_us <= F.lit(after * 1000)
    closed = kept_on_disk(_closed_rows(sessions.where(closes), last_sessions, ttl_us))  # written; the kept state reads it
    still_open = sessions.where(~closes)
    # The customer's newest closed session replaces the stored one; a customer idle for the TTL with nothing
    # open is forgotten (the rule above would forget them anyway: this only keeps the table small).
    newest_closed = (closed.withColumn("_n", F.row_number().over(
        Window.partitionBy("customer_id").orderBy(F.desc("session_end"))))
        .where(F.col("_n") == 1).select("customer_id", "session_end", "day_amount"))
    kept = (last_sessions.join(newest_closed.select("customer_id"), "customer_id", "left_anti")
            .unionByName(newest_closed)
            .join(still_open.select("customer_id").distinct().withColumn("_open", F.lit(True)), "customer_id", "left")
            .where(F.col("_open").isNotNull() | (_micros("session_end") + ttl_us > F.lit(after * 1000)))
            .select(*LAST_SESSIONS_SCHEMA.fieldNames()))
    return SessionsFold(open_sessions=still_open, last_sessions=kept, closed=closed, late=late, watermark_ms=after)


def _closed_rows(closing: DataFrame, last_sessions: DataFrame, ttl_us: int) -> DataFrame:
    """Rows of customer_activity for `closing`, oldest first per customer: the previous session's end (the
    stored one for the first), unless the session started the TTL or more after it (forgotten: null, and the
    day's spend starts again); the spend on the session's UTC day so far, the stored day's total included
    while nothing has been forgotten in between."""
    by_customer = Window.partitionBy("customer_id").orderBy("session_start")
    previous = F.coalesce(F.lag("session_end").over(by_customer), F.col("_stored_end"))
    day = F.floor(_micros("session_end") / _DAY_US)
    with_previous = (closing.join(last_sessions.select("customer_id", F.col("session_end").alias("_stored_end"),
                                                       F.col("day_amount").alias("_stored_day")), "customer_id", "left")
                     .withColumn("_previous", previous)
                     .withColumn("_forgets", (F.col("_previous").isNotNull()
                                              & (_micros("session_start") - F.unix_micros("_previous") >= ttl_us))
                                 .cast(LongType()))
                     .withColumn("_epoch", F.sum("_forgets").over(by_customer.rowsBetween(Window.unboundedPreceding, 0)))
                     .withColumn("_day", day))
    same_day = Window.partitionBy("customer_id", "_epoch", "_day").orderBy("session_start").rowsBetween(
        Window.unboundedPreceding, 0)
    stored = F.when((F.col("_epoch") == 0) & (F.floor(F.unix_micros("_stored_end") / _DAY_US) == F.col("_day")),
                    F.col("_stored_day")).otherwise(F.lit(0))
    return with_previous.select(
        "customer_id", "session_start", "session_end", "payment_count", "total_amount",
        F.transform("last_payments", lambda p: p["payment_id"]).alias("last_payment_ids"),
        F.when(F.col("_forgets") == 1, F.lit(None)).otherwise(F.col("_previous")).cast(TimestampType())
        .alias("previous_session_end"),
        (F.sum("total_amount").over(same_day) + stored).cast(TOTAL_TYPE).alias("day_amount"))


class SessionsStage(EventTimeStage):
    """The sessions step of a payments micro-batch: late payments, the open sessions, the last sessions, then
    the closed sessions as the closing commit."""

    closing_table, closing_marker, before_closing_fault = ACTIVITY, "activity_version", SESSIONS_BEFORE_CLOSING_COMMIT

    def __init__(self, layout: StorageLayout, last: Progress, settings: SessionSettings):
        super().__init__(layout, last)
        self.settings = settings

    def fold_and_write(self, rows: DataFrame, app_id: str, batch_id: int, marker: dict) -> FoldedBatch:
        spark, layout, spec = rows.sparkSession, self.layout, sessions_stream()
        payments = rows.select("customer_id", spec.id_field, spec.event_time_field, spec.value_field, "source_file",
                               "line_number")
        versions = self.last.state_versions
        fold = fold_sessions(read_state(spark, layout.table(OPEN_SESSIONS), versions[OPEN_SESSIONS]),
                             read_state(spark, layout.table(LAST_SESSIONS), versions[LAST_SESSIONS]),
                             payments, self.last.watermark_ms, self.settings)
        sessions_closed, late_count = fold.closed.count(), fold.late.count()
        if late_count:
            append_batch(fold.late, layout.table(LATE), app_id, batch_id, marker)
        fault_point(SESSIONS_AFTER_LATE_COMMIT)
        versions = {OPEN_SESSIONS: write_state(fold.open_sessions, layout.table(OPEN_SESSIONS), app_id, batch_id)}
        fault_point(SESSIONS_AFTER_OPEN_SESSIONS_COMMIT)
        versions[LAST_SESSIONS] = write_state(fold.last_sessions, layout.table(LAST_SESSIONS), app_id, batch_id)
        fault_point(SESSIONS_AFTER_LAST_SESSIONS_COMMIT)
        return FoldedBatch(fold.closed, versions, fold.watermark_ms,
                           {"sessions_closed": sessions_closed, "late_events": late_count})


def last_progress(spark: SparkSession, layout: StorageLayout) -> Progress | None:
    return event_time.last_progress(spark, layout.table(ACTIVITY), f"{ACTIVITY} and {LATE}")


def _state_from_tables(spark: SparkSession, layout: StorageLayout, last: Progress,
                       settings: SessionSettings) -> SessionsFold:
    """Tables of an earlier statetables, which kept the sessions' state in RocksDB: the state at the last
    committed batch, built once from bronze (payments up to its version that are neither late nor in a closed
    session) and customer_activity (each customer's newest session), then folded with no payments at the
    watermark the next batch would have had (the newest payment read minus the delay), as that batch would."""
    spec = sessions_stream()
    payments = (spark.read.format("delta").option("versionAsOf", last.bronze_version)
                .load(str(layout.table(spec.bronze_table))))
    late = spark.read.format("delta").load(str(layout.table(LATE))).where(F.col("stream") == spec.name)
    activity = spark.read.format("delta").load(str(layout.table(ACTIVITY)))
    in_closed = activity.select(F.col("customer_id").alias("c"), F.col("session_start").alias("s"),
                                F.col("session_end").alias("e"))
    open_payments = (payments.join(late.select(F.col("event_id").alias(spec.id_field)), spec.id_field, "left_anti")
                     .join(in_closed, (F.col("customer_id") == F.col("c"))
                           & F.col(spec.event_time_field).between(F.col("s"), F.col("e")), "left_anti"))
    newest_session = (activity.withColumn("_n", F.row_number().over(
        Window.partitionBy("customer_id").orderBy(F.desc("session_end")))).where(F.col("_n") == 1)
        .select(*LAST_SESSIONS_SCHEMA.fieldNames()))
    empty_open = spark.createDataFrame([], OPEN_SESSIONS_SCHEMA)
    # The open payments as sessions (watermark 0 and no delay bound: nothing late, nothing closes) ...
    opened = fold_sessions(empty_open, newest_session, open_payments, 0,
                           SessionSettings(dt.timedelta(days=366_000), settings.state_ttl, settings.gap))
    newest = payments.agg(F.max(F.unix_millis(spec.event_time_field))).first()[0] or 0
    # ... of which those the next watermark passes close now.
    return fold_sessions(kept_on_disk(opened.open_sessions), newest_session, open_payments.limit(0),
                         max(last.watermark_ms, newest - settings.watermark_delay // dt.timedelta(milliseconds=1)),
                         settings)


def _first_state(spark: SparkSession, layout: StorageLayout, last: Progress | None,
                 settings: SessionSettings) -> Progress:
    """The sessions' state of tables that have none yet: empty for new tables; for tables of an earlier
    statetables (state in RocksDB), built once from the tables. Recorded as batch -1 of an app id of its own, a
    commit of customer_activity carrying the progress."""
    last = last or Progress(watermark_ms=0, bronze_version=-1, state_versions={})
    start_id = new_app_id(f"{sessions_stream().name}/sessions-state")
    closed, watermark = spark.createDataFrame([], ACTIVITY_SCHEMA), last.watermark_ms
    if last.bronze_version >= 0:
        fold = _state_from_tables(spark, layout, last, settings)
        closed, watermark = kept_on_disk(fold.closed), fold.watermark_ms
        open_sessions, last_sessions = fold.open_sessions, fold.last_sessions
    else:
        open_sessions = spark.createDataFrame([], OPEN_SESSIONS_SCHEMA)
        last_sessions = spark.createDataFrame([], LAST_SESSIONS_SCHEMA)
    # A txn id of its own: Delta commits an empty append only when it carries one.
    versions = {OPEN_SESSIONS: write_state(open_sessions, layout.table(OPEN_SESSIONS), start_id, 0),
                LAST_SESSIONS: write_state(last_sessions, layout.table(LAST_SESSIONS), start_id, 0)}
    progress = {"app_id": start_id, "batch_id": -1, "watermark_ms": watermark, "bronze_version": last.bronze_version,
                "state_versions": versions, "sessions_closed": closed.count(), "late_events": 0,
                "started_because": "an earlier statetables kept the sessions in RocksDB" if last.bronze_version >= 0
                else "new tables"}
    append_batch(closed, layout.table(ACTIVITY), start_id, 0, progress)
    return Progress(watermark, last.bronze_version, versions, start_id, -1)


def ensure_session_tables(spark: SparkSession, layout: StorageLayout) -> None:
    for name, schema in ((ACTIVITY, ACTIVITY_SCHEMA), (LATE, LATE_SCHEMA), (OPEN_SESSIONS, OPEN_SESSIONS_SCHEMA),
                         (LAST_SESSIONS, LAST_SESSIONS_SCHEMA)):
        create_table_if_missing(spark, layout.table(name), schema)


def sessions_stage(spark: SparkSession, layout: StorageLayout, settings: SessionSettings = SessionSettings()
                   ) -> SessionsStage:
    """The sessions step as the last closing commit left it, for a run of the payments stream (which holds the
    stream's writer lock). The late_events rows of a batch that died before its closing commit are deleted
    first: the stream folds that batch's bronze rows again."""
    ensure_session_tables(spark, layout)
    require_settings(spark, layout.table(ACTIVITY), f"watermark-delay-{settings.watermark_delay.total_seconds():g}s."
                     f"gap-{settings.gap.total_seconds():g}s", "sessions")
    undone = undo_late_rows(spark, layout, sessions_stream().name, "activity_version",
                            table_version(spark, layout.table(ACTIVITY)) or 0)
    return resumed_stage(lambda last: SessionsStage(layout, last, settings), last_progress(spark, layout),
                         lambda last: _first_state(spark, layout, last, settings), undone,
                         kept=f"the open sessions ({OPEN_SESSIONS}, {LAST_SESSIONS})", events="payments")


def state_figures(spark: SparkSession, layout: StorageLayout) -> dict:
    """Rows and bytes of the sessions' state, per table and in all."""
    tables = {name: event_time.state_table_figures(spark, layout.table(name)) for name in (OPEN_SESSIONS, LAST_SESSIONS)}
    return {"rows": sum(t["rows"] for t in tables.values()), "bytes": sum(t["bytes"] for t in tables.values()),
            **tables}
