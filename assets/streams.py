"""Assets and checks of one event stream: bronze + quarantine (one ingest step) and its state table.

The asset bodies are thin: they ask the resources for a Spark session and the storage layout,
call one pipeline function, and describe what happened in metadata.
"""


from datetime import timedelta
from decimal import Decimal

import dagster as dg
from pydantic import Field
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from assets.metadata import (
    RUNBOOK_LINE, RUNBOOK_METADATA, event_time_metadata, frame_table, records_table, recovery_metadata,
)
from assets.keys import DEEP_CHECK, KINDS, STATE_FRESHNESS, bronze_key, changelog_key, ingest_op_name, pool, quarantine_key, state_key
from pipelines.bronze import DEFAULT_MAX_FILES_PER_TRIGGER, ingest_stream
from pipelines.changelog import publish_changes
from pipelines.expiry import EXPIRY
from pipelines import table_checks
from pipelines.state import update_state_table
from pipelines.table_checks import quarantine_reasons, state_totals
from pipelines.streaming import StreamRunResult, commits_since, table_version
from pipelines.streams import StreamSpec
from resources import CheckPolicyResource, SparkSessionResource, StatePolicyResource, StorageResource

class IngestConfig(dg.Config):
    dedup_horizon_days: float = Field(default=7.0, description="How far apart in event time a re-delivery is still recognised.")
    event_time_max_ahead_hours: float = Field(default=24.0, description=(
        "How far after its ingestion an event's time may lie; later ones are quarantined as out_of_range."))
    max_files_per_trigger: int = Field(default=DEFAULT_MAX_FILES_PER_TRIGGER, description="Landing files per micro-batch.")
    lock_timeout_s: float = Field(default=60.0, description="How long to wait for the stream's writer lock.")
    quarantine_warn_rate: float = Field(default=0.05, description="Share of quarantined lines in a run that warns.")


class StateConfig(dg.Config):
    lock_timeout_s: float = Field(default=60.0, description="How long to wait for the state table's writer lock.")


def _versions(result: StreamRunResult, name: str) -> dict:
    v = result.versions[name]
    return {"table_version_before": v.before if v.before is not None else -1, "table_version": v.after}


def ingest_figures_of_this_run(context: dg.AssetExecutionContext, spec: StreamSpec) -> dict:
    """What this run's ingest step reported (lines read, accepted, quarantined, duplicates), when it ran in this
    run: shown on the state table too, so its page answers "what did the last run do" on its own."""
    figures = {}
    for key, names in ((bronze_key(spec), ("lines_read", "rows_accepted", "duplicates_recognised")),
                       (quarantine_key(spec), ("rows_quarantined",))):
        event = context.instance.get_latest_materialization_event(key)
        if event is not None and event.run_id == context.run.run_id:
            metadata = event.asset_materialization.metadata
            figures.update({name: metadata[name] for name in names if name in metadata})
    return figures


