"""The data checks' queries, as plain functions that return figures (Dagster shows them in assets/).

Two depths for a state table:
- per run, costing what the run costs: its totals equal bronze's running totals at the bronze version
  it has folded through (bronze commits carry them, pipelines/ingest/bronze.py), its keys are unique and its
  counts positive. A state table scan is bounded by its keys; bronze history is never read.
- deep (nightly and on demand): every key's count and sum recomputed from all of bronze.
A corrupted state table fails both (tests/assets/test_dagster.py).
"""

from __future__ import annotations

import datetime as dt
import random
import threading
from collections import Counter, OrderedDict
from decimal import Decimal
from functools import reduce
from urllib.parse import unquote

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.types import StringType, StructField, StructType

from pipelines.declare.aggregates import final_column, partial_columns
from pipelines.declare.specs import EventTimeTableSpec, StateTableSpec, StreamSpec, TopSpec
from pipelines.declare.sql import query_over
from pipelines.event_time import watermark
from pipelines.event_time.watermark import output_schema
from pipelines.ingest.bronze import accepted_totals, bronze_schema
from pipelines.operate.inspect import newest_rows as newest_rows_in_process, newest_rows_streamed, rows_in_files
from pipelines.state.expiry import EXPIRED_VALUE, expired_rows, expired_totals, since_last_expiry
from pipelines.state.tables import aggregate, folded_through, state_schema
from pipelines.storage import files
from pipelines.storage.delta_log import commit_actions, table_version
from pipelines.storage.delta_rs import delta_table, file_batches
from pipelines.storage.frames import frame_of_arrow, frame_of_rows, kept
from pipelines.storage.layout import StorageLayout


def _state(spark: SparkSession, layout: StorageLayout, table: StateTableSpec, version: int | None = None) -> DataFrame:
    reader = spark.read.format("delta")
    if version is not None:
        reader = reader.option("versionAsOf", version)
    return reader.load(str(layout.table(table.name)))


# (path, version, its commit file's size and time, stream, table) -> `_scanned` figures. A version's rows never change,
# and a table created again writes that version's commit file anew: a run's materialization and its three per-run
# checks share one scan of the table (they were four queries of ~0.2-0.3 s each, warm, mostly the driver's planning
# and log reading).
_SCANS: OrderedDict[tuple, dict] = OrderedDict()
_SCANS_LOCK = threading.Lock()
_SCANS_KEPT = 32


def _null_required_key(spec: StreamSpec, table: StateTableSpec) -> Column:
    """NULL in a key that only a required field feeds."""
    null = F.lit(False)
    for key in (k for k in table.keys if spec.field(k).required):
        null = null | F.col(key).isNull()
    return null


def _never_negative(spec: StreamSpec, table: StateTableSpec) -> list:
    """The table's SUMs of a field that cannot be negative."""
    return [a for a in table.aggregates if a.function == "sum" and spec.field(a.column).min_value is not None
            and Decimal(spec.field(a.column).min_value) >= 0]


def _negative(spec: StreamSpec, table: StateTableSpec) -> Column:
    """A row whose count of events is not positive, or whose SUM of a field that cannot be negative is."""
    bad = F.lit(False)
    if table.count_column:
        bad = bad | (F.col(table.count_column) <= 0)
    for a in _never_negative(spec, table):
        bad = bad | (F.col(a.name) < 0)
    return bad


def _scanned(spark: SparkSession, layout: StorageLayout, spec: StreamSpec, table: StateTableSpec,
             version: int | None) -> dict:
    """One scan of the state table at `version` (default: the latest): its totals, how many rows the per-run
    checks flag (`surplus_or_null_keys`: rows beyond one per key plus rows with a NULL required key; `negative`),
    and its `top_rows` (TOP_ROWS of them, the largest count first, as dicts of the keys and aggregates)."""
    path = layout.table(table.name)
    version = table_version(spark, path) if version is None else version
    key = None  # no table yet, or its commit cleaned up by log retention: scanned, not remembered
    if version is not None:
        try:
            commit = (files.storage_path(path) / "_delta_log" / f"{version:020d}.json").stat()
            key = (str(path), version, commit.st_size, commit.st_mtime_ns, spec, table)
        except FileNotFoundError:
            pass
    with _SCANS_LOCK:
        if key in _SCANS:
            _SCANS.move_to_end(key)
            return dict(_SCANS[key])
    figures = _scanned_in_process(path, spec, table, version)
    if figures is None:
        figures = _scanned_by_spark(spark, layout, spec, table, version)
    if key is not None:
        with _SCANS_LOCK:
            _SCANS[key] = figures
            while len(_SCANS) > _SCANS_KEPT:
                _SCANS.popitem(last=False)
    return dict(figures)


