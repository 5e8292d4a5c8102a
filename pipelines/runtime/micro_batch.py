"""One streaming query per stream: each micro-batch of landing content goes through every table of the stream.

The query streams the stream's landing ledger (pipelines/ingest/landing.py; the scan runs in this driver, not as a
query). Its foreachBatch, `StreamBatch`, reads top to bottom in data-flow order:

1. validate, dedup, quarantine and bronze appends (pipelines/ingest/bronze.py, `ingest_batch`);
2. the all-time state MERGE (pipelines/state/tables.py);
3. the windowed and session tables (pipelines/event_time/windows.py, pipelines/event_time/sessions.py), with late events;
4. a state table's changelog topic, when it declares one, from the state-table versions this batch wrote
   (pipelines/state/changelog_topic.py).

No changelog table is written here: a state table's Change Data Feed, written by its MERGE's own commit, is its
change log; its durable copy is published off the micro-batch (pipelines/state/changelog.py).

Exactly once. Every commit names the stream's app id and batch id in its metadata; quarantine's and bronze's
appends of a replayed batch find their own and are skipped (pipelines/storage/delta_log.py, `made_by_batch`); a
topic's records carry the state-table version they cover, and a replay publishes only what comes after it. Each
step after bronze folds the bronze rows added after the version its own last commit
recorded (this batch's own append as the batch holds it, when that is all the step lacks), and records the version
it reached in the same commit as its rows. So a batch replayed after a crash
between any two commits, or after the checkpoint was lost (a new app id), folds every bronze row once: a step
that had committed skips it, a step that had not folds it, from the state the previous batch left (recorded
versions, read by time travel), never from what this batch had half written.

There is one checkpoint per stream. A lost or damaged one is set aside: a new one reads the whole ledger again,
lines already in bronze or quarantine are recognised by file and line number, and the later steps resume from
what their tables record. Before the query starts, every step is brought up to bronze's newest version
(`catch_up`): a batch that died midway, a savepoint restore, or tables of an earlier statetables.

    >>> advance_stream(spark, StorageLayout.under("data"), stream_spec("orders")).micro_batches
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import copy_context
from dataclasses import dataclass, replace
from typing import Iterator

from pyspark.sql import DataFrame, SparkSession

from pipelines.declare.project import streams
from pipelines.declare.specs import StreamSpec
from pipelines.errors import ConfigurationError
from pipelines.event_time import sessions, windows
from pipelines.event_time.sessions import sessions_stage
from pipelines.event_time.watermark import LATE, EventTimeStage, event_time_new_tables
from pipelines.event_time.windows import windows_stage
from pipelines.faults import STREAM_BATCH_END, fault_point
from pipelines.ingest.bronze import (
    DEFAULT_MAX_FILES_PER_TRIGGER, IngestSettings, bronze_tables, ingest_batch, ingest_records,
)
from pipelines.ingest.kafka_source import (
    planned_records, recorded_offsets, source_id, starting_offsets, topic_partitions, topic_records,
)
from pipelines.ingest.landing import (
    BatchUnits, LedgerView, ScanResult, landing_listing, ledger_replayable, record_units, scan_landing,
)
from pipelines.runtime.checkpoints import (
    batch_source_offsets, checkpoint_for_run, has_planned, planned_source_version, read_through, start_checkpoint,
    write_origin,
)
from pipelines.runtime.locks import Fence, LocalFence, writer_lock
from pipelines.runtime.query import (
    KEPT_IN_MEMORY_BYTES, RECORD_BYTES, SMALL_BATCH_BYTES, SMALL_BATCH_CONFS, Continuous, StreamRunResult,
    TableVersions, require_writable, run_query, session_confs_during, storage_errors,
)
from pipelines.runtime.spark import require_kafka_jars
from pipelines.state.changelog_topic import ChangelogTopicStage, changelog_topic_stage, close_producers
from pipelines.state.tables import StateTableStage, state_new_table, state_table_stage
from pipelines.storage.delta_log import (
    Appended, BronzeRows, NewTable, commits_since, create_tables_if_missing, new_app_id, table_id, table_version,
)
from pipelines.storage.frames import is_small_batch, small_batch
from pipelines.storage.layout import StorageLayout


@dataclass(frozen=True)
class StreamSettings:
    """How a run advances a stream: what the run may choose (Dagster config and the CLI fill it in). What decides
    the rows (rules, dedup horizon, watermarks, TTLs) is the stream's declaration, the same for every run."""

    max_files_per_trigger: int = DEFAULT_MAX_FILES_PER_TRIGGER  # landing units per micro-batch
    lock_timeout_s: float = 60.0
    event_time: bool = True  # keep the stream's windowed and session tables; False: they cost nothing
    # A batch with this many landing bytes or more (a topic's: records of RECORD_BYTES) runs as a large one (joins
    # and kept frames, not decided in the driver): pipelines/runtime/query.py says why a warm engine and a new process
    # differ. Its frames are kept on disk from `kept_on_disk_from_bytes`. The engine's warm-up sets both to 0 for the
    # batches that warm those paths.
    large_from_bytes: int = SMALL_BATCH_BYTES
    kept_on_disk_from_bytes: int = KEPT_IN_MEMORY_BYTES


