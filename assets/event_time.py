"""A stream's windowed and session tables (pipelines/event_time/windows.py, pipelines/event_time/sessions.py) as Dagster assets with
their checks: each table, its operator state, its top N tables, and late_events.

They are written by the stream's one step (assets/streams.py, one streaming query), so their specs, checks and
results are the parts of that step's multi-asset defined here. Not partitioned by window: a run closes whichever
windows or sessions the watermark passes (none, or many after a backlog), so a partition would be a second,
conflicting record of what the watermark already decides; the tables' metadata says what closed. late_events is
written by every such stream; its asset belongs to the first of them in the project file (one asset, one producer
in Dagster), and each table's metadata counts its own late events.
"""

from __future__ import annotations

import datetime as dt

import dagster as dg
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from assets.keys import KINDS, bronze_key
from assets.metadata import RUNBOOK_LINE, RUNBOOK_METADATA, frame_table, recent_since_ms, records_table
from pipelines.declare.project import streams
from pipelines.declare.specs import EventTimeTableSpec, StreamSpec
from pipelines.event_time import watermark
from pipelines.event_time.watermark import output_schema
from pipelines.operate import table_checks
from pipelines.runtime.query import StreamRunResult
from pipelines.storage.layout import StorageLayout
from resources import CheckPolicyResource, SparkSessionResource, StorageResource
from resources.check_policy import DEEP_CHECK, RECONCILE, TOP_MATCHES

LATE_KEY = dg.AssetKey(watermark.LATE)


def late_events_owner(kept: frozenset[str]) -> str | None:
    """The stream whose step holds the late_events asset: the first in the project file that keeps a windowed or
    session table."""
    return next((s.name for s in streams().values() if s.name in kept and s.event_time_tables), None)


def _iso(ms: int | None) -> str:
    return dt.datetime.fromtimestamp(ms / 1000, dt.timezone.utc).isoformat() if ms else "(none yet)"


