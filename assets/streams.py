"""Assets and checks of one event stream: one step, a multi-asset of every table its streaming query writes
(bronze, quarantine, the state table, the windows or the sessions), and the state table's checks. The changelog
tables are published by a job of their own (assets/maintenance.py).

The step is thin: it asks the resources for a Spark session and the storage layout, calls one pipeline function
(`advance_stream`), and describes what happened in metadata.
"""


from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from datetime import timedelta
from decimal import Decimal

import dagster as dg
from pydantic import Field
from pyspark.sql import SparkSession

from assets.metadata import (
    RUNBOOK_LINE, RUNBOOK_METADATA, event_time_metadata, frame_table, records_table, recovery_metadata,
)
from assets import event_time as event_time_assets
from assets.keys import (
    DEEP_CHECK, KINDS, STATE_FRESHNESS, bronze_key, pool, quarantine_key, state_key, stream_op_name,
)
from pipelines.declare.project import stream_spec, streams
from pipelines.declare.specs import StateTableSpec, StreamSpec
from pipelines.errors import ConfigurationError, DefinitionChangedError
from pipelines.event_time.watermark import recorded_changes
from pipelines.ingest.bronze import DEFAULT_MAX_FILES_PER_TRIGGER
from pipelines.operate import table_checks
from pipelines.operate.table_checks import quarantine_reasons, state_totals
from pipelines.runtime.micro_batch import StreamSettings, advance_stream, event_time_streams
from pipelines.runtime.query import NEW_PROCESS_SMALL_BATCH_BYTES, SMALL_BATCH_BYTES, StreamRunResult
from pipelines.state.expiry import EXPIRY
from pipelines.state.tables import changed_definitions, folded_through, state_schema
from resources import CheckPolicyResource, SparkSessionResource, StorageResource

class StreamConfig(dg.Config):
    """What one run may choose. What decides the rows (field rules, dedup horizon, event-time allowance,
    watermarks, session gap, TTLs) is in the project file, so every run of every kind uses the same."""

    max_files_per_trigger: int = Field(default=DEFAULT_MAX_FILES_PER_TRIGGER, description="Landing files per micro-batch.")
    lock_timeout_s: float = Field(default=60.0, description="How long to wait for the stream's writer lock.")
    quarantine_warn_rate: float = Field(default=0.05, description="Share of quarantined lines in a run that warns.")

    def settings(self, new_process: bool = False) -> StreamSettings:
        """`new_process`: the run's engine is a JVM of its own that ends with it (`statetables run` embedded), whose
        small batches stay interpreted up to a larger size (pipelines/runtime/query.py, `SMALL_BATCH_BYTES`)."""
        return StreamSettings(max_files_per_trigger=self.max_files_per_trigger, lock_timeout_s=self.lock_timeout_s,
                              large_from_bytes=NEW_PROCESS_SMALL_BATCH_BYTES if new_process else SMALL_BATCH_BYTES)


def current_declaration(loaded: StreamSpec) -> StreamSpec:
    """The stream as the project file declares it now: a setting changed there (a TTL, a horizon) applies to the
    next run without a reload. Its tables are assets, though: a table added or removed needs the code location
    reloaded first."""
    current = stream_spec(loaded.name)
    if [t.name for t in current.state_tables] != [t.name for t in loaded.state_tables]:
        raise ConfigurationError(
            f"The project file now declares the state tables {[t.name for t in current.state_tables]} for "
            f"{loaded.name}, this code location {[t.name for t in loaded.state_tables]}. Fix: reload the code "
            f"location (Dagster UI: Deployment, Reload; `statetables dev` restarted), then run again.")
    return current


def _versions(result: StreamRunResult, name: str) -> dict:
    v = result.versions[name]
    return {"table_version_before": v.before if v.before is not None else -1, "table_version": v.after}


def require_current_definitions(layout) -> None:
    """When the code location loads: refuse state tables whose rows an earlier definition wrote, naming the fix (a
    run would refuse them too, before touching data)."""
    changed = changed_definitions(layout, [t for spec in streams().values() for t in spec.state_tables])
    changed += [change for spec in streams().values() for change in recorded_changes(layout, spec)]
    if changed:
        raise DefinitionChangedError("The project file changed tables that hold rows: " + "; ".join(changed))