EVENT_TIME_ENV = "STATETABLES_EVENT_TIME"


def event_time_streams(value: str | None = None) -> frozenset[str]:
    """The streams that keep their windowed and session tables, from
    $STATETABLES_EVENT_TIME: `all` (the default), `none`, or stream names separated by commas. The code location
    reads it once: a stream left out has no event-time assets, and its runs pay nothing for them."""
    raw = (os.environ.get(EVENT_TIME_ENV, "all") if value is None else value).strip()
    if raw in ("", "all"):
        return frozenset(streams())
    if raw == "none":
        return frozenset()
    names = {name.strip() for name in raw.split(",") if name.strip()}
    if unknown := sorted(names - set(streams())):
        raise ConfigurationError(
            f"{EVENT_TIME_ENV}={raw!r} names no stream {', '.join(unknown)}. Fix: set it to all, none, or some of "
            f"{', '.join(streams())} separated by commas.")
    return frozenset(names)


def event_time_tables(spec: StreamSpec) -> tuple[str, ...]:
    """The tables a stream's windowed and session steps write (late_events is shared by every stream)."""
    names = tuple(name for t in spec.event_time_tables for name in (t.name, *(top.name for top in t.tops),
                                                                    t.state_table))
    return (*names, LATE) if names else ()


def stream_tables(spec: StreamSpec, settings: StreamSettings) -> tuple[str, ...]:
    """Every table a run of the stream writes, in data-flow order."""
    return (spec.quarantine_table, spec.bronze_table, *(t.name for t in spec.state_tables),
            *(event_time_tables(spec) if settings.event_time else ()))


class _CurrentStderr(logging.StreamHandler):
    """A handler that writes to `sys.stderr` as it is when a line is logged, not as it was when this module was
    imported (as `logging.lastResort` does): whoever captures the process's stderr later gets the lines."""

    def __init__(self):
        logging.Handler.__init__(self)

    @property
    def stream(self):
        return sys.stderr


# One line per micro-batch, on stderr: `statetables run` shows it, a Dagster step's captured stderr keeps it (the
# step's logs), and over Spark Connect it goes where the server's Python worker writes (the server's log). Set up
# here because every process that runs a batch imports this module; not propagated, so an application that also
# configures the root logger does not print it twice.
PROGRESS = logging.getLogger("statetables.progress")
if not PROGRESS.handlers:
    _handler = _CurrentStderr()
    _handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(message)s"))
    PROGRESS.addHandler(_handler)
    PROGRESS.setLevel(logging.INFO)
    PROGRESS.propagate = False


