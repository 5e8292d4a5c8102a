"""Deciding whether a streaming checkpoint can be trusted, and starting a fresh one when it cannot.

A checkpoint is trusted only if its files are whole and it agrees with what the Delta tables record
about the micro-batches it wrote. Every commit a query makes carries `{"app_id", "batch_id"}` in
its userMetadata, and every micro-batch commits (even an empty one), so for a healthy checkpoint

    last committed batch  <=  last batch found in each written table  <=  last planned batch

Anything else (checkpoint deleted, truncated, garbage, copied from an older backup, or a table
restored behind it) sets the checkpoint aside and starts a fresh one under a new app id; the
callers then make the fresh start exact from table contents (see docs/recovery.md).

Spark has no public API to validate a checkpoint, so its few files are checked here by hand:
Hadoop's .crc side files (CRC32 per 512-byte chunk) and the "v1" + JSON line layout.
"""

from __future__ import annotations

import json
import os
import struct
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

from pyspark.sql import SparkSession

from pipelines.storage import files
from pipelines.storage.delta_log import commit_metadata, history_rows, new_app_id, table_version
from pipelines.storage.files import AnyPath

ORIGIN_FILE = "statetables_checkpoint.json"
HISTORY_WINDOW = 1000  # newest table commits searched for this checkpoint's last batch
RECENT_WINDOW = 20  # searched first


@dataclass(frozen=True)
class CheckpointOrigin:
    """Written by statetables into every checkpoint it starts, before Spark writes anything."""

    app_id: str  # named by every commit made from this checkpoint (with its batch id)
    first_batch: int  # batches below this were written under an earlier app id (savepoint restore)
    created_at: str
    reason: str
    source_start_version: int | None = None  # a query over a Delta table: the first version to read
    source_table_id: str | None = None  # the source Delta table's id (the stream's landing ledger)
    # Ingest: landing units up to this number may hold lines an earlier checkpoint already wrote, so
    # their lines are looked up in bronze and quarantine; later units are new. None: look up all.
    recheck_through_unit: int | None = None
    # Written by an earlier statetables (its windows query); read, never used.
    closed_through_ms: int | None = None


@dataclass(frozen=True)
class CheckpointVerdict:
    origin: CheckpointOrigin | None  # None: start a fresh checkpoint
    problem: str | None  # why the checkpoint was not trusted (None: trusted, or there was none)
    last_commit: int | None = None


def _batch_files(folder: Path) -> dict[int, Path]:
    if not folder.is_dir():
        return {}
    return {int(p.name.split(".")[0]): p for p in folder.iterdir()
            if not p.name.startswith(".") and p.name.split(".")[0].isdigit()}


def _crc_problem(path: Path) -> str | None:
    crc = path.with_name(f".{path.name}.crc")
    if not crc.exists():
        return None
    data, sums = path.read_bytes(), crc.read_bytes()
    if len(sums) < 8 or sums[:4] != b"crc\x00":
        return f"{crc} is not a checksum file"
    chunk = struct.unpack(">i", sums[4:8])[0]
    expected = [struct.unpack(">I", sums[i:i + 4])[0] for i in range(8, len(sums) - 3, 4)]
    actual = [zlib.crc32(data[i:i + chunk]) for i in range(0, len(data), chunk)]
    return None if expected == actual else f"{path} does not match its checksum (truncated or overwritten)"


def _log_file_problem(path: Path, *, lines_at_least: int) -> str | None:
    """Spark's metadata logs: a version line `v<N>`, then one JSON value (or `-`) per line."""
    problem = _crc_problem(path)
    if problem:
        return problem
    try:
        text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError) as exc:
        return f"{path} is unreadable: {exc}"
    lines = text.removeprefix("\x00").split("\n")  # the Kafka source's first file: `_source_offset`
    lines = [line for line in lines if line != ""]
    if len(lines) < lines_at_least or not lines[0].startswith("v") or not lines[0][1:].isdigit():
        return f"{path} is truncated or not a Spark checkpoint file"
    for line in lines[1:]:
        if line == "-":
            continue
        try:
            json.loads(line)
        except ValueError:
            return f"{path} holds a line that is not JSON: {line[:80]!r}"
    return None


def read_origin(checkpoint_dir: Path) -> CheckpointOrigin | None:
    try:
        return CheckpointOrigin(**json.loads((checkpoint_dir / ORIGIN_FILE).read_text()))
    except (FileNotFoundError, ValueError, TypeError):
        return None


def start_checkpoint(checkpoint_dir: Path, query_name: str, reason: str, *, first_batch: int = 0,
                     source_start_version: int | None = None, source_table_id: str | None = None,
                     app_id: str | None = None, recheck_through_unit: int | None = None) -> CheckpointOrigin:
    """Write the origin record of a checkpoint (atomically); Spark fills in the rest on first start."""
    origin = CheckpointOrigin(
        app_id=app_id or new_app_id(query_name),
        first_batch=first_batch,
        created_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        reason=reason,
        source_start_version=source_start_version,
        source_table_id=source_table_id,
        recheck_through_unit=recheck_through_unit,
    )
    write_origin(checkpoint_dir, origin)
    return origin


