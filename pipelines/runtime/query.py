"""Running one streaming query to the end of its input, as one writer, with a stable idempotency id.

Spark's checkpoint makes a query resume where it stopped; every commit names its app id and micro-batch id, so
a replayed micro-batch finds what it already wrote (pipelines/storage/delta_log.py). The app id must
change when the checkpoint is replaced (batch ids restart at 0), so it lives inside the checkpoint
(pipelines/runtime/checkpoints.py decides whether a checkpoint can be trusted).
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from pyspark.errors import StreamingQueryException
from pyspark.sql import DataFrame, SparkSession

from pipelines.errors import ConfigurationError, StorageError, storage_fault
from pipelines.storage import files


# Spark waits 10 s for a new Python worker to connect back (PythonWorkerFactory, hard-coded). The worker imports
# pyspark, pandas and pyarrow first: 1.3 s on this idle 2-core machine, 5-11 s at a load of 14 (measured), as in CI.
# Six tries over 90 s all missed there; tries go on for as long as a run may wait for its engine.
WORKER_START_BUDGET_S = 300.0
_WORKER_START_FAILED = "Python worker failed to connect back"
# Spark 4.1.1's Kafka source fails the query in its progress report after it replays a batch planned but not committed
# (a crash between the two): its metrics read the newest offsets, which only planning a batch fetches, and a replay
# plans none (KafkaMicroBatchStream.metrics, NullPointerException; apache/spark issue 55236, fixed after 4.1.1). The
# replayed batch is in the commit log by then, so a new start of the query goes on from the next batch.
_KAFKA_REPLAY_REPORT_FAILED = 'because the return value of "scala.Option.get()" is null'
# How often a stop that waits for a running micro-batch says so.
STOP_NOTE_S = 10.0


@dataclass
class TableVersions:
    before: int | None
    after: int | None


@dataclass
class StreamRunResult:
    """What one availableNow run of a streaming query did; becomes Dagster metadata."""

    query_name: str
    micro_batches: int
    rows_read: int
    duration_s: float
    versions: dict[str, TableVersions] = field(default_factory=dict)
    commits: dict[str, list[dict]] = field(default_factory=dict)
    # Set when the checkpoint was not trusted: {"problem", "set_aside", "action"}.
    recovery: dict | None = None
    # Stateful queries: the operator state after the run (rows, bytes in memory).
    operator_state: dict | None = None
    # Landing files appended to or rewritten after they were ingested: {"file", "change", "version"}.
    changed_files: list[dict] = field(default_factory=list)
    # Per state table: the bronze version it was built through in one batch before the query (a new table, or
    # one that recorded none), those rows came in no micro-batch; None when it was not.
    built_through: dict[str, int | None] = field(default_factory=dict)


@dataclass
class Continuous:
    """Keep queries running with a processing-time trigger until `stop` is set: the always-on mode
    (pipelines/runtime/continuous.py). Without it a query processes what is available now and stops.

    `on_progress(query_name, report)` receives each new progress report of each query (from several
    threads); `fail` records the first error of any thread and stops every query."""

    trigger_interval_s: float = 1.0
    stop: threading.Event = field(default_factory=threading.Event)
    on_progress: Callable[[str, object], None] | None = None
    error: BaseException | None = None
    # How long a graceful stop waits for a running micro-batch to commit before stopping the query.
    stop_timeout_s: float = 300.0

    def __post_init__(self):
        if not self.trigger_interval_s > 0:
            raise ConfigurationError(f"trigger interval {self.trigger_interval_s}s: it must be positive. "
                                     f"Fix: give a number of seconds > 0 (default 1).")

    def fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        self.stop.set()

    def wait_until(self, ready: Callable[[], bool]) -> bool:
        """Whether a query can start: availableNow runs ask once; a continuous run waits for it (a Delta
        source cannot start at a version that does not exist yet) until it is told to stop."""
        while not ready():
            if self.stop.wait(self.trigger_interval_s):
                return False
        return True


def source_ready(ready: Callable[[], bool], continuous: Continuous | None) -> bool:
    return ready() if continuous is None else continuous.wait_until(ready)


def _new_reports(reports: list, after: str, query_name: str, continuous: Continuous, batches: list) -> str:
    """Pass on the reports newer than timestamp `after` (ISO-8601, so ordered as strings); the newest seen."""
    for report in reports:
        if report is None or report.timestamp <= after:
            continue
        after = report.timestamp
        # Idle triggers also report (no `addBatch`): they are passed on, not counted as batches.
        if "addBatch" in (report.durationMs or {}):
            batches.append(report)
        if continuous.on_progress is not None:
            continuous.on_progress(query_name, report)
    return after


def _newest_batch_committed(report) -> int:
    """The id of the newest batch a progress report says committed: its own if it ran one, else (an idle trigger
    reports the id of the batch to come) the one before; -1 for none."""
    if report is None:
        return -1
    return report.batchId if "addBatch" in (report.durationMs or {}) else report.batchId - 1


def _stop_after_the_running_batch(query, timeout_s: float) -> None:
    """Stop the query once the micro-batch running now has committed (at most `timeout_s`). Idle, a query is
    stopped at once; with a backlog the next batch starts at once and is stopped as it starts, and
    like any batch a stop interrupts it is replayed by the next run from the checkpoint, what it had committed
    skipped (its commits name their batch). A stop that waits says so every STOP_NOTE_S on the progress log, with
    what the query is doing; a query thread that does not end within `spark.sql.streaming.stopTimeout`
    (SESSION_CONFS) fails the stop with that thread's stack on the engine's log, instead of holding the run
    forever."""
    started = time.monotonic()
    deadline, next_note = started + timeout_s, started + STOP_NOTE_S
    committed = _newest_batch_committed(query.lastProgress)
    # A trigger that found no new data (an idle one, which may follow the previous at once on a busy engine) runs no
    # batch: it is stopped as it is.
    while (query.isActive and (status := query.status)["isTriggerActive"] and status["isDataAvailable"]
           and time.monotonic() < deadline):
        if _newest_batch_committed(query.lastProgress) > committed:
            break  # the batch that was running has committed
        if time.monotonic() >= next_note:
            next_note += STOP_NOTE_S
            logging.getLogger("statetables.progress").info(
                f"query {query.name}: stopping once its micro-batch commits ({status['message']}; waited "
                f"{time.monotonic() - started:.0f} s of {timeout_s:.0f} s)")
        time.sleep(0.05)
    try:
        query.stop()
    except Exception as exc:  # noqa: BLE001 - said where the run's log shows it, then raised
        logging.getLogger("statetables.progress").warning(f"query {query.name}: did not stop: {exc}")
        raise


def run_query(
    stream: DataFrame,
    *,
    query_name: str,
    checkpoint_dir: Path,
    on_batch: Callable[[DataFrame, int], None],
    progress: list | None = None,
    continuous: Continuous | None = None,
) -> tuple[int, int]:
    """Process everything available now in micro-batches, then stop; with `continuous`, keep going with a
    processing-time trigger until it is stopped. Returns (batches, rows read); the query's progress reports
    are added to `progress` when given (state operator figures).

    A Python worker that does not connect back to the JVM in time (Spark waits 10 s, not configurable; seen on
    this 2-core machine under load) fails the query before its batch commits, or, over Spark Connect, its start:
    the query is started again from its checkpoint, which replays nothing twice. So is a query from a topic whose
    progress report failed after the batch it replayed from its checkpoint committed (_KAFKA_REPLAY_REPORT_FAILED),
    once; that batch's report is lost, so the batches returned count one fewer."""
    reports: list = []
    failing_since: float | None = None
    replay_report_failed = False
    for attempt in itertools.count(1):
        if continuous is not None and continuous.stop.is_set():
            break  # told to stop before this query (re)started: nothing of it runs, nothing to stop
        writer = (stream.writeStream.queryName(query_name)
                  .option("checkpointLocation", str(checkpoint_dir))
                  .foreachBatch(on_batch))
        try:
            # Over Spark Connect the server starts the foreachBatch's Python worker inside start(): on a loaded
            # machine it may miss its time to connect back there too, before the query exists.
            query = (writer.trigger(availableNow=True) if continuous is None else
                     writer.trigger(processingTime=f"{continuous.trigger_interval_s} seconds")).start()
        except Exception as exc:  # noqa: BLE001 - only the worker's failed start is retried, the rest re-raised
            failing_since = _retry_worker_start(exc, query_name, attempt, failing_since)
            continue
        seen = ""
        try:
            if continuous is None:
                query.awaitTermination()
                reports += query.recentProgress
                break
            # awaitTermination(timeout) raises as soon as the query fails. A batch lasts seconds: the last
            # report, polled each second, misses none in practice and costs one report's JSON, not a hundred.
            while not query.awaitTermination(1.0):
                seen = _new_reports([query.lastProgress], seen, query_name, continuous, reports)
                if continuous.stop.is_set():
                    _stop_after_the_running_batch(query, continuous.stop_timeout_s)
            _new_reports(query.recentProgress, seen, query_name, continuous, reports)
            break
        except StreamingQueryException as exc:
            if continuous is None:
                reports += query.recentProgress
            if _KAFKA_REPLAY_REPORT_FAILED in str(exc) and not replay_report_failed:
                replay_report_failed = True  # once: the replayed batch is committed, the next start plans anew
                continue
            # A query that ran batches since its start fails afresh: a budget of its own.
            failing_since = _retry_worker_start(exc, query_name, attempt, None if seen else failing_since)
        except BaseException:
            # Interrupted (a Dagster cancel arrives as an exception in this thread): the batch finishes first.
            if query.isActive:
                _stop_after_the_running_batch(query, continuous.stop_timeout_s if continuous else 0)
            raise
    # A replayed batch reports 0 input rows from a Delta source, so batches are counted, not rows.
    if progress is not None:
        progress.extend(reports)
    return len(reports), sum(p.numInputRows for p in reports)


