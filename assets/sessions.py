"""The customer activity sessions of payments (pipelines/sessions.py) as Dagster assets with their check:
customer_activity and the operator's two state tables.

They are written by the payments stream's one step (assets/streams.py, one streaming query), so their specs,
check and results are the parts of that step's multi-asset defined here. Not partitioned: a session closes
when the watermark passes it, whatever hour or day that is, so partitions would only restate what the
watermark decides. Late payments go to late_events, whose asset belongs to the sales stream's step (one
asset, one producer in Dagster); customer_activity's metadata counts them.
"""

import datetime as dt

import dagster as dg
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from assets.keys import KINDS, bronze_key
from assets.metadata import RUNBOOK_LINE, RUNBOOK_METADATA, frame_table, within_watermark
from pipelines import event_time, table_checks
from pipelines.layout import StorageLayout
from pipelines.sessions import (
    ACTIVITY, LAST_PAYMENTS, LAST_SESSIONS, OPEN_SESSIONS, last_progress, state_figures,
)
from pipelines.streaming import StreamRunResult
from pipelines.streams import StreamSpec, sessions_stream
from resources import CheckPolicyResource

ACTIVITY_KEY, OPEN_KEY, LAST_KEY = dg.AssetKey(ACTIVITY), dg.AssetKey(OPEN_SESSIONS), dg.AssetKey(LAST_SESSIONS)


def specs(SPEC: StreamSpec) -> list:
    """The asset specs of the event-time tables of `SPEC`, the stream that declares them."""
    return [
    dg.AssetSpec(ACTIVITY_KEY, deps=[bronze_key(SPEC)], kinds=KINDS, metadata=RUNBOOK_METADATA, description=(
        f"One row per closed activity session of a customer: payments less than "
        f"{int(SPEC.sessions.gap.total_seconds() // 60)} minutes apart. `session_start` / `session_end` are its first and "
        f"last payment, with `payment_count`, `total_amount`, the last {LAST_PAYMENTS} `last_payment_ids` (newest "
        "first), `previous_session_end` (null for a first session, or after the customer was idle longer than the "
        "state TTL) and `day_amount`, the customer's spend on session_end's UTC day so far. A session is written "
        "once the watermark (newest payment minus the delay) is 30 minutes past its last payment, and is final. "
        f"Folded from {SPEC.bronze_table} in the stream's micro-batches; the operator's state is the Delta tables customer_open_sessions "
        "and customer_last_sessions. Late payments go to late_events and still count in the stream's state tables."
        + RUNBOOK_LINE)),
        dg.AssetSpec(OPEN_KEY, deps=[bronze_key(SPEC)], kinds=KINDS, metadata=RUNBOOK_METADATA, description=(
            "The sessions' operator state: one row per open session of a customer (first and last payment, count, "
            "amount, last payments), replaced by every micro-batch from the version the previous one left; a "
            "session leaves it for customer_activity once the watermark is 30 minutes past its last payment. "
            "Query it for a customer's session in progress." + RUNBOOK_LINE)),
        dg.AssetSpec(LAST_KEY, deps=[bronze_key(SPEC)], kinds=KINDS, metadata=RUNBOOK_METADATA, description=(
            "The sessions' keyed state: per customer, the newest closed session's end and the spend on its UTC "
            "day, which the next session's previous_session_end and day_amount start from. A customer idle for "
            "the state TTL with nothing open leaves it." + RUNBOOK_LINE)),
]
CHECK_SPECS = [dg.AssetCheckSpec("sessions_reconcile_with_bronze", asset=ACTIVITY, blocking=True, description=(
        "Bronze (at the version the sessions have folded) minus late_events, cut into sessions by window "
        "functions with the contract's rule (less than 30 minutes apart is one session; exactly 30 is two): "
        "every session the watermark has closed is a row with the same end, count and amount, and every row is "
        "such a session; every late payment is at or behind the watermark it missed. Reads all of "
        "the stream's bronze once."))]


def results(session: SparkSession, layout: StorageLayout, result: StreamRunResult, check_policy: CheckPolicyResource):
    """The sessions' materializations and check after a run of the payments stream."""
    batches = [c["user"] for c in result.commits[ACTIVITY] if "watermark_ms" in c["user"]]
    progress = last_progress(session, layout)
    state = state_figures(session, layout)
    watermark = (dt.datetime.fromtimestamp(progress.watermark_ms / 1000, dt.timezone.utc).isoformat()
                 if progress and progress.watermark_ms else "(none yet)")
    activity = session.read.format("delta").load(str(layout.table(ACTIVITY)))
    common = {"watermark": watermark}
    opened = session.read.format("delta").load(str(layout.table(OPEN_SESSIONS)))
    yield dg.MaterializeResult(asset_key=OPEN_KEY, metadata={
        **common, "open_sessions": state[OPEN_SESSIONS]["rows"],
        "newest_open_sessions": frame_table(opened.orderBy(F.desc("session_end"), "customer_id")),
        "table_version": result.versions[OPEN_SESSIONS].after})
    yield dg.MaterializeResult(asset_key=LAST_KEY, metadata={
        **common, "customers_kept": state[LAST_SESSIONS]["rows"],
        "table_version": result.versions[LAST_SESSIONS].after})
    yield dg.MaterializeResult(asset_key=ACTIVITY_KEY, metadata={
        "bronze_rows_read": event_time.rows_read(result.commits[ACTIVITY]), "watermark": watermark,
        "bronze_version_read": progress.bronze_version if progress else -1,
        "sessions_closed_this_run": sum(b.get("sessions_closed", 0) for b in batches),
        "late_payments_this_run": sum(b.get("late_events", 0) for b in batches),
        "operator_state_rows": state.get("rows", -1), "operator_state_bytes": state.get("bytes", -1),
        "newest_sessions": frame_table(activity.orderBy(F.desc("session_end"), "customer_id"), recent=within_watermark(
            progress and progress.watermark_ms, "session_end", sessions_stream().sessions.gap)),
        "table_version": result.versions[ACTIVITY].after})
    mismatched, figures = table_checks.sessions_mismatches(session, layout)
    bad = mismatched.count()
    yield check_policy.result(
        dg.AssetKey(ACTIVITY), "sessions_reconcile_with_bronze",
        passed=bad == 0 and figures["late_not_in_bronze"] == figures["late_not_behind_watermark"] == 0,
        metadata={**figures, "mismatched_sessions": bad, "sample": frame_table(mismatched, rows_known=bad)})