def write_origin(checkpoint_dir: AnyPath, origin: CheckpointOrigin) -> None:
    files.write_atomic(checkpoint_dir / ORIGIN_FILE, (json.dumps(asdict(origin), indent=1) + "\n").encode())


def set_aside(checkpoint_dir: Path, set_aside_root: Path) -> Path | None:
    """Move an untrusted checkpoint out of the way, kept for inspection (never deleted here)."""
    if not checkpoint_dir.exists():
        return None
    set_aside_root.mkdir(parents=True, exist_ok=True)
    target = set_aside_root / f"{checkpoint_dir.name}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{os.getpid()}"
    files.replace(checkpoint_dir, target)
    return target


def table_batches(spark: SparkSession, table_path: Path, app_id: str) -> tuple[int | None, int | None]:
    """(last batch of `app_id` the table ever committed, last one still in effect after RESTOREs).

    A Delta RESTORE leaves the commits it undoes in the log: a batch undone by a restore would be found
    there and skipped as "already written" if replayed under the same app id, so the two numbers
    differing is itself a reason to start over under a new app id.
    """
    if table_version(spark, table_path) is None:
        return None, None
    # A healthy checkpoint's last batch is among the newest commits: most runs read only a few.
    for window in (RECENT_WINDOW, HISTORY_WINDOW):
        rows = history_rows(spark, table_path, window)
        found = _last_batches(rows, app_id)
        if found[1] is not None or len(rows) < window:
            return found
    return found


def _last_batches(rows: list, app_id: str) -> tuple[int | None, int | None]:
    """table_batches over `rows`, newest first. Only RESTOREs newer than a batch can undo it, so a
    window that holds an in-effect batch holds everything that decides about it."""
    undone: list[tuple[int, int]] = []  # (restored-to version, version of the RESTORE commit)
    ever = None
    for row in rows:
        if row["operation"] == "RESTORE":
            target = (row["operationParameters"] or {}).get("version")
            # A restore by timestamp names no version: treat everything before it as undone (safe side).
            undone.append((int(target) if target not in (None, "") else -1, row["version"]))
            continue
        meta = commit_metadata(row)
        if meta.get("app_id") != app_id or meta.get("batch_id") is None:
            continue
        batch = int(meta["batch_id"])
        ever = batch if ever is None else ever
        if not any(to < row["version"] < at for to, at in undone):
            return ever, batch
    return ever, None


def verify_checkpoint(spark: SparkSession, checkpoint_dir: Path, written_tables: list[Path], *,
                      source_table_id: str | None = None, sometimes_written: list[Path] = ()) -> CheckpointVerdict:
    """Trust the checkpoint, or say precisely why not. Reads only; changes nothing. Every batch commits to each of
    `written_tables` (bronze); only some to each of `sometimes_written` (quarantine: a batch with a bad line)."""
    offsets, commits = _batch_files(checkpoint_dir / "offsets"), _batch_files(checkpoint_dir / "commits")
    origin = read_origin(checkpoint_dir)
    if not checkpoint_dir.exists():
        return CheckpointVerdict(None, None)
    if origin is None:
        if not offsets and not commits:
            return CheckpointVerdict(None, None)  # a start that died before its first batch
        return CheckpointVerdict(None, f"{checkpoint_dir / ORIGIN_FILE} is missing or unreadable")

    if offsets or commits:
        metadata = checkpoint_dir / "metadata"  # one JSON object: the query id
        try:
            problem = _crc_problem(metadata) or (None if "id" in json.loads(metadata.read_text()) else "no id")
        except (OSError, ValueError, TypeError) as exc:
            problem = f"{metadata} is missing or unreadable: {exc}"
        if problem:
            return CheckpointVerdict(None, problem)
    files = [(p, 3) for p in offsets.values()] + [(p, 2) for p in commits.values()]
    for source_log in (checkpoint_dir / "sources").glob("*"):
        files += [(p, 1) for p in _batch_files(source_log).values()]
    for path, lines in files:
        if not path.exists():
            return CheckpointVerdict(None, f"{path} is missing")
        problem = _log_file_problem(path, lines_at_least=lines)
        if problem:
            return CheckpointVerdict(None, problem)

    last_offset = max(offsets, default=None)
    last_commit = max(commits, default=None)
    if last_commit is not None and (last_offset is None or last_commit > last_offset):
        return CheckpointVerdict(None, f"batch {last_commit} is committed but was never planned (offsets lost)")
    if source_table_id is not None:
        if origin.source_table_id not in (None, source_table_id):
            return CheckpointVerdict(None, "the source table was re-created since this checkpoint started")
        if last_offset is not None and not source_table_id.startswith("kafka:"):  # a topic's offsets: Spark checks
            source_offset = _source_offset(offsets[last_offset])
            if "reservoirId" not in source_offset:
                # An ingest checkpoint of the landing folder itself, from before the landing ledger.
                return CheckpointVerdict(None, "the checkpoint reads another kind of source (an earlier version "
                                               "of statetables read the landing folder directly)")
            if source_offset["reservoirId"] != source_table_id:
                return CheckpointVerdict(None, "the checkpoint reads a different (older) source table")

    # Batches below first_batch belong to an earlier app id (a restored savepoint). A rebuilt start
    # records its rebuild commit as batch first_batch - 1, so that commit must still be in effect.
    done = last_commit if last_commit is not None and last_commit >= origin.first_batch else None
    planned = last_offset if last_offset is not None and last_offset >= origin.first_batch else origin.first_batch - 1
    for table in [*written_tables, *sometimes_written]:
        ever, in_effect = table_batches(spark, table, origin.app_id)
        if ever != in_effect:
            return CheckpointVerdict(None, f"{table.name} was restored to before batch {ever} of this checkpoint")
        if ever is not None and ever > planned:
            return CheckpointVerdict(
                None, f"{table.name} holds batch {ever} but the checkpoint planned only up to {planned} "
                      f"(checkpoint older than the table)")
        if table not in written_tables:
            continue
        if ever is None and origin.source_start_version is not None:
            return CheckpointVerdict(None, f"{table.name} no longer holds the rebuild this checkpoint starts from")
        if done is not None and (ever is None or ever < done):
            return CheckpointVerdict(
                None, f"the checkpoint finished batch {done} but {table.name} holds batches only up to {ever} "
                      f"(table replaced or rolled back)")
    return CheckpointVerdict(origin, None, last_commit)


