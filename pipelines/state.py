"""Bronze → state tables: the bronze rows of a micro-batch aggregated by key and MERGEd, exactly once.

One MERGE routine serves every state table; the table's shape comes from its `StateTableSpec`. It is a step
of the stream's micro-batch (pipelines/stream_query.py), `StateTableStage`: each MERGE commit records the
bronze version the table has folded through, so no bronze row is folded twice or missed, whichever attempt
of a batch commits. A table that records none is rebuilt from bronze (`rebuild_state_table`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import DecimalType, LongType, StringType, StructField, StructType, TimestampType

from pipelines import delta_sql
from pipelines.delta_sql import ident
from pipelines.layout import StorageLayout
from pipelines.checkpoints import new_app_id
from pipelines.errors import ConfigurationError
from pipelines.expiry import (
    EXPIRED, ExpiredTotals, expire_keys, expired_rows, expired_totals, newest_ingested_us, record_policy, require_whole_history,
    since_last_expiry, ttl_property,
)
from pipelines.faults import STATE_AFTER_MERGE_COMMIT, STATE_AFTER_REBUILD, STATE_BATCH_END, STATE_MERGE_START, fault_point
from pipelines.streaming import (
    TXN_APP_ID, TXN_VERSION, USER_METADATA, commit_confs, commits_since, create_table_if_missing, history_rows,
    retry_on_conflict, rows_added, table_version,
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


def aggregate(events: DataFrame, table: StateTableSpec, value_column: str, event_time_column: str) -> DataFrame:
    return events.groupBy(table.key).agg(
        F.count(value_column).alias("batch_count"),
        F.sum(value_column).cast(TOTAL_TYPE).alias("batch_sum"),
        F.min(event_time_column).alias("batch_first"),
        F.max(event_time_column).alias("batch_last"),
    )


FOLDED_THROUGH = "bronze_version"  # commit metadata: every bronze version up to this one is folded into the table
INGESTED_THROUGH = "ingested_through_us"  # MERGE commit metadata with a TTL: the newest bronze ingested_at folded
NEWEST_COMMITS = 20  # searched for the newest commit that records FOLDED_THROUGH


@dataclass(frozen=True)
class Folded:
    """What a state table's commits say it holds."""

    version: int  # the table's newest version
    through: int  # every bronze version up to this one is folded into it
    restored_to: int | None = None  # a Delta RESTORE newer than the commit that recorded `through` went back here


def folded_through(spark: SparkSession, table_path: Path) -> Folded | None:
    """The bronze version the table has folded through, from its newest commits: every MERGE, rebuild and
    savepoint restore records it with its rows, in the same commit. A Delta RESTORE brings back what the
    version it went back to had folded. None for a table whose commits do not record one (a new table, one
    kept by an earlier statetables, or one restored by timestamp)."""
    latest = table_version(spark, table_path)
    if latest is None:
        return None
    target, restored_to = latest, None
    for row in history_rows(spark, table_path, NEWEST_COMMITS):
        if row["version"] > target:
            continue
        if row["operation"] == "RESTORE":
            restored = (row["operationParameters"] or {}).get("version")
            if restored in (None, ""):
                return None
            target = restored_to = int(restored)
            continue
        meta = json.loads(row["userMetadata"]) if row["userMetadata"] else {}
        if isinstance(meta, dict) and meta.get(FOLDED_THROUGH) is not None:
            return Folded(latest, int(meta[FOLDED_THROUGH]), restored_to)
    return None


class StateTableStage:
    """The all-time state step of a stream's micro-batch: the bronze rows added after the version the table has
    folded, aggregated by key and MERGEd, with that version recorded in the same commit; with a `ttl`, the keys
    it has passed are then expired (pipelines/expiry.py).

    The bronze version travels in the MERGE's own commit, so a batch replayed under any app id (the same one
    after a crash, another after a lost checkpoint) folds each bronze row once: Delta's txn id skips a replay
    of the same batch, and the recorded version skips rows folded by a batch that died later on."""

    def __init__(self, layout: StorageLayout, spec: StreamSpec, ttl: timedelta | None, through: int):
        self.layout, self.spec, self.ttl, self.through = layout, spec, ttl, through
        self.rebuilt_through: int | None = None
        self.note: str | None = None  # why the table folds bronze it had folded before (a RESTORE)

    def advance(self, spark: SparkSession, bronze_path: Path, through: int, app_id: str, batch_id: int) -> None:
        if through <= self.through:
            return
        spec, table = self.spec, self.spec.state_table
        table_path = str(self.layout.table(table.name))
        events = rows_added(spark, bronze_path, self.through, through)
        batch = aggregate(events, table, spec.value_field, spec.event_time_field)
        fault_point(STATE_MERGE_START)
        metadata = {"app_id": app_id, "batch_id": batch_id, FOLDED_THROUGH: through}
        if self.ttl is not None:
            expired = expired_totals(spark, table_path)
            metadata[EXPIRED] = expired.as_metadata()
            metadata[INGESTED_THROUGH] = newest_ingested_us(events)

        upsert(spark, table_path, table, batch, app_id, batch_id, metadata)
        self.through = through
        fault_point(STATE_AFTER_MERGE_COMMIT)
        if self.ttl is not None:
            self.expire(spark, metadata[INGESTED_THROUGH], app_id, batch_id, expired)
        fault_point(STATE_BATCH_END)

    def expire(self, spark: SparkSession, ingested_through_us: int | None, app_id: str, batch_id: int,
               expired: ExpiredTotals | None = None) -> None:
        table_path = self.layout.table(self.spec.state_table.name)
        expired = expired if expired is not None else expired_totals(spark, table_path)
        retry_on_conflict(lambda: expire_keys(spark, table_path, self.spec.state_table, self.ttl,
                                              ingested_through_us=ingested_through_us, app_id=app_id,
                                              batch_id=batch_id, expired=expired),
                          f"expiry after micro-batch {batch_id} in {self.spec.state_table.name}")


