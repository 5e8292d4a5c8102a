"""Jobs that change tables on request: table maintenance (OPTIMIZE, VACUUM) and the full refresh of a state table."""


from datetime import timedelta

import dagster as dg
from pydantic import Field

from assets.keys import MAINTENANCE_JOB, REFRESH_JOB
from assets.metadata import records_table
from pipelines.declare.project import project, streams
from pipelines.declare.specs import StateTableSpec
from pipelines.operate.maintenance import MIN_RETAIN, maintain_stream
from pipelines.operate.refresh import refresh_event_time_table, refresh_state_table
from resources import SparkSessionResource, StorageResource


class MaintenanceConfig(dg.Config):
    retain_hours: float = Field(default=MIN_RETAIN / timedelta(hours=1), ge=MIN_RETAIN / timedelta(hours=1),
                                description=("VACUUM keeps every file a version of this many hours back needs (at "
                                             "least 168, Delta's safety floor); longer for a table a savepoint "
                                             "keeps an older version of (docs/recovery.md, 'Table maintenance')."))
    lock_timeout_s: float = Field(default=600.0, description="How long to wait for each stream's writer lock.")


@dg.op(description="OPTIMIZE and VACUUM every table of every stream, each stream under its writer lock.")
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


@dg.job(name=MAINTENANCE_JOB, description="Table maintenance: OPTIMIZE and VACUUM every table, never deleting a "
                                          "file a savepoint, time travel within the retention or a run needs.")
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