def log_batch(stream: str, batch_id: int, counts: dict, elapsed_s: float, steps_s: dict[str, float], small: bool
              ) -> None:
    """The micro-batch's line: its counts (what ingest_batch computed and bronze's commit records), its rate and
    duration, whether it ran as a small batch (`small`: decided in the driver, expressions interpreted), and each
    step's seconds (`<step>_s`: ingest, state, event_time, topic, those it has). The figures are also on the
    record (`figures`), for a handler that wants them as data."""
    lines = int(counts.get("lines", 0))
    figures = {"stream": stream, "batch": batch_id, "lines": lines, "accepted": int(counts.get("accepted", 0)),
               "quarantined": int(counts.get("quarantined", 0)), "duplicates": int(counts.get("duplicates", 0)),
               "rows_per_s": round(lines / elapsed_s, 1) if elapsed_s > 0 else 0.0, "elapsed_s": round(elapsed_s, 2),
               "small": small}
    if counts.get("already_ingested"):  # a replay under a new checkpoint: lines that an earlier attempt wrote
        figures["already_ingested"] = int(counts["already_ingested"])
    figures.update({f"{step}_s": round(seconds, 2) for step, seconds in steps_s.items()})
    PROGRESS.info(" ".join(f"{key}={value}" for key, value in figures.items()), extra={"figures": figures})


@contextmanager
def timed(seconds: dict[str, float], step: str) -> Iterator[None]:
    """Add the block's wall time to `seconds[step]`."""
    started = time.monotonic()
    try:
        yield
    finally:
        seconds[step] = seconds.get(step, 0.0) + time.monotonic() - started


