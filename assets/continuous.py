"""The always-on job `run_continuously`: every stream's query kept running in one warm engine (the run's embedded
JVM, or the Connect server of `make serve`), reported to Dagster as it goes.

Each stream runs its one streaming query (pipelines/runtime/micro_batch.py) with a processing-time trigger
(pipelines/runtime/continuous.py). Every `report_every_seconds` the op yields an
`AssetMaterialization` for each table that committed since the last report (rows, batches, versions, the
watermark, the newest event time folded in) and the state tables' per-run check results, so the asset pages
follow the tables while the run goes on. Its first report covers every table as found: a recovery run whose
dead predecessor's queries committed after their last report (over Connect they outlive their client) shows
the tables and their checks as they are, not the dead run's last figures. A cancel in the UI stops every query
after its current micro-batch; a killed run is restarted by `recover_failed_stream` and resumes from the
checkpoints.

One writer: each stream's query holds its kernel writer lock for the whole run, the landing sensor requests no
orchestrated run while a continuous run is in progress or its recovery is due, and an orchestrated run started
anyway waits for the lock and is then refused (StreamBusyError), having written nothing.
"""


import datetime as dt
import threading
from dataclasses import replace
from contextlib import closing
from typing import Iterator

import dagster as dg
from pydantic import Field

from assets.keys import (
    CONTINUOUS_JOB, CONTINUOUS_TAG, bronze_key, quarantine_key, state_key,
)
from assets.metadata import event_time_metadata
from assets.streams import StreamConfig, current_declaration
from pipelines.declare.project import streams
from pipelines.declare.specs import StateTableSpec, StreamSpec
from pipelines.operate import table_checks
from pipelines.runtime.continuous import ContinuousStep, create_tables, run_steps_continuously
from pipelines.runtime.micro_batch import advance_stream, event_time_streams, event_time_tables
from pipelines.runtime.query import Continuous
from pipelines.storage.delta_log import commits_since, table_version
from pipelines.storage.layout import StorageLayout
from resources import CheckPolicyResource, SparkSessionResource, StorageResource
from resources.check_policy import WARN_ONLY_NOTE


class ContinuousConfig(dg.Config):
    trigger_seconds: float = Field(default=1.0, gt=0, description=(
        "Processing-time trigger of each stream's query, and how often the landing folder is scanned: how often "
        "new input is looked for. Freshness (landing file to state table) is a few of these."))
    event_time_steps: bool = Field(default=True, description=(
        "Also keep the windowed and session tables in each micro-batch, for the streams that keep them "
        "($STATETABLES_EVENT_TIME, default all)."))
    report_every_seconds: float = Field(default=30.0, gt=0, description=(
        "How often the run reports to Dagster: a materialization per table that committed since the last "
        "report, and the state tables' per-run checks."))
    streams: StreamConfig = Field(default_factory=StreamConfig, description="As in the streams' assets.")

    def event_time_kept(self) -> frozenset[str]:
        """The streams whose windowed and session tables this run keeps."""
        return event_time_streams() if self.event_time_steps else frozenset()


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


def continuous_steps(spark: SparkSessionResource, layout: StorageLayout, config: ContinuousConfig
                     ) -> list[ContinuousStep]:
    """Each stream's query, on a session of its own (`session_of_its_own`); each runs in its own thread.

    The session is made in the step's thread: pyspark's Connect client binds a local checkpoint's frame to the
    thread's active session, not to the session that made it, and a Connect session becomes active in the thread
    that creates it. Made elsewhere, the step's kept frames would be looked up in another session and not found."""
    steps = []
    for spec in streams().values():
        spec = current_declaration(spec)
        settings = replace(config.streams.settings(), event_time=spec.name in config.event_time_kept())
        steps.append(ContinuousStep(spec.name, lambda c, spec=spec, settings=settings: advance_stream(
            spark.session_of_its_own(), layout, spec, settings, continuous=c)))
    return steps