def _retry_worker_start(exc: Exception, query_name: str, attempt: int, failing_since: float | None) -> float:
    """Wait before the next try if `exc` is a Python worker's missed connect-back and WORKER_START_BUDGET_S since
    `failing_since` (now if None) allows; else raise it. Returns when the failures began. Each try is logged: a run
    that waits here says why."""
    since = time.monotonic() if failing_since is None else failing_since
    elapsed = time.monotonic() - since
    if _WORKER_START_FAILED not in str(exc) or elapsed >= WORKER_START_BUDGET_S:
        raise exc
    pause = min(10, 2 * attempt)
    logging.getLogger("statetables.progress").warning(
        f"query {query_name}: its Python worker did not connect back within Spark's 10 s (the machine is busy); "
        f"try {attempt + 1} in {pause} s ({elapsed:.0f} s of {WORKER_START_BUDGET_S:.0f} s spent)")
    time.sleep(pause)
    return since


def _storage_message(path: Path | str, cause: str) -> str:
    return (f"Cannot write to {path}: {cause}. The storage root is read-only, full or not writable by this user; "
            f"this run stopped before anything half-written could count. Fix: make the folder writable or free "
            f"space, then run again: the next run resumes from the last commit, exactly once.")


def require_writable(folders: list[files.AnyPath]) -> None:
    """Fail fast, before any table or checkpoint is touched, if a folder the run writes cannot be written. On an
    object store: that the endpoint answers, the credentials are accepted and the bucket exists, then a probe."""
    if folders and isinstance(folders[0], files.S3Path):
        files.require_bucket(folders[0])
        files.require_writable(folders[0])
        return
    for folder in folders:
        while not folder.exists() and folder.parent != folder:  # not created yet: its parent must be writable
            folder = folder.parent
        try:
            probe = folder / f".statetables-write-probe-{os.getpid()}-{threading.get_ident()}"  # steps run in threads
            with open(probe, "wb") as handle:
                handle.write(b"probe")
                handle.flush()
                os.fsync(handle.fileno())
            probe.unlink()
        except OSError as exc:
            raise StorageError(_storage_message(folder, exc.strerror or str(exc))) from exc


