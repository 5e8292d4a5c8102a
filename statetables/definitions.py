"""Assembles the Dagster code location; no logic lives here. Loaded by workspace.yaml, and by the StateTables
component (statetables/component.py) in a Dagster project of the user's own."""

import dagster as dg


def build_definitions() -> dg.Definitions:
    """Every asset, check, job, schedule and sensor of the project file $STATETABLES_PROJECT names (or
    ./statetables.yaml). The assets' modules read the project when first imported, hence the imports here."""
    from assets.automation import (
        advance_all, every_five_minutes, landing_files_sensor, nightly_reconciliation, reconcile_state_tables,
        recover_failed_stream, spark_engine_health, stream_jobs,
    )
    from assets.continuous import run_continuously
    from assets.maintenance import (
        changelogs, daily_changelogs, maintain_all_tables, publish_all_changelogs, refresh_state_table_job,
        weekly_maintenance,
    )
    from assets.streams import build_stream_assets, require_current_definitions
    from pipelines.declare.project import streams
    from pipelines.runtime.micro_batch import event_time_streams
    from pipelines.runtime.spark import default_remote
    from pipelines.storage.layout import StorageLayout
    from resources import CheckPolicyResource, SparkSessionResource, StorageResource

    require_current_definitions(StorageLayout.under())  # a changed declaration fails the load, naming the fix
    return dg.Definitions(
        assets=[*(a for spec in streams().values()
                  for a in build_stream_assets(spec, spec.name in event_time_streams())), changelogs],
        jobs=[advance_all, reconcile_state_tables, *stream_jobs.values(), run_continuously, maintain_all_tables,
              publish_all_changelogs, refresh_state_table_job],
        schedules=[every_five_minutes, nightly_reconciliation, weekly_maintenance, daily_changelogs],
        sensors=[landing_files_sensor, recover_failed_stream, spark_engine_health],
        # A warm Spark Connect server when $STATETABLES_SPARK_REMOTE names one (`make dev`, `make serve`), else a JVM
        # per run.
        resources={"spark": SparkSessionResource(remote=default_remote()), "storage": StorageResource(),
                   "check_policy": CheckPolicyResource()},
        # One process, one SparkSession per run.
        executor=dg.in_process_executor,
    )


defs = build_definitions()
