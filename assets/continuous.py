"""The always-on job `run_continuously`: every stream's queries kept running in one warm JVM, reported to
Dagster as they go.

Each step (ingest, state table, changelog, windows, sessions) runs its streaming query with a
processing-time trigger (pipelines/continuous.py). Every `report_every_seconds` the op yields an
`AssetMaterialization` for each table that committed since the last report (rows, batches, versions, the
watermark, the newest event time folded in) and the state tables' per-run check results, so the asset pages
follow the tables while the run goes on. A cancel in the UI stops every query after its current micro-batch;
a killed run is restarted by `recover_failed_stream` and resumes from the checkpoints.

One writer: each query holds its kernel writer lock for the whole run, the landing sensor requests no
orchestrated run while a continuous run is in progress, and an orchestrated run started anyway waits for
the lock and is then refused (StreamBusyError), having written nothing.
"""


import datetime as dt
import threading
from contextlib import closing
from typing import Iterator

import dagster as dg
from pydantic import Field

from assets.keys import (
    CONTINUOUS_JOB, CONTINUOUS_TAG, bronze_key, changelog_key, quarantine_key, state_key,
)
from assets.metadata import event_time_metadata
from assets.streams import IngestConfig
from assets.sessions import SessionsConfig
from assets.windows import WindowsConfig
from pipelines import table_checks
from pipelines.bronze import ingest_stream
from pipelines.changelog import changelog_name, publish_changes, publish_query
from pipelines.continuous import ContinuousStep, create_tables, refuse_over_connect, run_steps_continuously
from pipelines.layout import StorageLayout
from pipelines.sessions import ACTIVITY, LAST_SESSIONS, OPEN_SESSIONS, SESSIONS_QUERY, SessionSettings, update_sessions
from pipelines.state import update_state_table
from pipelines.streaming import Continuous, commits_since, table_version
from pipelines.streams import STREAMS, StreamSpec
from pipelines.windows import HOURLY, LATE, OPEN_HOURS, TOP, WINDOWS_QUERY, update_windows
from resources import CheckPolicyResource, SparkSessionResource, StatePolicyResource, StorageResource
from resources.check_policy import WARN_ONLY_NOTE


class ContinuousConfig(dg.Config):
    trigger_seconds: float = Field(default=2.0, gt=0, description=(
        "Processing-time trigger of the ingest, state-table and changelog queries: how often each looks for new "
        "input. Freshness (landing file to state table) is a few of these."))
    event_time_trigger_seconds: float = Field(default=30.0, gt=0, description=(
        "Trigger of the windows and sessions queries, which cost far more per micro-batch (docs/performance.md); "
        "a window or session is written once the watermark passes it, so seconds matter less there."))
    event_time_steps: bool = Field(default=True, description=(
        "Also keep the windows (movie_ticket_sales) and sessions (payments) queries running."))
    report_every_seconds: float = Field(default=30.0, gt=0, description=(
        "How often the run reports to Dagster: a materialization per table that committed since the last "
        "report, and the state tables' per-run checks."))
    ingest: IngestConfig = Field(default_factory=IngestConfig, description="As in the ingest assets.")
    windows: WindowsConfig = Field(default_factory=WindowsConfig, description="As in movie_ticket_sales_windows.")
    sessions: SessionsConfig = Field(default_factory=SessionsConfig, description="As in customer_activity.")