@contextmanager
def storage_errors() -> Iterator[None]:
    """Turn an I/O failure deep inside Spark or Delta into a StorageError that says what to do."""
    try:
        yield
    except Exception as exc:  # Spark surfaces Java IOExceptions as several Python exception types
        text = str(exc)
        cause = storage_fault(exc)
        if cause is None:
            raise
        path = next((word for word in text.split() if word.startswith(("/", "file:"))), "the storage root")
        raise StorageError(_storage_message(path.rstrip(".,:;'\""), cause)) from exc


# A small micro-batch's session confs. Spark generates and compiles Java code for a query's expressions, and a
# micro-batch's plans carry its own literals (its time, batch id, watermark), so a warm process compiled most of them
# again on every batch: for a small batch, evaluating the expressions interpreted costs less than compiling them (a
# warm 300-payment run 6-11% faster, the first run of a process 7-13%). Adaptive execution re-plans a query at each
# shuffle, as a job of its own per stage, to size partitions that a small batch's few rows never fill: without it,
# a warm 300-payment batch without event time 1.32-1.34 s -> 1.26 s, with sessions the same (docs/performance.md).
# The engines the project starts run without it anyway (`spark.LOCAL_DEFAULTS`); this keeps a small batch without it
# on a cluster of the user's. Above SMALL_BATCH_BYTES of input, code generation wins again, and the session's own
# settings stand.
SMALL_BATCH_CONFS = {"spark.sql.codegen.wholeStage": "false", "spark.sql.codegen.factoryMode": "NO_CODEGEN",
                     "spark.sql.adaptive.enabled": "false"}
