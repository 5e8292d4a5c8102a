"""The event-time windows a stream declares (`windows:`, pipelines/windows.py) as Dagster assets with their checks.

They are written by the sales stream's one step (assets/streams.py, one streaming query), so their specs,
checks and results are the parts of that step's multi-asset defined here. Not partitioned by hour: a run
closes whichever hours the watermark passes (none, or many after a backlog), so an hourly partition would be a
second, conflicting record of what the watermark already decides; the tables' metadata says which hours closed.
"""

import datetime as dt

import dagster as dg
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from assets.keys import KINDS, bronze_key
from assets.metadata import RUNBOOK_LINE, RUNBOOK_METADATA, frame_table, within_watermark
from pipelines import event_time, table_checks
from pipelines.layout import StorageLayout
from pipelines.streaming import StreamRunResult
from pipelines.streams import StreamSpec
from pipelines.windows import (
    HOURLY, LATE, OPEN_HOURS, TOP, TOP_N, last_progress, state_figures,
)
from resources import CheckPolicyResource

HOURLY_KEY, TOP_KEY, LATE_KEY, OPEN_KEY = dg.AssetKey(HOURLY), dg.AssetKey(TOP), dg.AssetKey(LATE), dg.AssetKey(OPEN_HOURS)


def _iso(ms: int | None) -> str:
    return dt.datetime.fromtimestamp(ms / 1000, dt.timezone.utc).isoformat() if ms else "(none yet)"

def specs(SPEC: StreamSpec) -> list:
    """The asset specs of the event-time tables of `SPEC`, the stream that declares them."""
    return [
    dg.AssetSpec(HOURLY_KEY, deps=[bronze_key(SPEC)], kinds=KINDS,
                     metadata=RUNBOOK_METADATA, description=(
            "Tickets per title per one-hour tumbling window of `sale_ts` (`window_start`, `window_end`, "
            "`tickets_sold`, `total_ticket_value`). A window's row is written once the watermark (newest sale seen "
            "minus the configured delay, default 10 min) passes its end, and never changes after. Read from "
            f"{SPEC.bronze_table} in the stream's micro-batches; the hours still counting are rows of tickets_per_title_open_hours." +
            RUNBOOK_LINE)),
        dg.AssetSpec(OPEN_KEY, deps=[bronze_key(SPEC)], kinds=KINDS,
                     metadata=RUNBOOK_METADATA, description=(
            "The windows' operator state: one row per (title, hour) still counting, with its tickets and value so "
            "far. Replaced by every micro-batch from the version the previous one left; an hour leaves it for "
            "tickets_per_title_hourly once the watermark passes its end. Query it for the hour in progress." +
            RUNBOOK_LINE)),
        dg.AssetSpec(TOP_KEY, deps=[HOURLY_KEY], kinds=KINDS,
                     metadata=RUNBOOK_METADATA, description=(
            f"The {TOP_N} titles with most tickets for every closed hour (`rank` 1..{TOP_N}); ties broken by tickets, "
            "then value, then title. Written in the same micro-batch as the hour's windows." + RUNBOOK_LINE)),
        dg.AssetSpec(LATE_KEY, deps=[bronze_key(SPEC)], kinds=KINDS,
                     metadata=RUNBOOK_METADATA, description=(
            "Every sale that arrived at or behind the windows' watermark: `event_id`, its event time, the "
            "watermark it missed, `late_by_ms`, source file and line. It is in no window, and still counted in "
            "the stream's state tables. Nothing is dropped silently." + RUNBOOK_LINE)),
]
CHECK_SPECS = [
        dg.AssetCheckSpec("windows_reconcile_with_bronze", asset=HOURLY_KEY, blocking=True, description=(
            "For every hour this run closed: each sale of that hour in bronze (at the version the windows have "
            "folded) is either in late_events or counted in its (title, hour) window, whose tickets and value equal "
            "the hour's sales minus the late ones; the hour's sales are the two added up, as the state tables "
            "counts them. Costs what the closed hours hold: bronze is read through its event-time statistics.")),
        dg.AssetCheckSpec("top_titles_match_windows", asset=TOP_KEY, blocking=True, description=(
            f"top_titles_hourly equals the top {TOP_N} recomputed from tickets_per_title_hourly, row for row.")),
]


def results(session: SparkSession, layout: StorageLayout, result: StreamRunResult, check_policy: CheckPolicyResource):
    """The windows' materializations and checks after a run of the sales stream."""
    batches = [c["user"] for c in result.commits[HOURLY] if "watermark_ms" in c["user"]]
    progress = last_progress(session, layout)
    state = state_figures(session, layout)
    common = {"bronze_rows_read": event_time.rows_read(result.commits[HOURLY]),
              "watermark": _iso(progress.watermark_ms if progress else None),
              "bronze_version_read": progress.bronze_version if progress else -1}
    closed = sum(b.get("windows_closed", 0) for b in batches)
    late = sum(b.get("late_events", 0) for b in batches)
    recent = within_watermark(progress and progress.watermark_ms, "window_start", dt.timedelta(hours=1))
    hourly = session.read.format("delta").load(str(layout.table(HOURLY)))
    yield dg.MaterializeResult(asset_key=HOURLY_KEY, metadata={
        **common, "windows_closed_this_run": closed,
        "newest_windows": frame_table(hourly.orderBy(F.desc("window_start"), F.desc("tickets_sold"), "title"),
                                      recent=recent),
        "table_version": result.versions[HOURLY].after})
    top = session.read.format("delta").load(str(layout.table(TOP)))
    yield dg.MaterializeResult(asset_key=TOP_KEY, metadata={
        **common, "hours_ranked_this_run": len({b["batch_id"] for b in batches if b.get("windows_closed")}),
        "newest_hour": frame_table(top.orderBy(F.desc("window_start"), "rank"), TOP_N,
                                   recent=recent),
        "table_version": result.versions[TOP].after})
    counting = session.read.format("delta").load(str(layout.table(OPEN_HOURS)))
    yield dg.MaterializeResult(asset_key=OPEN_KEY, metadata={
        **common, "open_hours": state.get("rows", -1), "bytes": state.get("bytes", -1),
        "hours_counting": frame_table(counting.orderBy(F.desc("window_start"), F.desc("tickets_sold"), "title")),
        "table_version": result.versions[OPEN_HOURS].after})
    yield dg.MaterializeResult(asset_key=LATE_KEY, metadata={
        **common, "late_events_this_run": late, "table_version": result.versions[LATE].after})

    mismatched, figures = table_checks.windows_mismatches(session, layout, result.versions[HOURLY].before)
    bad = mismatched.count() if figures["hours_checked"] else 0
    yield check_policy.result(
        HOURLY_KEY, "windows_reconcile_with_bronze",
        passed=bad == 0 and figures["sales"] == figures["late_events"] + figures["in_closed_windows"]
        and figures["late_not_in_bronze"] == figures["late_not_behind_watermark"] == 0,
        metadata={**figures, "mismatched_windows": bad, "sample": frame_table(mismatched, rows_known=bad)})
    wrong = table_checks.top_titles_mismatches(session, layout)
    wrong_rows = wrong.count()
    yield check_policy.result(TOP_KEY, "top_titles_match_windows", passed=wrong_rows == 0,
                              metadata={"rows_differing": wrong_rows, "sample": frame_table(wrong, rows_known=wrong_rows)})
