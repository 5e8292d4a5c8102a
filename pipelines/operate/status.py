"""Where every declared stream stands, for an operator: `statetables status [--json]`.

Per stream: the landing files the ledger does not hold yet (the next run's input), the last micro-batch (its
bronze commit: batch id, when, lines, accepted, quarantined), each table's version, what each step has folded
(the bronze version each state table and the event-time step recorded, the event-time watermark, the state
version each changelog covers), the quarantine by reason, the late events, the writer lock's holder. And the
engine runs use: the Spark Connect server in $STATETABLES_SPARK_REMOTE, and whether it answers, or embedded.

Read only: it creates no table, folder or lock file, and on a storage root where nothing ran it starts no Spark.
Cheap: versions, folded versions, the last batch and the watermark come from the tables' commit files
(pipelines/storage/delta_log.py `history_rows`); Spark runs three small queries: the ledger's newest row per file, the
quarantine grouped by reason, late_events counted by stream.

    >>> report = storage_status(StorageLayout.under("data"))
    >>> print(render(report))
"""

from __future__ import annotations

import os
from datetime import datetime, timezone
from typing import Callable

from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from pipelines.declare.project import streams
from pipelines.declare.specs import StreamSpec
from pipelines.errors import ConfigurationError, DefinitionChangedError
from pipelines.event_time import watermark
from pipelines.event_time.watermark import LATE
from pipelines.ingest.kafka_source import end_offsets, recorded_offsets
from pipelines.ingest.landing import LedgerView, unrecorded_files
from pipelines.runtime.checkpoints import read_through
from pipelines.operate.maintenance import stream_tables
from pipelines.runtime.locks import lock_state
from pipelines.runtime.spark import REMOTE_ENV, build_spark_session, engine_answers
from pipelines.state.changelog import COVERS, changelog_name, coverage_record
from pipelines.state.tables import folded_through
from pipelines.storage.delta_log import commit_metadata, history_rows, table_version
from pipelines.storage.layout import StorageLayout

PENDING_SHOWN = 20  # pending landing files named (all are counted)
LAST_BATCH_SEARCHED = 20  # newest bronze commits searched for the last micro-batch's


def _iso(epoch_ms: int | None) -> str | None:
    if epoch_ms is None:
        return None
    moment = datetime.fromtimestamp(epoch_ms / 1000, tz=timezone.utc)
    return moment.isoformat(timespec="seconds" if epoch_ms % 1000 == 0 else "milliseconds").replace("+00:00", "Z")


def engine_status() -> dict:
    """The engine runs use: {"engine": "connect" | "embedded", "remote", "answers" (None when embedded), "problem"}."""
    remote = os.environ.get(REMOTE_ENV, "").strip()
    if not remote:
        return {"engine": "embedded", "remote": None, "answers": None, "problem": None}
    try:
        answers = engine_answers(remote)
    except ConfigurationError as error:  # a malformed URL
        return {"engine": "connect", "remote": remote, "answers": False, "problem": str(error)}
    return {"engine": "connect", "remote": remote, "answers": answers,
            "problem": None if answers else f"nothing accepts connections at {remote}"}