TOP_ROWS = 10
# A state table of at most this many rows is scanned in this process by delta-rs: the columns the figures need, as
# Arrow (1M rows of a key, two counts and a time are ~50 MB). A larger one is scanned by Spark.
SCANNED_IN_PROCESS_ROWS = 2_000_000


# The newest rows of an event-time table are read in this process by delta-rs (DataFusion) when the files that may
# hold them have at most this many rows; from more, page by page (`newest_rows_streamed`). DataFusion decodes a file's
# row groups whole: the 1M sessions of a first load (two files) raised the run's Python process by 60-70 MB.
NEWEST_IN_PROCESS_ROWS = 250_000


def newest_rows(path, column: str, since_ms: int | None, limit: int = TOP_ROWS) -> list[dict]:
    """The `limit` rows of the Delta table at `path` with the greatest `column`, newest first: first among those at
    `since_ms` or later (their files found by their statistics), all of them when fewer are there."""
    stored = delta_table(files.storage_path(path))
    if stored is None:
        return []
    counted = rows_in_files(stored, column, since_ms)
    if counted is not None and counted[0] <= NEWEST_IN_PROCESS_ROWS:
        rows = newest_rows_in_process(stored, column, since_ms, limit, whole=counted[1] <= NEWEST_IN_PROCESS_ROWS)
        if rows is not None:
            return rows.to_pylist()
    return newest_rows_streamed(stored, column, since_ms, limit).to_pylist()


def _top_order(table: StateTableSpec) -> list[tuple[str, str]]:
    """The order of a state table's top rows: the largest count first, then by key."""
    return [*([(table.count_column, "descending")] if table.count_column else []),
            *((k, "ascending") for k in table.keys)]


def _scanned_in_process(path, spec: StreamSpec, table: StateTableSpec, version: int | None) -> dict | None:
    """`_scanned`'s figures from the table's rows read by delta-rs (an independent reader, and no Spark job: in a
    warm run the scan and the top rows were two Spark queries of ~0.8 s each, one after the other); None for a
    table of more than SCANNED_IN_PROCESS_ROWS rows, or one whose files do not all say how many rows they hold."""
    state = delta_table(files.storage_path(path)) if version is not None else None
    if state is None:
        return None
    state.load_as_version(version)
    counts = pa.table(state.get_add_actions(flatten=True))["num_records"]
    if counts.null_count or (pc.sum(counts).as_py() or 0) > SCANNED_IN_PROCESS_ROWS:
        return None
    shown = [*table.keys, *(a.name for a in table.aggregates)]
    columns = list(dict.fromkeys([*shown, *filter(None, (table.count_column, table.sum_column,
                                                         table.last_ts_column))]))
    rows = state.to_pyarrow_dataset(schema=to_arrow_schema(state_schema(table))).to_table(columns=columns)

    def how_many(mask) -> int:
        return pc.sum(pc.cast(pc.fill_null(mask, False), pa.int64())).as_py() or 0

    null_key = [pc.is_null(rows[k]) for k in table.keys if spec.field(k).required]
    negative = [*([pc.less_equal(rows[table.count_column], 0)] if table.count_column else []),
                *(pc.less(rows[a.name], 0) for a in _never_negative(spec, table))]
    # Spark orders DESC with NULLs last and ASC with NULLs first; a count is never NULL, so NULL keys come first.
    top = rows.take(pc.sort_indices(rows, sort_keys=_top_order(table), null_placement="at_start")[:TOP_ROWS])
    latest = pc.max(rows[table.last_ts_column]).as_py() if table.last_ts_column else None
    return {"keys": rows.num_rows,
            "events_counted": (pc.sum(rows[table.count_column]).as_py() or 0) if table.count_column else None,
            "total": (pc.sum(rows[table.sum_column]).as_py() or Decimal(0)) if table.sum_column else None,
            "latest_event_time": _naive_utc(latest),
            "surplus_or_null_keys": (rows.num_rows - len(rows.group_by(list(table.keys)).aggregate([]))
                                     + (how_many(reduce(pc.or_, null_key)) if null_key else 0)),
            "negative": how_many(reduce(pc.or_, negative)) if negative else 0,
            "top_rows": [{k: _naive_utc(v) for k, v in r.items()} for r in top.select(shown).to_pylist()]}