def build_stream_assets(spec: StreamSpec) -> list:
    """The ingest multi-asset, the state-table asset and its blocking checks, for one stream."""
    bronze, quarantine, state = bronze_key(spec), quarantine_key(spec), state_key(spec)
    table = spec.state_table

    @dg.multi_asset(
        name=ingest_op_name(spec),
        specs=[
            dg.AssetSpec(bronze, group_name=spec.name, kinds=KINDS, metadata=RUNBOOK_METADATA, description=(
                f"Accepted `{spec.name}` events, one row per distinct `{spec.id_field}`, typed per the contract "
                f"(DECIMAL(18,2) `{spec.value_field}`, UTC `{spec.event_time_field}`), with source file and line. "
                f"Fed by JSON-lines files in landing/{spec.name}/ through a streaming file source." + RUNBOOK_LINE)),
            dg.AssetSpec(quarantine, group_name=spec.name, kinds=KINDS, metadata=RUNBOOK_METADATA, description=(
                f"Every `{spec.name}` line that was not accepted: the raw line and bytes as received, file, line "
                f"number, a machine-readable `reason` (+ `reason_field`, `detail`). Conflicting re-uses of an "
                f"accepted `{spec.id_field}` land here as `conflicting_duplicate`. Nothing is dropped." + RUNBOOK_LINE)),
        ],
        check_specs=[
            dg.AssetCheckSpec("quarantine_rate", asset=quarantine, description=(
                "Warns when the share of quarantined lines in this run passes `quarantine_warn_rate`.")),
            dg.AssetCheckSpec("landing_files_written_once", asset=bronze, description=(
                "Warns, naming the files, when a landing file changed after it was ingested (appended to, or "
                "rewritten under the same name) or vanished before it could be read. Appended lines are "
                "ingested; a rewritten file's content is ingested as its next version, re-deliveries in it "
                "counted once. See docs/recovery.md, 'Landing files that change'.")),
        ],
        pool=pool(spec),
    )
    def ingest(context: dg.AssetExecutionContext, config: IngestConfig, spark: SparkSessionResource,
               storage: StorageResource):
        session = spark.spark_session
        result = ingest_stream(session, storage.layout(), spec,
                               max_files_per_trigger=config.max_files_per_trigger,
                               dedup_horizon=timedelta(days=config.dedup_horizon_days),
                               max_ahead=timedelta(hours=config.event_time_max_ahead_hours),
                               lock_timeout_s=config.lock_timeout_s)
        counts = {k: sum(c["user"].get(k, 0) for c in result.commits["bronze"])
                  for k in ("files", "lines", "accepted", "quarantined", "duplicates", "already_ingested",
                            "unprocessable")}
        vanished = sorted({f for c in result.commits["bronze"] for f in c["user"].get("files_vanished", [])})
        common = {"micro_batches": len([c for c in result.commits["bronze"] if "batch_id" in c["user"]]),
                  "files_read": counts["files"], "lines_read": counts["lines"],
                  "duration_s": round(result.duration_s, 2),
                  "source": dg.MetadataValue.path(str(storage.layout().landing(spec.name))),
                  **recovery_metadata(context, result)}
        changed = [{"file": c["file"], "change": c["change"], "version": c["version"]} for c in result.changed_files]
        changed_table = records_table(
            changed + [{"file": f, "change": "vanished before it was read"} for f in vanished],
            {"file": "string", "change": "string", "version": "int"})
        yield dg.MaterializeResult(asset_key=bronze, metadata={
            **common, "rows_accepted": counts["accepted"], "duplicates_recognised": counts["duplicates"],
            "lines_already_ingested": counts["already_ingested"], "files_changed_after_ingestion": len(changed),
            "files_vanished": len(vanished), "changed_files": changed_table, **_versions(result, "bronze")})
        versions = result.versions["quarantine"]
        reasons = quarantine_reasons(session, storage.layout(), spec, versions.before, versions.after)
        yield dg.MaterializeResult(asset_key=quarantine, metadata={
            **common, "rows_quarantined": counts["quarantined"], "rows_unprocessable": counts["unprocessable"],
            "reasons": frame_table(reasons, 20, rows_known=0 if counts["quarantined"] == 0 else None),
            **_versions(result, "quarantine")})
        yield dg.AssetCheckResult(
            check_name="landing_files_written_once", asset_key=bronze, passed=not changed and not vanished,
            severity=dg.AssetCheckSeverity.WARN,
            metadata={"files_changed_after_ingestion": len(changed), "files_vanished": len(vanished),
                      "files": changed_table})
        rate = counts["quarantined"] / counts["lines"] if counts["lines"] else 0.0
        yield dg.AssetCheckResult(
            check_name="quarantine_rate", asset_key=quarantine, passed=rate <= config.quarantine_warn_rate,
            severity=dg.AssetCheckSeverity.WARN,
            metadata={"quarantine_rate": round(rate, 6), "threshold": config.quarantine_warn_rate,
                      "lines_read": counts["lines"], "rows_quarantined": counts["quarantined"]})

    @dg.asset(
        key=state,
        deps=[bronze],
        group_name=spec.name,
        kinds=KINDS,
        pool=pool(spec),
        freshness_policy=STATE_FRESHNESS,
        metadata=RUNBOOK_METADATA,
        description=(
            f"State table: one row per `{table.key}` with `{table.count_column}` (distinct accepted events), "
            f"`{table.sum_column}` (exact DECIMAL sum of `{spec.value_field}`), first/last `{spec.event_time_field}` "
            f"and `updated_at`. Kept by idempotent MERGE upserts of micro-batch aggregates read from "
            f"{spec.bronze_table} as a stream; Change Data Feed on, so it is also a changelog stream. "
            f"Optional TTL (resource `state_policy`, `ttl_days`): keys with no event for that many days of event "
            f"time are deleted, and show in the changelog as deletes." + RUNBOOK_LINE),
    )
    def state_table(context: dg.AssetExecutionContext, config: StateConfig, spark: SparkSessionResource,
                    storage: StorageResource, state_policy: StatePolicyResource) -> dg.MaterializeResult:
        session = spark.spark_session
        layout = storage.layout()
        ttl = state_policy.ttl(table.name)
        result = update_state_table(session, layout, spec, lock_timeout_s=config.lock_timeout_s, ttl=ttl)
        # Expiries are MERGE commits too (pipelines/expiry.py), told apart by their commit metadata.
        expiries = [c for c in result.commits[table.name] if EXPIRY in c["user"]]
        merges = [c for c in result.commits[table.name] if c["operation"] == "MERGE" and EXPIRY not in c["user"]]
        metric = lambda name: sum(int(c["metrics"].get(name, 0)) for c in merges)  # noqa: E731
        expired_now = sum(int(c["metrics"].get("numTargetRowsDeleted", 0)) for c in expiries)
        current = session.read.format("delta").load(str(layout.table(table.name)))
        totals = state_totals(session, layout, spec)
        return dg.MaterializeResult(metadata={
            **recovery_metadata(context, result),  # first: why this run recovered, when it did
            **ingest_figures_of_this_run(context, spec),
            "micro_batches": result.micro_batches,
            "bronze_rows_read": result.rows_read,
            # A first run builds the table from bronze in one batch, outside any micro-batch (-1: it did not).
            "first_build_through_bronze_version": (result.built_through_source_version
                                                          if result.built_through_source_version is not None else -1),
            "keys_in_batches": metric("numSourceRows"),
            "rows_inserted": metric("numTargetRowsInserted"),
            "rows_updated": metric("numTargetRowsUpdated"),
            "keys": totals["keys"], "events_counted": totals["events_counted"],
            "latest_event_time": event_time_metadata(totals["latest_event_time"]),
            "ttl_days": f"{ttl / timedelta(days=1):g}" if ttl else "off",
            "keys_expired_this_run": expired_now,
            f"{table.sum_column}": str(totals["total"]),
            "bronze_table_version": table_version(session, layout.table(spec.bronze_table)),
            "duration_s": round(result.duration_s, 2),
            "top_rows": frame_table(current.orderBy(F.desc(table.count_column), table.key).drop("updated_at")),
            **_versions(result, table.name),
        })

    @dg.asset(
        key=changelog_key(spec),
        deps=[state],
        group_name=spec.name,
        kinds=KINDS,
        pool=pool(spec),
        metadata=RUNBOOK_METADATA,
        description=(
            f"The change stream of {table.name}: every row its Change Data Feed reports (`_change_type` insert, "
            f"update_preimage, update_postimage, delete; `_commit_version`, `_commit_timestamp`), as a Delta "
            f"table other jobs read as a table or a stream. `statetables restore-changelog` rebuilds "
            f"{table.name} as of any version from this table alone." + RUNBOOK_LINE),
    )
    def changelog(context: dg.AssetExecutionContext, config: StateConfig, spark: SparkSessionResource,
                  storage: StorageResource) -> dg.MaterializeResult:
        session = spark.spark_session
        layout = storage.layout()
        result = publish_changes(session, layout, table, lock_timeout_s=config.lock_timeout_s)
        name = changelog_key(spec).path[-1]
        path = layout.table(name)
        appended = sum(int(c["metrics"].get("numTargetRowsInserted", 0))
                       for c in commits_since(session, path, result.versions[name].before))
        figures = session.read.format("delta").load(str(path)).agg(
            F.count("*").alias("rows"), F.max("_commit_version").alias("covered")).first()
        return dg.MaterializeResult(metadata={
            "micro_batches": result.micro_batches,
            "change_rows_appended": appended,
            "change_rows_total": figures["rows"],
            "state_table_version_covered": figures["covered"] if figures["covered"] is not None else -1,
            "path": dg.MetadataValue.path(str(path)),
            "duration_s": round(result.duration_s, 2),
            **_versions(result, name),
        })

    return [ingest, state_table, changelog, *build_state_checks(spec)]