def state_table_stage(spark: SparkSession, layout: StorageLayout, spec: StreamSpec, ttl: timedelta | None
                      ) -> StateTableStage:
    """The state step as the table's newest commits left it, for a run of the stream (which holds the stream's
    writer lock). A table that records no bronze version (new, deleted, or kept by an earlier statetables) is
    rebuilt from bronze first, exactly (`rebuild_state_table`). With a TTL, an expiry that a crash cut off after
    its MERGE is done now (an expiry repeated changes nothing)."""
    if ttl is not None and ttl <= timedelta(0):
        raise ConfigurationError(f"The TTL of {spec.state_table.name} must be positive, got {ttl}. "
                                 f"Fix: set a number of days > 0, or leave it unset to keep every key.")
    table_path = layout.table(spec.state_table.name)
    ensure_state_table(spark, layout, spec.state_table)
    record_policy(spark, table_path, ttl)
    found = folded_through(spark, table_path)
    stage = StateTableStage(layout, spec, ttl, found.through if found else -1)
    if found is not None and found.restored_to is not None:
        stage.note = (f"{spec.state_table.name} was restored to version {found.restored_to} (Delta RESTORE): "
                      f"bronze after version {found.through} is folded again")
    if found is None:
        if (table_version(spark, layout.table(spec.bronze_table)) or 0) > 0:
            stage.through = stage.rebuilt_through = rebuild_state_table(
                spark, layout, spec, new_app_id(f"{spec.name}/rebuild"), ttl)
    elif ttl is not None:
        newest = commits_since(spark, table_path, found.version - 1)
        through_us = newest[0]["user"].get(INGESTED_THROUGH) if newest else None
        if through_us is not None:
            stage.expire(spark, int(through_us), newest[0]["user"].get("app_id", ""),
                         int(newest[0]["user"].get("batch_id", -1)))
    return stage


def upsert(spark: SparkSession, table_path: str, table: StateTableSpec, batch: DataFrame, app_id: str, batch_id: int,
           metadata: dict) -> None:
    """MERGE a batch's per-key aggregate (`aggregate`) into the state table under the txn id (app id, batch id):
    Delta skips it if that batch already committed; a concurrent writer's commit is retried."""
    def merge() -> None:
        with commit_confs(spark, {TXN_APP_ID: app_id, TXN_VERSION: str(batch_id), USER_METADATA: json.dumps(metadata)}):
            delta_sql.merge(spark, table_path, batch, on=_on_key(table), clauses=_upsert_clauses(table))

    retry_on_conflict(merge, f"MERGE of micro-batch {batch_id} into {table.name}")


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
    The commits are recorded as batch -1 of `app_id`, with the bronze version the table now reflects, which is
    returned.
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
    content = aggregate(counted, table, spec.value_field, spec.event_time_field).select(
        F.col(table.key), F.col("batch_count").alias(table.count_column), F.col("batch_sum").alias(table.sum_column),
        F.col("batch_first").alias(table.first_ts_column), F.col("batch_last").alias(table.last_ts_column),
        F.current_timestamp().alias("updated_at"))
    metadata = {"app_id": app_id, "batch_id": -1, "rebuilt_from": spec.bronze_table, FOLDED_THROUGH: bronze_version}
    if ttl_property(spark, table_path) is not None:
        metadata[EXPIRED] = expired.as_metadata()
    set_table_content(spark, str(table_path), table, content, metadata)
    if ttl is not None:
        expire_keys(spark, table_path, table, ttl, ingested_through_us=newest_ingested_us(events),
                    app_id=app_id, batch_id=-1, expired=expired)
    fault_point(STATE_AFTER_REBUILD)
    return bronze_version
