"""The data checks' queries, as plain functions that return figures (Dagster shows them in assets/).

Two depths for a state table:
- per run, costing what the run costs: its totals equal bronze's running totals at the bronze version
  it has folded through (bronze commits carry them, pipelines/bronze.py), its keys are unique and its
  counts positive. A state table scan is bounded by its keys; bronze history is never read.
- deep (nightly and on demand): every key's count and sum recomputed from all of bronze.
A corrupted state table fails both (tests/assets/test_dagster.py).
"""

from __future__ import annotations

import datetime as dt
from decimal import Decimal

from pyspark.sql import DataFrame, SparkSession, Window
from pyspark.sql import functions as F

from pipelines.bronze import accepted_totals
from pipelines.expiry import EXPIRED_VALUE, expired_rows, expired_totals, since_last_expiry
from pipelines.layout import StorageLayout
from pipelines.state import TOTAL_TYPE, aggregate, folded_through
from pipelines.streaming import table_version
from pipelines.sessions import ACTIVITY, last_progress as sessions_progress
from pipelines.streams import StateTableSpec, StreamSpec, sessions_stream, windows_stream
from pipelines.windows import HOURLY, LATE, TOP, last_progress, top_titles


def _state(spark: SparkSession, layout: StorageLayout, table: StateTableSpec) -> DataFrame:
    return spark.read.format("delta").load(str(layout.table(table.name)))


def state_totals(spark: SparkSession, layout: StorageLayout, table: StateTableSpec, version: int | None = None) -> dict:
    """keys, events counted, the value total and the newest event time folded into the state table (at
    `version`, default the latest), in one scan; None for what the table has no column for."""
    frame = spark.read.format("delta")
    if version is not None:
        frame = frame.option("versionAsOf", version)
    nothing = F.lit(None)
    row = frame.load(str(layout.table(table.name))).agg(
        F.count("*").alias("keys"), F.sum(table.count_column or nothing).alias("events"),
        F.sum(table.sum_column or nothing).alias("total"), F.max(table.last_ts_column or nothing).alias("latest")).first()
    return {"keys": row["keys"],
            "events_counted": (row["events"] or 0) if table.count_column else None,
            "total": (row["total"] or Decimal(0)) if table.sum_column else None,
            "latest_event_time": row["latest"]}


def totals_match_bronze(spark: SparkSession, layout: StorageLayout, spec: StreamSpec, table: StateTableSpec) -> dict:
    """The per-run reconciliation: the state table's totals against bronze's at the version the table has folded
    through, which its commits record (pinned to one table version, so a MERGE committing meanwhile cannot make
    it fail): its count of every event, and its SUM of the value bronze keeps a running total of. Falls back to
    counting bronze at that version when its commits carry no running totals. `passed` None when the table
    records no version or counts no event (COUNT(*)): the caller runs the deep check instead.
    """
    found = folded_through(spark, layout.table(table.name))
    state_version, version = (found.version, found.through) if found else (None, None)
    state = state_totals(spark, layout, table, state_version)
    state.pop("latest_event_time")
    if version is None or table.count_column is None:
        return {"covered_bronze_version": -1 if version is None else version, **state, "passed": None}
    events, total = accepted_totals(spark, str(layout.table(spec.bronze_table)), spec.value_field, version)
    # Rows a TTL expired hold events too: their running totals are in the table's newest commits.
    expired = expired_totals(spark, layout.table(table.name), as_of=state_version)
    passed = events == state["events_counted"] + expired.events
    figures = {"covered_bronze_version": version, "state_table_version": state_version, "bronze_events": events,
               **state, "expired_events": expired.events}
    if table.sum_column and table.summed_field == spec.value_field:
        passed = passed and total == state["total"] + expired.value
        figures.update({"bronze_total": total, "expired_total": expired.value})
    else:
        figures.pop("total")
    return {**figures, "passed": passed}


def duplicated_or_null_keys(spark: SparkSession, layout: StorageLayout, spec: StreamSpec,
                            table: StateTableSpec) -> DataFrame:
    """Keys held by more than one row, and NULL in a key that only a required field feeds."""
    required = [k for k in table.keys if spec.field(k).required]
    null = F.lit(False)
    for key in required:
        null = null | F.col(key).isNull()
    return _state(spark, layout, table).groupBy(*table.keys).count().where((F.col("count") > 1) | null)


