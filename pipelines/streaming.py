"""Running one streaming query to the end of its input, as one writer, with a stable idempotency id.

Spark's checkpoint makes a query resume where it stopped; Delta's transaction identifiers
(`txnAppId`, `txnVersion` = micro-batch id) make a replayed micro-batch a no-op. The app id must
change when the checkpoint is replaced (batch ids restart at 0), so it lives inside the checkpoint
(pipelines/checkpoints.py decides whether a checkpoint can be trusted).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import random
import re
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from pyspark import StorageLevel
from pyspark.errors import StreamingQueryException
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import StructType

from pipelines import delta_sql
from pipelines import storage
from pipelines.errors import ConcurrentWriterError, ConfigurationError, StorageError

TXN_APP_ID = "spark.databricks.delta.write.txnAppId"
TXN_VERSION = "spark.databricks.delta.write.txnVersion"
USER_METADATA = "spark.databricks.delta.commitInfo.userMetadata"


def kept_on_disk(frame: DataFrame) -> DataFrame:
    """`frame` computed once and kept for the batch's later reads, its plan cut off (a local checkpoint).

    On local disk, not in the heap: a 1M-line batch keeps its lines twice (validated, then classified), and held
    in memory they needed a 4 GiB heap. With the kept frames on disk, 1M payments took the same time with a 1 GiB
    heap, and the JVM's peak RSS fell from 4.6 to 1.7 GB (measured)."""
    return frame.localCheckpoint(storageLevel=StorageLevel.DISK_ONLY)


CONFLICT_RETRIES = 8
# Spark waits 10 s for a new Python worker to connect back (PythonWorkerFactory, hard-coded). The worker imports
# pyspark, pandas and pyarrow first: 1.3 s on this idle 2-core machine, 5-11 s at a load of 14 (measured), as in CI.
# Six tries over 90 s all missed there; tries go on for as long as a run may wait for its engine.
WORKER_START_BUDGET_S = 300.0
_WORKER_START_FAILED = "Python worker failed to connect back"
_CONFLICT = re.compile(r"DELTA_CONCURRENT_|io\.delta\.exceptions\.Concurrent\w*Exception|^Concurrent\w*Exception")
conflicts_retried = {"count": 0}  # in this process; shows that retries happen (tests, diagnostics)
_STORAGE_FAULTS = ("No space left on device", "Read-only file system", "Permission denied",
                   "Operation not permitted", "Disk quota exceeded")

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


def create_table_if_missing(spark: SparkSession, path: Path, schema: StructType, *,
                            change_data_feed: bool = True, properties: dict[str, str] | None = None) -> None:
    """Create the Delta table at `path` unless it exists.

    A process killed while creating a table can leave `_delta_log/` without its first commit; Delta
    then refuses to create the table there and refuses to read it. Nothing was committed in that
    case, so the empty log is moved aside (kept, like everything this project sets aside).

    Two first runs may create a table they share (late_events) at once: Delta lets one commit version 0 and fails
    the other (DELTA_PROTOCOL_CHANGED). The loser finds the table there, made by the same code, and goes on.
    """
    if table_version(spark, path) is not None:
        return  # it has a first commit: no CREATE TABLE IF NOT EXISTS round trip (~20 ms, ~10 per run)
    path = storage.storage_path(path)
    log = path / "_delta_log"
    if log.is_dir() and not any(p.suffix == ".json" or ".checkpoint" in p.name for p in log.iterdir()):
        storage.replace(log, path / f"_delta_log.uncommitted-{time.time_ns()}")
    try:
        delta_sql.create_table_if_missing(spark, path, schema, {
            **({"delta.enableChangeDataFeed": "true"} if change_data_feed else {}), **(properties or {})} or None)
    except Exception:
        if table_version(spark, path) is None:
            raise


# Per table, the newest version this process has seen: where its next look starts (storage.newest_commit).
_SEEN_VERSION: dict[str, int] = {}


