"""Jobs that change tables off the streams' runs: the changelogs published, table maintenance (OPTIMIZE, VACUUM) and
the full refresh of a state table."""


from datetime import timedelta

import dagster as dg
from pydantic import Field

from assets.keys import (
    CHANGELOG_GROUP, CHANGELOG_JOB, KINDS, MAINTENANCE_JOB, REFRESH_JOB, changelog_key, state_key,
)
from assets.metadata import RUNBOOK_LINE, RUNBOOK_METADATA, records_table
from pipelines.declare.project import project, streams
from pipelines.declare.specs import StateTableSpec
from pipelines.operate.maintenance import MIN_RETAIN, maintain_stream, publish_changelogs
from pipelines.state.changelog import changelog_name
from pipelines.operate.refresh import refresh_event_time_table, refresh_state_table
from resources import SparkSessionResource, StorageResource


def _changelog_spec(table: StateTableSpec) -> dg.AssetSpec:
    return dg.AssetSpec(
        changelog_key(table), deps=[state_key(table)], group_name=CHANGELOG_GROUP, kinds=KINDS, skippable=True,
        metadata=RUNBOOK_METADATA, description=(
            f"The change log of {table.name} kept as a table: every row its Change Data Feed reports (`_change_type` "
            f"insert, update_preimage, update_postimage, delete; `_commit_version`, `_commit_timestamp`), each once, "
            f"which VACUUM never shortens. Published off the streams' runs: daily by this job's schedule, before "
            f"every VACUUM (`maintain_tables`), and by `statetables restore-changelog`, which rebuilds {table.name} "
            f"as of any version from this table alone. The live change log is {table.name}'s Change Data Feed."
            + RUNBOOK_LINE))


@dg.multi_asset(name="changelogs", specs=[_changelog_spec(table) for spec in streams().values()
                                          for table in spec.state_tables],
                description="Every state table's changelog brought up to the table's newest version, beside the "
                            "streams' runs: a publish needs no writer lock.")
def changelogs(context: dg.AssetExecutionContext, spark: SparkSessionResource, storage: StorageResource):
    session, layout = spark.spark_session, storage.layout()
    for spec in streams().values():
        published = {f["state_table"]: f for f in publish_changelogs(session, layout, spec)}
        for table in spec.state_tables:
            figures = published.get(table.name)
            if figures is None:  # the state table does not exist yet
                continue
            context.log.info(f"{figures['changelog']}: versions {figures['covered_before'] + 1} to "
                             f"{figures['covers']}, {figures['change_rows_appended']} change rows")
            yield dg.MaterializeResult(asset_key=changelog_key(table), metadata={
                "change_rows_appended": figures["change_rows_appended"],
                "change_rows_total": figures["change_rows_total"],
                "state_table_version_covered": figures["covers"],
                "path": dg.MetadataValue.path(str(layout.table(changelog_name(table))))})


publish_all_changelogs = dg.define_asset_job(
    CHANGELOG_JOB, selection=dg.AssetSelection.groups(CHANGELOG_GROUP),
    description="Every state table's change feed appended to its changelog table, up to the table's newest version.")

daily_changelogs = dg.ScheduleDefinition(
    name="publish_changelogs_daily", job=publish_all_changelogs, cron_schedule="15 1 * * *",
    default_status=dg.DefaultScheduleStatus.RUNNING)


class MaintenanceConfig(dg.Config):
    retain_hours: float = Field(default=MIN_RETAIN / timedelta(hours=1), ge=MIN_RETAIN / timedelta(hours=1),
                                description=("VACUUM keeps every file a version of this many hours back needs (at "
                                             "least 168, Delta's safety floor); longer for a table a savepoint "
                                             "keeps an older version of (docs/recovery.md, 'Table maintenance')."))
    lock_timeout_s: float = Field(default=600.0, description="How long to wait for each stream's writer lock.")


@dg.op(description="Publish the changelogs, then OPTIMIZE and VACUUM every table of every stream, each stream under "
                   "its writer lock.")
def optimize_and_vacuum(context: dg.OpExecutionContext, config: MaintenanceConfig, spark: SparkSessionResource,
                    storage: StorageResource):
    session, layout = spark.spark_session, storage.layout()
    figures = []
    for spec in streams().values():
        done = maintain_stream(session, layout, spec, retain=timedelta(hours=config.retain_hours),
                               lock_timeout_s=config.lock_timeout_s)
        context.log.info(f"{spec.name}: " + ", ".join(f"{f['table']} -{f['files_compacted']}+{f['files_written']} "
                                                      f"files, {f['files_deleted']} deleted" for f in done))
        figures += done
    yield dg.Output(None, metadata={
        "tables": records_table(figures, {"table": "string", "files_compacted": "int", "files_written": "int",
                                          "files_deleted": "int", "retained_hours": "float",
                                          "kept_for_savepoint": "bool", "seconds": "float"}),
        "files_deleted": sum(f["files_deleted"] for f in figures)})


@dg.job(name=MAINTENANCE_JOB, description="Table maintenance: the changelogs published, then OPTIMIZE and VACUUM "
                                          "every table, never deleting a file a savepoint, time travel within the "
                                          "retention, a run or a changelog needs.")
def maintain_all_tables():
    optimize_and_vacuum()


weekly_maintenance = dg.ScheduleDefinition(
    name="maintain_tables_weekly", job=maintain_all_tables, cron_schedule="0 3 * * 0",
    default_status=dg.DefaultScheduleStatus.STOPPED)


class RefreshConfig(dg.Config):
    table: str = Field(default="", description=(
        "The state, windowed or session table to rebuild from bronze under the project file's definition "
        "(required: empty fails the run, naming the tables there are)."))


@dg.op(description="Rebuild one state, windowed or session table from its stream's bronze under the current "
                   "definition, in one commit.")
def refresh_table(context: dg.OpExecutionContext, config: RefreshConfig, spark: SparkSessionResource,
                  storage: StorageResource):
    spec, table = project().table(config.table)
    refresh = refresh_state_table if isinstance(table, StateTableSpec) else refresh_event_time_table
    figures = refresh(spark.spark_session, storage.layout(), spec, table)
    context.log_event(dg.AssetMaterialization(asset_key=dg.AssetKey(table.name), metadata={
        **figures, "refreshed": True, "sql": dg.MetadataValue.md(f"```sql\n{table.sql}\n```")},
        description="full refresh from bronze"))
    yield dg.Output(None)


@dg.job(name=REFRESH_JOB, description="Full refresh: one state, windowed or session table rebuilt from bronze under "
                                      "the project file's definition, its content replaced in one commit "
                                      "(`statetables refresh TABLE`).")
def refresh_state_table_job():
    refresh_table()
