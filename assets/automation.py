"""Jobs, the schedule and the sensors that advance the streams without a person.

- `advance_all`: every asset and per-run check once (what `make run` launches); schedule every 5 min, off by default.
- `reconcile_state_tables`: the deep check of every state, windowed and session table against all of bronze; nightly.
- `advance_<stream>`: one stream; launched by the landing-files sensor and by recovery.
- `recover_failed_stream`: a run failure starts a recovery run of each failed stream, which resumes
  from its checkpoint; bounded by MAX_RECOVERY_ATTEMPTS so a persistent fault cannot loop. A failed
  `run_continuously` (assets/continuous.py) is started again with its own config.
- While a continuous run is in progress, or its recovery is due, it advances every stream: neither sensor starts an
  orchestrated run.
- `spark_engine_health`: whether the warm Spark Connect engine the runs use answers (`make dev`, `make serve`).
"""


import json
import os
import re
import time

import dagster as dg

from assets.continuous import run_continuously
from assets.keys import (
    CHANGELOG_GROUP, CONTINUOUS_JOB, ADVANCE_ALL_JOB, DEEP_CHECK_JOB, MAX_RECOVERY_ATTEMPTS, RECOVERY_ATTEMPT_TAG,
    RECOVERY_CHAIN_TAG,
    RECOVERY_OF_TAG, RECOVERY_REASON_TAG, STREAM_TAG,
    deep_check_keys, stream_job_name, stream_of_step,
)
from pipelines.declare.project import streams
from pipelines.declare.specs import StreamSpec
from pipelines.errors import ConfigurationError, EngineUnavailableError
from pipelines.ingest.kafka_source import end_offsets
from pipelines.ingest.landing import landing_listing
from pipelines.runtime.spark import REMOTE_ENV, engine_answers
from pipelines.storage.files import AnyPath
from resources import SparkSessionResource, StorageResource

DEEP_CHECKS = dg.AssetSelection.checks(*deep_check_keys())

advance_all = dg.define_asset_job(
    ADVANCE_ALL_JOB, selection=dg.AssetSelection.all() - DEEP_CHECKS - dg.AssetSelection.groups(CHANGELOG_GROUP),
    description="Advance every stream once: ingest landing files, update state tables, run the per-run checks.")

stream_jobs = {
    name: dg.define_asset_job(
        stream_job_name(spec), selection=dg.AssetSelection.groups(name) - DEEP_CHECKS, tags={STREAM_TAG: name},
        description=f"Advance {name} once: ingest its landing files, update "
                    f"{', '.join(t.name for t in spec.state_tables) or 'its tables'}, check them.")
    for name, spec in streams().items()
}

reconcile_state_tables = dg.define_asset_job(
    DEEP_CHECK_JOB, selection=DEEP_CHECKS,
    description="Deep check: every state, windowed and session table recomputed from all of bronze and compared row by "
                "row.")

nightly_reconciliation = dg.ScheduleDefinition(
    name="reconcile_state_tables_nightly", job=reconcile_state_tables, cron_schedule="30 2 * * *",
    default_status=dg.DefaultScheduleStatus.RUNNING)

every_five_minutes = dg.ScheduleDefinition(
    name="advance_all_every_5_minutes", job=advance_all, cron_schedule="*/5 * * * *",
    default_status=dg.DefaultScheduleStatus.STOPPED)


# A run of an older recovery chain that lasted this long was not the same fault repeating: count anew.
RECOVERY_CHAIN_RESET_S = 600
# How long after a continuous run failed its recovery is awaited before orchestrated runs resume (the run-failure
# sensor's tick and the launch take under a minute; this covers a busy daemon, or that sensor turned off).
RECOVERY_DUE_S = 300


IN_PROGRESS = [dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED, dg.DagsterRunStatus.STARTING,
               dg.DagsterRunStatus.STARTED]


def recovery_attempt(instance: dg.DagsterInstance, run: dg.DagsterRun) -> tuple[int, str]:
    """The attempt a recovery of the failed `run` would be, and the run whose failure began the chain. A
    continuous run that lasted over RECOVERY_CHAIN_RESET_S failed of a new fault: attempt 1 of a chain of its own."""
    if run.job_name == CONTINUOUS_JOB:
        record = instance.get_run_record_by_id(run.run_id)
        if record and record.start_time and record.end_time and record.end_time - record.start_time > RECOVERY_CHAIN_RESET_S:
            return 1, run.run_id
    # A recovery tagged before RECOVERY_CHAIN_TAG existed named its chain's first run in RECOVERY_OF_TAG.
    return (int(run.tags.get(RECOVERY_ATTEMPT_TAG, "0")) + 1,
            run.tags.get(RECOVERY_CHAIN_TAG, run.tags.get(RECOVERY_OF_TAG, run.run_id)))