def checkpoint_for_run(spark: SparkSession, checkpoint_dir: Path, set_aside_root: Path, written_tables: list[Path],
                       *, source_table_id: str | None = None, sometimes_written: list[Path] = ()
                       ) -> tuple[CheckpointVerdict, Path | None]:
    """Verify; if untrusted, move it aside. Returns the verdict and where the old checkpoint went."""
    verdict = verify_checkpoint(spark, checkpoint_dir, written_tables, source_table_id=source_table_id,
                                sometimes_written=sometimes_written)
    moved = None
    if verdict.origin is None and checkpoint_dir.exists():
        moved = set_aside(checkpoint_dir, set_aside_root)
    return verdict, moved


def has_planned(checkpoint_dir: Path) -> bool:
    """Whether the query planned a batch under this checkpoint: from then on its offsets say where it resumes, and a
    source's starting options are not read."""
    return bool(_batch_files(checkpoint_dir / "offsets"))


def planned_source_version(checkpoint_dir: Path) -> int | None:
    """The newest source Delta version that the query's newest planned batch (its offset log, written
    before the batch runs) reads whole; None before the first batch or when it stops inside a version."""
    offsets = _batch_files(checkpoint_dir / "offsets")
    if not offsets:
        return None
    try:
        return batch_end_version(checkpoint_dir, max(offsets))
    except (OSError, ValueError, IndexError, KeyError):
        return None


def read_through(checkpoint_dir: Path, source_version: int | None) -> bool:
    """Whether the query's newest batch is committed and read the source whole through `source_version`: then an
    availableNow query would find nothing to do, and need not be started (its start alone is ~1.3 s over Connect)."""
    offsets, commits = _batch_files(checkpoint_dir / "offsets"), _batch_files(checkpoint_dir / "commits")
    planned = planned_source_version(checkpoint_dir)
    return (source_version is not None and planned is not None and max(offsets) in commits
            and planned >= source_version)


def _source_offset(path: AnyPath) -> dict:
    """The source's offset a checkpoint file records: an offset log's third line (after its version and the batch's
    metadata), or a source's initial offsets file's second. The Kafka source writes that file after a zero byte
    (KafkaSourceInitialOffsetWriter, SPARK-19517)."""
    lines = path.read_text().removeprefix("\x00").split("\n")
    return json.loads(lines[2 if path.parent.name == "offsets" else 1])


def batch_source_offsets(checkpoint_dir: AnyPath, batch_id: int) -> tuple[dict, dict] | None:
    """Where the query's source starts and ends `batch_id`, as its checkpoint records them before the batch runs (a
    Kafka source's `{topic: {partition: offset}}` each): the start is the end of the batch before it, or for batch
    0 the offsets the query started from (its source's first file). None when either cannot be read."""
    try:
        start = _source_offset(checkpoint_dir / "offsets" / str(batch_id - 1) if batch_id > 0
                               else checkpoint_dir / "sources" / "0" / "0")
        return start, _source_offset(checkpoint_dir / "offsets" / str(batch_id))
    except (OSError, ValueError, IndexError):
        return None


def batch_end_version(checkpoint_dir: Path, batch_id: int) -> int | None:
    """The newest source Delta version `batch_id` read whole (end offset `reservoirVersion`, `index -1`);
    None if the batch stopped inside a version."""
    offset = _source_offset(checkpoint_dir / "offsets" / str(batch_id))
    return int(offset["reservoirVersion"]) - 1 if offset.get("index") == -1 else None
