"""Assets and checks of one event stream: one step, a multi-asset of every table its streaming query writes
(bronze, quarantine, the state table, the windows or the sessions, the changelog), and the state table's checks.

The step is thin: it asks the resources for a Spark session and the storage layout, calls one pipeline function
(`advance_stream`), and describes what happened in metadata.
"""


from dataclasses import replace
from datetime import timedelta
from decimal import Decimal

import dagster as dg
from pydantic import Field
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from assets.metadata import (
    RUNBOOK_LINE, RUNBOOK_METADATA, event_time_metadata, frame_table, records_table, recovery_metadata,
)
from assets import sessions as sessions_assets, windows as windows_assets
from assets.keys import (
    DEEP_CHECK, KINDS, STATE_FRESHNESS, bronze_key, changelog_key, pool, quarantine_key, state_key, stream_op_name,
)
from pipelines.bronze import DEFAULT_MAX_FILES_PER_TRIGGER
from pipelines.changelog import changelog_name
from pipelines.expiry import EXPIRY
from pipelines import table_checks
from pipelines.sessions import DEFAULT_STATE_TTL, SessionSettings
from pipelines.state import folded_through
from pipelines.stream_query import StreamSettings, advance_stream
from pipelines.table_checks import quarantine_reasons, state_totals
from pipelines.streaming import StreamRunResult, commits_since
from pipelines.streams import MOVIE_TICKET_SALES, PAYMENTS, StreamSpec
from pipelines.windows import DEFAULT_WATERMARK_DELAY
from resources import CheckPolicyResource, SparkSessionResource, StatePolicyResource, StorageResource

class StreamConfig(dg.Config):
    dedup_horizon_days: float = Field(default=7.0, description="How far apart in event time a re-delivery is still recognised.")
    event_time_max_ahead_hours: float = Field(default=24.0, description=(
        "How far after its ingestion an event's time may lie; later ones are quarantined as out_of_range."))
    max_files_per_trigger: int = Field(default=DEFAULT_MAX_FILES_PER_TRIGGER, description="Landing files per micro-batch.")
    lock_timeout_s: float = Field(default=60.0, description="How long to wait for the stream's writer lock.")
    quarantine_warn_rate: float = Field(default=0.05, description="Share of quarantined lines in a run that warns.")
    watermark_delay_minutes: float = Field(
        default=DEFAULT_WATERMARK_DELAY.total_seconds() / 60, ge=0,
        description=("How far behind the newest event seen the event-time watermark trails. An hour (sales) is "
                     "written once the watermark passes its end, a session (payments) once it is 30 minutes past "
                     "its last payment; an event at or behind the watermark goes to late_events."))
    session_state_ttl_days: float = Field(
        default=DEFAULT_STATE_TTL.days, gt=0,
        description=("Payments: a customer idle this many days of event time is forgotten by the sessions: their "
                     "next session has no previous_session_end and a fresh day_amount."))

    def settings(self, ttl: timedelta | None) -> StreamSettings:
        delay = timedelta(minutes=self.watermark_delay_minutes)
        return StreamSettings(max_files_per_trigger=self.max_files_per_trigger,
                              dedup_horizon=timedelta(days=self.dedup_horizon_days),
                              max_ahead=timedelta(hours=self.event_time_max_ahead_hours),
                              lock_timeout_s=self.lock_timeout_s, ttl=ttl, watermark_delay=delay,
                              sessions=SessionSettings(watermark_delay=delay,
                                                       state_ttl=timedelta(days=self.session_state_ttl_days)))


def _versions(result: StreamRunResult, name: str) -> dict:
    v = result.versions[name]
    return {"table_version_before": v.before if v.before is not None else -1, "table_version": v.after}


EVENT_TIME = {MOVIE_TICKET_SALES.name: windows_assets, PAYMENTS.name: sessions_assets}