def negative_rows(spark: SparkSession, layout: StorageLayout, spec: StreamSpec, table: StateTableSpec) -> DataFrame:
    """Rows whose count of events is not positive, or whose SUM of a field that cannot be negative is."""
    bad = F.lit(False)
    if table.count_column:
        bad = bad | (F.col(table.count_column) <= 0)
    for a in table.aggregates:
        rule = spec.field(a.column) if a.column else None
        if a.function == "sum" and rule.min_value is not None and Decimal(rule.min_value) >= 0:
            bad = bad | (F.col(a.name) < 0)
    return _state(spark, layout, table).where(bad)


def mismatches_with_bronze(spark: SparkSession, layout: StorageLayout, spec: StreamSpec,
                           table: StateTableSpec) -> tuple[DataFrame, dict]:
    """The deep check: keys where the state table differs from its declared query over all of bronze (every
    column), and the totals of both. A key a TTL expired is compared with its events ingested after its newest
    expiry; the expired rows' totals, read from the Change Data Feed, must equal the running totals the commits
    carry, and with the table's they must add up to bronze's."""
    table_path = layout.table(table.name)
    bronze = spark.read.format("delta").load(str(layout.table(spec.bronze_table)))
    state = _state(spark, layout, table)
    expiries = expired_rows(spark, table_path, table)
    expected = aggregate(since_last_expiry(bronze, expiries, table.keys), table)
    columns = [a.name for a in table.aggregates]
    e, st = expected.alias("e"), state.alias("s")
    on = None
    for k in table.keys:
        same = F.col(f"e.{k}").eqNullSafe(F.col(f"s.{k}"))
        on = same if on is None else on & same
    differs = F.lit(False)
    for c in columns:
        differs = differs | ~F.col(f"e.{c}").eqNullSafe(F.col(f"s.{c}"))
    mismatched = e.join(st, on, "full_outer").where(differs).select(
        *[F.coalesce(F.col(f"e.{k}"), F.col(f"s.{k}")).alias(k) for k in table.keys],
        *[x for c in columns for x in (F.col(f"e.{c}").alias(f"expected_{c}"), F.col(f"s.{c}").alias(c))])
    expired = expired_totals(spark, table_path)
    in_feed = (expiries.agg(F.count("*"), F.sum(table.count_column), F.sum(EXPIRED_VALUE)).first()
               if expiries is not None else (0, None, None))
    totals = {"distinct_accepted_events": bronze.select(spec.id_field, "content_hash").distinct().count(),
              "expired_keys": expired.keys, "expired_events": expired.events,
              "expiries_match_change_feed": (in_feed[0], in_feed[1] or 0, in_feed[2] or 0) == (
                  expired.keys, expired.events, expired.value)}
    passed = totals["expiries_match_change_feed"]
    if table.count_column:
        totals["sum_of_counts"] = (state.agg(F.sum(table.count_column)).first()[0] or 0) + expired.events
        passed = passed and totals["sum_of_counts"] == totals["distinct_accepted_events"]
    if table.sum_column:
        totals["bronze_sum"] = str(bronze.agg(F.sum(table.summed_field)).first()[0] or 0)
        totals["state_sum"] = str((state.agg(F.sum(table.sum_column)).first()[0] or 0) + expired.value)
        passed = passed and totals["bronze_sum"] == totals["state_sum"]
    totals["totals_agree"] = passed
    return mismatched, totals


def quarantine_reasons(spark: SparkSession, layout: StorageLayout, spec: StreamSpec, before: int | None,
                       after: int | None) -> DataFrame:
    """Lines quarantined by table versions (before, after], by reason, from the change feed (the run's rows only)."""
    if after is None or after <= (before or 0):
        return spark.createDataFrame([], "reason string, reason_field string, count long")
    written = (spark.read.format("delta").option("readChangeFeed", "true")
               .option("startingVersion", (before or 0) + 1).option("endingVersion", after)
               .load(str(layout.table(spec.quarantine_table))).where(F.col("_change_type") == "insert"))
    return written.groupBy("reason", "reason_field").count().orderBy(F.desc("count"))