def _naive_utc(value):
    """A time as Spark returns it (naive, in the session's UTC); anything else as it is."""
    if isinstance(value, dt.datetime) and value.tzinfo is not None:
        return value.astimezone(dt.timezone.utc).replace(tzinfo=None)
    return value


def _scanned_by_spark(spark: SparkSession, layout: StorageLayout, spec: StreamSpec, table: StateTableSpec,
                      version: int | None) -> dict:
    nothing = F.lit(None)
    state = _state(spark, layout, table, version)
    row = state.agg(
        F.count("*").alias("rows"), F.count_distinct(F.struct(*table.keys)).alias("keys"),
        F.sum(table.count_column or nothing).alias("events"), F.sum(table.sum_column or nothing).alias("total"),
        F.max(table.last_ts_column or nothing).alias("latest"),
        F.count(F.when(_null_required_key(spec, table), 1)).alias("null_keys"),
        F.count(F.when(_negative(spec, table), 1)).alias("negative")).first()
    order = [F.desc(c) if direction == "descending" else F.col(c) for c, direction in _top_order(table)]
    top = state.orderBy(*order).select(*table.keys, *(a.name for a in table.aggregates)).limit(TOP_ROWS).collect()
    return {"keys": row["rows"],
            "events_counted": (row["events"] or 0) if table.count_column else None,
            "total": (row["total"] or Decimal(0)) if table.sum_column else None,
            "latest_event_time": row["latest"],
            "surplus_or_null_keys": row["rows"] - row["keys"] + row["null_keys"], "negative": row["negative"],
            "top_rows": [r.asDict() for r in top]}


def state_totals(spark: SparkSession, layout: StorageLayout, spec: StreamSpec, table: StateTableSpec,
                 version: int | None = None) -> dict:
    """keys (rows), events counted, the value total, the newest event time folded into the state table (at
    `version`, default the latest) and its top rows, in one scan shared with the per-run checks; None for what the
    table has no column for."""
    figures = _scanned(spark, layout, spec, table, version)
    return {k: figures[k] for k in ("keys", "events_counted", "total", "latest_event_time", "top_rows")}


def totals_match_bronze(spark: SparkSession, layout: StorageLayout, spec: StreamSpec, table: StateTableSpec) -> dict:
    """The per-run reconciliation: the state table's totals against bronze's at the version the table has folded
    through, which its commits record (pinned to one table version, so a MERGE committing meanwhile cannot make
    it fail): its count of every event, and its SUM of the value bronze keeps a running total of. Falls back to
    counting bronze at that version when its commits carry no running totals. `passed` None when the table
    records no version or counts no event (COUNT(*)): the caller runs the deep check instead.
    """
    found = folded_through(spark, layout.table(table.name))
    state_version, version = (found.version, found.through) if found else (None, None)
    state = state_totals(spark, layout, spec, table, state_version)
    state.pop("latest_event_time")
    state.pop("top_rows")
    if version is None or table.count_column is None or table.where:  # bronze's totals count every event
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
                            table: StateTableSpec) -> tuple[int, DataFrame]:
    """(how many, which): keys held by more than one row, and NULL in a key that only a required field feeds. The
    table's shared scan (`state_totals`) tells whether there are any; only then are they counted."""
    version = table_version(spark, layout.table(table.name))
    found = (_state(spark, layout, table, version).groupBy(*table.keys).count()
             .where((F.col("count") > 1) | _null_required_key(spec, table)))
    return (0 if _scanned(spark, layout, spec, table, version)["surplus_or_null_keys"] == 0 else found.count()), found


