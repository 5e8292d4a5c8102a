"""Full refresh: a state, windowed or session table rebuilt from its stream's bronze under the project file's
definition.

`statetables refresh TABLE` (and the `refresh_state_table` job in Dagster) is how a changed declaration (keys,
aggregates) takes effect: runs refuse to fold into a table that an earlier definition wrote (pipelines/state/tables.py,
`require_definition`). Under the stream's writer lock the table's new content is computed from bronze at one
pinned version and replaces the old in one commit (CREATE OR REPLACE), which records the bronze version it
reflects: a reader sees the old table or the new one, and the next run folds bronze after that version. The
changelog first takes in the old table's last changes (unless its declaration changed: then they stay in the table's
own history), then starts again from that commit, holding the new content as inserts; its earlier versions keep the
old table's history (Delta time travel).
"""

from __future__ import annotations

import json

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from pipelines.declare.specs import EventTimeTableSpec, StateTableSpec, StreamSpec
from pipelines.errors import ChangelogError, ConfigurationError
from pipelines.runtime.locks import writer_lock
from pipelines.state.changelog import COVERS, STATE_TABLE_ID, changelog_name, publish_changelog
from pipelines.state.expiry import EXPIRED, TTL_PROPERTY, ExpiredTotals, expire_keys, newest_ingested_us
from pipelines.state.tables import (
    DEFINITION_PROPERTY, FOLDED_THROUGH, aggregate, changed_definitions, definition_of,
)
from pipelines.storage import delta_sql
from pipelines.storage.delta_log import USER_METADATA, commit_confs, new_app_id, table_id, table_version
from pipelines.storage.frames import frame_of_rows, kept
from pipelines.storage.layout import StorageLayout


def _bronze(spark: SparkSession, layout: StorageLayout, spec: StreamSpec, table: str) -> tuple[int, DataFrame]:
    """Bronze's newest version and its rows, pinned to it: what a refresh rebuilds `table` from."""
    bronze_path = layout.table(spec.bronze_table)
    version = table_version(spark, bronze_path)
    if version is None:
        raise ConfigurationError(f"{spec.bronze_table} does not exist yet, so there is nothing to rebuild {table} "
                                 f"from. Fix: run the stream (`statetables run`): it builds the table under the "
                                 f"project file's definition.")
    return version, spark.read.format("delta").option("versionAsOf", version).load(str(bronze_path))


def refresh_state_table(spark: SparkSession, layout: StorageLayout, spec: StreamSpec, table: StateTableSpec, *,
                        lock_timeout_s: float = 60.0) -> dict:
    """Rebuild `table` from all of its stream's bronze, replacing its content in one commit; returns figures."""
    path = layout.table(table.name)
    with writer_lock(layout.locks, spec.name, lock_timeout_s):
        bronze_version, events = _bronze(spark, layout, spec, table.name)
        content = aggregate(events, table)
        app_id = new_app_id(f"{spec.name}/refresh")
        # The old table's last changes into its changelog first, when its rows have the declared columns: under a
        # changed declaration they stay in the table's own change feed (its history), as the restart below begins
        # the changelog again.
        if table_version(spark, path) is not None and not changed_definitions(layout, [table]):
            try:
                publish_changelog(spark, layout, table, app_id)
            except ChangelogError:
                pass  # it holds an earlier table's changes: the restart below replaces them (time travel keeps them)
        # An expiry before the refresh is not in the new content: marking the commit as a restore to version -1
        # tells pipelines/state/expiry.py that every earlier expiry is undone.
        metadata = {"app_id": app_id, "batch_id": -1, "refreshed": table.name, FOLDED_THROUGH: bronze_version,
                    "restored_version": -1}
        properties = {"delta.enableChangeDataFeed": "true", DEFINITION_PROPERTY: definition_of(table)}
        if table.ttl is not None:
            metadata[EXPIRED] = ExpiredTotals().as_metadata()
            properties[TTL_PROPERTY] = f"{table.ttl.total_seconds() / 86400:g}"
        with commit_confs(spark, {USER_METADATA: json.dumps(metadata)}):
            delta_sql.replace_table(spark, path, content, properties)
        version = table_version(spark, path)
        if table.ttl is not None:
            expire_keys(spark, path, table, table.ttl, ingested_through_us=newest_ingested_us(events),
                        app_id=app_id, batch_id=-1, expired=ExpiredTotals())
        _restart_changelog(spark, layout, table)
    return {"table": table.name, "table_version": version, "bronze_version": bronze_version,
            "keys": spark.read.format("delta").load(str(path)).count()}