def _late_figures(late: DataFrame) -> tuple[int, int]:
    """(late events, those not at or behind the watermark they were said to miss). The operators' rule: an
    event exactly at the watermark is late, so only an event time after it is wrong."""
    row = late.agg(F.count("*"), F.count(F.when(F.col("event_time") > F.col("watermark"), 1))).first()
    return row[0], row[1]


def windows_mismatches(spark: SparkSession, layout: StorageLayout,
                       since_version: int | None = None) -> tuple[DataFrame, dict]:
    """The hours that closed after `tickets_per_title_hourly` version `since_version` (every hour when
    None), against bronze at the version the windows query has read.

    One watermark closes an hour for every title at once, so each sale of a closed hour is either in
    `late_events` or counted in its (title, hour) window: the window's tickets and value equal the
    hour's sales minus the late ones, and the hour's sales are those two added up. Per run the cost is
    the hours that run closed: bronze is read through its event-time file statistics, not whole.
    """
    spec = windows_stream()
    progress = last_progress(spark, layout)
    hourly = spark.read.format("delta").load(str(layout.table(HOURLY)))
    closed = hourly
    if since_version is not None and since_version >= (table_version(spark, layout.table(HOURLY)) or 0):
        closed = hourly.limit(0)  # nothing committed since: Delta refuses a change feed that starts later
    elif since_version is not None:
        closed = (spark.read.format("delta").option("readChangeFeed", "true")
                  .option("startingVersion", since_version + 1).load(str(layout.table(HOURLY)))
                  .where(F.col("_change_type") == "insert"))
    hours = sorted(r[0] for r in closed.select("window_start").distinct().collect())
    figures = {"hours_checked": len(hours), "sales": 0, "late_events": 0, "in_closed_windows": 0,
               "late_not_in_bronze": 0, "late_not_behind_watermark": 0,
               "bronze_version": progress.bronze_version if progress else -1}
    empty = spark.createDataFrame([], "title string, window_start timestamp, expected_tickets long, tickets_sold long")
    if not hours or progress is None:
        return empty, figures
    hour = F.date_trunc("hour", F.col(spec.event_time_field))
    span = (F.col(spec.event_time_field) >= F.lit(hours[0])) & (
        F.col(spec.event_time_field) < F.lit(hours[-1] + dt.timedelta(hours=1)))
    sales = (spark.read.format("delta").option("versionAsOf", progress.bronze_version)
             .load(str(layout.table(spec.bronze_table))).where(span & hour.isin(hours)))
    late = (spark.read.format("delta").load(str(layout.table(LATE)))
            .where((F.col("stream") == spec.name) & (F.col("event_time") >= F.lit(hours[0]))
                   & F.date_trunc("hour", "event_time").isin(hours)))
    on_time = sales.join(late.select(F.col("event_id").alias(spec.id_field)), spec.id_field, "left_anti")
    expected = on_time.groupBy("title", hour.alias("window_start")).agg(
        F.count("*").alias("expected_tickets"), F.sum(spec.value_field).cast(TOTAL_TYPE).alias("expected_value"))
    actual = hourly.where(F.col("window_start").isin(hours))
    mismatched = (expected.join(actual.select("title", "window_start", "tickets_sold", "total_ticket_value"),
                                ["title", "window_start"], "full_outer")
                  .where(~F.col("expected_tickets").eqNullSafe(F.col("tickets_sold"))
                         | ~F.col("expected_value").eqNullSafe(F.col("total_ticket_value"))))
    late_in_bronze = late.join(sales.select(F.col(spec.id_field).alias("event_id")), "event_id", "left_semi").count()
    late_count, not_behind = _late_figures(late)
    figures.update({"sales": sales.count(), "late_events": late_in_bronze,
                    "in_closed_windows": actual.agg(F.sum("tickets_sold")).first()[0] or 0,
                    "late_not_in_bronze": late_count - late_in_bronze, "late_not_behind_watermark": not_behind})
    return mismatched, figures


def top_titles_mismatches(spark: SparkSession, layout: StorageLayout) -> DataFrame:
    """Rows of `top_titles_hourly` that differ from the ranking recomputed from `tickets_per_title_hourly`
    (either side), with `side` saying which table holds the row."""
    stored = spark.read.format("delta").load(str(layout.table(TOP)))
    recomputed = top_titles(spark.read.format("delta").load(str(layout.table(HOURLY))))
    return (stored.exceptAll(recomputed).withColumn("side", F.lit("only in top_titles_hourly"))
            .unionByName(recomputed.exceptAll(stored).withColumn("side", F.lit("missing from top_titles_hourly"))))


