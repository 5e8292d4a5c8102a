"""Bronze → state tables: the bronze rows of a micro-batch aggregated by key and MERGEd, exactly once.

One MERGE routine serves every state table; the table's shape comes from its `StateTableSpec`. It is a step
of the stream's micro-batch (pipelines/runtime/micro_batch.py), `StateTableStage`: each MERGE commit records the
bronze version the table has folded through, so no bronze row is folded twice or missed, whichever attempt
of a batch commits. A table that records none is rebuilt from bronze (`rebuild_state_table`).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Callable

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import StructField, StructType, TimestampType

from pipelines.declare.aggregates import kind_of, partial_columns
from pipelines.declare.specs import FIELD_TYPES, StateTableSpec, StreamSpec
from pipelines.errors import ConcurrentWriterError, ConfigurationError, DefinitionChangedError
from pipelines.faults import (
    STATE_AFTER_MERGE_COMMIT, STATE_AFTER_REBUILD, STATE_BATCH_END, STATE_MERGE_START, fault_point,
)
from pipelines.ingest.jvm import batch_timestamp
from pipelines.state.expiry import (
    EXPIRED, ExpiredTotals, expire_keys, expired_rows, expired_totals, newest_ingested_us, record_policy,
    require_whole_history, since_last_expiry, ttl_property,
)
from pipelines.storage import delta_sql
from pipelines.storage.delta_log import (
    USER_METADATA, BronzeRows, commit_confs, commit_metadata, commits_since, NewTable, create_tables_if_missing,
    history_rows, holds_no_rows, logged_properties, new_app_id, newest_commit_with, retry_on_conflict,
    table_properties, table_version,
)
from pipelines.storage.delta_sql import ident
from pipelines.storage.layout import StorageLayout

def state_schema(table: StateTableSpec) -> StructType:
    """The declared columns with the types the declared query yields in Spark, `updated_at`, then what the MERGE
    needs to combine an AVG (its exact sum and count) or a MIN_BY/MAX_BY (the ordering value beside the value);
    those columns start with `_`."""
    field = {f.name: f for f in table.fields}
    visible, hidden = [], []
    for key in table.keys:
        visible.append(StructField(key, FIELD_TYPES[field[key].kind], nullable=not field[key].required))
    for a in table.aggregates:
        kind = kind_of(a)
        if kind.shown_as_kept():
            visible += kind.fields(a, field)
        else:
            visible.append(StructField(a.name, kind.final_type(a, field)))
            hidden += kind.fields(a, field)
    return StructType([*visible, StructField("updated_at", TimestampType()), *hidden])


def state_new_table(layout: StorageLayout, table: StateTableSpec) -> NewTable:
    # The definition is recorded by the creation itself: a commit of its own would be a version with no rows.
    return NewTable(layout.table(table.name), state_schema(table), properties={DEFINITION_PROPERTY: definition_of(table)})


def ensure_state_table(spark: SparkSession, layout: StorageLayout, table: StateTableSpec) -> None:
    create_tables_if_missing(spark, [state_new_table(layout, table)])


DEFINITION_PROPERTY = "statetables.definition"  # a fingerprint of the keys and aggregates that wrote the rows


def definition_of(table: StateTableSpec) -> str:
    """What decides the table's rows: its keys, aggregates and WHERE (not its name, its SQL's spelling, or its TTL,
    which has its own record, pipelines/state/expiry.py)."""
    text = json.dumps({"stream": table.stream, "keys": table.keys,
                       "aggregates": [[a.name, a.function, a.column, a.by] for a in table.aggregates],
                       **({"where": table.where} if table.where else {})})
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def require_definition(spark: SparkSession, table_path: Path, table: StateTableSpec) -> None:
    """Refuse to fold into a table whose rows an earlier definition wrote: its keys or aggregates changed, so
    old rows and new rows would mean different things. A table without a record gets one, if its columns are
    the declared ones."""
    wanted = definition_of(table)
    found = table_properties(spark, table_path).get(DEFINITION_PROPERTY)
    if found == wanted:
        return
    columns = [(f.name, f.dataType.simpleString()) for f in spark.read.format("delta").load(str(table_path)).schema]
    declared = [(f.name, f.dataType.simpleString()) for f in state_schema(table)]
    if found is not None or columns != declared:
        raise DefinitionChangedError(
            f"{table.name} holds rows of another definition than the project file's (line {table.line}: "
            f"{table.sql}); its keys or aggregates changed. Fix: `statetables refresh {table.name}` rebuilds it from "
            f"bronze under the new definition, replacing its content in one commit; or put the old SQL back.")
    delta_sql.set_property(spark, table_path, DEFINITION_PROPERTY, wanted)


def recorded_definition(table_path: Path) -> str | None:
    """The fingerprint the table's newest metadata records, read from its log without Spark, so that the code
    location can check it when it loads. None when none of the newest commit files holds metadata (older ones
    checkpointed away)."""
    return (logged_properties(table_path) or {}).get(DEFINITION_PROPERTY)


def changed_definitions(layout: StorageLayout, tables: list[StateTableSpec]) -> list[str]:
    """What to tell the operator about tables whose recorded definition is not the declared one."""
    return [f"{t.name} (line {t.line}): its rows were written under another definition; its keys or aggregates "
            f"changed. Fix: `statetables refresh {t.name}` rebuilds it from bronze under the new one (or put the "
            f"old SQL back)" for t in tables
            if (found := recorded_definition(layout.table(t.name))) is not None and found != definition_of(t)]


def aggregate(events: DataFrame, table: StateTableSpec, updated_at: Column | None = None) -> DataFrame:
    """The declared query over `events`: one row per key with every column of the state table (the hidden ones
    too), `updated_at` (default: the query's current_timestamp())."""
    kinds = {f.name: f.kind for f in table.fields}
    if table.where:
        events = events.where(F.expr(table.where))
    grouped = events.groupBy(*table.keys).agg(*partial_columns(table.aggregates, kinds))
    finals = [kind_of(a).final(a, kinds) for a in table.aggregates if not kind_of(a).shown_as_kept()]
    schema = state_schema(table)
    return grouped.select("*", *finals).select(
        *[F.col(f.name).cast(f.dataType) if f.name != "updated_at"
          else (F.current_timestamp() if updated_at is None else updated_at).alias("updated_at") for f in schema])


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
    for row in history_rows(spark, table_path, NEWEST_COMMITS, latest=latest):
        if row["version"] > target:
            continue
        if row["operation"] == "RESTORE":
            restored = (row["operationParameters"] or {}).get("version")
            if restored in (None, ""):
                return None
            target = restored_to = int(restored)
            continue
        meta = commit_metadata(row)
        if meta.get(FOLDED_THROUGH) is not None:
            return Folded(latest, int(meta[FOLDED_THROUGH]), restored_to)
    return None


class StateTableStage:
    """The all-time state step of a stream's micro-batch: the bronze rows added after the version the table has
    folded, aggregated by key and MERGEd, with that version recorded in the same commit; with a `ttl`, the keys
    it has passed are then expired (pipelines/state/expiry.py).

    The bronze version travels in the MERGE's own commit, so a batch replayed under any app id (the same one
    after a crash, another after a lost checkpoint) folds each bronze row once: the recorded version skips the
    rows a batch folded before it died."""

    def __init__(self, layout: StorageLayout, spec: StreamSpec, table: StateTableSpec, through: int):
        self.layout, self.spec, self.table, self.ttl, self.through = layout, spec, table, table.ttl, through
        self.rebuilt_through: int | None = None
        self.note: str | None = None  # why the table folds bronze it had folded before (a RESTORE)
        self.empty = False  # holds no row yet: its first fold appends (`upsert`)

    def advance(self, spark: SparkSession, bronze: BronzeRows, app_id: str, batch_id: int) -> None:
        through = bronze.through
        table = self.table
        table_path = str(self.layout.table(table.name))
        # Asked again at each batch: another copy of it may have folded since the run started (a killed run's
        # query that went on in a Spark Connect server, until the fence stopped it: docs/recovery.md).
        if (recorded := self.recorded_through(spark)) is not None and recorded > self.through:
            self.through, self.empty = recorded, False
        if through <= self.through:
            return
        folded = self.through
        events = bronze.after(folded)
        # The batch's time as a constant that is not a literal (`batch_timestamp`): current_timestamp() became one,
        # written into the code generated for the fold's and the MERGE's stages, new each batch.
        batch = aggregate(events, table, batch_timestamp(spark, time.time_ns() // 1000))
        fault_point(STATE_MERGE_START)
        metadata = {"app_id": app_id, "batch_id": batch_id, FOLDED_THROUGH: through}
        if self.ttl is not None:
            expired = expired_totals(spark, table_path)
            metadata[EXPIRED] = expired.as_metadata()
            metadata[INGESTED_THROUGH] = newest_ingested_us(events)

        def still_from_folded() -> None:
            if (now := self.recorded_through(spark)) is not None and now != folded:
                raise ConcurrentWriterError(
                    f"Micro-batch {batch_id} of {self.spec.name} was to fold bronze after version {folded} into "
                    f"{table.name}, and another writer has meanwhile recorded version {now} there: another copy of "
                    f"this stream's batch. Nothing of this batch was written to {table.name}. Fix: none needed, the "
                    f"next run folds from what the table records; if this repeats, find the other writer (one "
                    f"statetables run per stream writes it).")

        upsert(spark, table_path, table, batch, batch_id, metadata, empty=self.empty, before_commit=still_from_folded)
        self.through, self.empty = through, False
        fault_point(STATE_AFTER_MERGE_COMMIT)
        if self.ttl is not None:
            self.expire(spark, metadata[INGESTED_THROUGH], app_id, batch_id, expired)
        fault_point(STATE_BATCH_END)

    def recorded_through(self, spark: SparkSession) -> int | None:
        """The bronze version the table's newest commit that records one says it folded through; None for none, or
        when a RESTORE is newer (`folded_through` reads what that brought back, when a run starts)."""
        found = newest_commit_with(spark, self.layout.table(self.table.name), FOLDED_THROUGH, NEWEST_COMMITS,
                                   unless_after="RESTORE")
        return int(found[1][FOLDED_THROUGH]) if found is not None else None

    def expire(self, spark: SparkSession, ingested_through_us: int | None, app_id: str, batch_id: int,
               expired: ExpiredTotals | None = None) -> None:
        table_path = self.layout.table(self.table.name)
        expired = expired if expired is not None else expired_totals(spark, table_path)
        retry_on_conflict(lambda: expire_keys(spark, table_path, self.table, self.ttl,
                                              ingested_through_us=ingested_through_us, app_id=app_id,
                                              batch_id=batch_id, expired=expired),
                          f"expiry after micro-batch {batch_id} in {self.table.name}")


def state_table_stage(spark: SparkSession, layout: StorageLayout, spec: StreamSpec, table: StateTableSpec
                      ) -> StateTableStage:
    """The state step as the table's newest commits left it, for a run of the stream (which holds the stream's
    writer lock). A table that records no bronze version (new, deleted, or kept by an earlier statetables) is
    rebuilt from bronze first, exactly (`rebuild_state_table`). With a TTL, an expiry that a crash cut off after
    its MERGE is done now (an expiry repeated changes nothing)."""
    ttl = table.ttl
    if ttl is not None and ttl <= timedelta(0):
        raise ConfigurationError(f"The TTL of {table.name} must be positive, got {ttl}. "
                                 f"Fix: set a number of days > 0, or leave it unset to keep every key.")
    table_path = layout.table(table.name)
    ensure_state_table(spark, layout, table)
    require_definition(spark, table_path, table)
    record_policy(spark, table_path, ttl)
    found = folded_through(spark, table_path)
    stage = StateTableStage(layout, spec, table, found.through if found else -1)
    if found is not None and found.restored_to is not None:
        stage.note = (f"{table.name} was restored to version {found.restored_to} (Delta RESTORE): "
                      f"bronze after version {found.through} is folded again")
    if found is None:
        if (table_version(spark, layout.table(spec.bronze_table)) or 0) > 0:
            stage.through = stage.rebuilt_through = rebuild_state_table(
                spark, layout, spec, table, new_app_id(f"{spec.name}/rebuild"))
        else:
            stage.empty = holds_no_rows(spark, table_path)
    elif ttl is not None:
        newest = commits_since(spark, table_path, found.version - 1)
        through_us = newest[0]["user"].get(INGESTED_THROUGH) if newest else None
        if through_us is not None:
            stage.expire(spark, int(through_us), newest[0]["user"].get("app_id", ""),
                         int(newest[0]["user"].get("batch_id", -1)))
    return stage


def upsert(spark: SparkSession, table_path: str, table: StateTableSpec, batch: DataFrame, batch_id: int,
           metadata: dict, *, empty: bool = False, before_commit: Callable[[], None] = lambda: None) -> None:
    """MERGE a batch's per-key aggregate (`aggregate`) into the state table, the commit carrying `metadata` (the
    bronze version folded: what makes a replay fold nothing, `StateTableStage`); a concurrent writer's commit is
    retried.

    Into a table that holds no row (`empty`: a new table's first fold) the batch is appended instead: the rows, and
    the change rows (inserts), are the MERGE's, without its join of the table (a new root's first run 5.32 -> 4.94 s
    warm, measured: docs/performance.md)."""
    def fold() -> None:
        before_commit()  # each attempt: a conflict retried must not fold on top of another copy of the batch
        with commit_confs(spark, {USER_METADATA: json.dumps(metadata)}):
            if empty:
                _inserted(batch, table).write.format("delta").mode("append").save(str(table_path))
            else:
                delta_sql.merge(spark, table_path, batch, on=_on_key(table), clauses=_upsert_clauses(table))

    retry_on_conflict(fold, f"{'append' if empty else 'MERGE'} of micro-batch {batch_id} into {table.name}")


def _inserted(batch: DataFrame, table: StateTableSpec) -> DataFrame:
    """The rows the MERGE's insert clause (`_upsert_clauses`) makes of a batch's keys."""
    return batch.select(*(F.col(f.name).cast(f.dataType).alias(f.name) for f in state_schema(table)))


def merge_text(table: StateTableSpec, path) -> str:
    """The MERGE each micro-batch runs for the table, its batch written as `batch`: one row per key of the batch's
    events, the aggregates' partial values."""
    return delta_sql.merge_statement(path, "batch", on=_on_key(table), clauses=_upsert_clauses(table))


def _on_key(table: StateTableSpec) -> str:
    """Key equality; NULL-safe for an optional key field (GROUP BY keeps NULL as a key of its own)."""
    required = {f.name for f in table.fields if f.required}
    return " AND ".join(f"t.{ident(k)} {'=' if k in required else '<=>'} s.{ident(k)}" for k in table.keys)


def _upsert_clauses(table: StateTableSpec) -> str:
    """Combine a key's row with the batch's partial aggregate column by column; new keys insert."""
    field = {f.name: f for f in table.fields}
    schema = state_schema(table)
    types = {f.name: f.dataType.simpleString() for f in schema}
    sets = [clause for a in table.aggregates for clause in kind_of(a).merged(a, types, field)]
    columns = [ident(f.name) for f in schema]
    values = [f"s.{ident(f.name)}" for f in schema]
    return (f"WHEN MATCHED THEN UPDATE SET {', '.join(sets)}, t.updated_at = s.updated_at "
            f"WHEN NOT MATCHED THEN INSERT ({', '.join(columns)}) VALUES ({', '.join(values)})")


def set_table_content(spark: SparkSession, table_path: str, table: StateTableSpec, content: DataFrame,
                      metadata: dict) -> None:
    """Make the state table hold exactly `content` (its columns, one row per key), in one MERGE.

    Only keys whose values change are rewritten (`updated_at` alone does not count), keys missing
    from `content` are deleted, so the Change Data Feed shows real changes only. Used by the rebuild
    from bronze and by savepoint restores; the result is absolute, so repeating it is safe.
    """
    values = [c for c in state_schema(table).fieldNames() if c not in (*table.keys, "updated_at")]
    differs = " OR ".join(f"NOT (t.{ident(c)} <=> s.{ident(c)})" for c in values)
    with commit_confs(spark, {USER_METADATA: json.dumps(metadata)}):
        delta_sql.merge(spark, table_path, content, on=_on_key(table),
                        clauses=f"WHEN MATCHED AND ({differs}) THEN UPDATE SET * WHEN NOT MATCHED THEN INSERT * "
                                f"WHEN NOT MATCHED BY SOURCE THEN DELETE")


def rebuild_state_table(spark: SparkSession, layout: StorageLayout, spec: StreamSpec, table: StateTableSpec,
                        app_id: str) -> int:
    """Recompute the state table from the whole bronze table at one pinned version, in one MERGE.

    A key that expired counts only the events ingested after its newest expiry, as the live table
    does; with a `ttl`, the keys it has passed are then expired (pipelines/state/expiry.py).
    The commits are recorded as batch -1 of `app_id`, with the bronze version the table now reflects, which is
    returned.
    """
    ttl = table.ttl
    table_path = layout.table(table.name)
    bronze_path = layout.table(spec.bronze_table)
    bronze_version = table_version(spark, bronze_path)
    events = spark.read.format("delta").option("versionAsOf", bronze_version).load(str(bronze_path))
    expired = expired_totals(spark, table_path)
    expired_before = expired_rows(spark, table_path, table)
    require_whole_history(expired_before, table, expired, table_path)
    counted = since_last_expiry(events, expired_before, table.keys)
    content = aggregate(counted, table)
    metadata = {"app_id": app_id, "batch_id": -1, "rebuilt_from": spec.bronze_table, FOLDED_THROUGH: bronze_version}
    if ttl_property(spark, table_path) is not None:
        metadata[EXPIRED] = expired.as_metadata()
    set_table_content(spark, str(table_path), table, content, metadata)
    if ttl is not None:
        expire_keys(spark, table_path, table, ttl, ingested_through_us=newest_ingested_us(events),
                    app_id=app_id, batch_id=-1, expired=expired)
    fault_point(STATE_AFTER_REBUILD)
    return bronze_version
