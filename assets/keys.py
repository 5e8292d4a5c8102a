"""Names shared by assets, checks, jobs and sensors: asset keys, pools, jobs, tags."""

from __future__ import annotations

from datetime import timedelta

import dagster as dg

from pipelines.declare.project import streams
from pipelines.declare.specs import StateTableSpec, StreamSpec
from pipelines.runtime.micro_batch import event_time_streams
from pipelines.state.changelog import changelog_name
# The blocking checks' names live with the policy that names them (resources/check_policy.py).
from resources.check_policy import DEEP_CHECK

KINDS = {"spark", "delta"}
ADVANCE_ALL_JOB = "advance_all"
STREAM_TAG = "statetables/stream"
RECOVERY_OF_TAG = "statetables/recovery_of"  # the run that failed
RECOVERY_CHAIN_TAG = "statetables/recovery_chain_of"  # the run whose failure began the recoveries in a row
RECOVERY_ATTEMPT_TAG = "statetables/recovery_attempt"
RECOVERY_REASON_TAG = "statetables/recovery_reason"
MAX_RECOVERY_ATTEMPTS = 3
DEEP_CHECK_JOB = "reconcile_state_tables"
CONTINUOUS_JOB = "run_continuously"
MAINTENANCE_JOB = "maintain_tables"
CHANGELOG_JOB = "publish_changelogs"
CHANGELOG_GROUP = "changelogs"  # apart from the streams' groups: a stream's run does not publish its changelogs
REFRESH_JOB = "refresh_state_table"
CONTINUOUS_TAG = "statetables/continuous"
# A state table not materialized for this long shows as stale in the UI. The continuous job reports every
# 30 s while a table moves; orchestrated runs follow the landing sensor (30 s) or the 5-minute schedule.
STATE_FRESHNESS = dg.FreshnessPolicy.time_window(fail_window=timedelta(minutes=30), warn_window=timedelta(minutes=10))


def bronze_key(spec: StreamSpec) -> dg.AssetKey:
    return dg.AssetKey(spec.bronze_table)


def quarantine_key(spec: StreamSpec) -> dg.AssetKey:
    return dg.AssetKey(spec.quarantine_table)


def state_key(table: StateTableSpec) -> dg.AssetKey:
    return dg.AssetKey(table.name)


def changelog_key(table: StateTableSpec) -> dg.AssetKey:
    return dg.AssetKey(changelog_name(table))


def deep_check_keys() -> list[dg.AssetCheckKey]:
    """The checks against all of bronze: every state, windowed and session table's (nightly, not in a run)."""
    timed = event_time_streams()
    return [dg.AssetCheckKey(dg.AssetKey(t.name), DEEP_CHECK) for spec in streams().values()
            for t in (*spec.state_tables, *(spec.event_time_tables if spec.name in timed else ()))]


def pool(spec: StreamSpec) -> str:
    """One Dagster concurrency pool per stream: with run granularity and limit 1, the daemon never
    runs two runs that advance the same stream at once."""
    return f"stream_{spec.name}"


def stream_job_name(spec: StreamSpec) -> str:
    return f"advance_{spec.name}"


def job_names() -> list[str]:
    return [ADVANCE_ALL_JOB, DEEP_CHECK_JOB, CONTINUOUS_JOB, MAINTENANCE_JOB, CHANGELOG_JOB, REFRESH_JOB,
            *(stream_job_name(spec) for spec in streams().values())]


def streams_of_job(job: str) -> list[StreamSpec]:
    """The streams a job advances: its own (advance_<stream>), every one (advance_all, the continuous job), or none."""
    return [spec for spec in streams().values() if job in (ADVANCE_ALL_JOB, CONTINUOUS_JOB, stream_job_name(spec))]


def stream_op_name(spec: StreamSpec) -> str:
    """The stream's one step: its streaming query through every table of the stream."""
    return spec.name


def stream_of_step(step_key: str) -> StreamSpec | None:
    """Which stream a failed step belongs to (asset ops and check ops are named after it)."""
    for spec in streams().values():
        if step_key.startswith(spec.name) or any(step_key.startswith(t.name) for t in spec.state_tables):
            return spec
    return None