def build_stream_assets(spec: StreamSpec, keeps_event_time: bool = True) -> list:
    """The stream's one step (a multi-asset: every table its streaming query writes) and the state table's
    blocking checks. Without `keeps_event_time`, the stream has no windowed or session assets and its runs do not
    write them (pipelines/runtime/micro_batch.py, `event_time_streams`)."""
    bronze, quarantine = bronze_key(spec), quarantine_key(spec)
    event_time = keeps_event_time and bool(spec.event_time_tables)
    owns_late = event_time and event_time_assets.late_events_owner(event_time_streams() | {spec.name}) == spec.name

    @dg.multi_asset(
        name=stream_op_name(spec),
        group_name=spec.name,
        specs=[
            dg.AssetSpec(bronze, kinds=KINDS, metadata=RUNBOOK_METADATA, description=(
                f"Accepted `{spec.name}` events, one row per distinct `{spec.id_field}`, typed as the project file "
                f"declares (UTC `{spec.event_time_field}`), with source file and line. " +
                (f"Fed by JSON-lines files in landing/{spec.name}/" if spec.topic is None else
                 f"Fed by the records of Kafka topic `{spec.topic.topic}`") +
                " through the stream's one streaming query." + RUNBOOK_LINE)),
            dg.AssetSpec(quarantine, kinds=KINDS, metadata=RUNBOOK_METADATA, description=(
                f"Every `{spec.name}` line that was not accepted: the raw line and bytes as received, file, line "
                f"number, a machine-readable `reason` (+ `reason_field`, `detail`). Conflicting re-uses of an "
                f"accepted `{spec.id_field}` land here as `conflicting_duplicate`. Nothing is dropped." + RUNBOOK_LINE)),
            *(spec_ for table in spec.state_tables for spec_ in _state_table_specs(spec, table)),
            *(event_time_assets.specs(spec, owns_late) if event_time else ()),
        ],
        check_specs=[
            dg.AssetCheckSpec("quarantine_rate", asset=quarantine, description=(
                "Warns when the share of quarantined lines in this run passes `quarantine_warn_rate`.")),
            dg.AssetCheckSpec("landing_files_written_once", asset=bronze, description=(
                "Warns, naming the files, when a landing file changed after it was ingested (appended to, or "
                "rewritten under the same name) or vanished before it could be read. Appended lines are "
                "ingested; a rewritten file's content is ingested as its next version, re-deliveries in it "
                "counted once. See docs/recovery.md, 'Landing files that change'.")),
            *(event_time_assets.check_specs(spec) if event_time else ()),
        ],
        pool=pool(spec),
    )
    def stream(context: dg.AssetExecutionContext, config: StreamConfig, spark: SparkSessionResource,
               storage: StorageResource, check_policy: CheckPolicyResource):
        session, layout = spark.spark_session, storage.layout()
        current = current_declaration(spec)
        settings = config.settings(new_process=spark.one_command and not spark.remote)
        result = advance_stream(session, layout, current, replace(settings, event_time=event_time))
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
        source = (dg.MetadataValue.path(str(layout.landing(spec.name))) if spec.topic is None
                  else dg.MetadataValue.text(f"kafka topic {spec.topic.topic} on {spec.topic.servers}"))
        # A topic's lines come from its partitions: the batch commits count them where files are counted.
        ingest = {"files_read" if spec.topic is None else "partitions_read": counts["files"],
                  "lines_read": counts["lines"], "source": source}
        if spec.topic is not None:  # where the tables end in the topic: a lost checkpoint resumes from here
            offsets = next((c["user"]["source_offsets"] for c in reversed(bronze_commits)
                            if "source_offsets" in c["user"]), None)
            if offsets is not None:
                ingest["topic_offsets"] = dg.MetadataValue.json(offsets["next"])
        # What the tables hold after the run, each a Spark query of its own, asked at once: one after the other they
        # were a fifth of a cold `statetables run` (measured). Yielded in order below. The event-time checks, the
        # longest of them, first.
        pool = ThreadPoolExecutor(METADATA_QUERIES_AT_ONCE, thread_name_prefix=f"{spec.name}-metadata")
        checked = pool.submit(lambda: list(event_time_assets.run_checks(session, layout, current, result,
                                                                        check_policy))) if event_time else None
        versions = result.versions[spec.quarantine_table]
        reasons = pool.submit(lambda: frame_table(
            quarantine_reasons(session, layout, spec, versions.before, versions.after), 20,
            rows_known=0 if counts["quarantined"] == 0 else None))
        states = [pool.submit(_state_result, session, layout, current, table, result, counts, common)
                  for table in current.state_tables]
        windowed = pool.submit(lambda: list(event_time_assets.results(session, layout, current, result,
                                                                      owns_late))) if event_time else None
        pool.shutdown(wait=False)
        yield dg.MaterializeResult(asset_key=bronze, metadata={
            **common, **ingest, "rows_accepted": counts["accepted"], "duplicates_recognised": counts["duplicates"],
            "lines_already_ingested": counts["already_ingested"], "files_changed_after_ingestion": len(changed),
            "files_vanished": len(vanished), "changed_files": changed_table, **_versions(result, spec.bronze_table)})
        yield dg.MaterializeResult(asset_key=quarantine, metadata={
            **common, **ingest, "rows_quarantined": counts["quarantined"], "rows_unprocessable": counts["unprocessable"],
            "reasons": reasons.result(), **_versions(result, spec.quarantine_table)})
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
        for state in states:
            yield state.result()
        if windowed is not None:
            yield from windowed.result()
            yield from checked.result()

    return [stream, *(check for table in spec.state_tables for check in build_state_checks(spec, table)),
            *(event_time_assets.deep_checks(spec) if event_time else [])]