def _landing(spark: SparkSession | None, layout: StorageLayout, spec: StreamSpec) -> dict:
    """Landing files (or changes to one) the ledger does not hold, and whether the query has read the whole ledger."""
    ledger = layout.table(spec.files_table)
    ledger_version = table_version(spark, ledger)
    pending = unrecorded_files(layout.landing(spec.name), LedgerView.read(ledger))
    return {
        "folder": str(layout.landing(spec.name)),
        "pending": len(pending),
        "pending_files": [{"path": path, "size": size, "modified_at": _iso(mtime_ns // 1_000_000)}
                          for mtime_ns, path, size in pending[:PENDING_SHOWN]],
        # Units recorded by a run's scan that the stream's query has not read yet (a run that died before them).
        "recorded_not_read": bool(ledger_version) and not read_through(layout.checkpoint(spec.name), ledger_version),
    }


def _topic(spark: SparkSession | None, layout: StorageLayout, spec: StreamSpec, ran: bool) -> dict:
    """A topic stream's input: the records after the offsets bronze's newest commit records (the next run's input)."""
    recorded = recorded_offsets(spark, layout.table(spec.bronze_table), spec.topic) if spark is not None and ran else {}
    try:
        ends, problem = end_offsets(spec.topic), None
    except ConfigurationError as error:  # the brokers are down: said, the rest of the status still shown
        ends, problem = {}, str(error)
    return {"topic": spec.topic.topic, "servers": spec.topic.servers, "problem": problem,
            "pending": sum(max(0, end - recorded.get(p, 0)) for p, end in ends.items()),
            "offsets_in_tables": {str(p): n for p, n in sorted(recorded.items())},
            "end_offsets": {str(p): n for p, n in sorted(ends.items())}}


def last_batch(spark: SparkSession, layout: StorageLayout, spec: StreamSpec) -> dict | None:
    """The newest micro-batch's bronze commit: its counts (pipelines/ingest/bronze.py `_write_batch`) and when."""
    for row in history_rows(spark, layout.table(spec.bronze_table), LAST_BATCH_SEARCHED):
        meta = commit_metadata(row)
        if "batch_id" in meta and "lines" in meta:
            return {"batch_id": int(meta["batch_id"]), "app_id": meta.get("app_id"), "bronze_version": row["version"],
                    "committed_at": _iso(row.get("timestamp_ms")),
                    **{k: int(meta.get(k, 0)) for k in ("files", "lines", "accepted", "quarantined", "duplicates")}}
    return None


def _event_time(spark: SparkSession | None, layout: StorageLayout, spec: StreamSpec) -> dict[str, dict]:
    """Each windowed and session table's progress: the bronze version and watermark its newest closing commit
    recorded."""
    found = {}
    for table in spec.event_time_tables:
        entry = found[table.name] = {"bronze_version": None, "watermark": None, "problem": None}
        if spark is None or table_version(spark, layout.table(table.name)) is None:
            continue
        try:
            progress = watermark.last_progress(spark, table, layout)
        except DefinitionChangedError as error:  # written by an earlier statetables: the message names the fix
            entry["problem"] = str(error)
            continue
        if progress is not None:
            # A watermark of 0: no event seen yet.
            entry.update(bronze_version=progress.bronze_version if progress.bronze_version >= 0 else None,
                         watermark=_iso(progress.watermark_ms) if progress.watermark_ms > 0 else None)
    return found


def _folded(spark: SparkSession | None, layout: StorageLayout, spec: StreamSpec) -> dict:
    """What each step after bronze has folded, from its newest commits (all None when `spark` is: nothing ran)."""
    state_tables = {}
    for table in spec.state_tables:
        folded = folded_through(spark, layout.table(table.name)) if spark is not None else None
        state_tables[table.name] = {"bronze_version": folded.through if folded else None,
                                    "restored_to": folded.restored_to if folded else None}
    changelogs = {}
    for table in spec.state_tables:
        record = coverage_record(spark, layout.table(changelog_name(table))) if spark is not None else None
        changelogs[changelog_name(table)] = {"state_table": table.name,
                                             "state_version": int(record[COVERS]) if record else None}
    return {"state_tables": state_tables, "event_time": _event_time(spark, layout, spec), "changelogs": changelogs}


def stream_status(spark: SparkSession | None, layout: StorageLayout, spec: StreamSpec,
                  late_by_stream: dict[str, int] | None) -> dict:
    """One stream's status; `spark` None when no table of the storage root exists (nothing is read then)."""
    bronze_path = layout.table(spec.bronze_table)
    ran = table_version(spark, bronze_path) is not None
    report = {
        "ran": ran,
        **({"landing": _landing(spark, layout, spec)} if spec.topic is None else
           {"topic": _topic(spark, layout, spec, ran)}),
        "last_batch": None,
        "tables": {name: table_version(spark, layout.table(name)) for name in stream_tables(spec)},
        "folded": _folded(spark if ran else None, layout, spec),
        "quarantine_by_reason": {},
        "late_events": None if late_by_stream is None else late_by_stream.get(spec.name, 0),
        "writer_lock": lock_state(layout.locks, spec.name),
    }
    if not ran or spark is None:
        return report
    report["last_batch"] = last_batch(spark, layout, spec)
    quarantine = layout.table(spec.quarantine_table)
    if table_version(spark, quarantine) is not None:
        reasons = (spark.read.format("delta").load(str(quarantine)).groupBy("reason").count()
                   .orderBy(F.desc("count"), "reason").collect())
        report["quarantine_by_reason"] = {r["reason"]: r["count"] for r in reasons}
    return report


def storage_status(layout: StorageLayout, specs: dict[str, StreamSpec] | None = None,
                   spark_session: Callable[[], SparkSession] = build_spark_session) -> dict:
    """Every declared stream's status, the engine's, as one JSON-ready document with stable keys. `spark_session`
    is called only if some table exists (an untouched storage root starts no JVM)."""
    specs = streams() if specs is None else specs
    names = {LATE, *(name for spec in specs.values() for name in stream_tables(spec))}
    spark = spark_session() if any(table_version(None, layout.table(n)) is not None for n in names) else None
    late_by_stream = None
    if spark is not None and table_version(spark, layout.table(LATE)) is not None:
        rows = spark.read.format("delta").load(str(layout.table(LATE))).groupBy("stream").count().collect()
        late_by_stream = {r["stream"]: r["count"] for r in rows}
    by_stream = {name: stream_status(spark, layout, spec, late_by_stream) for name, spec in specs.items()}
    return {
        "storage_root": str(layout.home),
        "nothing_run_yet": not any(s["ran"] for s in by_stream.values()),
        "engine": engine_status(),
        "streams": by_stream,
    }


def _version(value: int | None) -> str:
    return "-" if value is None else f"v{value}"


def _engine_line(engine: dict) -> str:
    if engine["engine"] == "embedded":
        return f"embedded: each run starts a JVM of its own (${REMOTE_ENV} unset)"
    if engine["answers"]:
        return f"Spark Connect {engine['remote']} (${REMOTE_ENV}): answers"
    return (f"Spark Connect {engine['remote']} (${REMOTE_ENV}): DOES NOT ANSWER ({engine['problem']}). Fix: start it "
            f"(`make dev` / `make serve` supervise one; alone, `make connect-server`), or unset {REMOTE_ENV}")


def _lock_line(lock: dict) -> str:
    who = f"pid {lock['pid']}" + (f" on {lock['host']}" if lock["host"] else "") + f" since {lock['since']}" \
        if lock["pid"] is not None else None
    if lock["held"]:
        return f"HELD by {who or 'a run that has not written its name yet'}: a run is advancing the stream"
    return f"free (last held by {who})" if who else "free"


def _stream_lines(name: str, report: dict) -> list[str]:
    lines = [name]
    if "topic" in report:
        topic = report["topic"]
        pending = (topic["problem"] if topic["problem"] else
                   f"{topic['pending']} record(s) not ingested yet" if topic["pending"] else "nothing new")
        lines.append(f"  {'topic':<13}{pending}  ({topic['topic']} on {topic['servers']})")
        return lines + _stream_rest(name, report)
    landing = report["landing"]
    pending = f"{landing['pending']} landing file(s) not ingested yet" if landing["pending"] else "nothing new"
    if landing["recorded_not_read"]:
        pending += "; the ledger holds content the query has not read yet (the next run reads it)"
    lines.append(f"  {'landing':<13}{pending}  ({landing['folder']})")
    lines += [f"  {'':<13}  {f['path']}  ({f['size']} bytes, {f['modified_at']})" for f in landing["pending_files"]]
    if landing["pending"] > len(landing["pending_files"]):
        lines.append(f"  {'':<13}  ... and {landing['pending'] - len(landing['pending_files'])} more")
    return lines + _stream_rest(name, report)


def _stream_rest(name: str, report: dict) -> list[str]:
    lines = []
    if not report["ran"]:
        lines.append(f"  {'tables':<13}none yet: the stream has not run")
    batch = report["last_batch"]
    if batch:
        lines.append(f"  {'last batch':<13}{batch['batch_id']} at {batch['committed_at']} (bronze "
                     f"{_version(batch['bronze_version'])}): {batch['lines']} lines, {batch['accepted']} accepted, "
                     f"{batch['quarantined']} quarantined, {batch['duplicates']} duplicates, {batch['files']} file(s)")
    elif report["ran"]:
        lines.append(f"  {'last batch':<13}none yet")
    lines.append(f"  {'writer lock':<13}{_lock_line(report['writer_lock'])}")
    if report["ran"]:
        lines += _table_lines(report, f"{name}_bronze")
        reasons = report["quarantine_by_reason"]
        lines.append(f"  {'quarantine':<13}" + (", ".join(f"{reason} {count}" for reason, count in reasons.items())
                                                  + " (all time)" if reasons else "empty"))
        if report["late_events"] is not None:
            lines.append(f"  {'late events':<13}{report['late_events']} (behind a windowed or session table's "
                         f"watermark, in late_events; still counted in the state tables)")
    return lines


def _table_lines(report: dict, bronze_table: str) -> list[str]:
    """Each table's version and, for the steps after bronze, what it has folded (BEHIND: not all of it yet)."""
    tables, folded = report["tables"], report["folded"]
    bronze = tables[bronze_table]
    notes: dict[str, str] = {}

    def folded_note(through: int | None) -> str:
        if through is None:
            return "folded: nothing recorded"
        return f"folded bronze {_version(through)}" + ("" if bronze is None or through >= bronze else "  BEHIND")

    for table, found in folded["state_tables"].items():
        notes[table] = folded_note(found["bronze_version"]) + (
            f" (restored to v{found['restored_to']})" if found["restored_to"] is not None else "")
    for table, found in folded["event_time"].items():
        notes[table] = (f"PROBLEM: {found['problem']}" if found["problem"] else folded_note(found["bronze_version"])
                        + f", watermark {found['watermark'] or 'none yet'}")
    for changelog, found in folded["changelogs"].items():
        state = tables.get(found["state_table"])
        covers = found["state_version"]
        publish = "statetables run --job publish_changelogs"
        notes[changelog] = (f"not published yet ({publish})" if covers is None else
                            f"covers {found['state_table']} {_version(covers)}"
                            + ("" if state is None or covers >= state else
                               f", {state - covers} newer versions to publish ({publish})"))
    width = max(len(name) for name in tables)
    lines = [f"  {'tables':<13}{'':<{width}}  version"]
    for name, version in tables.items():
        lines.append(f"  {'':<13}{name:<{width}}  {_version(version):>7}  {notes.get(name, '')}".rstrip())
    return lines


def render(report: dict) -> str:
    """The report as aligned text, for a person."""
    lines = [f"statetables status of {report['storage_root']}",
             f"{'engine':<15}{_engine_line(report['engine'])}"]
    if report["nothing_run_yet"]:
        lines.append("nothing run yet: no stream has tables under this storage root")
    for name, stream in report["streams"].items():
        lines += ["", *_stream_lines(name, stream)]
    return "\n".join(lines)