def table_version(spark: SparkSession, path: Path) -> int | None:
    """The table's latest committed version, from its log's file names (Delta protocol: one
    `<version>.json` per commit); None if it is not a table yet. Asking Spark costs a job each time. A run asks
    some 30 to 80 times, so only the newest part of the log is looked at: from the version this process saw last,
    else from Delta's `_last_checkpoint`. The whole log is listed only when neither holds (a new table, or one
    deleted and created again)."""
    log = storage.storage_path(path) / "_delta_log"
    start = _SEEN_VERSION.get(str(path))
    if start is None:
        start = _checkpointed_version(log)
    version = storage.newest_commit(log, start) if start is not None else None
    if version is None:
        try:
            versions = [int(p.name[:-5]) for p in log.iterdir() if p.name.endswith(".json") and p.name[:-5].isdigit()]
        except FileNotFoundError:
            versions = []
        version = max(versions) if versions else None
    if version is None:
        _SEEN_VERSION.pop(str(path), None)
    else:
        _SEEN_VERSION[str(path)] = version
    return version


def _checkpointed_version(log) -> int | None:
    """The version of the log's newest checkpoint, from `_last_checkpoint` (Delta protocol); None without one."""
    try:
        return int(json.loads((log / "_last_checkpoint").read_text(encoding="utf-8"))["version"])
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None


def table_id(spark: SparkSession, path: Path) -> str:
    """The Delta table's id (`metaData.id`, chosen when the table is created), from its first commit
    when the log still holds it; otherwise asked of Delta. DESCRIBE DETAIL costs a Spark job on every
    run, and only the id is needed. A table deleted and created again has a new first commit, and so
    a new id."""
    first = storage.storage_path(path) / "_delta_log" / f"{0:020d}.json"
    try:
        for line in first.read_text(encoding="utf-8").splitlines():
            action = json.loads(line) if line.strip() else {}
            if "metaData" in action:
                return action["metaData"]["id"]
    except (FileNotFoundError, ValueError):
        pass
    return delta_sql.detail(spark, path)["id"]


def commit_actions(path: Path, newest: int, count: int | None = None) -> Iterator[tuple[int, Iterator[dict]]]:
    """(version, actions) of the table's commit files from version `newest` down, `count` of them (all when None),
    read by name (Delta protocol: `_delta_log/<version>.json`, one action a line); stops at a file cleaned up by
    log retention. Actions are parsed as taken: `commitInfo` comes first, and a MERGE's file actions carry stats."""
    log = storage.storage_path(path) / "_delta_log"
    for version in range(newest, -1 if count is None else max(-1, newest - count), -1):
        try:
            text = (log / f"{version:020d}.json").read_text(encoding="utf-8")
        except FileNotFoundError:
            return
        yield version, (json.loads(line) for line in text.splitlines() if line.strip())


def history_rows(spark: SparkSession, path: Path, limit: int | None = None, *,
                 latest: int | None = None) -> list[dict]:
    """DESCRIBE HISTORY's version, operation, operationParameters, operationMetrics, userMetadata and timestamp
    (`timestamp_ms`, epoch milliseconds) of the newest `limit` commits (all when None), newest first, read from the
    commit files of the table's log (each holds the commit's `commitInfo`); the commits cleaned up by log retention
    are left out, as DESCRIBE HISTORY leaves them. DESCRIBE HISTORY costs a Spark job, and a run asks some ten
    times; it answers instead for a log without commitInfo (another writer's). `latest`: the table's version when
    the caller has just read it."""
    if latest is None:
        latest = table_version(spark, path)
    if latest is None:
        return []
    rows = []
    for version, actions in commit_actions(path, latest, limit):
        info = next((a["commitInfo"] for a in actions if "commitInfo" in a), None)
        if info is None:
            columns = ("version", "operation", "operationParameters", "operationMetrics", "userMetadata")
            return [r.asDict() for r in delta_sql.history(spark, path, limit)
                    .select(*columns, F.unix_millis("timestamp").alias("timestamp_ms")).collect()]
        rows.append({"version": version, "operation": info.get("operation"),
                     "operationParameters": info.get("operationParameters") or {},
                     "operationMetrics": info.get("operationMetrics") or {}, "userMetadata": info.get("userMetadata"),
                     "timestamp_ms": info.get("inCommitTimestamp", info.get("timestamp"))})
    return rows