def _restart_changelog(spark: SparkSession, layout: StorageLayout, table: StateTableSpec) -> None:
    """The changelog after a refresh: the table's content as inserts at its newest version, which it then covers."""
    path = layout.table(table.name)
    version = table_version(spark, path)
    rows = (spark.read.format("delta").load(str(path))
            .withColumn("_change_type", F.lit("insert")).withColumn("_commit_version", F.lit(version).cast("long"))
            .withColumn("_commit_timestamp", F.current_timestamp()))
    (rows.write.format("delta").mode("overwrite").option("overwriteSchema", "true")
     .option("userMetadata", json.dumps({COVERS: version, STATE_TABLE_ID: table_id(spark, path), "refreshed": True}))
     .save(str(layout.table(changelog_name(table)))))


def refresh_event_time_table(spark: SparkSession, layout: StorageLayout, spec: StreamSpec, table: EventTimeTableSpec,
                             *, lock_timeout_s: float = 60.0) -> dict:
    """Rebuild a windowed or session table (and its top N tables) from all of its stream's bronze, as one batch
    would fold it from nothing: no event is late for the rebuilt table (its late_events rows are deleted), and the
    watermark is the newest event minus the delay. Its state is replaced first, its top N tables next, the table
    last, in one commit that records the progress: a crash before that commit leaves the table as it was, and the
    refresh can be run again."""
    from pipelines.event_time import sessions
    from pipelines.event_time import windows
    from pipelines.event_time.watermark import (
        DEFINITION_PROPERTY as EVENT_TIME_DEFINITION, LATE, NO_PROGRESS, definition_of as event_time_definition, ensure_tables, output_schema, top_schema,
    )
    operator = windows if table.kind == "window" else sessions
    path = layout.table(table.name)
    with writer_lock(layout.locks, spec.name, lock_timeout_s):
        bronze_version, events = _bronze(spark, layout, spec, table.name)
        if table.kind == "window":
            empty = frame_of_rows(spark, [], operator.state_schema(table))
            fold = windows.fold_windows(table, spec, empty, events, NO_PROGRESS.watermark_ms)
            state, closed = fold.open_windows, fold.closed
        else:
            fold = sessions.fold_sessions(table, spec, None, events, NO_PROGRESS.watermark_ms)
            state, closed = fold.state, fold.closed
        app_id = new_app_id(f"{spec.name}/refresh")
        state_path = layout.table(table.state_table)
        (state.write.format("delta").mode("overwrite").option("overwriteSchema", "true")
         .save(str(state_path)))
        closed = closed.select(*(F.col(f.name).cast(f.dataType) for f in output_schema(table)))
        closed = kept(closed)  # ranked and written
        for top in table.tops:
            delta_sql.replace_table(spark, layout.table(top.name), windows.top_rows(top, table, closed).select(
                *(F.col(f.name).cast(f.dataType) for f in top_schema(top, table))),
                {"delta.enableChangeDataFeed": "true",
                 EVENT_TIME_DEFINITION: event_time_definition(top, spec.watermark_delay)})
        metadata = {"app_id": app_id, "batch_id": -1, "refreshed": table.name, "watermark_ms": fold.watermark_ms,
                    "bronze_version": bronze_version, "rows_read": events.count(),
                    "state_versions": {table.state_table: table_version(spark, state_path)}}
        with commit_confs(spark, {USER_METADATA: json.dumps(metadata)}):
            delta_sql.replace_table(spark, path, closed, {
                "delta.enableChangeDataFeed": "true",
                EVENT_TIME_DEFINITION: event_time_definition(table, spec.watermark_delay)})
        ensure_tables(spark, layout, spec, table, operator.state_schema(table))
        late = spark.read.format("delta").load(str(layout.table(LATE))).where(F.col("table_name") == table.name)
        if not late.isEmpty():
            delta_sql.merge(spark, layout.table(LATE), late.select("table_name", "event_id").distinct(),
                            on="t.table_name = s.table_name AND t.event_id = s.event_id",
                            clauses="WHEN MATCHED THEN DELETE")
    return {"table": table.name, "table_version": table_version(spark, path), "bronze_version": bronze_version,
            "keys": spark.read.format("delta").load(str(path)).count()}
