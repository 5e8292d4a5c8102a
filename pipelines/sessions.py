"""Payments in per-customer activity sessions: `customer_activity`, one row per closed session.

A session is a customer's payments with less than 30 minutes between one and the next: exactly 30
minutes apart is two sessions (not Spark's `session_window`, which merges at exactly the gap). It closes once the watermark (newest payment seen minus the delay) is 30
minutes past its last payment: no payment still to come can join it. Its row says when it started and
ended, how many payments and how much, the last five payment ids, when the customer's previous session
ended, and how much the customer spent that day.

One streaming query reads `payments_bronze` with `transformWithState` (event-time mode, RocksDB state
store), keyed by customer. Which state does what (`CustomerSessions`):
- list state `open_payments`: the payments of the customer's open sessions. The payments themselves,
  not a running count: a payment arriving out of order (within the watermark) can join two sessions
  into one, so a session is only known once it closes;
- an event-time timer at the last payment + 30 minutes of the open session that closes first: it
  closes that session (and any other the watermark has passed), then is set for the next;
- value state `last_session`: when the customer's previous session ended;
- map state `day_amount`: the customer's spend per UTC day (a session counts on the day it ended);
  days more than the TTL old are dropped;
- TTL, D days of event time (default 30): a customer idle that long is forgotten, so the state holds
  active customers only, and their next session has no previous session and a fresh day total. An
  event-time timer at the last session's end + D clears the value and map state. Not Spark's state
  TTL: Spark refuses it in event-time mode (STATEFUL_PROCESSOR_INCORRECT_TIME_MODE_TO_ASSIGN_TTL), and
  the sessions need event-time timers. Event time also makes the rule exact and repeatable: a session
  starting D or more after the previous one's end has forgotten it, whether or not the timer has fired
  yet (`close_sessions`), so a replay or a rebuild writes the same rows.

Written by hand because Spark's `session_window` aggregation drops payments behind the watermark
silently and keeps no state beyond the session; the contract forbids the first, and the previous
session and the day's spend need the second. Late payments go to late_events (`stream` = payments)
and still count in payments_per_customer.

Exactly once as in windows.py: late_events is written with idempotent appends, then every batch
commits to customer_activity, even empty, with the watermark and the bronze version reached. A lost
checkpoint is rebuilt from the tables (`_restart`), never reset to nothing.
"""

from __future__ import annotations

import datetime as dt
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable, Iterator

from pyspark.sql import DataFrame, Row, SparkSession, Window
from pyspark.sql import functions as F
from pyspark.sql.streaming import StatefulProcessor, StatefulProcessorHandle
from pyspark.sql.types import ArrayType, LongType, StringType, StructField, StructType, TimestampType

from pipelines import event_time
from pipelines.bronze import ensure_bronze_tables
from pipelines.checkpoints import (
    batch_end_version, batch_watermark_ms, checkpoint_for_run, new_app_id, start_checkpoint,
)
from pipelines.event_time import LATE, LATE_SCHEMA, Progress, append_batch, late_rows, micros, undo_late_rows
from pipelines.faults import SESSIONS_BEFORE_CLOSING_COMMIT, fault_point
from pipelines.layout import StorageLayout
from pipelines.state import TOTAL_TYPE
from pipelines.streaming import (
    Continuous, StreamRunResult, TableVersions, commits_since, create_table_if_missing, require_writable, run_query,
    source_ready, storage_errors, table_id, table_version, writer_lock,
)
from pipelines.streams import PAYMENTS

ACTIVITY = "customer_activity"
SESSIONS_QUERY = f"{ACTIVITY}_sessions"
SESSION_GAP = dt.timedelta(minutes=30)
DEFAULT_WATERMARK_DELAY = dt.timedelta(minutes=10)
DEFAULT_STATE_TTL = dt.timedelta(days=30)
LAST_PAYMENTS = 5
_DAY_US = 86_400_000_000

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
_SESSION_FIELDS = ("session_start_us", "session_end_us", "payment_count", "amount_cents", "last_payment_ids",
                   "previous_session_end_us", "day_amount_cents")
