"""The customer activity sessions of payments (pipelines/sessions.py) as Dagster assets with their check:
customer_activity and the operator's two state tables.

One step, one streaming query, in the payments group after bronze. Not partitioned: a session closes
when the watermark passes it, whatever hour or day that is, so partitions would only restate what the
watermark decides.

The query also appends late payments to late_events, whose asset belongs to the windows step (one
asset, one producer in Dagster); this asset's metadata counts them.
"""

import datetime as dt

import dagster as dg
from pydantic import Field
from pyspark.sql import functions as F

from assets.keys import KINDS, bronze_key, pool
from assets.metadata import RUNBOOK_LINE, RUNBOOK_METADATA, frame_table, recovery_metadata
from pipelines import table_checks
from pipelines.sessions import (
    ACTIVITY, DEFAULT_STATE_TTL, LAST_SESSIONS, OPEN_SESSIONS, DEFAULT_WATERMARK_DELAY, LAST_PAYMENTS, SESSION_GAP, SessionSettings, last_progress,
    update_sessions,
)
from pipelines.streams import PAYMENTS
from resources import CheckPolicyResource, SparkSessionResource, StorageResource

SPEC = PAYMENTS
ACTIVITY_KEY, OPEN_KEY, LAST_KEY = dg.AssetKey(ACTIVITY), dg.AssetKey(OPEN_SESSIONS), dg.AssetKey(LAST_SESSIONS)


class SessionsConfig(dg.Config):
    watermark_delay_minutes: float = Field(
        default=DEFAULT_WATERMARK_DELAY.total_seconds() / 60, ge=0,
        description=("How far behind the newest payment seen the watermark trails. A session is written once the "
                     "watermark is 30 minutes past its last payment; a payment at or behind it goes to late_events."))
    state_ttl_days: float = Field(
        default=DEFAULT_STATE_TTL.days, gt=0,
        description=("A customer idle this many days of event time is forgotten: the operator drops their state, "
                     "and their next session has no previous_session_end and a fresh day_amount."))
    lock_timeout_s: float = Field(default=60.0, description="How long to wait for the sessions query's writer lock.")


@dg.multi_asset(
    name=ACTIVITY, group_name=SPEC.name, pool=pool(SPEC),
    specs=[dg.AssetSpec(ACTIVITY_KEY, deps=[bronze_key(SPEC)], kinds=KINDS, metadata=RUNBOOK_METADATA, description=(
        f"One row per closed activity session of a customer: payments less than "
        f"{int(SESSION_GAP.total_seconds() // 60)} minutes apart. `session_start` / `session_end` are its first and "
        f"last payment, with `payment_count`, `total_amount`, the last {LAST_PAYMENTS} `last_payment_ids` (newest "
        "first), `previous_session_end` (null for a first session, or after the customer was idle longer than the "
        "state TTL) and `day_amount`, the customer's spend on session_end's UTC day so far. A session is written "
        "once the watermark (newest payment minus the delay) is 30 minutes past its last payment, and is final. "
        "Read from payments_bronze as a stream; the operator's state is the Delta tables customer_open_sessions "
        "and customer_last_sessions. Late payments go to late_events and still count in payments_per_customer."
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
    ],
    check_specs=[dg.AssetCheckSpec("sessions_reconcile_with_bronze", asset=ACTIVITY, blocking=True, description=(
        "Bronze (at the version the sessions query has read) minus late_events, cut into sessions by window "
        "functions with the contract's rule (less than 30 minutes apart is one session; exactly 30 is two): "
        "every session the watermark has closed is a row with the same end, count and amount, and every row is "
        "such a session; every late payment is at or behind the watermark it missed. Reads all of "
        "payments_bronze once."))],
)
def customer_activity(context: dg.AssetExecutionContext, config: SessionsConfig, spark: SparkSessionResource,
                      storage: StorageResource, check_policy: CheckPolicyResource):
    session, layout = spark.spark_session, storage.layout()
    settings = SessionSettings(watermark_delay=dt.timedelta(minutes=config.watermark_delay_minutes),
                               state_ttl=dt.timedelta(days=config.state_ttl_days))
    result = update_sessions(session, layout, settings, lock_timeout_s=config.lock_timeout_s)
    batches = [c["user"] for c in result.commits[ACTIVITY] if "watermark_ms" in c["user"]]
    progress = last_progress(session, layout)
    state = result.operator_state or {}
    watermark = (dt.datetime.fromtimestamp(progress.watermark_ms / 1000, dt.timezone.utc).isoformat()
                 if progress and progress.watermark_ms else "(none yet)")
    activity = session.read.format("delta").load(str(layout.table(ACTIVITY)))
    common = {"micro_batches": result.micro_batches, "watermark": watermark}
    opened = session.read.format("delta").load(str(layout.table(OPEN_SESSIONS)))
    yield dg.MaterializeResult(asset_key=OPEN_KEY, metadata={
        **common, "open_sessions": opened.count(),
        "newest_open_sessions": frame_table(opened.orderBy(F.desc("session_end"), "customer_id")),
        "table_version": result.versions[OPEN_SESSIONS].after})
    yield dg.MaterializeResult(asset_key=LAST_KEY, metadata={
        **common, "customers_kept": session.read.format("delta").load(str(layout.table(LAST_SESSIONS))).count(),
        "table_version": result.versions[LAST_SESSIONS].after})
    yield dg.MaterializeResult(asset_key=ACTIVITY_KEY, metadata={
        "micro_batches": result.micro_batches, "bronze_rows_read": result.rows_read, "watermark": watermark,
        "bronze_version_read": progress.bronze_version if progress else -1,
        "sessions_closed_this_run": sum(b.get("sessions_closed", 0) for b in batches),
        "late_payments_this_run": sum(b.get("late_events", 0) for b in batches),
        "operator_state_rows": state.get("rows", -1), "operator_state_bytes": state.get("bytes", -1),
        "newest_sessions": frame_table(activity.orderBy(F.desc("session_end"), "customer_id")),
        "duration_s": round(result.duration_s, 2), "table_version": result.versions[ACTIVITY].after,
        **recovery_metadata(context, result)})
    mismatched, figures = table_checks.sessions_mismatches(session, layout)
    bad = mismatched.count()
    yield check_policy.result(
        dg.AssetKey(ACTIVITY), "sessions_reconcile_with_bronze",
        passed=bad == 0 and figures["late_not_in_bronze"] == figures["late_not_behind_watermark"] == 0,
        metadata={**figures, "mismatched_sessions": bad, "sample": frame_table(mismatched, rows_known=bad)})
