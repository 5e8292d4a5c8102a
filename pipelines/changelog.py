"""A state table's Change Data Feed as its own Delta table, and rebuilding a state table from it.

`ChangelogStage`, the last step of the stream's micro-batch, appends the state table's change rows to
`<state table>_changelog` (a table other jobs read, as a table or as a stream). `table_from_changelog`
rebuilds the state table as of any version from the changelog alone: per key, the newest change at or
before that version.
"""

from __future__ import annotations

import json
from pathlib import Path

from pyspark.sql import DataFrame, SparkSession, Window
from pyspark.sql import functions as F
from pyspark.sql.types import LongType, StringType, TimestampType

from pipelines.layout import StorageLayout
from pipelines.state import state_schema
from pipelines.streaming import commits_since, create_table_if_missing, rows_changed, table_version
from pipelines.streams import StateTableSpec

def changelog_name(table: StateTableSpec) -> str:
    return f"{table.name}_changelog"


COVERS = "state_version"  # commit metadata: every state-table version up to this one is in the changelog


def changelog_schema(table: StateTableSpec):
    return state_schema(table).add("_change_type", StringType()).add("_commit_version", LongType()) \
        .add("_commit_timestamp", TimestampType())


class ChangelogStage:
    """The changelog step of a stream's micro-batch, its last: the state table's change rows of the versions
    after those the changelog covers, appended in one commit that records the version it now covers. The
    record travels with the rows, so whichever attempt of a batch commits, no change row is appended twice
    or missed; the txn id makes a replay of the same batch a no-op."""

    def __init__(self, layout: StorageLayout, table: StateTableSpec, covers: int):
        self.layout, self.table, self.covers = layout, table, covers

    def advance(self, spark: SparkSession, app_id: str, batch_id: int) -> None:
        state_path = self.layout.table(self.table.name)
        now = table_version(spark, state_path)
        if now is None or now <= self.covers:
            return
        changes = rows_changed(spark, state_path, self.covers, now)
        (changes.write.format("delta").mode("append").option("txnAppId", app_id).option("txnVersion", batch_id)
         .option("userMetadata", json.dumps({"app_id": app_id, "batch_id": batch_id, COVERS: now}))
         .save(str(self.layout.table(changelog_name(self.table)))))
        self.covers = now


def changelog_stage(spark: SparkSession, layout: StorageLayout, table: StateTableSpec) -> ChangelogStage:
    """The changelog step as the changelog's newest commits left it. A changelog written by an earlier
    statetables (a query of its own, without the record) covers the newest version its rows hold."""
    path = layout.table(changelog_name(table))
    create_table_if_missing(spark, path, changelog_schema(table), change_data_feed=False)
    latest = table_version(spark, path) or 0
    for commit in reversed(commits_since(spark, path, max(-1, latest - 20))):
        if commit["user"].get(COVERS) is not None:
            return ChangelogStage(layout, table, int(commit["user"][COVERS]))
    newest = spark.read.format("delta").load(str(path)).agg(F.max("_commit_version")).first()[0]
    return ChangelogStage(layout, table, -1 if newest is None else int(newest))


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