# Of landing bytes (pipelines/ingest/landing.py `BatchUnits`), in a warm engine: ~2,000 payment lines. There the
# codegen cache holds the batch's classes, and on a 1M-payment home the large path, compiled, its steps side by side,
# was as fast at 1,000-2,000 lines and faster from 5,000 (5,000 lines 2.49 s against 3.50 s; docs/performance.md):
# interpreted, the event-time steps' joins with their operator state cost by the state's rows, not the batch's.
SMALL_BATCH_BYTES = 256 << 10
# In a process whose JVM ends with its run (`statetables run`) every class is compiled for the first time: there the
# interpreted path stays cheaper up to ~64,000 lines (a new process on 5,000 lines 13.9 s against 15.0 s compiled).
NEW_PROCESS_SMALL_BATCH_BYTES = 8 << 20
# A topic's batch is sized in records before they are read: a record counts as a line of ~128 bytes (a payment's
# JSON line is 130 on average), so the same events take the same path from a folder or a topic.
RECORD_BYTES = 128
# A batch under this many landing bytes keeps its frames in memory (`storage.frames.kept`), not on disk. Profiled, a
# warm +100k batch (12 MiB) spent about 8% of its JVM samples serializing its kept rows to disk and reading them
# back; a 1M-line batch (120 MiB) needed a 4 GiB heap to hold its frames.
KEPT_IN_MEMORY_BYTES = 32 << 20


@contextmanager
def session_confs_during(spark: SparkSession, confs: dict[str, str]) -> Iterator[None]:
    """Session confs for a block, with what was set before put back after (over Spark Connect the session is
    shared with other queries; these confs change how fast a query runs, never what it writes)."""
    before = {key: spark.conf.get(key, None) for key in confs}
    for key, value in confs.items():
        spark.conf.set(key, value)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                spark.conf.unset(key)
            else:
                spark.conf.set(key, value)