def build_state_checks(spec: StreamSpec) -> list[dg.AssetChecksDefinition]:
    """The per-run blocking checks of the state table (cost bounded by the run and the table's keys),
    and the deep check `reconciles_with_bronze` (all of bronze), which jobs/automation.py runs nightly."""
    table = spec.state_table
    state = state_key(spec)

    @dg.asset_check(asset=state, name="totals_match_bronze", blocking=True, description=(
        f"The sum of `{table.count_column}` and of `{table.sum_column}` equal the number and the sum of accepted "
        f"events in {spec.bronze_table} at the bronze version the state table covers (bronze commits carry "
        f"running totals, so bronze's history is not read). The per-key comparison with all of bronze is the "
        f"deep check `{DEEP_CHECK}`."))
    def totals_match_bronze(spark: SparkSessionResource, storage: StorageResource,
                            check_policy: CheckPolicyResource) -> dg.AssetCheckResult:
        session, layout = spark.spark_session, storage.layout()
        figures = table_checks.totals_match_bronze(session, layout, spec)
        if figures["passed"] is None:  # the checkpoint does not say which bronze version it covers
            return _reconciliation(session, layout, spec, check_policy, "totals_match_bronze")
        return check_policy.result(state, "totals_match_bronze", passed=figures.pop("passed"), name_asset=False,
                                   metadata={k: str(v) if isinstance(v, Decimal) else v for k, v in figures.items()})

    @dg.asset_check(asset=state, name=DEEP_CHECK, blocking=True, description=(
        f"Deep check, nightly and on demand: every `{table.key}`'s count and sum equal the seed query over all of "
        f"{spec.bronze_table} (`COUNT({spec.value_field})`, `SUM({spec.value_field})` GROUP BY `{table.key}`), "
        f"and the sum of counts equals the number of distinct accepted events."))
    def reconciles_with_bronze(spark: SparkSessionResource, storage: StorageResource,
                               check_policy: CheckPolicyResource) -> dg.AssetCheckResult:
        return _reconciliation(spark.spark_session, storage.layout(), spec, check_policy, DEEP_CHECK)

    @dg.asset_check(asset=state, name="unique_keys", blocking=True,
                    description=f"Exactly one row per `{table.key}`, and no NULL key.")
    def unique_keys(spark: SparkSessionResource, storage: StorageResource,
                    check_policy: CheckPolicyResource) -> dg.AssetCheckResult:
        duplicated = table_checks.duplicated_or_null_keys(spark.spark_session, storage.layout(), spec)
        bad = duplicated.count()
        return check_policy.result(state, "unique_keys", passed=bad == 0, name_asset=False, metadata={
            "duplicated_or_null_keys": bad, "sample": frame_table(duplicated, rows_known=bad)})

    @dg.asset_check(asset=state, name="nothing_negative", blocking=True,
                    description=f"`{table.count_column}` > 0 and `{table.sum_column}` >= 0 on every row.")
    def nothing_negative(spark: SparkSessionResource, storage: StorageResource,
                         check_policy: CheckPolicyResource) -> dg.AssetCheckResult:
        negative = table_checks.negative_rows(spark.spark_session, storage.layout(), spec)
        bad = negative.count()
        return check_policy.result(state, "nothing_negative", passed=bad == 0, name_asset=False, metadata={
            "bad_rows": bad, "sample": frame_table(negative, rows_known=bad)})

    return [totals_match_bronze, reconciles_with_bronze, unique_keys, nothing_negative]


def _reconciliation(session: SparkSession, layout, spec: StreamSpec, check_policy: CheckPolicyResource,
                    check: str) -> dg.AssetCheckResult:
    mismatched, totals = table_checks.mismatches_with_bronze(session, layout, spec)
    bad = mismatched.count()
    return check_policy.result(
        state_key(spec), check, name_asset=False,
        passed=bad == 0 and totals["sum_of_counts"] == totals["distinct_accepted_events"]
        and totals["bronze_sum"] == totals["state_sum"] and totals["expiries_match_change_feed"],
        metadata={"mismatched_keys": bad, **totals, "sample_mismatches": frame_table(mismatched, rows_known=bad)})