def build_stream_assets(spec: StreamSpec, keeps_event_time: bool = True) -> list:
    """The stream's one step (a multi-asset: every table its streaming query writes) and the state table's
    blocking checks. Without `keeps_event_time`, the stream has no windows or sessions assets and its runs do not
    write them (pipelines/stream_query.py, `event_time_streams`)."""
    bronze, quarantine, state = bronze_key(spec), quarantine_key(spec), state_key(spec)
    table = spec.state_table
    event_time = EVENT_TIME[spec.name] if keeps_event_time else None

    @dg.multi_asset(
        name=stream_op_name(spec),
        group_name=spec.name,
        specs=[
            dg.AssetSpec(bronze, kinds=KINDS, metadata=RUNBOOK_METADATA, description=(
                f"Accepted `{spec.name}` events, one row per distinct `{spec.id_field}`, typed per the contract "
                f"(DECIMAL(18,2) `{spec.value_field}`, UTC `{spec.event_time_field}`), with source file and line. "
                f"Fed by JSON-lines files in landing/{spec.name}/ through the stream's one streaming query." +
                RUNBOOK_LINE)),
            dg.AssetSpec(quarantine, kinds=KINDS, metadata=RUNBOOK_METADATA, description=(
                f"Every `{spec.name}` line that was not accepted: the raw line and bytes as received, file, line "
                f"number, a machine-readable `reason` (+ `reason_field`, `detail`). Conflicting re-uses of an "
                f"accepted `{spec.id_field}` land here as `conflicting_duplicate`. Nothing is dropped." + RUNBOOK_LINE)),
            dg.AssetSpec(state, deps=[bronze], kinds=KINDS, freshness_policy=STATE_FRESHNESS, metadata=RUNBOOK_METADATA,
                         description=(
                f"State table: one row per `{table.key}` with `{table.count_column}` (distinct accepted events), "
                f"`{table.sum_column}` (exact DECIMAL sum of `{spec.value_field}`), first/last "
                f"`{spec.event_time_field}` and `updated_at`. Kept by a MERGE of each micro-batch's bronze rows "
                f"aggregated by key, whose commit records the bronze version folded; Change Data Feed on. Optional "
                f"TTL (resource `state_policy`, `ttl_days`): keys with no event for that many days of event time are "
                f"deleted, and show in the changelog as deletes." + RUNBOOK_LINE)),
            *(event_time.SPECS if event_time else ()),
            dg.AssetSpec(changelog_key(spec), deps=[state], kinds=KINDS, metadata=RUNBOOK_METADATA, description=(
                f"The change stream of {table.name}: every row its Change Data Feed reports (`_change_type` insert, "
                f"update_preimage, update_postimage, delete; `_commit_version`, `_commit_timestamp`), appended in "
                f"the micro-batch that changed the table, as a Delta table other jobs read as a table or a stream. "
                f"`statetables restore-changelog` rebuilds {table.name} as of any version from this table alone." +
                RUNBOOK_LINE)),
        ],
        check_specs=[
            dg.AssetCheckSpec("quarantine_rate", asset=quarantine, description=(
                "Warns when the share of quarantined lines in this run passes `quarantine_warn_rate`.")),
            dg.AssetCheckSpec("landing_files_written_once", asset=bronze, description=(
                "Warns, naming the files, when a landing file changed after it was ingested (appended to, or "
                "rewritten under the same name) or vanished before it could be read. Appended lines are "
                "ingested; a rewritten file's content is ingested as its next version, re-deliveries in it "
                "counted once. See docs/recovery.md, 'Landing files that change'.")),
            *(event_time.CHECK_SPECS if event_time else ()),
        ],
        pool=pool(spec),
    )
    def stream(context: dg.AssetExecutionContext, config: StreamConfig, spark: SparkSessionResource,
               storage: StorageResource, state_policy: StatePolicyResource, check_policy: CheckPolicyResource):
        session, layout = spark.spark_session, storage.layout()
        ttl = state_policy.ttl(table.name)
        result = advance_stream(session, layout, spec, replace(config.settings(ttl), event_time=event_time is not None))
        bronze_commits = result.commits[spec.bronze_table]
        counts = {k: sum(c["user"].get(k, 0) for c in bronze_commits)
                  for k in ("files", "lines", "accepted", "quarantined", "duplicates", "already_ingested",
                            "unprocessable")}
        vanished = sorted({f for c in bronze_commits for f in c["user"].get("files_vanished", [])})
        common = {"micro_batches": result.micro_batches, "duration_s": round(result.duration_s, 2),
                  **recovery_metadata(context, result)}
        changed = [{"file": c["file"], "change": c["change"], "version": c["version"]} for c in result.changed_files]
        changed_table = records_table(
            changed + [{"file": f, "change": "vanished before it was read"} for f in vanished],
            {"file": "string", "change": "string", "version": "int"})
        ingest = {"files_read": counts["files"], "lines_read": counts["lines"],
                  "source": dg.MetadataValue.path(str(layout.landing(spec.name)))}
        yield dg.MaterializeResult(asset_key=bronze, metadata={
            **common, **ingest, "rows_accepted": counts["accepted"], "duplicates_recognised": counts["duplicates"],
            "lines_already_ingested": counts["already_ingested"], "files_changed_after_ingestion": len(changed),
            "files_vanished": len(vanished), "changed_files": changed_table, **_versions(result, spec.bronze_table)})
        versions = result.versions[spec.quarantine_table]
        reasons = quarantine_reasons(session, layout, spec, versions.before, versions.after)
        yield dg.MaterializeResult(asset_key=quarantine, metadata={
            **common, **ingest, "rows_quarantined": counts["quarantined"], "rows_unprocessable": counts["unprocessable"],
            "reasons": frame_table(reasons, 20, rows_known=0 if counts["quarantined"] == 0 else None),
            **_versions(result, spec.quarantine_table)})
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
        yield _state_result(session, layout, spec, result, ttl, counts, common)
        if event_time is not None:
            yield from event_time.results(session, layout, result, check_policy)
        name = changelog_name(table)
        path = layout.table(name)
        appended = sum(int(c["metrics"].get("numOutputRows", 0))
                       for c in commits_since(session, path, result.versions[name].before))
        figures = session.read.format("delta").load(str(path)).agg(
            F.count("*").alias("rows"), F.max("_commit_version").alias("covered")).first()
        yield dg.MaterializeResult(asset_key=changelog_key(spec), metadata={
            "change_rows_appended": appended, "change_rows_total": figures["rows"],
            "state_table_version_covered": figures["covered"] if figures["covered"] is not None else -1,
            "path": dg.MetadataValue.path(str(path)), **_versions(result, name)})

    return [stream, *build_state_checks(spec)]