class ContinuousReport:
    """What changed since the last report, as Dagster events: one materialization per table whose Delta
    version moved (every existing table at the first report), and the state tables' per-run checks (pinned to
    the table's newest batch, so a MERGE committing meanwhile cannot make them fail)."""

    def __init__(self, spark, layout: StorageLayout, progress: QueryProgress, event_time_kept: frozenset[str],
                 check_policy: CheckPolicyResource):
        self.spark, self.layout, self.progress, self.check_policy = spark, layout, progress, check_policy
        self.tables: dict[dg.AssetKey, tuple[str, str]] = {}  # asset → (table folder, query writing it)
        self.state_tables: dict[dg.AssetKey, tuple[StreamSpec, StateTableSpec]] = {}
        self.bronze: dict[dg.AssetKey, StreamSpec] = {}
        for spec in streams().values():
            self.tables[bronze_key(spec)] = (spec.bronze_table, spec.name)
            self.bronze[bronze_key(spec)] = spec
            self.tables[quarantine_key(spec)] = (spec.quarantine_table, spec.name)
            for table in spec.state_tables:
                self.tables[state_key(table)] = (table.name, spec.name)
                self.state_tables[state_key(table)] = (spec, table)
            if spec.name in event_time_kept:
                for name in event_time_tables(spec):
                    self.tables.setdefault(dg.AssetKey(name), (name, spec.name))
        self.versions = {key: table_version(spark, layout.table(name)) for key, (name, _) in self.tables.items()}
        self.failed_checks: list[str] = []
        self.reported = False

    def events(self) -> Iterator[dg.AssetMaterialization | dg.AssetCheckEvaluation]:
        queries = self.progress.take()
        for key, (name, query) in self.tables.items():
            before, now = self.versions[key], table_version(self.spark, self.layout.table(name))
            if now is None or (now == before and self.reported):
                continue
            self.versions[key] = now
            figures = queries.get(query, {})
            metadata = {"table_version": now, "table_version_before": before if before is not None else -1,
                        "micro_batches": figures.get("batches", 0), "query_input_rows": figures.get("rows", 0),
                        "mode": "continuous"}
            if figures.get("watermark"):
                metadata["watermark"] = dg.MetadataValue.timestamp(
                    dt.datetime.fromisoformat(figures["watermark"].replace("Z", "+00:00")))
            if key in self.bronze:
                metadata.update(self._bronze_counts(self.bronze[key], before))
            checks = []
            if key in self.state_tables:
                spec, table = self.state_tables[key]
                totals = table_checks.state_totals(self.spark, self.layout, spec, table)
                metadata["keys"] = totals["keys"]
                if table.last_ts_column:
                    metadata["latest_event_time"] = event_time_metadata(totals["latest_event_time"])
                if table.count_column:
                    metadata["events_counted"] = totals["events_counted"]
                if table.sum_column:
                    metadata[table.sum_column] = str(totals["total"])
                checks = self._state_checks(spec, table)
            yield dg.AssetMaterialization(asset_key=key, metadata=metadata, description=(
                f"{CONTINUOUS_JOB}: committed since the last report" if now != before else
                f"{CONTINUOUS_JOB}: as found when the run started"))
            yield from checks
        self.reported = True

    def _bronze_counts(self, spec: StreamSpec, before: int | None) -> dict:
        commits = commits_since(self.spark, self.layout.table(spec.bronze_table), before)
        return {name: sum(c["user"].get(field, 0) for c in commits) for name, field in (
            ("lines_read", "lines"), ("rows_accepted", "accepted"), ("rows_quarantined", "quarantined"),
            ("duplicates_recognised", "duplicates"))}

    def _state_checks(self, spec: StreamSpec, table: StateTableSpec) -> list[dg.AssetCheckEvaluation]:
        key = state_key(table)
        totals = table_checks.totals_match_bronze(self.spark, self.layout, spec, table)
        passed = totals.pop("passed")
        duplicated, _ = table_checks.duplicated_or_null_keys(self.spark, self.layout, spec, table)
        negative, _ = table_checks.negative_rows(self.spark, self.layout, spec, table)
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


@dg.op(out={}, tags={CONTINUOUS_TAG: "true"}, description=(
    "Keeps every stream's streaming query running (each micro-batch through ingest, state table, windows or "
    "sessions, changelog topic) and reports each table to Dagster every `report_every_seconds`. Cancel the run to "
    "stop: each query finishes its current micro-batch first."))
def keep_streams_running(context: dg.OpExecutionContext, config: ContinuousConfig, spark: SparkSessionResource,
                         storage: StorageResource, check_policy: CheckPolicyResource):
    session, layout = spark.spark_session, storage.layout()
    create_tables(session, layout)
    progress = QueryProgress()
    continuous = Continuous(trigger_interval_s=config.trigger_seconds, on_progress=progress.add)
    steps = continuous_steps(spark, layout, config)
    report = ContinuousReport(session, layout, progress, config.event_time_kept(), check_policy)
    context.log.info(f"{len(steps)} queries running: {', '.join(s.name for s in steps)}")
    with closing(run_steps_continuously(steps, continuous, tick_s=config.report_every_seconds)) as ticks:
        for _ in ticks:
            yield from report.events()
            if report.failed_checks:
                # Blocking checks: the queries stop after their current batch, then the run fails naming them.
                context.log.error(f"blocking checks failed: {', '.join(report.failed_checks)}; stopping")
                continuous.stop.set()
    if report.failed_checks:
        raise dg.Failure(
            description=f"Blocking checks failed: {', '.join(sorted(set(report.failed_checks)))}. The queries "
                        f"stopped after their current micro-batch. Fix: compare the disputed keys (each check's "
                        f"metadata) with an independent read of bronze, as docs/recovery.md says ('A blocking check "
                        f"fails'): a wrong table is restored from a savepoint; a wrong check is listed in "
                        f"check_policy.warn_only.",
            metadata={"failed_checks": sorted(set(report.failed_checks))})


@dg.job(name=CONTINUOUS_JOB, tags={CONTINUOUS_TAG: "true"}, description=(
    "Always on: keeps every stream's queries running with a processing-time trigger in one warm JVM, and "
    "reports each table as it moves. Launch from the UI or `make serve`; cancel to stop after the current "
    "micro-batch. A killed run is restarted by recover_failed_stream."))
def run_continuously():
    keep_streams_running()