class QueryProgress:
    """Batches, rows and watermark per query since the last report, from the queries' progress reports
    (delivered from the steps' threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queries: dict[str, dict] = {}

    def add(self, query_name: str, report) -> None:
        with self._lock:
            entry = self._queries.setdefault(query_name, {"batches": 0, "rows": 0, "watermark": None})
            if "addBatch" in (report.durationMs or {}):
                entry["batches"] += 1
                entry["rows"] += report.numInputRows
            watermark = (report.eventTime or {}).get("watermark")
            if watermark and not watermark.startswith("1970-01-01T00:00:00"):
                entry["watermark"] = watermark

    def take(self) -> dict[str, dict]:
        with self._lock:
            taken = {name: dict(entry) for name, entry in self._queries.items()}
            for entry in self._queries.values():
                entry["batches"] = entry["rows"] = 0
            return taken


def continuous_steps(spark, layout: StorageLayout, config: ContinuousConfig,
                     state_policy: StatePolicyResource) -> list[ContinuousStep]:
    """The steps of every stream, in data-flow order; each runs in its own thread."""
    ingest = config.ingest
    steps = []
    for spec in STREAMS.values():
        ttl = state_policy.ttl(spec.state_table.name)
        steps += [
            ContinuousStep(spec.ingest_query, lambda c, spec=spec: ingest_stream(
                spark, layout, spec, max_files_per_trigger=ingest.max_files_per_trigger,
                dedup_horizon=dt.timedelta(days=ingest.dedup_horizon_days),
                max_ahead=dt.timedelta(hours=ingest.event_time_max_ahead_hours),
                lock_timeout_s=ingest.lock_timeout_s, continuous=c)),
            ContinuousStep(spec.state_query, lambda c, spec=spec, ttl=ttl: update_state_table(
                spark, layout, spec, ttl=ttl, continuous=c)),
            ContinuousStep(publish_query(spec.state_table), lambda c, spec=spec: publish_changes(
                spark, layout, spec.state_table, continuous=c)),
        ]
    if config.event_time_steps:
        slow = config.event_time_trigger_seconds
        settings = SessionSettings(watermark_delay=dt.timedelta(minutes=config.sessions.watermark_delay_minutes),
                                   state_ttl=dt.timedelta(days=config.sessions.state_ttl_days))
        steps += [
            ContinuousStep(WINDOWS_QUERY, lambda c: update_windows(
                spark, layout, watermark_delay=dt.timedelta(minutes=config.windows.watermark_delay_minutes),
                lock_timeout_s=config.windows.lock_timeout_s, continuous=c), trigger_interval_s=slow),
            ContinuousStep(SESSIONS_QUERY, lambda c: update_sessions(
                spark, layout, settings, lock_timeout_s=config.sessions.lock_timeout_s, continuous=c),
                trigger_interval_s=slow),
        ]
    return steps


class ContinuousReport:
    """What changed since the last report, as Dagster events: one materialization per table whose Delta
    version moved, and the state tables' per-run checks (pinned to the table's newest batch, so a MERGE
    committing meanwhile cannot make them fail)."""

    def __init__(self, spark, layout: StorageLayout, progress: QueryProgress, event_time_steps: bool,
                 check_policy: CheckPolicyResource):
        self.spark, self.layout, self.progress, self.check_policy = spark, layout, progress, check_policy
        self.tables: dict[dg.AssetKey, tuple[str, str]] = {}  # asset → (table folder, query writing it)
        for spec in STREAMS.values():
            self.tables[bronze_key(spec)] = (spec.bronze_table, spec.ingest_query)
            self.tables[quarantine_key(spec)] = (spec.quarantine_table, spec.ingest_query)
            self.tables[state_key(spec)] = (spec.state_table.name, spec.state_query)
            self.tables[changelog_key(spec)] = (changelog_name(spec.state_table), publish_query(spec.state_table))
        if event_time_steps:
            for name, query in ((HOURLY, WINDOWS_QUERY), (TOP, WINDOWS_QUERY), (LATE, WINDOWS_QUERY),
                                (OPEN_HOURS, WINDOWS_QUERY), (ACTIVITY, SESSIONS_QUERY),
                                (OPEN_SESSIONS, SESSIONS_QUERY), (LAST_SESSIONS, SESSIONS_QUERY)):
                self.tables[dg.AssetKey(name)] = (name, query)
        self.versions = {key: table_version(spark, layout.table(name)) for key, (name, _) in self.tables.items()}
        self.failed_checks: list[str] = []

    def events(self) -> Iterator[dg.AssetMaterialization | dg.AssetCheckEvaluation]:
        queries = self.progress.take()
        for key, (name, query) in self.tables.items():
            before, now = self.versions[key], table_version(self.spark, self.layout.table(name))
            if now is None or now == before:
                continue
            self.versions[key] = now
            figures = queries.get(query, {})
            metadata = {"table_version": now, "table_version_before": before if before is not None else -1,
                        "micro_batches": figures.get("batches", 0), "query_input_rows": figures.get("rows", 0),
                        "mode": "continuous"}
            if figures.get("watermark"):
                metadata["watermark"] = dg.MetadataValue.timestamp(
                    dt.datetime.fromisoformat(figures["watermark"].replace("Z", "+00:00")))
            spec = next((s for s in STREAMS.values() if key in (bronze_key(s), state_key(s))), None)
            if spec is not None and key == bronze_key(spec):
                metadata.update(self._bronze_counts(spec, before))
            checks = []
            if spec is not None and key == state_key(spec):
                totals = table_checks.state_totals(self.spark, self.layout, spec)
                metadata.update({"keys": totals["keys"], "events_counted": totals["events_counted"],
                                 spec.state_table.sum_column: str(totals["total"]),
                                 "latest_event_time": event_time_metadata(totals["latest_event_time"])})
                checks = self._state_checks(spec)
            yield dg.AssetMaterialization(asset_key=key, metadata=metadata,
                                          description=f"{CONTINUOUS_JOB}: committed since the last report")
            yield from checks

    def _bronze_counts(self, spec: StreamSpec, before: int | None) -> dict:
        commits = commits_since(self.spark, self.layout.table(spec.bronze_table), before)
        return {name: sum(c["user"].get(field, 0) for c in commits) for name, field in (
            ("lines_read", "lines"), ("rows_accepted", "accepted"), ("rows_quarantined", "quarantined"),
            ("duplicates_recognised", "duplicates"))}

    def _state_checks(self, spec: StreamSpec) -> list[dg.AssetCheckEvaluation]:
        key = state_key(spec)
        totals = table_checks.totals_match_bronze(self.spark, self.layout, spec)
        passed = totals.pop("passed")
        duplicated = table_checks.duplicated_or_null_keys(self.spark, self.layout, spec).count()
        negative = table_checks.negative_rows(self.spark, self.layout, spec).count()
        results = [("unique_keys", duplicated == 0, {"duplicated_or_null_keys": duplicated}),
                   ("nothing_negative", negative == 0, {"bad_rows": negative})]
        if passed is not None:  # the newest batch does not say which bronze version it covers: next report
            results.append(("totals_match_bronze", passed, {k: v if isinstance(v, int) else str(v)
                                                            for k, v in totals.items()}))
        evaluations = []
        for name, ok, metadata in results:
            severity = self.check_policy.severity(key.to_user_string(), name)
            if not ok and severity == dg.AssetCheckSeverity.ERROR:
                self.failed_checks.append(f"{key.to_user_string()}:{name}")
            elif not ok:
                metadata = {**metadata, "blocking": WARN_ONLY_NOTE}
            evaluations.append(dg.AssetCheckEvaluation(asset_key=key, check_name=name, passed=ok, metadata=metadata,
                                                       severity=severity, blocking=True))
        return evaluations


@dg.op(tags={CONTINUOUS_TAG: "true"}, description=(
    "Keeps every stream's streaming queries running (ingest, state table, changelog, windows, sessions) and "
    "reports each table to Dagster every `report_every_seconds`. Cancel the run to stop: each query finishes "
    "its current micro-batch first."))
def keep_streams_running(context: dg.OpExecutionContext, config: ContinuousConfig, spark: SparkSessionResource,
                         storage: StorageResource, state_policy: StatePolicyResource,
                         check_policy: CheckPolicyResource):
    refuse_over_connect(spark.remote)
    session, layout = spark.spark_session, storage.layout()
    create_tables(session, layout)
    progress = QueryProgress()
    continuous = Continuous(trigger_interval_s=config.trigger_seconds, on_progress=progress.add)
    steps = continuous_steps(session, layout, config, state_policy)
    report = ContinuousReport(session, layout, progress, config.event_time_steps, check_policy)
    context.log.info(f"{len(steps)} queries running: {', '.join(s.name for s in steps)}")
    with closing(run_steps_continuously(steps, continuous, tick_s=config.report_every_seconds)) as ticks:
        for _ in ticks:
            yield from report.events()
            if report.failed_checks:
                # Blocking checks: the queries stop and the run fails with the checks named (Dagster raises).
                context.log.error(f"blocking checks failed: {', '.join(report.failed_checks)}; stopping")
                continuous.stop.set()


@dg.job(name=CONTINUOUS_JOB, tags={CONTINUOUS_TAG: "true"}, description=(
    "Always on: keeps every stream's queries running with a processing-time trigger in one warm JVM, and "
    "reports each table as it moves. Launch from the UI or `make serve`; cancel to stop after the current "
    "micro-batch. A killed run is restarted by recover_failed_stream."))
def run_continuously():
    keep_streams_running()