class StreamBatch:
    """The foreachBatch body of a stream's query: one micro-batch of landing units through every table."""

    def __init__(self, layout: StorageLayout, spec: StreamSpec, ingest: IngestSettings,
                 states: list[StateTableStage], event_time: list[EventTimeStage],
                 fence: Fence | LocalFence | None = None, topics: dict[str, ChangelogTopicStage] | None = None,
                 large_from_bytes: int = SMALL_BATCH_BYTES, kept_on_disk_from_bytes: int = KEPT_IN_MEMORY_BYTES):
        self.layout, self.spec, self.ingest = layout, spec, ingest
        self.large_from_bytes, self.kept_on_disk_from_bytes = large_from_bytes, kept_on_disk_from_bytes
        self.states, self.event_time = states, event_time
        self.fence = fence
        self.topics = topics or {}  # state table → its changelog topic's stage

    def __call__(self, units: DataFrame, batch_id: int) -> None:
        started = time.monotonic()
        self.fenced()
        spark, topic = units.sparkSession, self.spec.topic
        if topic is None:
            listed, recorded = BatchUnits.of(units), None
            landing_bytes = listed.landing_bytes
        else:
            # A topic's batch is sized by the offsets its checkpoint plans, before any record is read.
            listed, recorded = None, recorded_offsets(spark, self.layout.table(self.spec.bronze_table), topic)
            records = planned_records(topic, batch_source_offsets(self.layout.checkpoint(self.spec.name), batch_id))
            # Not planned (unknown size): the large path, on disk.
            landing_bytes = records * RECORD_BYTES if records is not None else None
        small = landing_bytes is not None and landing_bytes < self.large_from_bytes
        in_memory = landing_bytes is not None and landing_bytes < self.kept_on_disk_from_bytes
        steps_s: dict[str, float] = {}
        with session_confs_during(spark, SMALL_BATCH_CONFS if small else {}), small_batch(small, in_memory), \
                ThreadPoolExecutor(1, thread_name_prefix=f"{self.spec.name}-state-ahead") as ahead:
            try:
                if not small:
                    # A large batch's ingest leaves the cores idle between its jobs: the event-time steps' operator
                    # state is read and kept meanwhile, in the batch's context (where kept frames go).
                    for step in self.event_time:
                        step.state_ahead = ahead.submit(copy_context().run, step.read_state_ahead, spark)
                with timed(steps_s, "ingest"):
                    ingested = (ingest_batch(listed, batch_id, settings=self.ingest) if listed is not None
                                else ingest_records(units, batch_id, recorded, settings=self.ingest))
                self.fold(spark, self.ingest.app_id, batch_id, ingested.appended, steps_s)
            finally:
                for step in self.event_time:
                    step.state_ahead = None
        log_batch(self.spec.name, batch_id, ingested.counts, time.monotonic() - started, steps_s, small)
        fault_point(STREAM_BATCH_END)

    def fenced(self) -> None:
        """Raise unless this run still holds the stream's writer lock (`locks.LocalFence`, `locks.Fence`): over Spark
        Connect a killed run's query goes on in the server."""
        if self.fence is not None:
            self.fence()

    def fold(self, spark: SparkSession, app_id: str, batch_id: int, appended: Appended | None = None,
             steps_s: dict[str, float] | None = None) -> None:
        """Every step after bronze, up to bronze's newest version (this batch's append, and any a batch that died
        before its later steps committed had made). A step whose only unfolded version is `appended` folds its
        rows as the batch holds them; a step further behind reads bronze (`BronzeRows`). Each step's seconds are
        added to `steps_s`.

        A large batch's event-time steps run in a thread of their own, beside the state tables and their
        changelog topics: each step folds the same bronze rows into tables no other step writes, and records what it
        folded in its own commits, so no order between them matters to recovery, and a warm +100k batch's queries
        left the cores idle half the time (measured). A topic follows its state table, in the same thread. When one
        side fails, the other still finishes (its commits are whole), then the error is raised (the state side's
        when both fail)."""
        steps_s = {} if steps_s is None else steps_s
        bronze_path = self.layout.table(self.spec.bronze_table)
        through = table_version(spark, bronze_path)
        rows = BronzeRows(spark, bronze_path, through, appended)

        # Each step first asks the fence again: a killed run's batch that was already past it when another run took
        # the lock stops at its next step instead of committing that step a second time.
        def event_time() -> None:
            with timed(steps_s, "event_time"):
                for step in self.event_time:
                    self.fenced()
                    step.advance(spark, rows, app_id, batch_id)

        def state_tables() -> None:
            with timed(steps_s, "state"):
                for state in self.states:
                    self.fenced()
                    state.advance(spark, rows, app_id, batch_id)

        def topics() -> None:
            if not self.topics:
                return
            with timed(steps_s, "topic"):
                for topic in self.topics.values():
                    self.fenced()
                    topic.advance(spark)

        if not self.event_time or is_small_batch():
            # A small batch's steps, one after the other: only large batches were measured faster side by side.
            state_tables()
            event_time()
            topics()
            return
        # A thread per batch, not one kept: over Spark Connect this object is pickled for foreachBatch. The thread
        # runs in a copy of this one's context: whether the batch is small (`frames.small_batch`) is a context
        # variable. Leaving the block waits for it, whichever side failed.
        with ThreadPoolExecutor(1, thread_name_prefix=f"{self.spec.name}-event-time") as pool:
            beside = pool.submit(copy_context().run, event_time)
            state_tables()
            topics()
        if beside.exception() is not None:
            raise beside.exception()

    def catch_up(self, spark: SparkSession) -> bool:
        """Bring every step up to bronze's newest version before the query starts, under an app id of its own;
        whether there was anything to fold."""
        through = table_version(spark, self.layout.table(self.spec.bronze_table))
        # Bronze's version 0 is its creation: no rows.
        behind = through > 0 and (any(state.through < through for state in self.states)
                  or any(step.last.bronze_version < through for step in self.event_time)
                  or any(t.published < (table_version(spark, self.layout.table(name)) or 0)
                         for name, t in self.topics.items()))
        if behind:
            self.fenced()
            self.fold(spark, new_app_id(f"{self.spec.name}/catch-up"), 0)
        return behind


def new_tables(layout: StorageLayout, spec: StreamSpec, event_time: bool = True) -> list[NewTable]:
    """Every table a run of the stream writes (with `event_time`, its event-time tables too), as each is created
    when missing."""
    tables = bronze_tables(layout, spec)
    for table in spec.state_tables:
        tables.append(state_new_table(layout, table))
    for table in spec.event_time_tables if event_time else ():
        operator = windows if table.kind == "window" else sessions
        tables += event_time_new_tables(layout, spec, table, operator.state_schema(table))
    return tables


def _event_time_stages(spark: SparkSession, layout: StorageLayout, spec: StreamSpec,
                       settings: StreamSettings) -> list[EventTimeStage]:
    if not settings.event_time:
        return []
    return [(windows_stage if table.kind == "window" else sessions_stage)(spark, layout, spec, table)
            for table in spec.event_time_tables]


