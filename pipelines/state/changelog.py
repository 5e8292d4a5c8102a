"""A state table's Change Data Feed kept as its own Delta table, and rebuilding a state table from it.

The state table's Change Data Feed is its live change log: a micro-batch's MERGE writes it in the same commit as
the rows. `<state table>_changelog` is that feed's durable copy, which VACUUM never shortens: `publish_changelog`
appends the change rows of the state-table versions it does not cover yet, off the micro-batch (whose MERGE commit
already holds them). Table maintenance publishes before it VACUUMs, so no version's
change rows are deleted before the copy holds them; so do the `publish_changelogs` job and `restore-changelog`.
`table_from_changelog` rebuilds the state table as of any version from the changelog alone: per key, the newest
change at or before that version.
"""

from __future__ import annotations

import json
from pathlib import Path

from pyspark.sql import DataFrame, SparkSession, Window
from pyspark.sql import functions as F
from pyspark.sql.types import LongType, StringType, TimestampType

from pipelines.declare.specs import StateTableSpec
from pipelines.errors import ChangelogError
from pipelines.state.tables import state_new_table, state_schema
from pipelines.storage.delta_log import (
    NewTable, create_tables_if_missing, newest_commit_with, retry_on_conflict, rows_changed, table_id,
    table_version,
)
from pipelines.storage.delta_rs import rows_and_max
from pipelines.storage.layout import StorageLayout

def changelog_name(table: StateTableSpec) -> str:
    return f"{table.name}_changelog"


COVERS = "state_version"  # commit metadata: every state-table version up to this one is in the changelog
STATE_TABLE_ID = "state_table_id"  # ... of the state table with this Delta id


def changelog_schema(table: StateTableSpec):
    return state_schema(table).add("_change_type", StringType()).add("_commit_version", LongType()) \
        .add("_commit_timestamp", TimestampType())


class ChangelogStage:
    """A changelog as it stands: the state table's change rows of the versions after those it covers are appended
    in one commit that records the version it then covers. The record travels with the rows, so whichever attempt
    commits, no change row is appended twice or missed: one repeated after a crash finds the versions covered and
    appends nothing.

    Publishers need no lock (a continuous run holds the stream's writer lock for its whole life): the append is a
    Delta idempotent write whose application id names the version it starts after, so of two publishers that read
    the same coverage only one appends. The other's write is skipped when it starts after the first committed, or
    conflicts when both are in flight (Delta's conflict check on the transaction id it read); retried, it reads the
    new coverage."""

    def __init__(self, layout: StorageLayout, table: StateTableSpec, covers: int, state_table_id: str):
        self.layout, self.table, self.covers, self.state_table_id = layout, table, covers, state_table_id

    def advance(self, spark: SparkSession, app_id: str, batch_id: int) -> None:
        """Append the change rows of every state-table version after those covered."""
        state_path = self.layout.table(self.table.name)
        now = table_version(spark, state_path)
        if now is None or now <= self.covers:
            return
        changes = rows_changed(spark, state_path, self.covers, now)
        # The record of what the commit covers makes a replay append nothing; the transaction id, a concurrent one.
        (changes.write.format("delta").mode("append")
         .option("txnAppId", f"changelog-of-{self.state_table_id}-after-{self.covers}").option("txnVersion", 0)
         .option("userMetadata", json.dumps({"app_id": app_id, "batch_id": batch_id, COVERS: now,
                                             STATE_TABLE_ID: self.state_table_id}))
         .save(str(self.layout.table(changelog_name(self.table)))))
        self.covers = now