def _state_result(session: SparkSession, layout, spec: StreamSpec, result: StreamRunResult, ttl: timedelta | None,
                  counts: dict, common: dict) -> dg.MaterializeResult:
    table = spec.state_table
    commits = result.commits[table.name]
    # Expiries are MERGE commits too (pipelines/expiry.py), told apart by their commit metadata.
    expiries = [c for c in commits if EXPIRY in c["user"]]
    merges = [c for c in commits if c["operation"] == "MERGE" and EXPIRY not in c["user"]]
    metric = lambda name: sum(int(c["metrics"].get(name, 0)) for c in merges)  # noqa: E731
    current = session.read.format("delta").load(str(layout.table(table.name)))
    totals = state_totals(session, layout, spec)
    found = folded_through(session, layout.table(table.name))
    return dg.MaterializeResult(asset_key=state_key(spec), metadata={
        **common,  # first: why this run recovered, when it did
        "lines_read": counts["lines"], "rows_accepted": counts["accepted"], "rows_quarantined": counts["quarantined"],
        "duplicates_recognised": counts["duplicates"],
        # A table that recorded no bronze version is built from bronze in one batch, outside any micro-batch
        # (-1: it was not).
        "first_build_through_bronze_version": (result.built_through_source_version
                                               if result.built_through_source_version is not None else -1),
        "keys_in_batches": metric("numSourceRows"),
        "rows_inserted": metric("numTargetRowsInserted"),
        "rows_updated": metric("numTargetRowsUpdated"),
        "keys": totals["keys"], "events_counted": totals["events_counted"],
        "latest_event_time": event_time_metadata(totals["latest_event_time"]),
        "ttl_days": f"{ttl / timedelta(days=1):g}" if ttl else "off",
        "keys_expired_this_run": sum(int(c["metrics"].get("numTargetRowsDeleted", 0)) for c in expiries),
        f"{table.sum_column}": str(totals["total"]),
        "bronze_table_version": result.versions[spec.bronze_table].after,
        "bronze_version_folded": found.through if found else -1,
        "top_rows": frame_table(current.orderBy(F.desc(table.count_column), table.key).drop("updated_at")),
        **_versions(result, table.name),
    })


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