# What the operator emits: a closed session (kind "session") or a late payment (kind "late").
_EMITTED = StructType([
    StructField("kind", StringType()), StructField("customer_id", StringType()),
    StructField("session_start_us", LongType()), StructField("session_end_us", LongType()),
    StructField("payment_count", LongType()), StructField("amount_cents", LongType()),
    StructField("last_payment_ids", ArrayType(StringType())), StructField("previous_session_end_us", LongType()),
    StructField("day_amount_cents", LongType()),
    StructField("event_id", StringType()), StructField("event_time", TimestampType()),
    StructField("watermark_ms", LongType()), StructField("source_file", StringType()),
    StructField("line_number", LongType()),
])
_PAYMENT = StructType([StructField("payment_id", StringType()), StructField("paid_at_us", LongType()),
                       StructField("amount_cents", LongType())])
_LAST_SESSION = StructType([StructField("session_end_us", LongType())])
_DAY = StructType([StructField("day", LongType())])
_CENTS = StructType([StructField("cents", LongType())])
# The initial state of a rebuilt query, one row per entry: an open payment (kind "payment"), the last
# session's end ("last_session") or a day's spend ("day").
_INITIAL = StructType([
    StructField("customer_id", StringType()), StructField("kind", StringType()),
    StructField("payment_id", StringType()), StructField("paid_at_us", LongType()), StructField("cents", LongType()),
    StructField("day", LongType()),
])

Payment = tuple  # (payment_id, paid_at_us, amount_cents)


def split_sessions(payments: list[Payment], gap_us: int) -> list[list[Payment]]:
    """Payments in sessions, oldest first: a payment less than `gap_us` after the previous one joins it."""
    sessions: list[list[Payment]] = []
    for payment in sorted(payments, key=lambda p: (p[1], p[0])):
        if sessions and payment[1] - sessions[-1][-1][1] < gap_us:
            sessions[-1].append(payment)
        else:
            sessions.append([payment])
    return sessions


def close_sessions(customer: str, payments: list[Payment], watermark_us: int, previous_end_us: int | None,
                   day_cents: Callable[[int], int], ttl_us: int, gap_us: int
                   ) -> tuple[list[dict], list[Payment], int | None, dict[int, int], bool]:
    """The sessions the watermark has closed (no payment after it can join them), as rows, oldest first;
    the payments still open; the customer's last session end, the day totals it changed, and whether
    the customer had been forgotten (idle for the TTL: earlier day totals no longer count).
    Used by the operator and by a restart, so both close sessions alike."""
    rows, still_open, days, forgot = [], [], {}, False
    for session in split_sessions(payments, gap_us):
        end = session[-1][1]
        if watermark_us < end + gap_us:
            still_open.extend(session)
            continue
        if previous_end_us is not None and session[0][1] - previous_end_us >= ttl_us:
            previous_end_us, days, forgot = None, {}, True
        cents = sum(p[2] for p in session)
        day = end // _DAY_US
        days[day] = days.get(day, 0 if forgot else day_cents(day)) + cents
        rows.append({"customer_id": customer, "session_start_us": session[0][1], "session_end_us": end,
                     "payment_count": len(session), "amount_cents": cents,
                     "last_payment_ids": [p[0] for p in reversed(session[-LAST_PAYMENTS:])],
                     "previous_session_end_us": previous_end_us, "day_amount_cents": days[day]})
        previous_end_us = end
    return rows, still_open, previous_end_us, days, forgot