def continuous_run_in_charge(instance: dg.DagsterInstance) -> str | None:
    """Why a `run_continuously` run advances every stream now, if one does: it is queued, starting or running; or
    it failed less than RECOVERY_DUE_S ago and `recover_failed_stream` starts it again (an orchestrated run started
    meanwhile would hold the writer locks its queries need)."""
    if records := instance.get_run_records(dg.RunsFilter(job_name=CONTINUOUS_JOB, statuses=IN_PROGRESS), limit=1):
        return f"{CONTINUOUS_JOB} run {records[0].dagster_run.run_id} is advancing every stream"
    newest = instance.get_run_records(dg.RunsFilter(job_name=CONTINUOUS_JOB), limit=1)
    if not newest or newest[0].dagster_run.status != dg.DagsterRunStatus.FAILURE:
        return None
    run, ended = newest[0].dagster_run, newest[0].end_time
    if (ended is None or time.time() - ended > RECOVERY_DUE_S
            or recovery_attempt(instance, run)[0] > MAX_RECOVERY_ATTEMPTS):
        return None
    return (f"{CONTINUOUS_JOB} run {run.run_id} failed {time.time() - ended:.0f}s ago and recover_failed_stream "
            f"starts it again (orchestrated runs resume if it has not within {RECOVERY_DUE_S}s)")


def stream_run_in_progress(instance: dg.DagsterInstance, stream: str) -> str | None:
    """The id of a queued or running run that advances `stream` (its own job, or advance_all), if any."""
    for runs in (dg.RunsFilter(tags={STREAM_TAG: stream}, statuses=IN_PROGRESS),
                 dg.RunsFilter(job_name=ADVANCE_ALL_JOB, statuses=IN_PROGRESS)):
        if records := instance.get_run_records(runs, limit=1):
            return records[0].dagster_run.run_id
    return None


LANDING_SENSOR_ENV = "STATETABLES_LANDING_SENSOR_SECONDS"
FAILURE_SENSOR_ENV = "STATETABLES_FAILURE_SENSOR_SECONDS"


def sensor_interval(variable: str, default: int) -> int:
    """A sensor's `minimum_interval_seconds` from $`variable`, `default` when unset; a bad value names the fix."""
    value = os.environ.get(variable, str(default))
    if not value.isdigit() or int(value) < 1:
        raise ConfigurationError(f"{variable}={value!r}: it must be a whole number of seconds >= 1. "
                                 f"Fix: e.g. {variable}={default} (or unset it).")
    return int(value)


def landing_sensor_interval() -> int:
    """The landing sensor's interval: $STATETABLES_LANDING_SENSOR_SECONDS, default 5. A tick lists the landing
    folders only, so it is cheap; the wait for it is part of a file's freshness."""
    return sensor_interval(LANDING_SENSOR_ENV, 5)


def failure_sensor_interval() -> int:
    """The run-failure sensor's interval: $STATETABLES_FAILURE_SENSOR_SECONDS, default 30 (Dagster's own default for
    a sensor). The wait for a tick is part of the time from a failed run to its recovery run."""
    return sensor_interval(FAILURE_SENSOR_ENV, 30)


def _newest_records(spec: StreamSpec) -> tuple[int, str] | None:
    """(records ever produced, the end offset of each partition) of a stream's topic: grows when records arrive."""
    ends = end_offsets(spec.topic)
    total = sum(ends.values())
    return (total, json.dumps(sorted(ends.items()))) if total else None


def _newest_landing_file(folder: AnyPath) -> tuple[int, str] | None:
    """(mtime_ns, path) of the newest complete landing file at any depth (an append makes a file newer)."""
    listing = landing_listing(folder)
    return (listing[-1][0], listing[-1][1]) if listing else None


@dg.sensor(jobs=list(stream_jobs.values()), minimum_interval_seconds=landing_sensor_interval(),
           default_status=dg.DefaultSensorStatus.RUNNING,
           description="Starts `advance_<stream>` when a new landing file appears for that stream (for a stream read "
                       "from a topic: when records arrive), unless a run of that stream is already queued or running "
                       f"(interval: ${LANDING_SENSOR_ENV}).")
def landing_files_sensor(context: dg.SensorEvaluationContext, storage: StorageResource):
    # The cursor only decides *when* to run; which files are new is tracked by each stream's own
    # checkpoint, so a file the cursor misses (an old mtime) is still ingested by the next run.
    cursor = json.loads(context.cursor) if context.cursor else {}
    layout = storage.layout()
    requests, busy = [], []
    for name, spec in streams().items():
        if spec.topic is not None:
            try:
                newest = _newest_records(spec)
            except ConfigurationError as exc:  # the brokers are down: said on the tick, the other streams go on
                busy.append(f"{name}: {exc}")
                continue
        else:
            newest = _newest_landing_file(layout.landing(name))
        if newest is None or list(newest) <= cursor.get(name, [0, ""]):
            continue
        if running := stream_run_in_progress(context.instance, name):
            # The cursor stays: the first tick after that run asks for one more, for what it may have missed.
            busy.append(f"{name}: run {running} is queued or running")
            continue
        cursor[name] = list(newest)
        requests.append(dg.RunRequest(job_name=stream_job_name(spec), run_key=f"{name}:{newest[0]}:{newest[1]}",
                                      tags={STREAM_TAG: name}))
    # The cursor moves on either way: files a continuous run ingests are not a reason for a run after it.
    if requests and (continuous := continuous_run_in_charge(context.instance)):
        return dg.SensorResult(skip_reason=continuous, cursor=json.dumps(cursor))
    if not requests:
        return dg.SensorResult(skip_reason="; ".join(busy) or "no new landing files", cursor=json.dumps(cursor))
    return dg.SensorResult(run_requests=requests, cursor=json.dumps(cursor))