def _what(table: EventTimeTableSpec, spec: StreamSpec) -> str:
    minutes = int(spec.watermark_delay.total_seconds() // 60)
    if table.kind == "window":
        return (f"One row per key ({', '.join(table.keys)}) and closed {table.size} window of "
                f"`{table.event_time_field}`, written once the watermark (newest event minus {minutes} min) passes the window's end, and final "
                f"then. The windows still counting are rows of {table.state_table}.")
    return (f"One row per closed session of a key ({', '.join(table.keys)}): its events less than {table.size} apart, "
            f"written once the watermark (newest event minus {minutes} min) is {table.size} past its last event, and "
            f"final then. The open sessions are rows of {table.state_table}.")


def specs(spec: StreamSpec, owns_late: bool) -> list:
    """The asset specs of the stream's windowed and session tables, their state and top N tables (and
    late_events, for its owner)."""
    found = []
    for table in spec.event_time_tables:
        found += [
            dg.AssetSpec(dg.AssetKey(table.name), deps=[bronze_key(spec)], kinds=KINDS, metadata=RUNBOOK_METADATA,
                         description=f"{_what(table, spec)} Declared in the project file (line {table.line}): "
                                     f"`{table.sql}`. Late events go to late_events and still count in the stream's "
                                     f"state tables." + RUNBOOK_LINE),
            dg.AssetSpec(dg.AssetKey(table.state_table), deps=[bronze_key(spec)], kinds=KINDS,
                         metadata=RUNBOOK_METADATA, description=(
                f"{table.name}'s operator state: one row per open {'window' if table.kind == 'window' else 'session'} "
                f"with its aggregates' partial values" + (" and one per key with the values its next session starts "
                "from" if table.kind == "session" else "") + ", replaced by every micro-batch from the version the "
                "previous one left. Query it for what is still open." + RUNBOOK_LINE)),
            *(dg.AssetSpec(dg.AssetKey(top.name), deps=[dg.AssetKey(table.name)], kinds=KINDS,
                           metadata=RUNBOOK_METADATA, description=(
                f"The top {top.n} rows of every closed window of {table.name}, ranked `{top.rank_column}` 1..{top.n} "
                f"by {', '.join(c + (' DESC' if d else '') for c, d, _ in top.order)}. Written in the same micro-batch "
                f"as the window's rows. Declared in the project file (line {top.line})." + RUNBOOK_LINE))
              for top in table.tops)]
    if owns_late:
        # Its rows are the events a windowed or session table's watermark turned away: those tables are its lineage
        # (this stream's: another stream's would make this step wait for that one's).
        found.append(dg.AssetSpec(LATE_KEY, deps=[dg.AssetKey(t.name) for t in spec.event_time_tables], kinds=KINDS, metadata=RUNBOOK_METADATA,
                                  description=(
            "Every event that arrived at or behind a windowed or session table's watermark: `stream`, `table_name`, "
            "`event_id`, its event time, the watermark it missed, `late_by_ms`, source file and line. It is in no "
            "window or session of that table, and still counted in the stream's state tables. Nothing is dropped "
            "silently." + RUNBOOK_LINE)))
    return found


def check_specs(spec: StreamSpec) -> list:
    found = []
    for table in spec.event_time_tables:
        found.append(dg.AssetCheckSpec(RECONCILE, asset=dg.AssetKey(table.name), blocking=True, description=(
            "The rows this run wrote against the table's declared query recomputed over bronze (at the version the "
            "table has folded) minus the events late for it: " + (
                "the windows this run closed, by Spark's own window() over the events of those windows"
                if table.kind == "window" else
                "the sessions of the keys this run closed a session of (a sample of "
                f"{table_checks.RUN_CHECK_KEYS:,} keys, different each run, when it closed more), cut again by window "
                "functions with the contract's rule (less than the gap apart is one session) from their events "
                "since (read by delta-rs, an independent reader), the late ones among them at or behind the "
                "watermark they missed") +
            ("; every late event is at or behind the watermark it missed" if table.kind == "window" else "") +
            f". All of bronze: the deep check `{DEEP_CHECK}`, nightly.")))
        found += [dg.AssetCheckSpec(TOP_MATCHES, asset=dg.AssetKey(top.name), blocking=True, description=(
            f"{top.name} equals its declared query run by Spark over {table.name}, row for row."))
            for top in table.tops]
    return found


def reconciliation(session: SparkSession, layout: StorageLayout, spec: StreamSpec, table: EventTimeTableSpec,
                   check_policy, check: str, since_version: int | None, name_asset: bool = True) -> dg.AssetCheckResult:
    """The table against its declared query over bronze: the rows written after `since_version`, or all (None)."""
    mismatched, figures = table_checks.event_time_mismatches(session, layout, spec, table, since_version)
    bad = mismatched.count()
    return check_policy.result(
        dg.AssetKey(table.name), check, name_asset=name_asset,
        passed=bad == 0 and figures["late_not_in_bronze"] == figures["late_not_behind_watermark"] == 0,
        metadata={**figures, "rows_differing": bad, "sample": frame_table(mismatched, rows_known=bad)})


def deep_checks(spec: StreamSpec) -> list[dg.AssetChecksDefinition]:
    """Every windowed and session table against its declared query over all of bronze: nightly and on demand
    (jobs in assets/automation.py), not in a stream's run."""
    def build(table: EventTimeTableSpec) -> dg.AssetChecksDefinition:
        @dg.asset_check(asset=dg.AssetKey(table.name), name=DEEP_CHECK, blocking=True, description=(
            f"Deep check, nightly and on demand: every {'window' if table.kind == 'window' else 'session'} the "
            f"watermark has closed equals the table's declared query over all of {spec.bronze_table} minus the "
            f"events late for it (`{table.sql}`); every late event is in bronze and at or behind its watermark."))
        def reconciles_with_bronze(spark: SparkSessionResource, storage: StorageResource,
                                   check_policy: CheckPolicyResource) -> dg.AssetCheckResult:
            return reconciliation(spark.spark_session, storage.layout(), spec, table, check_policy, DEEP_CHECK, None,
                                  name_asset=False)
        return reconciles_with_bronze

    return [build(table) for table in spec.event_time_tables]


def results(session: SparkSession, layout: StorageLayout, spec: StreamSpec, result: StreamRunResult, owns_late: bool):
    """The materializations of the stream's windowed and session tables after a run (their checks: `run_checks`)."""
    late_this_run = 0
    for table in spec.event_time_tables:
        closing = [c for c in result.commits[table.name] if "watermark_ms" in c["user"]]
        batches = [c["user"] for c in closing]
        progress = watermark.last_progress(session, table, layout)
        state = watermark.state_table_figures(session, layout.table(table.state_table))
        common = {"bronze_rows_read": watermark.rows_read(result.commits[table.name]),
                  "watermark": _iso(progress.watermark_ms if progress else None),
                  "bronze_version_read": progress.bronze_version if progress else -1}
        closed_key = "windows_closed" if table.kind == "window" else "sessions_closed"
        late = sum(b.get("late_events", 0) for b in batches)
        late_this_run += late
        newest = next((a.name for a in table.aggregates if a.function == "max"
                       and a.column == table.event_time_field), None)
        order = table.column("start") or newest or table.aggregates[0].name
        since = recent_since_ms(progress and progress.watermark_ms, table.size) \
            if order in (table.column("start"), newest) else None
        rows = table_checks.newest_rows(layout.table(table.name), order, since)
        yield dg.MaterializeResult(asset_key=dg.AssetKey(table.name), metadata={
            # A closing commit's rows are the windows or sessions its batch closed.
            **common, f"{closed_key}_this_run": sum(int(c["metrics"].get("numOutputRows", 0)) for c in closing),
            "late_events_this_run": late, "operator_state_rows": state.get("rows", -1),
            "operator_state_bytes": state.get("bytes", -1),
            "newest_rows": records_table(rows, {f.name: f.dataType.simpleString() for f in output_schema(table)}),
            "table_version": result.versions[table.name].after})
        yield dg.MaterializeResult(asset_key=dg.AssetKey(table.state_table), metadata={
            **common, "rows": state.get("rows", -1), "bytes": state.get("bytes", -1),
            "table_version": result.versions[table.state_table].after})
        for top in table.tops:
            ranked = session.read.format("delta").load(str(layout.table(top.name)))
            start = table.column("start") if table.column("start") in top.columns else top.rank_column
            yield dg.MaterializeResult(asset_key=dg.AssetKey(top.name), metadata={
                **common, "windows_ranked_this_run": sum(b.get("windows_closed", 0) > 0 for b in batches),
                "newest_window": frame_table(ranked.orderBy(F.desc(start), top.rank_column), top.n),
                "table_version": result.versions[top.name].after})
    if owns_late:
        yield dg.MaterializeResult(asset_key=LATE_KEY, metadata={
            "late_events_this_run": late_this_run, "table_version": result.versions[watermark.LATE].after})


def run_checks(session: SparkSession, layout: StorageLayout, spec: StreamSpec, result: StreamRunResult, check_policy):
    """The per-run checks of the stream's windowed and session tables: each against its declared query over the
    rows the run wrote, each top N table against its query."""
    for table in spec.event_time_tables:
        yield reconciliation(session, layout, spec, table, check_policy, RECONCILE, result.versions[table.name].before)
        for top in table.tops:
            wrong = table_checks.top_mismatches(session, layout, top)
            wrong_rows = wrong.count()
            yield check_policy.result(dg.AssetKey(top.name), TOP_MATCHES, passed=wrong_rows == 0, metadata={
                "rows_differing": wrong_rows, "sample": frame_table(wrong, rows_known=wrong_rows)})