def negative_rows(spark: SparkSession, layout: StorageLayout, spec: StreamSpec, table: StateTableSpec
                  ) -> tuple[int, DataFrame]:
    """(how many, which): rows whose count of events is not positive, or whose SUM of a field that cannot be
    negative is; counted by the table's shared scan."""
    version = table_version(spark, layout.table(table.name))
    return (_scanned(spark, layout, spec, table, version)["negative"],
            _state(spark, layout, table, version).where(_negative(spec, table)))


def mismatches_with_bronze(spark: SparkSession, layout: StorageLayout, spec: StreamSpec,
                           table: StateTableSpec) -> tuple[DataFrame, dict]:
    """The deep check: keys where the state table differs from its declared query over all of bronze (every
    column), and the totals of both. A key a TTL expired is compared with its events ingested after its newest
    expiry; the expired rows' totals, read from the Change Data Feed, must equal the running totals the commits
    carry, and with the table's they must add up to bronze's."""
    table_path = layout.table(table.name)
    bronze = spark.read.format("delta").load(str(layout.table(spec.bronze_table)))
    if table.where:  # the events the table counts
        bronze = bronze.where(F.expr(table.where))
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
        return frame_of_rows(spark, [], "reason string, reason_field string, count long")
    written = (spark.read.format("delta").option("readChangeFeed", "true")
               .option("startingVersion", (before or 0) + 1).option("endingVersion", after)
               .load(str(layout.table(spec.quarantine_table))).where(F.col("_change_type") == "insert"))
    return written.groupBy("reason", "reason_field").count().orderBy(F.desc("count"))


def _late_figures(late: DataFrame, events: DataFrame, id_field: str) -> tuple[int, int, int, int]:
    """(late events, those whose id is among `events`', those not at or behind the watermark they were said to
    miss, the number of `events`), in one job. The operators' rule: an event exactly at the watermark is late, so
    only an event time after it is wrong."""
    ids = events.groupBy(F.col(id_field).alias("event_id")).agg(F.count("*").alias("_events"))
    on_late = late.join(ids, "event_id", "left").agg(
        F.count("*").alias("late"), F.count("_events").alias("found"),
        F.count(F.when(F.col("event_time") > F.col("watermark"), 1)).alias("ahead"))
    row = on_late.crossJoin(ids.agg(F.sum("_events").alias("events"))).first()
    return row["late"], row["found"], row["ahead"], row["events"] or 0


def _inserted_since(spark: SparkSession, path, since_version: int | None) -> DataFrame | None:
    """The rows committed to a table after `since_version` (None: every row), from its change feed."""
    if since_version is None:
        return None
    if since_version >= (table_version(spark, path) or 0):
        return spark.read.format("delta").load(str(path)).limit(0)  # Delta refuses a change feed that starts later
    return (spark.read.format("delta").option("readChangeFeed", "true").option("startingVersion", since_version + 1)
            .load(str(path)).where(F.col("_change_type") == "insert"))


