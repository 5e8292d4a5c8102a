"""Bronze → state tables: each micro-batch pre-aggregated by key and MERGEd, idempotently.

One MERGE routine (`upsert_batch`) serves every state table; the table's shape comes from its
`StateTableSpec`. Delta's txnAppId/txnVersion session confs make MERGE skip a micro-batch that
already committed, which is what happens when a run dies between the MERGE commit and the
checkpoint commit and the batch is replayed. Without a checkpoint that can be trusted, the table
is rebuilt from bronze (`rebuild_state_table`) and a fresh checkpoint starts after it.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta
from functools import partial

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import DecimalType, LongType, StringType, StructField, StructType, TimestampType

from pipelines import delta_sql
from pipelines.delta_sql import ident
from pipelines.layout import StorageLayout
from pipelines.bronze import ensure_bronze_tables
from pipelines.checkpoints import checkpoint_for_run, new_app_id, start_checkpoint
from pipelines.errors import ConfigurationError
from pipelines.expiry import (
    EXPIRED, expire_keys, expired_rows, expired_totals, newest_ingested_us, record_policy, require_whole_history,
    since_last_expiry, ttl_property,
)
from pipelines.faults import STATE_AFTER_MERGE_COMMIT, STATE_AFTER_REBUILD, STATE_BATCH_END, STATE_MERGE_START, fault_point
from pipelines.streaming import (
    TXN_APP_ID, TXN_VERSION, USER_METADATA, Continuous, StreamRunResult, TableVersions, commit_confs, commits_since,
    create_table_if_missing, require_writable, retry_on_conflict, run_query, source_ready, storage_errors, table_id,
    table_version, writer_lock,
)
from pipelines.streams import StateTableSpec, StreamSpec

TOTAL_TYPE = DecimalType(28, 2)  # what Spark's SUM of DECIMAL(18,2) yields


def state_schema(table: StateTableSpec) -> StructType:
    return StructType([
        StructField(table.key, StringType(), nullable=False),
        StructField(table.count_column, LongType(), nullable=False),
        StructField(table.sum_column, TOTAL_TYPE, nullable=False),
        StructField(table.first_ts_column, TimestampType()),
        StructField(table.last_ts_column, TimestampType()),
        StructField("updated_at", TimestampType()),
    ])


def ensure_state_table(spark: SparkSession, layout: StorageLayout, table: StateTableSpec) -> None:
    create_table_if_missing(spark, layout.table(table.name), state_schema(table))


def _aggregate(events: DataFrame, table: StateTableSpec, value_column: str, event_time_column: str) -> DataFrame:
    return events.groupBy(table.key).agg(
        F.count(value_column).alias("batch_count"),
        F.sum(value_column).cast(TOTAL_TYPE).alias("batch_sum"),
        F.min(event_time_column).alias("batch_first"),
        F.max(event_time_column).alias("batch_last"),
    )


def upsert_batch(events: DataFrame, batch_id: int, *, table_path: str, table: StateTableSpec,
                 value_column: str, event_time_column: str, app_id: str, ttl: timedelta | None = None) -> None:
    """foreachBatch body: aggregate the batch's events by key and MERGE them into the state table;
    with a `ttl`, then expire the keys it has passed (pipelines/expiry.py).

    Every batch commits, even an empty one: the table's record of `{"app_id", "batch_id"}` is how
    the next run knows the checkpoint and the table agree (pipelines/checkpoints.py).

    >>> upsert_batch(bronze_batch, 7, table_path="data/tables/movie_tickets_sold",
    ...              table=MOVIE_TICKET_SALES.state_table, value_column="ticket_total_value",
    ...              event_time_column="sale_ts", app_id="statetables/...")
    """
    spark = events.sparkSession
    batch = _aggregate(events, table, value_column, event_time_column)
    fault_point(STATE_MERGE_START)
    metadata = {"app_id": app_id, "batch_id": batch_id}
    if ttl is not None:
        expired = expired_totals(spark, table_path)
        metadata[EXPIRED] = expired.as_metadata()

    def merge() -> None:
        with commit_confs(spark, {TXN_APP_ID: app_id, TXN_VERSION: str(batch_id), USER_METADATA: json.dumps(metadata)}):
            delta_sql.merge(spark, table_path, batch, on=_on_key(table), clauses=_upsert_clauses(table))

    retry_on_conflict(merge, f"MERGE of micro-batch {batch_id} into {table.name}")
    fault_point(STATE_AFTER_MERGE_COMMIT)
    if ttl is not None:
        through = newest_ingested_us(events)
        retry_on_conflict(lambda: expire_keys(spark, table_path, table, ttl, ingested_through_us=through,
                                              app_id=app_id, batch_id=batch_id, expired=expired),
                          f"expiry after micro-batch {batch_id} in {table.name}")
    fault_point(STATE_BATCH_END)


def _on_key(table: StateTableSpec) -> str:
    key = ident(table.key)
    return f"t.{key} = s.{key}"


def _upsert_clauses(table: StateTableSpec) -> str:
    """Add the batch's count and sum to a key's row, widen its first/last event time; new keys insert."""
    key, count, total = ident(table.key), ident(table.count_column), ident(table.sum_column)
    first, last = ident(table.first_ts_column), ident(table.last_ts_column)
    return (
        f"WHEN MATCHED THEN UPDATE SET t.{count} = t.{count} + s.batch_count, "
        f"t.{total} = CAST(t.{total} + s.batch_sum AS {TOTAL_TYPE.simpleString()}), "
        f"t.{first} = least(t.{first}, s.batch_first), t.{last} = greatest(t.{last}, s.batch_last), "
        f"t.updated_at = current_timestamp() "
        f"WHEN NOT MATCHED THEN INSERT ({key}, {count}, {total}, {first}, {last}, updated_at) "
        f"VALUES (s.{key}, s.batch_count, s.batch_sum, s.batch_first, s.batch_last, current_timestamp())"
    )


def set_table_content(spark: SparkSession, table_path: str, table: StateTableSpec, content: DataFrame,
                      metadata: dict) -> None:
    """Make the state table hold exactly `content` (its columns, one row per key), in one MERGE.

    Only keys whose values change are rewritten (`updated_at` alone does not count), keys missing
    from `content` are deleted, so the Change Data Feed shows real changes only. Used by the rebuild
    from bronze and by savepoint restores; the result is absolute, so repeating it is safe.
    """
    values = [c for c in state_schema(table).fieldNames() if c not in (table.key, "updated_at")]
    differs = " OR ".join(f"NOT (t.{ident(c)} <=> s.{ident(c)})" for c in values)
    with commit_confs(spark, {USER_METADATA: json.dumps(metadata)}):
        delta_sql.merge(spark, table_path, content, on=_on_key(table),
                        clauses=f"WHEN MATCHED AND ({differs}) THEN UPDATE SET * WHEN NOT MATCHED THEN INSERT * "
                                f"WHEN NOT MATCHED BY SOURCE THEN DELETE")


def rebuild_state_table(spark: SparkSession, layout: StorageLayout, spec: StreamSpec, app_id: str,
                        ttl: timedelta | None = None) -> int:
    """Recompute the state table from the whole bronze table at one pinned version, in one MERGE.

    A key that expired counts only the events ingested after its newest expiry, as the live table
    does; with a `ttl`, the keys it has passed are then expired (pipelines/expiry.py).
    The commits are recorded as batch -1 of `app_id`: the fresh checkpoint starts right after them.
    Returns the bronze version the table now reflects.
    """
    table = spec.state_table
    table_path = layout.table(table.name)
    bronze_path = layout.table(spec.bronze_table)
    bronze_version = table_version(spark, bronze_path)
    events = spark.read.format("delta").option("versionAsOf", bronze_version).load(str(bronze_path))
    expired = expired_totals(spark, table_path)
    expired_before = expired_rows(spark, table_path, table)
    require_whole_history(expired_before, table, expired, table_path)
    counted = since_last_expiry(events, expired_before, table.key)
    content = _aggregate(counted, table, spec.value_field, spec.event_time_field).select(
        F.col(table.key), F.col("batch_count").alias(table.count_column), F.col("batch_sum").alias(table.sum_column),
        F.col("batch_first").alias(table.first_ts_column), F.col("batch_last").alias(table.last_ts_column),
        F.current_timestamp().alias("updated_at"))
    metadata = {"app_id": app_id, "batch_id": -1, "rebuilt_from": spec.bronze_table, "bronze_version": bronze_version}
    if ttl_property(spark, table_path) is not None:
        metadata[EXPIRED] = expired.as_metadata()
    set_table_content(spark, str(table_path), table, content, metadata)
    if ttl is not None:
        expire_keys(spark, table_path, table, ttl, ingested_through_us=newest_ingested_us(events),
                    app_id=app_id, batch_id=-1, expired=expired)
    fault_point(STATE_AFTER_REBUILD)
    return bronze_version


def update_state_table(spark: SparkSession, layout: StorageLayout, spec: StreamSpec, *,
                       lock_timeout_s: float = 60.0, ttl: timedelta | None = None,
                       continuous: Continuous | None = None) -> StreamRunResult:
    """Fold every bronze event not yet counted into the stream's state table; with a `ttl`, expire
    keys with no event for that long of event time (pipelines/expiry.py).

    With no trusted checkpoint (first run, checkpoint lost, corrupt, or out of step with the table)
    the table is first rebuilt from bronze and a fresh checkpoint starts after that bronze version.

    >>> update_state_table(spark, StorageLayout.under("data"), MOVIE_TICKET_SALES).micro_batches
    """
    if ttl is not None and ttl <= timedelta(0):
        raise ConfigurationError(f"The TTL of {spec.state_table.name} must be positive, got {ttl}. "
                                 f"Fix: set a number of days > 0, or leave it unset to keep every key.")
    started = time.monotonic()
    table = spec.state_table
    table_path = layout.table(table.name)
    bronze_path = layout.table(spec.bronze_table)
    checkpoint = layout.checkpoint(spec.state_query)
    require_writable([layout.locks, table_path / "_delta_log", layout.checkpoints_root])
    with writer_lock(layout.locks, spec.state_query, lock_timeout_s), storage_errors():
        ensure_bronze_tables(spark, layout, spec)
        ensure_state_table(spark, layout, table)
        record_policy(spark, table_path, ttl)
        before = table_version(spark, table_path)
        bronze_id = table_id(spark, bronze_path)
        verdict, moved = checkpoint_for_run(spark, checkpoint, layout.set_aside_checkpoints, [table_path],
                                            source_table_id=bronze_id)
        origin, recovery, built_through = verdict.origin, None, None
        if origin is None:
            reason = verdict.problem or "no checkpoint yet"
            app_id = new_app_id(spec.state_query)
            bronze_version = built_through = rebuild_state_table(spark, layout, spec, app_id, ttl)
            origin = start_checkpoint(checkpoint, spec.state_query, reason, app_id=app_id,
                                      source_start_version=bronze_version + 1, source_table_id=bronze_id)
            if verdict.problem or moved:
                recovery = {"problem": reason, "set_aside": str(moved) if moved else None,
                            "action": f"rebuilt {table.name} from {spec.bronze_table} version {bronze_version}; "
                                      f"new checkpoint reads from version {bronze_version + 1}"}
        batches = rows = 0
        # Delta refuses a starting version that does not exist yet; until it does, the rebuild is current.
        has_offsets = any((checkpoint / "offsets").glob("[0-9]*"))
        start = origin.source_start_version
        if source_ready(lambda: has_offsets or start is None or start <= table_version(spark, bronze_path),
                        continuous):
            events = spark.readStream.format("delta")
            if start is not None:
                events = events.option("startingVersion", start)
            on_batch = partial(upsert_batch, table_path=str(table_path), table=table,
                               value_column=spec.value_field, event_time_column=spec.event_time_field,
                               app_id=origin.app_id, ttl=ttl)
            batches, rows = run_query(events.load(str(bronze_path)), query_name=spec.state_query,
                                      checkpoint_dir=checkpoint, on_batch=on_batch, continuous=continuous)
        return StreamRunResult(
            query_name=spec.state_query,
            micro_batches=batches,
            rows_read=rows,
            duration_s=time.monotonic() - started,
            versions={table.name: TableVersions(before, table_version(spark, table_path))},
            commits={table.name: commits_since(spark, table_path, before)},
            recovery=recovery,
            built_through_source_version=built_through,
        )