def _scan_continuously(spark: SparkSession, layout: StorageLayout, spec: StreamSpec, per_commit: int,
                       continuous: Continuous, changed: list[dict]) -> None:
    """The continuous run's landing scan: every trigger interval, record what arrived in the ledger, which the
    running query reads. A listing equal to the last one costs no Spark job.

    The query reads one ledger commit per micro-batch, and a batch costs seconds whatever it holds, so a commit
    per scan would fall behind files arriving every few seconds, for good. While the query has a commit it
    has not planned yet, nothing is recorded: what arrives meanwhile goes into one commit, the next batch."""
    landing, ledger, staging = layout.landing(spec.name), layout.table(spec.files_table), layout.staging(spec.name)
    checkpoint = layout.checkpoint(spec.name)
    last = None  # the first pass scans: a file may have arrived since the run's own scan
    view = None
    while not continuous.stop.wait(continuous.trigger_interval_s):
        try:
            listing = landing_listing(landing)
            if listing == last:
                continue
            planned = planned_source_version(checkpoint)
            if planned is not None and (table_version(spark, ledger) or 0) > planned:
                continue  # a backlog: wait for the query to take it
            view = view or LedgerView.read(ledger)
            scan = scan_landing(landing, ledger, staging, view)
            record_units(spark, ledger, scan.units, per_commit)
            view.add(scan.units)
            changed.extend(scan.changed)
            last = listing
        except BaseException as exc:  # noqa: BLE001 - handed to the run, which stops the query and raises it
            continuous.fail(exc)
            return