def publish_changelog(spark: SparkSession, layout: StorageLayout, table: StateTableSpec, app_id: str) -> dict:
    """Bring `table`'s changelog up to the state table's newest version; its figures. Safe beside runs and other
    publishers (`ChangelogStage`): a conflicting append is retried from the coverage it then finds."""
    path = layout.table(changelog_name(table))
    covered_before = changelog_stage(spark, layout, table).covers
    rows_before, _ = changelog_figures(spark, path)
    retry_on_conflict(lambda: changelog_stage(spark, layout, table).advance(spark, app_id, 0),
                      f"publishing {changelog_name(table)}")
    rows, _ = changelog_figures(spark, path)
    # Read again: another publisher may have appended what this one's skipped write held.
    covers = changelog_stage(spark, layout, table).covers
    return {"changelog": changelog_name(table), "state_table": table.name, "covered_before": covered_before,
            "covers": covers, "change_rows_appended": rows - rows_before, "change_rows_total": rows}


def changelog_figures(spark: SparkSession, path: Path) -> tuple[int, int | None]:
    """(change rows, the newest state-table version among them) of the changelog at `path`: from its files'
    statistics in the log (delta-rs, no Spark job; the table keeps statistics of `_commit_version` for this and its
    readers), else read by Spark: a changelog only grows, and reading its rows takes four Spark jobs a run."""
    figures = rows_and_max(path, "_commit_version")
    if figures is not None:
        return figures
    row = spark.read.format("delta").load(str(path)).agg(F.count("*").alias("rows"),
                                                         F.max("_commit_version").alias("covered")).first()
    return row["rows"], row["covered"]


def changelog_new_table(layout: StorageLayout, table: StateTableSpec) -> NewTable:
    # Statistics of the commit version only: its readers (the topic publisher, restore-changelog) select by it, and
    # every column's were almost half of an append (100k change rows: 0.77 s, 0.44 s without).
    return NewTable(layout.table(changelog_name(table)), changelog_schema(table), change_data_feed=False,
                    properties={"delta.dataSkippingStatsColumns": "_commit_version"})


def coverage_record(spark: SparkSession, path: Path) -> dict | None:
    """The metadata of the changelog's newest commit that records the state-table version it covers (`COVERS`),
    among its newest 20; None when none does (no changelog yet, or one of an earlier statetables)."""
    found = newest_commit_with(spark, path, COVERS)
    return found[1] if found is not None else None


def changelog_stage(spark: SparkSession, layout: StorageLayout, table: StateTableSpec) -> ChangelogStage:
    """The changelog as its newest commits left it. A changelog written by an earlier
    statetables (a query of its own, without the record) covers the newest version its rows hold."""
    path, state_path = layout.table(changelog_name(table)), layout.table(table.name)
    create_tables_if_missing(spark, [state_new_table(layout, table), changelog_new_table(layout, table)])
    latest = table_version(spark, path) or 0
    newest = coverage_record(spark, path)
    state_id = table_id(spark, state_path)
    if newest is None:
        # Version 0 is the table's creation: no rows to read.
        highest = (None if latest == 0
                   else spark.read.format("delta").load(str(path)).agg(F.max("_commit_version")).first()[0])
        covers, covered_id = (-1 if highest is None else int(highest)), state_id
    else:
        covers, covered_id = int(newest[COVERS]), newest.get(STATE_TABLE_ID, state_id)
    if covered_id != state_id or covers > (table_version(spark, state_path) or 0):
        raise ChangelogError(
            f"{path.name} holds the changes of an earlier {table.name}: that table was deleted and created again, "
            f"and its versions start over. Fix: move {path} aside (keep it: it is the old table's history); the "
            f"next run publishes the new table's changes from its first version.")
    return ChangelogStage(layout, table, covers, state_id)


def table_from_changelog(changelog: DataFrame, table: StateTableSpec, version: int) -> DataFrame:
    """The state table as of `version`, from change rows alone.

    Per key the newest change at or before `version` decides: an insert or update_postimage is the
    row, a delete means no row. Within one commit a key can be both deleted and inserted (a
    file-level rewrite); then the row exists, so insert/postimage sort before delete.
    """
    newest_first = Window.partitionBy(*table.keys).orderBy(
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