METADATA_QUERIES_AT_ONCE = 5


def _state_table_specs(spec: StreamSpec, table: StateTableSpec) -> list[dg.AssetSpec]:
    state = state_key(table)
    ttl = (f" TTL {table.ttl / timedelta(days=1):g} days (project file): keys with no event for that long in event "
           f"time are deleted, and show in its change feed as deletes." if table.ttl else "")
    return [
        dg.AssetSpec(state, deps=[bronze_key(spec)], kinds=KINDS, freshness_policy=STATE_FRESHNESS,
                     metadata={**RUNBOOK_METADATA, "sql": dg.MetadataValue.md(f"```sql\n{table.sql}\n```")},
                     description=(
            f"State table, declared in the project file (line {table.line}): one row per "
            f"{', '.join(f'`{k}`' for k in table.keys)}, equal to `{table.sql}` over the accepted events it has "
            f"folded, and `updated_at`. Kept by a MERGE of each micro-batch's bronze rows aggregated by key, whose "
            f"commit records the bronze version folded; Change Data Feed on.{ttl}" + RUNBOOK_LINE)),
    ]


# A MERGE's metrics of a fold, as an append's commit (a new table's first fold) names them.
APPENDED_AS = {"numSourceRows": "numOutputRows", "numTargetRowsInserted": "numOutputRows"}


def _state_result(session: SparkSession, layout, spec: StreamSpec, table: StateTableSpec, result: StreamRunResult,
                  counts: dict, common: dict) -> dg.MaterializeResult:
    commits = result.commits[table.name]
    # Expiries are MERGE commits too (pipelines/state/expiry.py), told apart by their commit metadata. A new table's
    # first fold is an append (WRITE): its rows are the batch's keys, all inserted.
    expiries = [c for c in commits if EXPIRY in c["user"]]
    folds = [c for c in commits if c["operation"] in ("MERGE", "WRITE") and EXPIRY not in c["user"]]

    def metric(name: str) -> int:
        return sum(int(c["metrics"].get(name if c["operation"] == "MERGE" else APPENDED_AS.get(name, ""), 0))
                   for c in folds)
    totals = state_totals(session, layout, spec, table)
    found = folded_through(session, layout.table(table.name))
    built = result.built_through.get(table.name)
    figures = {"keys": totals["keys"]}
    if table.last_ts_column:  # the newest event folded in, where the table keeps MAX(event time)
        figures["latest_event_time"] = event_time_metadata(totals["latest_event_time"])
    if table.count_column:
        figures["events_counted"] = totals["events_counted"]
    if table.sum_column:
        figures[table.sum_column] = str(totals["total"])
    return dg.MaterializeResult(asset_key=state_key(table), metadata={
        **common,  # first: why this run recovered, when it did
        "lines_read": counts["lines"], "rows_accepted": counts["accepted"], "rows_quarantined": counts["quarantined"],
        "duplicates_recognised": counts["duplicates"],
        # A table that recorded no bronze version is built from bronze in one batch, outside any micro-batch
        # (-1: it was not).
        "first_build_through_bronze_version": built if built is not None else -1,
        "keys_in_batches": metric("numSourceRows"),
        "rows_inserted": metric("numTargetRowsInserted"),
        "rows_updated": metric("numTargetRowsUpdated"),
        **figures,
        "ttl_days": f"{table.ttl / timedelta(days=1):g}" if table.ttl else "off",
        "keys_expired_this_run": sum(int(c["metrics"].get("numTargetRowsDeleted", 0)) for c in expiries),
        "bronze_table_version": result.versions[spec.bronze_table].after,
        "bronze_version_folded": found.through if found else -1,
        "top_rows": records_table(totals["top_rows"], {
            f.name: f.dataType.simpleString() for f in state_schema(table)
            if f.name in (*table.keys, *(a.name for a in table.aggregates))}),
        **_versions(result, table.name),
    })