def advance_stream(spark: SparkSession, layout: StorageLayout, spec: StreamSpec,
                   settings: StreamSettings = StreamSettings(), *,
                   continuous: Continuous | None = None) -> StreamRunResult:
    """Take every landing file (and every change to one) not yet ingested through all of the stream's tables;
    with `continuous`, keep scanning the landing folder and folding what arrives until stopped."""
    started = time.monotonic()
    bronze_path, quarantine_path = layout.table(spec.bronze_table), layout.table(spec.quarantine_table)
    ledger_path, staging_dir = layout.table(spec.files_table), layout.staging(spec.name)
    checkpoint = layout.checkpoint(spec.name)
    names = stream_tables(spec, settings)
    require_writable([layout.locks, layout.tables_root, staging_dir, layout.checkpoints_root])
    with writer_lock(layout.locks, spec.name, settings.lock_timeout_s) as fence, storage_errors():
        create_tables_if_missing(spark, new_tables(layout, spec, settings.event_time))
        before = {name: table_version(spark, layout.table(name)) for name in names}
        states = [state_table_stage(spark, layout, spec, table) for table in spec.state_tables]
        event_time = _event_time_stages(spark, layout, spec, settings)
        if spec.topic is None:
            scan = scan_landing(layout.landing(spec.name), ledger_path, staging_dir)
            record_units(spark, ledger_path, scan.units, settings.max_files_per_trigger)
            source = table_id(spark, ledger_path)
        else:
            require_kafka_jars()
            topic_partitions(spec.topic)  # the brokers answer and the topic exists, before any query starts
            scan, source = ScanResult([], 0, []), source_id(spec.topic)
        verdict, moved = checkpoint_for_run(spark, checkpoint, layout.set_aside_checkpoints,
                                            [bronze_path], source_table_id=source,
                                            sometimes_written=[quarantine_path])
        origin, recovery = verdict.origin, None
        if origin is None:
            reason = verdict.problem or "no checkpoint yet"
            # Lines of the units recorded so far may already be in bronze or quarantine (written under
            # the checkpoint that was lost); units scanned later are new content.
            holds_lines = any(before[name] not in (None, 0) for name in (spec.bronze_table, spec.quarantine_table))
            origin = start_checkpoint(checkpoint, spec.name, reason, source_table_id=source,
                                      recheck_through_unit=scan.known_units + len(scan.units) - 1 if holds_lines
                                      else -1)
            if verdict.problem or moved:
                recovery = {"problem": reason, "set_aside": str(moved) if moved else None,
                            "action": "new checkpoint: every landing file is read again; lines already in "
                                      "bronze or quarantine are recognised by file and line number and skipped; "
                                      "the later tables resume from the bronze version each records"
                                      if spec.topic is None else
                                      "new checkpoint: the topic is read from the offsets bronze's newest commit "
                                      "records; records quarantine already holds are recognised by partition and "
                                      "offset and skipped; the later tables resume from the bronze version each "
                                      "records"}
        elif origin.recheck_through_unit is None:
            # A checkpoint started by an earlier version: units scanned from now on are new content.
            origin = replace(origin, recheck_through_unit=scan.known_units - 1)
            write_origin(checkpoint, origin)
        ingest = IngestSettings(spec=spec, bronze_path=str(bronze_path), quarantine_path=str(quarantine_path),
                                staging_dir=staging_dir, app_id=origin.app_id, horizon=spec.dedup_horizon,
                                max_ahead=spec.max_ahead, recheck_through_unit=origin.recheck_through_unit,
                                recheck_offsets=recorded_offsets(spark, quarantine_path, spec.topic)
                                if spec.topic is not None else None)
        topics = {table.name: changelog_topic_stage(layout, table, table_version(spark, layout.table(table.name)))
                  for table in spec.state_tables if table.changelog_topic is not None}
        batch = StreamBatch(layout, spec, ingest, states, event_time, fence, topics,
                            settings.large_from_bytes, settings.kept_on_disk_from_bytes)
        caught_up = batch.catch_up(spark)
        if spec.topic is None:
            # One ledger commit file per micro-batch, in unit order (record_units writes them that way).
            reader = spark.readStream.format("delta").option("maxFilesPerTrigger", "1")
            if not has_planned(checkpoint) and ledger_replayable(spark, ledger_path):
                reader = reader.option("startingVersion", "0")
            units = reader.load(str(ledger_path))
        else:
            # Read only without a checkpoint (Spark's own offsets win): where bronze's newest commit ends.
            units = topic_records(spark, spec.topic,
                                  starting_offsets(spec.topic, recorded_offsets(spark, bronze_path, spec.topic)))
        changed = list(scan.changed)
        scanner = None
        if continuous is not None and spec.topic is None:
            scanner = threading.Thread(target=_scan_continuously, name=f"{spec.name}-landing-scan", daemon=True,
                                       args=(spark, layout, spec, settings.max_files_per_trigger, continuous,
                                             changed))
            scanner.start()
        try:
            if continuous is None and spec.topic is None and read_through(checkpoint,
                                                                          table_version(spark, ledger_path)):
                batches = 0  # no new ledger commit since the last committed batch
            else:
                batches, _ = run_query(units, query_name=spec.name, checkpoint_dir=checkpoint, on_batch=batch,
                                       continuous=continuous)
        finally:
            if scanner is not None:
                continuous.stop.set()
                scanner.join()
            close_producers()
        # One recovery is shown: the checkpoint's first, then an event-time step's, then a state table's.
        recovered = next((step.recovered for step in event_time if step.recovered), None)
        if recovery is None and recovered:
            recovery = {**recovered, "set_aside": None}
        note = next((state.note for state in states if state.note), None)
        if recovery is None and note:
            recovery = {"problem": note.split(":")[0], "set_aside": None, "action": note}
        commits = {name: commits_since(spark, layout.table(name), before[name])
                   for name in (spec.bronze_table, *(t.name for t in spec.state_tables),
                                *(step.table.name for step in event_time))}
        return StreamRunResult(
            query_name=spec.name,
            micro_batches=batches + int(caught_up),
            rows_read=sum(int(c["user"].get("lines", 0)) for c in commits[spec.bronze_table]),
            duration_s=time.monotonic() - started,
            versions={name: TableVersions(before[name], table_version(spark, layout.table(name))) for name in names},
            commits=commits,
            recovery=recovery,
            changed_files=changed,
            built_through={state.table.name: state.rebuilt_through for state in states},
        )