@dg.sensor(minimum_interval_seconds=30, default_status=dg.DefaultSensorStatus.RUNNING,
           description="Whether the Spark Connect engine the runs use answers: each tick says so, and a tick fails "
                       "(red in the sensor's history) while it does not. Nothing to watch on the embedded engine.")
def spark_engine_health(context: dg.SensorEvaluationContext, spark: SparkSessionResource):
    if not spark.remote:
        return dg.SkipReason(f"runs use an embedded JVM of their own (no ${REMOTE_ENV}): nothing to watch")
    started = time.monotonic()
    if not engine_answers(spark.remote):
        raise EngineUnavailableError(
            f"The Spark engine at {spark.remote} does not answer: runs wait {spark.engine_wait_seconds:.0f}s for "
            f"it, then fail. Fix: `make dev` and `make serve` restart it by themselves (see logs/spark-connect.log "
            f"under the storage root); alone, `make connect-server`.")
    return dg.SkipReason(f"{spark.remote} answers ({(time.monotonic() - started) * 1000:.0f} ms to connect)")


def failed_streams(context: dg.RunFailureSensorContext) -> list[StreamSpec]:
    """The streams whose steps failed in the run; every stream of the run if no step failed."""
    found = {spec.name: spec for event in context.get_step_failure_events()
             if (spec := stream_of_step(event.step_key or ""))}
    if found:
        return list(found.values())
    tagged = context.dagster_run.tags.get(STREAM_TAG)
    known = streams()
    return [known[tagged]] if tagged in known else list(known.values())


_EXCEPTION_LINE = re.compile(r"^\s*[\w.]*(Error|Exception|Fault): .+")


def _failure_summary(context: dg.RunFailureSensorContext) -> str:
    """The failed steps and the exception that stopped each, in one line for the recovery run's tag.

    Errors raised inside foreachBatch reach Dagster wrapped in Spark's StreamingQueryException with the
    Python traceback inside; the last `SomeError: message` line in it is the real cause.
    """
    causes = []
    for event in context.get_step_failure_events():
        error = event.event_specific_data.error if event.event_specific_data else None
        text = "" if error is None else "\n".join(filter(None, [error.message, *(c.message for c in [error.cause] if c)]))
        lines = [line.strip() for line in text.splitlines() if _EXCEPTION_LINE.match(line)]
        causes.append(f"{event.step_key}: {lines[-1] if lines else (text.strip().splitlines() or ['failed'])[0]}")
    return "; ".join(causes) or context.failure_event.message or "run failed"


@dg.run_failure_sensor(
    name="recover_failed_stream",
    minimum_interval_seconds=failure_sensor_interval(),
    monitored_jobs=[advance_all, *stream_jobs.values(), run_continuously],
    request_jobs=[*stream_jobs.values(), run_continuously],
    default_status=dg.DefaultSensorStatus.RUNNING,
    description=("When a run fails, starts a recovery run of each failed stream; it resumes from the "
                 f"stream's checkpoint. At most {MAX_RECOVERY_ATTEMPTS} recovery attempts in a row "
                 f"(interval: ${FAILURE_SENSOR_ENV}, default 30 s)."),
)
def recover_failed_stream(context: dg.RunFailureSensorContext):
    run = context.dagster_run
    attempt, origin = recovery_attempt(context.instance, run)
    error = _failure_summary(context)
    continuous = run.job_name == CONTINUOUS_JOB
    if not continuous and (other := continuous_run_in_charge(context.instance)):
        return dg.SkipReason(f"Not recovering run {run.run_id}: {other}, from the same checkpoints.")
    if attempt > MAX_RECOVERY_ATTEMPTS:
        message = (f"Not recovering run {run.run_id}: it was recovery attempt {attempt - 1} of {MAX_RECOVERY_ATTEMPTS} "
                   f"for run {origin}. The fault persists; fix it (see the run's error), then run the stream's job.")
        context.log.error(message)
        return dg.SkipReason(message)
    tags = {RECOVERY_OF_TAG: run.run_id, RECOVERY_CHAIN_TAG: origin, RECOVERY_ATTEMPT_TAG: str(attempt),
            RECOVERY_REASON_TAG: f"run {run.run_id} failed: {error}"[:400]}
    if continuous:  # started again as it was, with its own config
        return [dg.RunRequest(job_name=CONTINUOUS_JOB, run_key=f"recover:{run.run_id}", run_config=run.run_config,
                              tags=tags)]
    return [
        dg.RunRequest(
            job_name=stream_job_name(spec),
            run_key=f"recover:{run.run_id}:{spec.name}",
            tags={STREAM_TAG: spec.name, **tags},
        )
        for spec in failed_streams(context)
    ]