def commits_since(spark: SparkSession, path: Path, version: int | None) -> list[dict]:
    """Commits after `version`, oldest first: version, operation, metrics, userMetadata."""
    latest = table_version(spark, path)
    if latest is None or (version is not None and latest <= version):
        return []
    rows = [r for r in reversed(history_rows(spark, path, latest - version if version is not None else None,
                                             latest=latest))
            if version is None or r["version"] > version]
    return [
        {
            "version": r["version"],
            "operation": r["operation"],
            "metrics": dict(r["operationMetrics"] or {}),
            "user": json.loads(r["userMetadata"]) if r["userMetadata"] else {},
        }
        for r in rows
    ]


@dataclass
class Continuous:
    """Keep queries running with a processing-time trigger until `stop` is set: the always-on mode
    (pipelines/continuous.py). Without it a query processes what is available now and stops.

    `on_progress(query_name, report)` receives each new progress report of each query (from several
    threads); `fail` records the first error of any thread and stops every query."""

    trigger_interval_s: float = 2.0
    stop: threading.Event = field(default_factory=threading.Event)
    on_progress: Callable[[str, object], None] | None = None
    error: BaseException | None = None
    # How long a graceful stop waits for a running micro-batch to commit before stopping the query.
    stop_timeout_s: float = 300.0

    def __post_init__(self):
        if not self.trigger_interval_s > 0:
            raise ConfigurationError(f"trigger interval {self.trigger_interval_s}s: it must be positive. "
                                     f"Fix: give a number of seconds > 0 (default 2).")

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


def _stop_between_batches(query, timeout_s: float) -> None:
    """Stop the query once no micro-batch is running, so that the current batch commits first. A batch
    that a stop interrupts anyway (one starting in between, or one past the timeout) is replayed by the
    next run from the checkpoint and its commits skipped by their transaction ids."""
    deadline = time.monotonic() + timeout_s
    while query.isActive and query.status["isTriggerActive"] and time.monotonic() < deadline:
        time.sleep(0.05)
    query.stop()


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
    the query is started again from its checkpoint, which replays nothing twice."""
    reports: list = []
    failing_since: float | None = None
    for attempt in itertools.count(1):
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
                    _stop_between_batches(query, continuous.stop_timeout_s)
            _new_reports(query.recentProgress, seen, query_name, continuous, reports)
            break
        except StreamingQueryException as exc:
            if continuous is None:
                reports += query.recentProgress
            # A query that ran batches since its start fails afresh: a budget of its own.
            failing_since = _retry_worker_start(exc, query_name, attempt, None if seen else failing_since)
        except BaseException:
            # Interrupted (a Dagster cancel arrives as an exception in this thread): the batch finishes first.
            if query.isActive:
                _stop_between_batches(query, continuous.stop_timeout_s if continuous else 0)
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


def rows_changed(spark: SparkSession, path: Path, after: int, through: int) -> DataFrame:
    """Every change row of a Delta table's versions after `after` up to `through` (its Change Data Feed)."""
    return (spark.read.format("delta").option("readChangeFeed", "true").option("startingVersion", after + 1)
            .option("endingVersion", through).load(str(path)))


def rows_added(spark: SparkSession, path: Path, after: int, through: int) -> DataFrame:
    """The rows appended to a Delta table in versions after `after` up to `through` (an append's change data
    is the files it added: nothing else is read). How each step of a stream's micro-batch reads the bronze rows
    it has not folded yet, whoever wrote them: this batch, or a batch that died before the step committed."""
    return (rows_changed(spark, path, after, through).where(F.col("_change_type") == "insert")
            .drop("_change_type", "_commit_version", "_commit_timestamp"))


@dataclass(frozen=True)
class Appended:
    """The bronze commit a micro-batch has just made: its version and its rows (kept on local disk)."""

    version: int
    rows: DataFrame


@dataclass(frozen=True)
class BronzeRows:
    """The bronze rows a step of a micro-batch has not folded yet, up to version `through`. When the step's only
    unfolded version is the batch's own append, they are that append's rows as the batch holds them (no read of
    bronze: a Delta read costs a snapshot and a plan); otherwise (a step behind after a crash, a catch-up) they
    are read from bronze's change data."""

    spark: SparkSession
    path: Path
    through: int
    appended: Appended | None = None  # this batch's bronze commit, when it made one

    def after(self, folded: int) -> DataFrame:
        """The rows of the versions after `folded` up to `through`."""
        if self.appended is not None and self.appended.version == self.through == folded + 1:
            return self.appended.rows
        return rows_added(self.spark, self.path, folded, self.through)

    def count_after(self, folded: int) -> int:
        return rows_appended(self.spark, self.path, folded, self.through)