def build_state_checks(spec: StreamSpec, table: StateTableSpec) -> list[dg.AssetChecksDefinition]:
    """The per-run blocking checks of the state table (cost bounded by the run and the table's keys),
    and the deep check `reconciles_with_bronze` (all of bronze), which jobs/automation.py runs nightly."""
    state = state_key(table)
    keys = ", ".join(f"`{k}`" for k in table.keys)
    totals = " and ".join(filter(None, [f"the sum of `{table.count_column}` equals the number of accepted events"
                                        if table.count_column else "",
                                        f"the sum of `{table.sum_column}` equals their sum of `{table.summed_field}`"
                                        if table.sum_column and table.summed_field == spec.value_field else ""]))

    @dg.asset_check(asset=state, name="totals_match_bronze", blocking=True, description=(
        f"{(totals[0].upper() + totals[1:]) if totals else 'The table counts no event (no COUNT(*)): the deep check runs instead'}"
        f" in {spec.bronze_table} at the bronze version the state table covers (bronze commits carry running "
        f"totals, so bronze's history is not read). The per-key comparison with all of bronze is the deep check "
        f"`{DEEP_CHECK}`."))
    def totals_match_bronze(spark: SparkSessionResource, storage: StorageResource,
                            check_policy: CheckPolicyResource) -> dg.AssetCheckResult:
        session, layout = spark.spark_session, storage.layout()
        figures = table_checks.totals_match_bronze(session, layout, spec, table)
        if figures["passed"] is None:  # no bronze version recorded, or nothing to total: compare key by key
            return _reconciliation(session, layout, spec, table, check_policy, "totals_match_bronze")
        return check_policy.result(state, "totals_match_bronze", passed=figures.pop("passed"), name_asset=False,
                                   metadata={k: str(v) if isinstance(v, Decimal) else v for k, v in figures.items()})

    @dg.asset_check(asset=state, name=DEEP_CHECK, blocking=True, description=(
        f"Deep check, nightly and on demand: every row equals the table's declared query over all of "
        f"{spec.bronze_table} (`{table.sql}`), every column, and the totals add up to bronze's."))
    def reconciles_with_bronze(spark: SparkSessionResource, storage: StorageResource,
                               check_policy: CheckPolicyResource) -> dg.AssetCheckResult:
        return _reconciliation(spark.spark_session, storage.layout(), spec, table, check_policy, DEEP_CHECK)

    @dg.asset_check(asset=state, name="unique_keys", blocking=True,
                    description=f"Exactly one row per {keys}, and no NULL where a required field is the key.")
    def unique_keys(spark: SparkSessionResource, storage: StorageResource,
                    check_policy: CheckPolicyResource) -> dg.AssetCheckResult:
        bad, duplicated = table_checks.duplicated_or_null_keys(spark.spark_session, storage.layout(), spec, table)
        return check_policy.result(state, "unique_keys", passed=bad == 0, name_asset=False, metadata={
            "duplicated_or_null_keys": bad, "sample": frame_table(duplicated, rows_known=bad)})

    @dg.asset_check(asset=state, name="nothing_negative", blocking=True, description=(
        "Every row's count of events is positive, and no SUM of a field that cannot be negative is."))
    def nothing_negative(spark: SparkSessionResource, storage: StorageResource,
                         check_policy: CheckPolicyResource) -> dg.AssetCheckResult:
        bad, negative = table_checks.negative_rows(spark.spark_session, storage.layout(), spec, table)
        return check_policy.result(state, "nothing_negative", passed=bad == 0, name_asset=False, metadata={
            "bad_rows": bad, "sample": frame_table(negative, rows_known=bad)})

    return [totals_match_bronze, reconciles_with_bronze, unique_keys, nothing_negative]


def _reconciliation(session: SparkSession, layout, spec: StreamSpec, table: StateTableSpec,
                    check_policy: CheckPolicyResource, check: str) -> dg.AssetCheckResult:
    mismatched, totals = table_checks.mismatches_with_bronze(session, layout, spec, table)
    bad = mismatched.count()
    return check_policy.result(
        state_key(table), check, name_asset=False, passed=bad == 0 and totals["totals_agree"],
        metadata={"mismatched_keys": bad, **totals, "sample_mismatches": frame_table(mismatched, rows_known=bad)})