def recomputed_sessions(table: EventTimeTableSpec, events: DataFrame) -> DataFrame:
    """The contract's sessions of `events`, recomputed with window functions: per key, in event-time order, an
    event *less than* the gap after the previous one joins its session; the gap or more starts a new one. A second
    implementation of the rule with the same edges (the operator cuts pieces, open sessions and events, not events),
    with `_first` and `_last` and the declared key, bound and aggregate columns. Ties in event time change no
    session: equal times are 0 apart."""
    kinds = {f.name: f.kind for f in table.fields}
    at = F.unix_micros(table.event_time_field)
    in_order = Window.partitionBy(*table.keys).orderBy(table.event_time_field)
    starts = F.when(F.lag(at).over(in_order).isNull()
                    | (at - F.lag(at).over(in_order) >= table.size // dt.timedelta(microseconds=1)), 1).otherwise(0)
    numbered = (events.withColumn("_starts", starts)
                .withColumn("_session", F.sum("_starts").over(in_order.rowsBetween(Window.unboundedPreceding, 0))))
    grouped = numbered.groupBy(*table.keys, "_session").agg(
        *partial_columns(table.aggregates, kinds),
        F.min(table.event_time_field).alias("_first"), F.max(table.event_time_field).alias("_last"))
    typed = {f.name: f.dataType for f in output_schema(table)}
    gap_us = table.size // dt.timedelta(microseconds=1)
    columns = []
    for c in table.columns:
        if c.role == "key":
            columns.append(F.col(c.name))
        elif c.role == "start":
            columns.append(F.col("_first").alias(c.name))
        elif c.role == "end":
            columns.append(F.timestamp_micros(F.unix_micros("_last") + F.lit(gap_us)).alias(c.name))
        elif c.role == "aggregate":
            a = next(a for a in table.aggregates if a.name == c.of)
            columns.append(final_column(a, kinds).cast(typed[c.name]).alias(c.name))
    return grouped.select(*columns, "_first", "_last")


# The per-run session check recomputes the sessions of at most this many of the keys the run wrote, a sample that
# changes from run to run; the deep check compares every key. Unbounded, a first load of 1M payments spent 18 s of
# its 94 s recomputing all of its ~100k keys' sessions, twice (measured).
RUN_CHECK_KEYS = 1_000


def _written_sample(sessions, path, table: EventTimeTableSpec, first: str, since_version: int
                    ) -> tuple[pa.Table | None, int]:
    """The keys of the sessions the table gained after `since_version` (read by delta-rs), each with the start of
    its first such session (`_since`): at most RUN_CHECK_KEYS of them, a sample drawn with `since_version` as its
    seed, so each run checks others (None when there were none); and how many keys there were. When every commit
    since only added files (a session table's closing commits), the rows are those files', read page by page
    (`file_batches`); otherwise its change feed's inserts: delta-rs reads a feed whole, ~95 MB more of the Python
    process for a first load's 983k sessions, where their files' keys and starts read page by page took ~2 MB
    (measured)."""
    keys = list(table.keys)
    newest = sessions.version() if sessions is not None else -1
    if since_version >= newest:
        return None, 0
    added = _files_added(path, since_version, newest)
    if added is not None:
        batches = file_batches(sessions.to_pyarrow_dataset(schema=to_arrow_schema(output_schema(table))),
                               [*keys, first], paths=added)
    else:
        batches = pa.RecordBatchReader.from_stream(sessions.load_cdf(
            starting_version=since_version + 1, ending_version=newest, columns=[*keys, first, "_change_type"]))

    def firsts(pieces: list[pa.Table]) -> pa.Table:
        return (pa.concat_tables(pieces).group_by(keys).aggregate([(first, "min")]).select([*keys, f"{first}_min"])
                .rename_columns([*keys, first]))

    # Batch by batch, each key's first session kept, folded into one table every few batches: a first load's are
    # every session it closed.
    written, pending = None, []
    for batch in batches:
        changes = pa.table(batch)
        changes = changes.cast(pa.schema([pa.field(f.name, _plain(f.type)) for f in changes.schema]))
        if "_change_type" in changes.column_names:
            changes = changes.filter(pc.equal(changes["_change_type"], "insert")).select([*keys, first])
        pending.append(changes)
        if len(pending) == 16:
            written, pending = firsts([written, *pending] if written is not None else pending), []
    if pending:
        written = firsts([written, *pending] if written is not None else pending)
    if written is None:
        return None, 0
    written = written.rename_columns([*keys, "_since"])
    count = written.num_rows
    if count == 0:
        return None, 0
    # Sorted first, so the same keys and seed draw the same sample whatever order the files were read in.
    written = written.sort_by([(k, "ascending") for k in keys])
    if count > RUN_CHECK_KEYS:
        written = written.take(sorted(random.Random(since_version).sample(range(count), RUN_CHECK_KEYS)))
    return written, count


def _files_added(path, since_version: int, newest: int) -> set[str] | None:
    """The data files the table's commits after `since_version` through `newest` added, when those commits only
    added files (no file removed, no change-data file); otherwise None."""
    added, commits = set(), 0
    for _, actions in commit_actions(path, newest, newest - since_version):
        commits += 1
        for action in actions:
            if "remove" in action or "cdc" in action:
                return None
            if "add" in action:
                added.add(unquote(action["add"]["path"]))
    return added if commits == newest - since_version else None  # a commit file cleaned up: the feed decides


def _plain(kind: pa.DataType) -> pa.DataType:
    """delta-rs's change feed gives strings as views; the rest of pyarrow (and pyspark) wants plain strings."""
    return pa.string() if pa.types.is_string_view(kind) else kind


def _rows_of_keys(dataset, table: EventTimeTableSpec, keys: set[tuple], where, columns: list[str]) -> pa.Table:
    """The rows of a delta-rs `dataset` matching `where` whose key is one of `keys`, NULL equal to NULL as the table
    groups it. Files and row groups are skipped by their statistics of `where`'s (time) column and read page by page
    (`file_batches`); the keys are matched here, batch by batch, so only the matching rows are held (a sample of a
    first load's keys reaches back to its first event)."""
    first_key = table.keys[0]
    firsts = None
    found = []
    for batch in file_batches(dataset, columns, where):
        if firsts is None:
            firsts = pa.array(sorted({k[0] for k in keys}, key=lambda v: (v is None, v)),
                              batch.schema.field(first_key).type)
        batch = batch.filter(pc.is_in(batch.column(first_key), value_set=firsts, skip_nulls=False))
        if len(table.keys) > 1 and batch.num_rows:
            batch = batch.filter(pa.array([key in keys for key in zip(*(batch.column(k).to_pylist()
                                                                          for k in table.keys))]))
        found.append(batch)
    if not found:
        return pa.table({c: [] for c in columns}, schema=pa.schema([dataset.schema.field(c) for c in columns]))
    return pa.Table.from_batches(found)


def _session_run_check(spark: SparkSession, layout: StorageLayout, spec: StreamSpec, table: EventTimeTableSpec,
                       progress, since_version: int, figures: dict) -> tuple[DataFrame, dict]:
    """The per-run session check: the keys of the sessions the run wrote (at most RUN_CHECK_KEYS of them, a sample
    drawn with `since_version` as its seed), from a gap before the first of them on. A session cut from those events
    alone is whole unless it starts less than a gap after that bound (an earlier event could join it), so both sides
    keep only the sessions starting at the first written one or later: every session the run wrote for those keys
    is among them, with every stored or recomputed session of its key since.

    The table's change feed, its stored sessions, bronze's events at the version the table has folded and the late
    events among them are read by delta-rs in this process, an independent reader; Spark recomputes the sessions
    from those events as a local frame and the comparison is one job. Read by Spark (a change-feed query, a kept
    frame of bronze's events, a join for the late figures, the comparison: four jobs in a row) the check took
    ~1.2 s of every warm run, mostly fixed cost."""
    first = table.column("start") or next(a.name for a in table.aggregates
                                          if a.function == "min" and a.column == table.event_time_field)
    compared = [c.name for c in table.columns if c.role in ("key", "start", "end", "aggregate")]
    typed = {f.name: f.dataType for f in output_schema(table)}
    stored_schema = StructType([StructField(c, typed[c]) for c in compared])
    sessions = delta_table(files.storage_path(layout.table(table.name)))
    written, keys_written = _written_sample(sessions, layout.table(table.name), table, first, since_version)
    figures.update({"keys_written": keys_written, "keys_checked": written.num_rows if written else 0})
    if not written:
        schema = StructType([*stored_schema.fields, StructField("side", StringType())])
        return frame_of_rows(spark, [], schema), figures
    keys = set(zip(*(written[k].to_pylist() for k in table.keys)))
    since = pc.min(written["_since"]).as_py()
    micros = pa.timestamp("us", tz="UTC")
    # Read with the tables' declared schemas: plain strings, whoever wrote the files.
    stored = _rows_of_keys(sessions.to_pyarrow_dataset(schema=to_arrow_schema(output_schema(table))), table, keys,
                           ds.field(first) >= pa.scalar(since, micros), compared)
    bronze = delta_table(files.storage_path(layout.table(spec.bronze_table)))
    bronze.load_as_version(progress.bronze_version)
    events = _rows_of_keys(bronze.to_pyarrow_dataset(schema=to_arrow_schema(bronze_schema(spec))), table, keys,
                           ds.field(table.event_time_field) >= pa.scalar(since - table.size, micros),
                           list(spec.field_names))
    late = _late_of(layout, table, events[spec.id_field])
    event_schema = StructType([f for f in bronze_schema(spec).fields if f.name in spec.field_names])
    # Without a WHERE every event read is the table's; with one, Spark counts those it keeps (a job on local rows).
    kept_count = (watermark.kept_events(table, frame_of_arrow(spark, events, event_schema)).count() if table.where
                  else events.num_rows)
    figures.update({"events": kept_count, "late_events": late.num_rows, "late_not_in_bronze": 0,
                    "late_not_behind_watermark": pc.sum(pc.greater(late["event_time"], late["watermark"])).as_py()
                    or 0})
    on_time = events.filter(pc.invert(pc.is_in(events[spec.id_field], value_set=late["event_id"])))
    gap_us = table.size // dt.timedelta(microseconds=1)
    expected = (recomputed_sessions(table, watermark.kept_events(table, frame_of_arrow(spark, on_time, event_schema)))
                .where((F.unix_micros("_last") + F.lit(gap_us) <= F.lit(progress.watermark_ms * 1000))
                       & (F.col("_first") >= F.lit(since)))
                .select(*(F.col(c).cast(typed[c]) for c in compared)))
    return _compared_in_driver(frame_of_arrow(spark, stored, stored_schema), expected, table.name, figures)


def _late_of(layout: StorageLayout, table: EventTimeTableSpec, ids: pa.ChunkedArray) -> pa.Table:
    """late_events' rows for `table` of the events `ids`, read by delta-rs: event_id, event_time, watermark."""
    late = delta_table(files.storage_path(layout.table(watermark.LATE)))
    columns = ["event_id", "event_time", "watermark"]
    if late is None:
        return pa.table({c: [] for c in columns}, schema=pa.schema(
            [f for f in to_arrow_schema(watermark.LATE_SCHEMA) if f.name in columns]))
    return late.to_pyarrow_dataset(schema=to_arrow_schema(watermark.LATE_SCHEMA)).to_table(
        columns=columns, filter=(ds.field("table_name") == table.name) & ds.field("event_id").isin(pc.unique(ids)))


def event_time_mismatches(spark: SparkSession, layout: StorageLayout, spec: StreamSpec, table: EventTimeTableSpec,
                          since_version: int | None = None) -> tuple[DataFrame, dict]:
    """A windowed or session table against its declared query recomputed over bronze, at the bronze version and
    watermark its step has reached, minus the events late_events says were late for it.

    Windows: the declared SQL run by Spark itself (`window()`), every window whose end the watermark has reached;
    per run (`since_version`), only the windows the run closed, bronze read through its event-time statistics. A
    column Spark's own aggregates cannot compute (a list MAX_BY) is left out. Sessions: cut again by
    `recomputed_sessions`, every session the watermark is a gap past (all of bronze); per run, the keys of the
    sessions the run closed (a sample of RUN_CHECK_KEYS when it closed more), from the first of them on
    (`_session_run_check`).
    The columns a key carries from session to session (LAG, day totals) depend on the order sessions closed in and
    are not recomputed. Rows on either side only are the mismatches (`side` says which)."""
    progress = watermark.last_progress(spark, table, layout)
    path = layout.table(table.name)
    actual = spark.read.format("delta").load(str(path))
    figures = {"rows_checked": 0, "events": 0, "late_events": 0, "late_not_in_bronze": 0,
               "late_not_behind_watermark": 0, "bronze_version": progress.bronze_version if progress else -1}
    if progress is None or progress.bronze_version < 0:
        return actual.limit(0).withColumn("side", F.lit("")), figures
    if table.kind == "session" and since_version is not None:
        return _session_run_check(spark, layout, spec, table, progress, since_version, figures)
    late = (spark.read.format("delta").load(str(layout.table(watermark.LATE)))
            .where(F.col("table_name") == table.name))
    bronze = (spark.read.format("delta").option("versionAsOf", progress.bronze_version)
              .load(str(layout.table(spec.bronze_table))))
    at = F.col(table.event_time_field)
    size_us = table.size // dt.timedelta(microseconds=1)
    watermark_us = progress.watermark_ms * 1000
    if table.kind == "window":
        start = table.column("start")
        inserted = _inserted_since(spark, path, since_version)
        if inserted is not None:
            starts = sorted(r[0] for r in inserted.select(start).distinct().collect())
            actual = actual.where(F.col(start).isin(starts)) if starts else actual.limit(0)
            window_of = F.timestamp_micros(F.unix_micros(at) - F.pmod(F.unix_micros(at), F.lit(size_us)))
            bronze = bronze.where((at >= F.lit(starts[0] if starts else dt.datetime(1970, 1, 1)))
                                  & window_of.isin(starts)) if starts else bronze.limit(0)
        dropped = {a.name for a in table.aggregates if a.n}
        on_time = bronze.join(late.select(F.col("event_id").alias(spec.id_field)), spec.id_field, "left_anti")
        expected = spark.sql(query_over(table.sql, dropped), source=on_time)
        expected = expected.where(F.unix_micros(start) + F.lit(size_us) <= F.lit(watermark_us))
        compared = [c.name for c in table.columns if c.name not in dropped]
    else:
        events = watermark.kept_events(table, bronze)
        on_time = events.join(late.select(F.col("event_id").alias(spec.id_field)), spec.id_field, "left_anti")
        expected = recomputed_sessions(table, on_time).where(
            F.unix_micros("_last") + F.lit(size_us) <= F.lit(watermark_us))
        compared = [c.name for c in table.columns if c.role in ("key", "start", "end", "aggregate")]
    typed = {f.name: f.dataType for f in output_schema(table)}
    expected = expected.select(*(F.col(c).cast(typed[c]) for c in compared))
    stored = actual.select(*compared)
    late_count, late_in_bronze, not_behind, events_read = _late_figures(late, bronze, spec.id_field)
    figures.update({"events": events_read, "late_events": late_in_bronze,
                    "late_not_in_bronze": late_count - late_in_bronze if since_version is None else 0,
                    "late_not_behind_watermark": not_behind})
    # Read by both sides of the comparison: recomputed once.
    expected = kept(expected)
    mismatched = (stored.exceptAll(expected).withColumn("side", F.lit(f"only in {table.name}"))
                  .unionByName(expected.exceptAll(stored).withColumn("side", F.lit(f"missing from {table.name}"))))
    figures["rows_checked"] = stored.count()
    return mismatched, figures


def _compared_in_driver(stored: DataFrame, expected: DataFrame, name: str, figures: dict) -> tuple[DataFrame, dict]:
    """`stored` against `expected` as multisets of rows, in the driver, both read by one job: for the per-run session
    check, a sample of at most RUN_CHECK_KEYS keys' sessions. The rows on one side only, with `side`, as a local
    frame. In Spark (two kept frames, two differences, their counts) the comparison was four jobs of mostly fixed
    cost."""
    both = stored.withColumn("_expected", F.lit(False)).unionByName(expected.withColumn("_expected", F.lit(True)))
    have, want, rows_of = Counter(), Counter(), {}
    for row in both.collect():
        values = tuple(row)[:-1]
        # A list (a MAX_BY's n values) is hashed as a tuple; the row's own values are what the mismatch shows.
        hashable = tuple(tuple(v) if isinstance(v, list) else v for v in values)
        rows_of.setdefault(hashable, values)
        (want if row["_expected"] else have)[hashable] += 1
    differing = ([(*rows_of[r], f"only in {name}") for r in (have - want).elements()]
                 + [(*rows_of[r], f"missing from {name}") for r in (want - have).elements()])
    figures["rows_checked"] = sum(have.values())
    schema = StructType([*stored.schema.fields, StructField("side", StringType())])
    return frame_of_rows(stored.sparkSession, differing, schema), figures


def top_mismatches(spark: SparkSession, layout: StorageLayout, top: TopSpec) -> DataFrame:
    """Rows of a top N table that differ from its declared query run by Spark over its windowed table (either
    side), with `side` saying which table holds the row."""
    stored = spark.read.format("delta").load(str(layout.table(top.name)))
    recomputed = spark.sql(query_over(top.sql), source=spark.read.format("delta").load(str(layout.table(top.source))))
    recomputed = recomputed.select(*(F.col(f.name).cast(f.dataType) for f in stored.schema))
    return (stored.exceptAll(recomputed).withColumn("side", F.lit(f"only in {top.name}"))
            .unionByName(recomputed.exceptAll(stored).withColumn("side", F.lit(f"missing from {top.name}"))))