def rows_appended(spark: SparkSession, path: Path, after: int, through: int) -> int:
    """How many rows `rows_added` over the same versions holds, from the appends' commit metrics in the log: no
    Spark job."""
    return sum(int(c["metrics"].get("numOutputRows", 0)) for c in commits_since(spark, path, after)
               if c["version"] <= through and c["operation"] == "WRITE")


def _storage_message(path: Path | str, cause: str) -> str:
    return (f"Cannot write to {path}: {cause}. The storage root is read-only, full or not writable by this user; "
            f"this run stopped before anything half-written could count. Fix: make the folder writable or free "
            f"space, then run again: the next run resumes from the last commit, exactly once.")


def require_writable(folders: list[storage.AnyPath]) -> None:
    """Fail fast, before any table or checkpoint is touched, if a folder the run writes cannot be written. On an
    object store: that the endpoint answers, the credentials are accepted and the bucket exists, then a probe."""
    if folders and isinstance(folders[0], storage.S3Path):
        storage.require_bucket(folders[0])
        storage.require_writable(folders[0])
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


def storage_fault(exc: BaseException) -> str | None:
    """The storage cause named in an error (read-only, full, permissions), if it is one."""
    text = str(exc)
    return next((fault for fault in _STORAGE_FAULTS if fault in text), None)


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


def retry_on_conflict(commit: Callable[[], None], what: str) -> None:
    """Run one Delta commit, again if another writer committed first.

    A failed optimistic commit wrote nothing, and the retry re-reads the table; if the winner was
    this same micro-batch (same txnAppId/txnVersion), the retry sees that and skips. So retrying
    never counts twice; giving up raises with the reason.
    """
    for attempt in range(1, CONFLICT_RETRIES + 1):
        try:
            commit()
            return
        except Exception as exc:
            # delta.exceptions classes only appear where delta-spark converted the JVM error; from other
            # threads and over Spark Connect it arrives as a generic error carrying the same class name.
            if not _CONFLICT.search(f"{type(exc).__name__} {exc}"):
                raise
            if attempt == CONFLICT_RETRIES:
                raise ConcurrentWriterError(
                    f"{what}: another writer committed to the table {CONFLICT_RETRIES} times while this batch "
                    f"tried to; nothing of this batch was written. Fix: find the other writer (only statetables "
                    f"jobs should write state tables), stop it, run again. Last conflict: "
                    f"{str(exc).splitlines()[0]}") from exc
            conflicts_retried["count"] += 1
            # Jittered: two writers that collided and waited the same fixed time collided again, in
            # step, until one gave up (seen with two racing MERGEs on a loaded machine).
            time.sleep(min(attempt, 4) * random.uniform(0.5, 1.5))


# Spark generates and compiles Java code for a query's expressions. A micro-batch's plans carry its own literals (its
# time, batch id, watermark), so a warm process compiled most of them again on every batch. For a small batch,
# evaluating the expressions interpreted costs less than compiling them (a warm 300-payment run 6-11% faster, the
# first run of a process 7-13%: docs/performance.md). Above SMALL_BATCH_BYTES of input compiled code wins again, and
# the session's own settings stand.
INTERPRETED = {"spark.sql.codegen.wholeStage": "false", "spark.sql.codegen.factoryMode": "NO_CODEGEN"}
SMALL_BATCH_BYTES = 8 << 20
GZIP_RATIO = 10  # a compressed unit's bytes count this many times


def batch_bytes(units: DataFrame) -> int:
    """The landing bytes a micro-batch of ledger units reads (compressed units at GZIP_RATIO times their size)."""
    size = F.when(F.col("compressed"), F.col("byte_length") * GZIP_RATIO).otherwise(F.col("byte_length"))
    return int(units.agg(F.sum(size)).first()[0] or 0)


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


@contextmanager
def commit_confs(spark: SparkSession, confs: dict[str, str]) -> Iterator[None]:
    """Session confs for one Delta commit; unset after, as foreachBatch shares the session over Spark Connect."""
    for key, value in confs.items():
        spark.conf.set(key, value)
    try:
        yield
    finally:
        for key in confs:
            spark.conf.unset(key)