def _timer_ms(due_us: int) -> int:
    """The timer that fires once the watermark reaches `due_us`: Spark fires a timer at t ms for a
    watermark of t + 1 ms or more."""
    return -(-due_us // 1000) - 1


class CustomerSessions(StatefulProcessor):
    """Per customer: open sessions in list state, closed by event-time timers; the last session's end
    (value state) and the spend per day (map state), cleared by a timer once the customer has been
    idle for the TTL. The module docstring says why each is there.

    A payment is late when its event time is at or behind the watermark (Spark's own rule), or behind
    `closed_through_ms`, the watermark a lost checkpoint had reached, until Spark's passes it."""

    def __init__(self, ttl_us: int, gap_us: int, closed_through_ms: int = 0):
        self.ttl_us, self.gap_us, self.closed_through_ms = ttl_us, gap_us, closed_through_ms

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.handle = handle
        self.open_payments = handle.getListState("open_payments", _PAYMENT)
        self.last_session = handle.getValueState("last_session", _LAST_SESSION)
        self.day_amount = handle.getMapState("day_amount", _DAY, _CENTS)

    def _open(self) -> list[Payment]:
        return [tuple(p) for p in self.open_payments.get()] if self.open_payments.exists() else []

    def _add(self, payments: list[Payment]) -> None:
        payments = self._open() + payments
        self.open_payments.put(payments)
        self._time_first_close(payments)

    def _time_first_close(self, payments: list[Payment]) -> None:
        """One timer per customer, for the open session that closes first; the next one is set when it
        fires. Every state call is a round trip to the JVM, so a timer per session cost a firing per
        session when a backlog closed them all at once. A timer whose session later grew finds nothing
        to close; the grown session's own timer was set when it grew."""
        first = split_sessions(payments, self.gap_us)[0]
        self.handle.registerTimer(_timer_ms(first[-1][1] + self.gap_us))

    def handleInputRows(self, key, rows, timerValues) -> Iterator[Row]:
        watermark_ms = max(timerValues.getCurrentWatermarkInMs(), self.closed_through_ms)
        arrived = []
        for row in rows:
            paid_us = micros(row.paid_at)
            if paid_us <= watermark_ms * 1000:
                yield Row(kind="late", customer_id=key[0], **dict.fromkeys(_SESSION_FIELDS), event_id=row.payment_id,
                          event_time=row.paid_at, watermark_ms=watermark_ms, source_file=row.source_file,
                          line_number=row.line_number)
                continue
            arrived.append((row.payment_id, paid_us, int(row.amount * 100)))  # DECIMAL(18,2): exact in cents
        if arrived:
            self._add(arrived)

    def handleExpiredTimer(self, key, timerValues, expiredTimerInfo) -> Iterator[Row]:
        watermark_us = timerValues.getCurrentWatermarkInMs() * 1000
        last = self.last_session.get() if self.last_session.exists() else None

        def day_cents(day: int) -> int:
            found = self.day_amount.getValue((day,))
            return found[0] if found else 0

        payments = self._open()
        rows, still_open, last_end, days, forgot = close_sessions(
            key[0], payments, watermark_us, last[0] if last else None, day_cents, self.ttl_us, self.gap_us)
        if not rows:
            # A session's timer that later grew or merged, or the TTL timer: an idle customer is forgotten.
            if not payments and last is not None and watermark_us >= last[0] + self.ttl_us:
                self.last_session.clear()
                self.day_amount.clear()
            return
        self.open_payments.clear()
        if still_open:
            self.open_payments.put(still_open)
            self._time_first_close(still_open)
        if forgot:
            self.day_amount.clear()
        self.last_session.update((last_end,))
        for day, cents in days.items():
            self.day_amount.updateValue((day,), (cents,))
        oldest_kept = (last_end - self.ttl_us) // _DAY_US
        for (day,) in list(self.day_amount.keys()):
            if day < oldest_kept:
                self.day_amount.removeKey((day,))
        self.handle.registerTimer(_timer_ms(last_end + self.ttl_us))
        for row in rows:
            yield Row(kind="session", **row, **dict.fromkeys(
                ("event_id", "event_time", "watermark_ms", "source_file", "line_number")))

    def handleInitialState(self, key, initialState, timerValues) -> None:
        if initialState.kind == "payment":
            self._add([(initialState.payment_id, initialState.paid_at_us, initialState.cents)])
        elif initialState.kind == "last_session":
            self.last_session.update((initialState.paid_at_us,))
            self.handle.registerTimer(_timer_ms(initialState.paid_at_us + self.ttl_us))
        else:
            self.day_amount.updateValue((initialState.day,), (initialState.cents,))

    def close(self) -> None:
        pass


def _sessions_as_rows(sessions: DataFrame) -> DataFrame:
    """Operator rows of kind "session" (or a restart's) as rows of customer_activity."""
    cents = lambda name: (F.col(name).cast(TOTAL_TYPE) / 100).cast(TOTAL_TYPE)  # noqa: E731
    return sessions.select(
        "customer_id", F.timestamp_micros("session_start_us").alias("session_start"),
        F.timestamp_micros("session_end_us").alias("session_end"), "payment_count",
        cents("amount_cents").alias("total_amount"), "last_payment_ids",
        F.timestamp_micros("previous_session_end_us").alias("previous_session_end"),
        cents("day_amount_cents").alias("day_amount"))


def _commit_outputs(layout: StorageLayout, sessions: DataFrame, late: DataFrame | None, *, app_id: str,
                    batch_id: int, progress: dict) -> None:
    """Late payments, then the closed sessions: this last commit, made on every batch, says the batch
    is done and what it reached. An unfinished batch is replayed, or undone at a restart."""
    path = layout.table(ACTIVITY)
    closing_version = (table_version(sessions.sparkSession, path) or 0) + 1
    if late is not None:
        append_batch(late, layout.table(LATE), app_id, batch_id,
                     {"app_id": app_id, "batch_id": batch_id, "activity_version": closing_version})
    fault_point(SESSIONS_BEFORE_CLOSING_COMMIT)
    append_batch(sessions, path, app_id, batch_id, progress)


def write_sessions(emitted: DataFrame, batch_id: int, *, layout: StorageLayout, checkpoint: Path,
                   app_id: str, closed_through_ms: int) -> None:
    """foreachBatch body: the sessions that closed and the late payments."""
    emitted = emitted.localCheckpoint()  # read up to three times below; the operator must run once
    kinds = dict(emitted.groupBy("kind").count().collect())
    late = late_rows(emitted, PAYMENTS.name) if kinds.get("late") else None
    sessions = _sessions_as_rows(emitted.where(F.col("kind") == "session"))
    progress = {"app_id": app_id, "batch_id": batch_id,
                "watermark_ms": max(batch_watermark_ms(checkpoint, batch_id), closed_through_ms),
                "bronze_version": batch_end_version(checkpoint, batch_id),
                "sessions_closed": kinds.get("session", 0), "late_events": kinds.get("late", 0)}
    _commit_outputs(layout, sessions, late, app_id=app_id, batch_id=batch_id, progress=progress)


def last_progress(spark: SparkSession, layout: StorageLayout) -> Progress | None:
    return event_time.last_progress(spark, layout.table(ACTIVITY), f"{ACTIVITY} and {LATE}")


def _open_payments(spark: SparkSession, layout: StorageLayout, through_version: int) -> DataFrame:
    """The payments in bronze up to `through_version` that are neither late nor in a closed session:
    what the operator held open at that point. Sessions are maximal, so a payment of the customer
    between a closed session's first and last payment is in it."""
    spec = PAYMENTS
    payments = (spark.read.format("delta").option("versionAsOf", through_version)
                .load(str(layout.table(spec.bronze_table))))
    late = spark.read.format("delta").load(str(layout.table(LATE))).where(F.col("stream") == spec.name)
    closed = spark.read.format("delta").load(str(layout.table(ACTIVITY))).select(
        F.col("customer_id").alias("c"), "session_start", "session_end")
    in_closed = ((F.col("customer_id") == F.col("c")) & F.col(spec.event_time_field).between(
        F.col("session_start"), F.col("session_end")))
    return (payments.join(late.select(F.col("event_id").alias(spec.id_field)), spec.id_field, "left_anti")
            .join(closed, in_closed, "left_anti")
            .select("customer_id", spec.id_field, F.unix_micros(spec.event_time_field).alias("paid_at_us"),
                    (F.col(spec.value_field) * 100).cast(LongType()).alias("cents")))


def _kept_state(spark: SparkSession, layout: StorageLayout, ttl_us: int, watermark_ms: int,
                customers: list[str] | None = None) -> DataFrame:
    """The value and map state the operator holds, from customer_activity: per customer the newest
    session's end, per (customer, day) the newest session's day total; customers idle for the TTL at
    `watermark_ms` are left out, as the operator forgets them."""
    sessions = spark.read.format("delta").load(str(layout.table(ACTIVITY))).where(
        F.unix_micros("session_end") + ttl_us > watermark_ms * 1000)
    if customers is not None:
        sessions = sessions.where(F.col("customer_id").isin(customers))
    newest = lambda *keys: F.row_number().over(Window.partitionBy(*keys).orderBy(F.desc("session_end")))  # noqa: E731
    day = (F.unix_micros("session_end") / _DAY_US).cast(LongType())
    last = (sessions.withColumn("_n", newest("customer_id")).where(F.col("_n") == 1)
            .select("customer_id", F.lit("last_session").alias("kind"), F.lit(None).cast(StringType()).alias("payment_id"),
                    F.unix_micros("session_end").alias("paid_at_us"), F.lit(None).cast(LongType()).alias("cents"),
                    F.lit(None).cast(LongType()).alias("day")))
    days = (sessions.withColumn("day", day).withColumn("_n", newest("customer_id", "day")).where(F.col("_n") == 1)
            .select("customer_id", F.lit("day").alias("kind"), F.lit(None).cast(StringType()).alias("payment_id"),
                    F.lit(None).cast(LongType()).alias("paid_at_us"),
                    (F.col("day_amount") * 100).cast(LongType()).alias("cents"), "day"))
    return last.unionByName(days)


def _restart(spark: SparkSession, layout: StorageLayout, last: Progress | None, app_id: str, reason: str,
             delay: dt.timedelta, ttl_us: int, gap_us: int) -> tuple[Progress, list[tuple]]:
    """Start the sessions again after the last committed batch, exactly where they were left.

    The watermark the next batch would have had is the newest payment read so far minus the delay; the
    sessions it closes are closed now (`close_sessions`, as the operator would) and written as batch -1
    of `app_id`. Returns that watermark and the payments still open, the operator's initial state."""
    spec = PAYMENTS
    last = last or Progress(watermark_ms=0, bronze_version=-1)
    undone = undo_late_rows(spark, layout, spec.name, "activity_version", table_version(spark, layout.table(ACTIVITY)) or 0)
    watermark, rows, still_open = last.watermark_ms, [], []
    if last.bronze_version >= 0:
        newest = (spark.read.format("delta").option("versionAsOf", last.bronze_version)
                  .load(str(layout.table(spec.bronze_table))).agg(F.max(F.unix_millis(spec.event_time_field))).first()[0])
        if newest is not None:
            watermark = max(watermark, newest - delay // dt.timedelta(milliseconds=1))
        # Open payments are those of active customers in the last delay + gap or so: few, so the
        # sessions are closed here, in Python, by the same code as the operator's.
        by_customer: dict[str, list[Payment]] = {}
        for r in _open_payments(spark, layout, last.bronze_version).collect():
            by_customer.setdefault(r.customer_id, []).append((r[spec.id_field], r.paid_at_us, r.cents))
        kept: dict[str, dict] = {}
        closing = [c for c, payments in by_customer.items()
                   if any(watermark * 1000 >= s[-1][1] + gap_us for s in split_sessions(payments, gap_us))]
        if closing:
            for r in _kept_state(spark, layout, ttl_us, watermark, closing).collect():
                entry = kept.setdefault(r.customer_id, {"last": None, "days": {}})
                if r.kind == "last_session":
                    entry["last"] = r.paid_at_us
                else:
                    entry["days"][r.day] = r.cents
        for customer, payments in by_customer.items():
            entry = kept.get(customer, {"last": None, "days": {}})
            closed, open_now, *_ = close_sessions(customer, payments, watermark * 1000, entry["last"],
                                                  lambda day, e=entry: e["days"].get(day, 0), ttl_us, gap_us)
            rows.extend(closed)
            still_open.extend((customer, *p) for p in open_now)
    sessions = _sessions_as_rows(spark.createDataFrame(rows, _EMITTED)) if rows else spark.createDataFrame([], ACTIVITY_SCHEMA)
    progress = {"app_id": app_id, "batch_id": -1, "watermark_ms": watermark, "bronze_version": last.bronze_version,
                "sessions_closed": len(rows), "late_events": 0, "restarted_because": reason, "undone": undone}
    # A txn id of its own: Delta commits an empty append only when it carries one, and this record must exist.
    _commit_outputs(layout, sessions, None, app_id=f"{app_id}/restart", batch_id=0, progress=progress)
    return Progress(watermark, last.bronze_version), still_open


def _initial_state(spark: SparkSession, layout: StorageLayout, open_payments: list[tuple], ttl_us: int,
                   watermark_ms: int) -> DataFrame:
    payments = spark.createDataFrame(
        [(c, "payment", pid, at, cents, None) for c, pid, at, cents in open_payments], _INITIAL)
    return payments.unionByName(_kept_state(spark, layout, ttl_us, watermark_ms))


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


def update_sessions(spark: SparkSession, layout: StorageLayout, settings: SessionSettings = SessionSettings(), *,
                    lock_timeout_s: float = 60.0, continuous: Continuous | None = None) -> StreamRunResult:
    """Fold every bronze payment not yet seen into the customers' sessions; write the ones that closed.

    Without a trusted checkpoint (first run, lost, corrupt) the query starts again after the last
    committed batch (`_restart`); open sessions, last sessions and day totals come back as the
    operator's initial state.

    >>> update_sessions(spark, StorageLayout.under("data")).micro_batches
    """
    spec = PAYMENTS
    started = time.monotonic()
    gap_us = settings.gap // dt.timedelta(microseconds=1)
    ttl_us = settings.state_ttl // dt.timedelta(microseconds=1)
    checkpoint = layout.checkpoint(SESSIONS_QUERY)
    path, bronze_path = layout.table(ACTIVITY), layout.table(spec.bronze_table)
    require_writable([layout.locks, path.parent, layout.checkpoints_root])
    with writer_lock(layout.locks, SESSIONS_QUERY, lock_timeout_s), storage_errors():
        ensure_bronze_tables(spark, layout, spec)
        for name, schema in ((ACTIVITY, ACTIVITY_SCHEMA), (LATE, LATE_SCHEMA)):
            create_table_if_missing(spark, layout.table(name), schema)
        before = {name: table_version(spark, layout.table(name)) for name in (ACTIVITY, LATE)}
        bronze_id = table_id(spark, bronze_path)
        verdict, moved = checkpoint_for_run(spark, checkpoint, layout.set_aside_checkpoints, [path],
                                            source_table_id=bronze_id, stateful=True)
        origin, recovery, still_open = verdict.origin, None, None
        if origin is None:
            last = last_progress(spark, layout)
            reason = verdict.problem or (f"{checkpoint} is missing, but {ACTIVITY} holds batches written from an "
                                         f"earlier checkpoint" if last else "no checkpoint yet")
            app_id = new_app_id(SESSIONS_QUERY)
            start, still_open = _restart(spark, layout, last, app_id, reason, settings.watermark_delay,
                                         ttl_us, gap_us)
            origin = start_checkpoint(checkpoint, SESSIONS_QUERY, reason, app_id=app_id,
                                      source_start_version=start.bronze_version + 1, source_table_id=bronze_id,
                                      closed_through_ms=start.watermark_ms)
            if verdict.problem or moved or last:
                closed = dt.datetime.fromtimestamp(start.watermark_ms / 1000, dt.timezone.utc)
                recovery = {"problem": reason, "set_aside": str(moved) if moved else None,
                            "action": f"restarted {SESSIONS_QUERY} after bronze version {start.bronze_version}: "
                                      f"sessions closed up to {closed:%Y-%m-%d %H:%M:%S} written, open ones "
                                      f"rebuilt from bronze and {ACTIVITY} as the operator's initial state"}
        closed_through = origin.closed_through_ms or 0
        initial = None
        if not any((checkpoint / "commits").glob("[0-9]*")) and origin.source_start_version:
            # Until its first batch commits, a restarted query takes its initial state on every start.
            if still_open is None:  # a run after a restart that died before its first batch
                still_open = [(r.customer_id, r[spec.id_field], r.paid_at_us, r.cents) for r in _open_payments(
                    spark, layout, origin.source_start_version - 1).collect()]
            initial = _initial_state(spark, layout, still_open, ttl_us, closed_through)
        batches = rows = 0
        reports: list = []
        start_version = origin.source_start_version
        has_offsets = any((checkpoint / "offsets").glob("[0-9]*"))
        if source_ready(lambda: has_offsets or start_version is None
                        or start_version <= table_version(spark, bronze_path), continuous):
            events = spark.readStream.format("delta").option("maxFilesPerTrigger", 1_000_000)  # whole versions
            if start_version is not None:
                events = events.option("startingVersion", start_version)
            # As in windows.py: the watermark is Spark's, but its column is dropped before the operator,
            # so that Spark does not drop the late payments there.
            payments = (events.load(str(bronze_path))
                        .withColumn("_event_time", F.col(spec.event_time_field))
                        .withWatermark("_event_time", f"{int(settings.watermark_delay.total_seconds())} seconds")
                        .select("customer_id", spec.id_field, spec.event_time_field, spec.value_field,
                                "source_file", "line_number"))
            emitted = payments.groupBy("customer_id").transformWithState(
                CustomerSessions(ttl_us, gap_us, closed_through), _EMITTED, "Append", "EventTime",
                initialState=initial.groupBy("customer_id") if initial is not None else None)
            on_batch = partial(write_sessions, layout=layout, checkpoint=checkpoint, app_id=origin.app_id,
                               closed_through_ms=closed_through)
            batches, rows = run_query(emitted, query_name=SESSIONS_QUERY, checkpoint_dir=checkpoint,
                                              on_batch=on_batch, progress=reports,
                                      continuous=continuous)
        return StreamRunResult(
            query_name=SESSIONS_QUERY, micro_batches=batches, rows_read=rows, duration_s=time.monotonic() - started,
            versions={name: TableVersions(before[name], table_version(spark, layout.table(name)))
                      for name in (ACTIVITY, LATE)},
            commits={ACTIVITY: commits_since(spark, path, before[ACTIVITY])},
            recovery=recovery,
            operator_state=event_time.operator_state(reports),
        )
