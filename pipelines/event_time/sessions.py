"""Session tables: `GROUP BY keys, session_window(event_time, gap)`, one row per closed session of a key.

A session is a key's events with less than the gap between one and the next: exactly the gap apart is two
sessions (the contract's rule: "less than 30 minutes apart form one session"). Spark's own `session_window`
merges windows that touch, so it puts two events exactly the gap apart in one session. It closes once the
watermark (newest event of the earlier batches minus the stream's delay) is a gap past its last event: no event
still to come can join it. Its row is final then: the declared aggregates, `session_window.start` (its first
event) and `session_window.end` (its last event plus the gap, as Spark's), and two kinds of per-key values a
session carries from the ones before it:
- LAG(agg) OVER (PARTITION BY keys ORDER BY MIN(event_time)): the previous session's value of an aggregate;
- SUM(agg) OVER (PARTITION BY keys, DATE(MAX(event_time)) ORDER BY MIN(event_time)): the running total of the
  key's sessions that end on the same UTC day.
With `ttl_days`, a session starting that long or more after the key's previous session ended has forgotten it
(no previous value, a fresh day total); event time makes the rule exact and repeatable.

Operator state is one Delta table, `<table>_state`, so any reader can query a key's open session, and nothing
depends on the number of partitions: a row per open session (`_open`: its first and last event and the
aggregates' partial columns; sessions, not events: an event arriving out of order within the watermark can join
two open sessions into one, and the rows hold what that needs), and, when the table declares per-key values, a
row per key (`_open` false) with its newest closed session's end and the values the next session starts from. A
later session only ever closes on that day or after, so that day's total is all of a day total's state a session
can still need. Keys idle for the TTL with nothing open leave it.

A batch's bronze rows are folded by `fold_sessions`, a plain function from (state before, events, the watermark)
to (state after, closed sessions, late events, the next watermark): window functions over the open sessions and
the new events, in the JVM. Exactly once as in pipelines/event_time/watermark.py: late_events, the state, then the table,
the closing commit with the progress.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F
from pyspark.sql.types import BooleanType, LongType, StructField, StructType, TimestampType

from pipelines.declare.aggregates import (
    combined_columns, final_column, partial_columns, row_columns, window_ranks,
)
from pipelines.declare.specs import FIELD_TYPES, EventTimeTableSpec, OutputColumn, StreamSpec
from pipelines.event_time.watermark import (
    NO_PROGRESS, EventTimeStage, FoldedBatch, append_late, behind_watermark, declared_columns,
    ensure_tables, kept_events, late_rows, newest_of_stream, next_watermark, output_schema, partial_schema,
    resume, undo_late_rows, write_state,
)
from pipelines.faults import (
    SESSIONS_AFTER_LATE_COMMIT, SESSIONS_AFTER_STATE_COMMIT, SESSIONS_BEFORE_CLOSING_COMMIT, fault_point,
)
from pipelines.storage.delta_log import table_version
from pipelines.storage.frames import frame_of_rows, kept
from pipelines.storage.layout import StorageLayout

OPEN, FIRST, LAST = "_open", "_first", "_last"
NEWEST = "_newest"  # a closed session that is its key's newest in the batch
CLOSES = "_closes"  # a session the batch's watermark closes
CARRIES = "_carries"  # the row a key's per-key state row comes from after the batch
_DAY_US = 86_400_000_000
_US = dt.timedelta(microseconds=1)


def _carried(column: str) -> str:
    """The per-key row's column that the next session's `column` (a LAG or a day total) starts from."""
    return f"_carried_{column}"


def _keyed(table: EventTimeTableSpec) -> list:
    """The columns whose values a key carries from one session to the next."""
    return [c for c in table.columns if c.role in ("previous", "day_total")]


def state_schema(table: EventTimeTableSpec) -> StructType:
    """`<table>_state`: the keys, whether the row is an open session, its first and last event, the aggregates'
    partial columns (open sessions), and the carried values (per-key rows)."""
    field = {f.name: f for f in table.fields}
    typed = {f.name: f.dataType for f in output_schema(table)}
    return StructType([
        *(StructField(k, FIELD_TYPES[field[k].kind], nullable=not field[k].required) for k in table.keys),
        StructField(OPEN, BooleanType(), nullable=False), StructField(FIRST, TimestampType()),
        StructField(LAST, TimestampType(), nullable=False), *partial_schema(table),
        *(StructField(_carried(c.name), typed[c.name]) for c in _keyed(table))])


@dataclass(frozen=True)
class SessionsFold:
    """What one batch does to a session table: the state after it and what it emits."""

    state: DataFrame  # rows of <table>_state after the batch
    closed: DataFrame  # rows of the table: the sessions the new watermark has closed
    late: DataFrame  # rows of late_events
    watermark_ms: int  # the watermark after the batch


def _same_keys(left: DataFrame, right: DataFrame, table: EventTimeTableSpec) -> Column:
    """Key equality, NULL-safe where a key may be NULL (GROUP BY keeps NULL as a key of its own); `right`'s keys
    renamed `_k_<key>`. A key that is never NULL is compared plainly: `left`, partitioned by the keys already, then
    joins without a shuffle of its own (a NULL-safe key is joined on other expressions than the key itself)."""
    required = {f.name for f in table.fields if f.required}
    condition = F.lit(True)
    for k in table.keys:
        same = left[k] == right[f"_k_{k}"] if k in required else left[k].eqNullSafe(right[f"_k_{k}"])
        condition = condition & same
    return condition


def fold_sessions(table: EventTimeTableSpec, spec: StreamSpec, state: DataFrame | None, events: DataFrame,
                  watermark_ms: int, newest_ms: int | None = None) -> SessionsFold:
    """(state before, a batch of bronze events, the watermark before) -> the state after and the outputs. A state
    of None is none at all (the table's first batch, a rebuild): nothing open, nothing carried. `newest_ms`: the
    events' newest event time, when known (otherwise one Spark job asks).

    An event at or behind the watermark is late. The others join their key's open sessions: per key, in
    event-time order, a piece (an open session, or an event) less than the gap after the latest end before it
    joins that session. The watermark then moves to the newest event minus the delay (never back), and every
    session it is a gap past closes, oldest first, each knowing the previous one's values; the TTL's rule forgets
    them."""
    keys, kinds = list(table.keys), {f.name: f.kind for f in table.fields}
    gap_us = table.size // _US
    stream_events, events = events, kept_events(table, events)
    at = F.col(table.event_time_field)
    behind = behind_watermark(table, watermark_ms)
    partials = [f.name for f in partial_schema(table)]
    schema = state_schema(table)
    arrived = events.where(~behind).select("*", at.alias(FIRST), at.alias(LAST), F.lit(False).alias("_held"))
    in_order = Window.partitionBy(*keys).orderBy(FIRST, LAST)
    latest_end = F.max(F.unix_micros(LAST)).over(in_order.rowsBetween(Window.unboundedPreceding, -1))
    starts = F.when(latest_end.isNull() | (F.unix_micros(FIRST) - latest_end >= gap_us), 1).otherwise(0)

    def cut(pieces: DataFrame) -> DataFrame:
        return pieces.withColumn("_starts", starts).withColumn(
            "_session", F.sum("_starts").over(in_order.rowsBetween(Window.unboundedPreceding, 0)))

    # A session's aggregates over the window of its pieces, kept on its first piece (each session has one piece that
    # starts it): one sort of the cut pieces by session, then one pass. As a GROUP BY, an aggregation of a list
    # (MAX_BY with a count is a collect_list, an object aggregate) ran twice, partial then final on the same
    # partitions, and each fell back to sorting all the pieces. A list (MAX_BY with a count) collects only the best of
    # the session's pieces, which `window_ranks` ranks first: the whole list on every piece grew as the square of a
    # key's pieces.
    session = Window.partitionBy(*keys, "_session")
    first_piece = F.col("_starts") == 1
    if state is None:
        # Every session is made of events alone: their partial aggregates are its state, over the cut events as the
        # window left them (partitioned by key), with nothing to keep in between.
        state = frame_of_rows(events.sparkSession, [], schema)
        aggregated = (cut(arrived).withColumns(window_ranks(table.aggregates, session))
                      .select(*keys, "_session", "_starts", *partial_columns(table.aggregates, kinds, session),
                              F.min(FIRST).over(session).alias(FIRST), F.max(LAST).over(session).alias(LAST))
                      .where(first_piece).drop("_starts"))
    else:
        # Sessions are cut on (key, first, last) alone: the state's partial columns travel renamed, beside the
        # events' own fields. Once every piece knows its session, an event becomes the partial columns of itself
        # alone and an open session keeps its own, so one aggregation combines both (the cut pieces are read once).
        held = state.where(F.col(OPEN)).select(*keys, FIRST, LAST, *(F.col(p).alias(f"_s{p}") for p in partials),
                                                F.lit(True).alias("_held"))
        pieces = cut(held.unionByName(arrived, allowMissingColumns=True))
        own = row_columns(table.aggregates, kinds)
        as_partials = pieces.select(*keys, "_session", "_starts", FIRST, LAST, *(
            F.when(F.col("_held"), F.col(f"_s{p}")).otherwise(row).alias(p) for p, row in zip(partials, own)))
        aggregated = (as_partials.withColumns(window_ranks(table.aggregates, session, combining=True))
                      .select(*keys, "_session", "_starts", *combined_columns(table.aggregates, kinds, session),
                              F.min(FIRST).over(session).alias(FIRST), F.max(LAST).over(session).alias(LAST))
                      .where(first_piece).drop("_starts"))
    if newest_ms is None:
        aggregated = kept(aggregated)  # the watermark's job reads it too
    newest = newest_of_stream(table, stream_events, watermark_ms,
                              lambda: aggregated.agg(F.max(F.unix_millis(LAST))).first()[0], newest_ms)
    after = next_watermark(watermark_ms, newest, spec.watermark_delay)
    closes = F.unix_micros(LAST) + F.lit(gap_us) <= F.lit(after * 1000)
    carried = state.where(~F.col(OPEN))
    # Kept: the closed rows are counted and written, and with the open ones and the keys' carried rows they make the
    # state, all from this one frame.
    sessions = kept(_session_rows(table, aggregated, carried, closes, after))
    closed, still_open = sessions.where(F.col(CLOSES)), sessions.where(~F.col(CLOSES))
    typed = {f.name: f.dataType for f in schema}
    open_rows = still_open.select(*keys, F.lit(True).alias(OPEN), FIRST, LAST, *(F.col(f"_s{p}").alias(p)
                                                                                for p in partials),
                                  *(F.lit(None).cast(typed[_carried(c.name)]).alias(_carried(c.name))
                                    for c in _keyed(table)))
    next_state = open_rows
    if _keyed(table):
        carried_after = sessions.where(F.col(CARRIES)).select(
            *keys, F.lit(False).alias(OPEN), F.lit(None).cast(TimestampType()).alias(FIRST),
            F.col(_carried(LAST)).alias(LAST), *(F.col(_carried(c.name)) for c in _keyed(table)))
        next_state = (open_rows.unionByName(carried_after, allowMissingColumns=True)
                      .unionByName(_idle_keys(table, carried, sessions, after), allowMissingColumns=True))
    return SessionsFold(state=next_state.select(*(F.col(f.name).cast(f.dataType) for f in schema)),
                        closed=closed.select(*output_schema(table).fieldNames()),
                        late=late_rows(table, spec, events.where(behind), watermark_ms), watermark_ms=after)


def _forgotten(table: EventTimeTableSpec, started: Column, previous_last: Column) -> Column:
    """Whether a session starting at `started` has forgotten the key's session that ended at `previous_last`."""
    if table.ttl is None:
        return F.lit(False)
    return previous_last.isNotNull() & (F.unix_micros(started) - F.unix_micros(previous_last) >= table.ttl // _US)


def _within_ttl(table: EventTimeTableSpec, last: Column, watermark_ms: int) -> Column:
    """Whether a key whose newest closed session ended at `last` is remembered at the watermark (`table.ttl` set)."""
    return F.unix_micros(last) + F.lit(table.ttl // _US) > F.lit(watermark_ms * 1000)


def _idle_keys(table: EventTimeTableSpec, carried: DataFrame, batch_keys: DataFrame, watermark_ms: int) -> DataFrame:
    """The stored per-key rows (`carried`) of the keys of no session this batch (open sessions are sessions of the
    batch: `batch_keys`), as they are, but those idle for the TTL at the new watermark."""
    keys = list(table.keys)
    others = batch_keys.select(*(F.col(k).alias(f"_k_{k}") for k in keys))
    idle = carried.join(others, _same_keys(carried, others, table), "left_anti")
    return idle.where(_within_ttl(table, F.col(LAST), watermark_ms)) if table.ttl is not None else idle


def _session_rows(table: EventTimeTableSpec, sessions: DataFrame, carried: DataFrame, closes: Column,
                  watermark_ms: int) -> DataFrame:
    """Every session of the batch (`sessions`: keys, partial columns, first and last event) with whether the new
    watermark closes it (`_closes`) and the table's row it makes then (with `_first`, `_last` and `_newest` kept for
    the state); an open one with its partial columns, as `_s<name>`. Per key, oldest first: the previous session's
    values (the carried ones for the first), unless it is forgotten (null, and the day totals start again); the day
    totals so far, the carried ones included while nothing has been forgotten in between.

    When the table declares per-key values, the rows after the batch of the batch's keys come out of the same pass:
    one row per key flagged `_carries`, with `_carried__last` and the `_carried_<column>` values. A key's newest
    closed session replaces its row (what the next session's LAG sees is this one's aggregate; its day totals go on
    from this one's); a key without one keeps its stored row; a key idle for the TTL with nothing open is forgotten
    (the rule would forget it anyway: this only keeps the table small). The keys of no session this batch keep
    their rows apart (`_idle_keys`), outside these windows.

    A key's closed sessions are its oldest (its sessions never overlap, and they close by their end), so the windows
    over all its sessions give them what they would give over the closed ones alone. The stored rows are joined to
    the sessions (a left join), so the windows run on the partitions the aggregation left (by key), with no
    shuffle of their own; a full join of both had its output shuffled by key again."""
    keys, kinds = list(table.keys), {f.name: f.kind for f in table.fields}
    gap_us = table.size // _US
    partials = [f.name for f in partial_schema(table)]
    keyed = _keyed(table)
    stored = carried.select(*(F.col(k).alias(f"_k_{k}") for k in keys), F.col(LAST).alias("_stored_last"),
                            *(F.col(_carried(c.name)).alias(f"_stored_{c.name}") for c in keyed))
    finals = sessions.select(*keys, "_session", FIRST, LAST, closes.alias(CLOSES),
                             *(F.when(~closes, F.col(p)).alias(f"_s{p}") for p in partials),
                             *(final_column(a, kinds).alias(a.name) for a in table.aggregates))
    joined = finals.join(stored, _same_keys(finals, stored, table), "left").drop(*(f"_k_{k}" for k in keys))
    # A key's sessions in order of their numbers, which follow their first events: the rows come sorted by them from
    # the aggregation, where ordered by the first event they were sorted again (1M sessions of a first load).
    by_key = Window.partitionBy(*keys).orderBy("_session")
    first_closed = F.row_number().over(by_key) == 1
    previous_last = F.when(first_closed, F.col("_stored_last")).otherwise(F.lag(LAST).over(by_key))
    numbered = (joined.withColumn("_forgets", _forgotten(table, F.col(FIRST), previous_last).cast(LongType()))
                .withColumn("_epoch", F.sum("_forgets").over(by_key.rowsBetween(Window.unboundedPreceding, 0)))
                .withColumn("_day", F.floor(F.unix_micros(LAST) / _DAY_US)))
    same_day = Window.partitionBy(*keys, "_epoch", "_day").orderBy(FIRST).rowsBetween(Window.unboundedPreceding, 0)
    stored_day = F.floor(F.unix_micros("_stored_last") / _DAY_US)
    def value_of(column: OutputColumn) -> Column:
        if column.role == "aggregate":
            return F.col(column.of)
        if column.role == "previous":
            previous = F.when(first_closed, F.col(f"_stored_{column.name}")).otherwise(F.lag(column.of).over(by_key))
            return F.when(F.col("_forgets") == 1, F.lit(None)).otherwise(previous)
        running = F.sum(column.of).over(same_day)
        kept = F.when((F.col("_epoch") == 0) & (stored_day == F.col("_day")), F.col(f"_stored_{column.name}"))
        return F.coalesce(running + kept, running, kept)

    bounds = (F.col(FIRST), F.timestamp_micros(F.unix_micros(LAST) + F.lit(gap_us)))
    # The last closed by start is the key's newest, the one its per-key row carries on from, flagged here in the
    # same window rather than ranked again.
    later = F.lead(CLOSES).over(by_key)
    newest = (F.col(CLOSES) & F.coalesce(~later, F.lit(True))).alias(NEWEST)
    rows = numbered.select(*declared_columns(table, *bounds, value_of), FIRST, LAST, newest, CLOSES,
                           *(f"_s{p}" for p in partials),
                           *((first_closed.alias("_first_of_key"), later.isNotNull().alias("_later"), "_stored_last",
                              *(f"_stored_{c.name}" for c in keyed)) if keyed else ()))
    if not keyed:
        return rows
    # Per key, from the rows' own flags, as the closed sessions are its oldest: one closed when its first did (a key
    # with none closed carries its stored row on), and a session stays open after its newest closed one when a later
    # session exists (a key with none closed has one open: its first). So no window over the whole key.
    from_stored = F.col("_first_of_key") & ~F.col(CLOSES) & F.col("_stored_last").isNotNull()
    open_in_key = F.when(F.col(NEWEST), F.col("_later")).otherwise(F.lit(True))
    carried_last = F.when(F.col(NEWEST), F.col(LAST)).otherwise(F.col("_stored_last"))
    carries = F.col(NEWEST) | from_stored
    if table.ttl is not None:
        carries = carries & (open_in_key | _within_ttl(table, carried_last, watermark_ms))
    return rows.select(
        *(c for c in rows.columns if c not in ("_first_of_key", "_later") and not c.startswith("_stored_")),
        carries.alias(CARRIES), carried_last.alias(_carried(LAST)),
        *(F.when(F.col(NEWEST), F.col(c.of if c.role == "previous" else c.name))
          .otherwise(F.col(f"_stored_{c.name}")).alias(_carried(c.name)) for c in keyed))


class SessionsStage(EventTimeStage):
    """A session table's step of its stream's micro-batch: late events, the state, then the closed sessions as
    the closing commit."""

    before_closing_fault = SESSIONS_BEFORE_CLOSING_COMMIT

    def operator_state_schema(self) -> StructType:
        return state_schema(self.table)

    def fold_and_write(self, rows: DataFrame, newest_ms: int | None, app_id: str, batch_id: int, marker: dict,
                       late_possible: bool = True) -> FoldedBatch:
        spark, layout, table = rows.sparkSession, self.layout, self.table
        state_path = layout.table(table.state_table)
        before = self.state_before(spark) if self.last.state_version is not None else None
        fold = fold_sessions(table, self.spec, before, rows, self.last.watermark_ms, newest_ms)
        # Nothing is counted first: the late events are appended whenever the batch can hold one (its commit counts
        # them), and the sessions closed are the closing commit's rows. Counted by a query of their own, they were
        # ~0.3 s of a warm +100k batch, in its longest branch.
        late_count = append_late(fold.late, layout, marker) if late_possible else 0
        fault_point(SESSIONS_AFTER_LATE_COMMIT)
        version = write_state(fold.state, state_path, marker)
        fault_point(SESSIONS_AFTER_STATE_COMMIT)
        return FoldedBatch(fold.closed, version, fold.watermark_ms, {"late_events": late_count})


def sessions_stage(spark: SparkSession, layout: StorageLayout, spec: StreamSpec, table: EventTimeTableSpec
                   ) -> SessionsStage:
    """The table's step as its last closing commit left it, for a run of its stream (which holds the stream's
    writer lock). The late_events rows of a batch that died before its closing commit are deleted first: the
    stream folds that batch's bronze rows again."""
    ensure_tables(spark, layout, spec, table, state_schema(table))
    stage = SessionsStage(layout, spec, table, NO_PROGRESS)
    return resume(spark, stage, undo_late_rows(spark, layout, table.name, stage.marker,
                                               table_version(spark, layout.table(table.name)) or 0))