def recomputed_sessions(payments: DataFrame, gap: dt.timedelta) -> DataFrame:
    """The contract's sessions of `payments`, recomputed with window functions: per customer, in event-time
    order, a payment *less than* `gap` after the previous one joins its session; `gap` or more starts a new
    one. Not Spark's `session_window`: that merges a session with the next when the next starts exactly at
    its last payment + gap, so at an exact 30-minute gap it disagreed with the contract (issue 26).
    Ties in event time are ordered by id, which changes no session: equal times are 0 apart."""
    spec = sessions_stream()
    at = F.unix_micros(spec.event_time_field)
    in_order = Window.partitionBy("customer_id").orderBy(spec.event_time_field, spec.id_field)
    starts = F.when(F.lag(at).over(in_order).isNull()
                    | (at - F.lag(at).over(in_order) >= gap // dt.timedelta(microseconds=1)), 1).otherwise(0)
    numbered = (payments.withColumn("_starts", starts)
                .withColumn("_session", F.sum("_starts").over(in_order.rowsBetween(Window.unboundedPreceding, 0))))
    return numbered.groupBy("customer_id", "_session").agg(
        F.min(spec.event_time_field).alias("session_start"), F.max(spec.event_time_field).alias("expected_end"),
        F.count("*").alias("expected_payments"),
        F.sum(spec.value_field).cast(TOTAL_TYPE).alias("expected_amount")).drop("_session")


def sessions_mismatches(spark: SparkSession, layout: StorageLayout) -> tuple[DataFrame, dict]:
    """customer_activity against the sessions recomputed from bronze (`recomputed_sessions`), at the
    bronze version and watermark the sessions query has reached: the payments that are not in
    late_events, cut by the contract's gap rule; each session the watermark has closed (a gap past its
    last payment, the operator's rule) must be a row with the same end, count and amount, and each row
    such a session. A second implementation of the rule with the same edges, so a fault in the operator
    (or a corrupted row) shows. Previous session and day totals depend on the TTL and are not
    recomputed. One pass over bronze."""
    spec = sessions_stream()
    gap = spec.sessions.gap
    progress = sessions_progress(spark, layout)
    activity = spark.read.format("delta").load(str(layout.table(ACTIVITY))).select(
        "customer_id", "session_start", "session_end", "payment_count", "total_amount")
    late = spark.read.format("delta").load(str(layout.table(LATE))).where(F.col("stream") == spec.name)
    if progress is None or progress.bronze_version < 0:
        payments = spark.createDataFrame([], "customer_id string, payment_id string, paid_at timestamp, amount decimal(18,2)")
    else:
        payments = (spark.read.format("delta").option("versionAsOf", progress.bronze_version)
                    .load(str(layout.table(spec.bronze_table))))
    on_time = payments.join(late.select(F.col("event_id").alias(spec.id_field)), spec.id_field, "left_anti")
    recomputed = recomputed_sessions(on_time, gap).where(
        F.unix_micros("expected_end") + gap // dt.timedelta(microseconds=1)
        <= (progress.watermark_ms if progress else 0) * 1000)
    mismatched = (recomputed.join(activity, ["customer_id", "session_start"], "full_outer")
                  .where(~F.col("expected_end").eqNullSafe(F.col("session_end"))
                         | ~F.col("expected_payments").eqNullSafe(F.col("payment_count"))
                         | ~F.col("expected_amount").eqNullSafe(F.col("total_amount"))))
    totals = activity.agg(F.count("*"), F.sum("payment_count")).first()
    late_in_bronze = late.join(payments.select(F.col(spec.id_field).alias("event_id")), "event_id", "left_semi").count()
    late_count, not_behind = _late_figures(late)
    figures = {"sessions_checked": totals[0], "payments_in_sessions": totals[1] or 0, "late_events": late_in_bronze,
               "late_not_in_bronze": late_count - late_in_bronze, "late_not_behind_watermark": not_behind,
               "bronze_version": progress.bronze_version if progress else -1}
    return mismatched, figures
