"""A state table's Change Data Feed as its own Delta table, and rebuilding a state table from it.

`publish_changes` streams the state table's CDF into `<state table>_changelog` (a table other jobs
read, as a table or as a stream). `table_from_changelog` rebuilds the state table as of any version
from the changelog alone: per key, the newest change at or before that version.
"""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path

from pyspark.sql import DataFrame, SparkSession, Window
from pyspark.sql import functions as F
from pyspark.sql.types import LongType, StringType, TimestampType

from pipelines import delta_sql
from pipelines.delta_sql import ident, int_literal
from pipelines.layout import StorageLayout
from pipelines.state import state_schema
from pipelines.streaming import (
    Continuous, StreamRunResult, TableVersions, create_table_if_missing, run_query, source_ready, table_version,
    writer_lock,
)
from pipelines.streams import StateTableSpec

CHANGE_COLUMNS = ("_change_type", "_commit_version", "_commit_timestamp")


def changelog_name(table: StateTableSpec) -> str:
    return f"{table.name}_changelog"


def publish_query(table: StateTableSpec) -> str:
    """The streaming query (and checkpoint) that appends the table's changes to its changelog."""
    return f"{changelog_name(table)}_publish"


def append_changes(changes: DataFrame, batch_id: int, *, changelog_path: str, key: str) -> None:
    """foreachBatch body: add the batch's change rows not already in the changelog.

    Keyed on (commit version, key, change type), so replaying a batch, or reading the whole feed
    again after a lost checkpoint, adds nothing twice; no checkpoint bookkeeping is needed.
    """
    spark = changes.sparkSession
    versions = changes.agg(F.min("_commit_version").alias("lo"), F.max("_commit_version").alias("hi")).first()
    if versions["lo"] is None:
        return  # no change rows: nothing to add
    # The range on the target lets Delta skip every changelog file of other versions (file statistics):
    # the lookup costs what the batch holds, not the changelog's whole history.
    on = " AND ".join([f"t._commit_version BETWEEN {int_literal(versions['lo'])} AND {int_literal(versions['hi'])}"]
                      + [f"t.{ident(c)} <=> s.{ident(c)}" for c in ("_commit_version", key, "_change_type")])
    delta_sql.merge(spark, changelog_path, changes, on=on, clauses="WHEN NOT MATCHED THEN INSERT *")


def publish_changes(spark: SparkSession, layout: StorageLayout, table: StateTableSpec, *,
                    lock_timeout_s: float = 60.0, continuous: Continuous | None = None) -> StreamRunResult:
    """Append every change of the state table not yet in its changelog table; with `continuous`, keep
    appending until stopped."""
    started = time.monotonic()
    name = changelog_name(table)
    path = layout.table(name)
    query = publish_query(table)
    with writer_lock(layout.locks, query, lock_timeout_s):
        schema = state_schema(table).add("_change_type", StringType()).add("_commit_version", LongType()) \
            .add("_commit_timestamp", TimestampType())
        create_table_if_missing(spark, path, schema, change_data_feed=False)
        before = table_version(spark, path)
        # A continuous run starts every step at once: the state table may not exist yet.
        if not source_ready(lambda: table_version(spark, layout.table(table.name)) is not None, continuous):
            return StreamRunResult(query_name=query, micro_batches=0, rows_read=0, duration_s=time.monotonic() - started,
                                   versions={name: TableVersions(before, before)})
        changes = (spark.readStream.format("delta").option("readChangeFeed", "true").option("startingVersion", 0)
                   .load(str(layout.table(table.name))))
        batches, rows = run_query(changes, query_name=query, checkpoint_dir=layout.checkpoint(query),
                                          on_batch=partial(append_changes, changelog_path=str(path), key=table.key),
                                  continuous=continuous)
        return StreamRunResult(query_name=query, micro_batches=batches, rows_read=rows,
                               duration_s=time.monotonic() - started,
                               versions={name: TableVersions(before, table_version(spark, path))})


def table_from_changelog(changelog: DataFrame, table: StateTableSpec, version: int) -> DataFrame:
    """The state table as of `version`, from change rows alone.

    Per key the newest change at or before `version` decides: an insert or update_postimage is the
    row, a delete means no row. Within one commit a key can be both deleted and inserted (a
    file-level rewrite); then the row exists, so insert/postimage sort before delete.
    """
    newest_first = Window.partitionBy(table.key).orderBy(
        F.col("_commit_version").desc(), (F.col("_change_type") == "delete").asc())
    return (
        changelog.where((F.col("_commit_version") <= version) & (F.col("_change_type") != "update_preimage"))
        .withColumn("_rank", F.row_number().over(newest_first))
        .where((F.col("_rank") == 1) & (F.col("_change_type") != "delete"))
        .select(*state_schema(table).fieldNames())
    )


def restore_from_changelog(spark: SparkSession, layout: StorageLayout, table: StateTableSpec, version: int,
                           into: str) -> Path:
    """Write the state table as of `version`, rebuilt from its changelog table only, to tables/<into>."""
    target = layout.table(into)
    if target == layout.table(table.name):
        raise ValueError(f"refusing to overwrite the live table {table.name}; choose another name with --into")
    # A version can have no change rows (a MERGE that changed nothing), so the changelog cannot say how
    # far it reaches by itself; the changelog asset's metadata shows the version it was published up to.
    changelog = spark.read.format("delta").load(str(layout.table(changelog_name(table))))
    (table_from_changelog(changelog, table, version).write.format("delta").mode("overwrite")
     .option("overwriteSchema", "true").option("userMetadata", f'{{"restored_from_changelog_version": {version}}}')
     .save(str(target)))
    return target
