"""Landing files → a ledger of the content that arrived → raw lines with file, line number and bytes.

Spark's file source cannot be pointed at the landing folder as it is: it reads every name as a
glob pattern (`[x]`, `{a,b}` and `*` read other files twice), Hadoop rejects names with `:`, it does
not descend into date folders, and it never looks at a file again once listed (an append or a
rewrite would be lost without a word). So the landing folder is scanned here, in plain Python (on an object
store, with its own listing: pipelines/storage/files.py):

- every new piece of content becomes a *unit* (a new file, the bytes appended to a file, or the new
  content of a file rewritten under the same name) with a row in the stream's ledger table
  `<stream>_files` (size, modification time, sha256, lines) and a symlink under a safe name in
  `staging/<stream>/` (on an object store, a server-side copy); names are only ever compared, never interpreted;
- the ingest query streams the ledger (a Delta source, so each unit is planned exactly once per
  checkpoint) and reads each unit's link by exact path, keeping the unit's byte range only.

A line is identified by its file and line number: appended lines continue the file's numbering; a
rewritten file's content is version 2, 3, … and its lines are labelled `<path>#v<N>`.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from datetime import datetime, timezone

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import (
    ArrayType, BinaryType, BooleanType, IntegerType, LongType, StringType, StructField, StructType, TimestampType,
)

from pipelines.errors import ConfigurationError
from pipelines.ingest.jvm import register_jvm_function
from pipelines.storage import files
from pipelines.storage.delta_log import history_rows, table_version
from pipelines.storage.delta_rs import delta_table
from pipelines.storage.frames import frame_of_rows

LANDING_SUFFIXES = (".jsonl", ".jsonl.gz")
READ_CHUNK = 1 << 20

LEDGER_SCHEMA = StructType([
    StructField("unit", LongType(), nullable=False),
    StructField("source_file", StringType(), nullable=False),  # the landing file's real path
    StructField("file_version", IntegerType(), nullable=False),  # 1, then +1 per rewrite
    StructField("change", StringType(), nullable=False),  # new | appended | rewritten | touched
    StructField("staged_name", StringType()),  # link under staging/<stream>/; NULL: nothing to read
    StructField("compressed", BooleanType(), nullable=False),
    StructField("byte_offset", LongType(), nullable=False),  # the unit's bytes in the file
    StructField("byte_length", LongType(), nullable=False),
    StructField("first_line", LongType(), nullable=False),  # line number of the unit's first line
    StructField("file_size", LongType(), nullable=False),  # the whole file when scanned
    StructField("file_mtime_ns", LongType(), nullable=False),
    StructField("file_modified_at", TimestampType(), nullable=False),
    StructField("sha256", StringType(), nullable=False),  # of the whole file when scanned
    StructField("newlines", LongType()),  # '\n' bytes in the whole file (NULL for gzip)
    StructField("ends_with_newline", BooleanType()),
    StructField("scanned_at", TimestampType(), nullable=False),
])


# What a scan compares a file with: its newest unit's size, time, content and line count.
VIEW_COLUMNS = ["unit", "source_file", "file_version", "file_size", "file_mtime_ns", "sha256", "newlines",
                "ends_with_newline"]


def is_landing_name(name: str) -> bool:
    return name.endswith(LANDING_SUFFIXES) and not name.startswith(files.IN_FLIGHT_PREFIXES)


@dataclass
class ScanResult:
    units: list[dict]  # new ledger rows, in arrival order
    known_units: int  # units recorded in the ledger before this scan (their numbers are 0 .. known_units - 1)
    changed: list[dict]  # {"file", "change", "version"} for files appended to or rewritten after ingestion


def _digest(path: files.AnyPath, prefix: int | None) -> tuple[str, str | None, int, bool]:
    """(sha256 of the file, sha256 of its first `prefix` bytes, newlines, ends with a newline)."""
    whole, head, newlines, last = hashlib.sha256(), None, 0, b""
    read = 0
    with path.open("rb") as handle:
        while chunk := handle.read(READ_CHUNK):
            if prefix is not None and head is None and read + len(chunk) >= prefix:
                cut = prefix - read
                whole.update(chunk[:cut])
                head = whole.copy()
                whole.update(chunk[cut:])
            else:
                whole.update(chunk)
            newlines += chunk.count(b"\n")
            last = chunk[-1:]
            read += len(chunk)
    if prefix == 0:
        head = hashlib.sha256()
    return whole.hexdigest(), head.hexdigest() if head else None, newlines, last == b"\n"


@dataclass
class LedgerView:
    """The newest ledger row of every file, and the next unit number. Read from the ledger in this process (delta-rs:
    a Spark job cost ~0.7 s of every warm run); a continuous run's scanner, the ledger's one writer, keeps it
    current with `add` instead of reading it again on every scan."""

    latest: dict[str, dict]
    next_unit: int

    @classmethod
    def read(cls, ledger_path: files.AnyPath) -> "LedgerView":
        table = delta_table(ledger_path)
        rows = table.to_pyarrow_table(columns=VIEW_COLUMNS).to_pylist() if table is not None else []
        latest: dict[str, dict] = {}
        for row in rows:
            if row["source_file"] not in latest or row["unit"] > latest[row["source_file"]]["unit"]:
                latest[row["source_file"]] = row
        return cls(latest, max((r["unit"] for r in rows), default=-1) + 1)

    def has_seen(self, path: str, size: int, mtime_ns: int) -> bool:
        """Whether the file's newest ledger row has this size and modification time: nothing new to read."""
        before = self.latest.get(path)
        return before is not None and (before["file_size"], before["file_mtime_ns"]) == (size, mtime_ns)

    def add(self, units: list[dict]) -> None:
        for unit in units:
            self.latest[unit["source_file"]] = unit
            self.next_unit = max(self.next_unit, unit["unit"] + 1)


def landing_listing(landing_dir: files.AnyPath) -> list[tuple[int, str, int]]:
    """(mtime_ns, path, size) of every complete landing file at any depth, in arrival order; names and folders
    starting with `_` or `.` are still being written. Costs no Spark job (on S3: one listing, no request per file):
    a continuous run compares it with the previous one before it scans (pipelines/runtime/continuous.py)."""
    return sorted((stat.st_mtime_ns, str(path), stat.st_size) for path, stat in files.walk(landing_dir)
                  if is_landing_name(path.name))


def unrecorded_files(landing_dir: files.AnyPath, view: LedgerView) -> list[tuple[int, str, int]]:
    """(mtime_ns, path, size) of the landing files, or the changes to one, that the ledger does not hold yet: what
    the next scan records and the next run ingests. Reads no file."""
    return [(mtime_ns, name, size) for mtime_ns, name, size in landing_listing(landing_dir)
            if not view.has_seen(name, size, mtime_ns)]


def waiting_bytes(landing_dir: files.AnyPath, ledger_path: files.AnyPath) -> int:
    """The bytes of the landing files (or the changes to one, counted whole) the ledger does not hold yet: about what
    the next run reads. No JVM: `statetables run` asks before it starts one."""
    return sum(size for _, _, size in unrecorded_files(landing_dir, LedgerView.read(ledger_path)))


def scan_landing(landing_dir: files.AnyPath, ledger_path: files.AnyPath, staging_dir: files.AnyPath,
                 view: LedgerView | None = None) -> ScanResult:
    """Find the content that arrived since the last scan, link it under staging names; returns the new
    ledger rows (not yet committed: `record_units` does that, after the links exist).

    Files are taken in arrival order (modification time, then path); a file whose size and
    modification time are unchanged is not read again.
    """
    if landing_dir.exists() and not landing_dir.is_dir():
        raise ConfigurationError(f"The landing folder {landing_dir} is a file. Fix: move it away; landing files go "
                                 f"inside that folder (any depth).")
    landing_dir.mkdir(parents=True, exist_ok=True)
    view = view or LedgerView.read(ledger_path)
    latest, next_unit = view.latest, view.next_unit
    known = next_unit
    found = landing_listing(landing_dir)
    staging_dir.mkdir(parents=True, exist_ok=True)
    units, changed = [], []
    scanned_at = time.time()
    for mtime_ns, name, size in found:
        if view.has_seen(name, size, mtime_ns):
            continue
        before = latest.get(name)
        compressed = name.endswith(".gz")
        prefix = before["file_size"] if before is not None and size >= before["file_size"] else None
        try:
            sha, head, newlines, ends_nl = _digest(files.storage_path(name), prefix)
        except FileNotFoundError:
            continue
        version, offset, first_line, change = 1, 0, 1, "new"
        if before is not None:
            version = before["file_version"]
            if size == before["file_size"] and sha == before["sha256"]:
                change = "touched"  # same content, new modification time: nothing to read
                offset, first_line = size, (before["newlines"] or 0) + 1
            elif (not compressed and head == before["sha256"] and before["ends_with_newline"]):
                change, offset, first_line = "appended", before["file_size"], before["newlines"] + 1
            else:
                change, version = "rewritten", version + 1
            if change != "touched":
                changed.append({"file": name, "change": change, "version": version})
        length = size - offset
        staged = None
        if length > 0:
            staged = f"{next_unit:012d}{'.jsonl.gz' if compressed else '.jsonl'}"
            # A leftover of a scan that died before its ledger commit carries the same unit number and is replaced.
            files.stage(name, staging_dir / staged)
        units.append({
            "unit": next_unit, "source_file": name, "file_version": version, "change": change,
            "staged_name": staged, "compressed": compressed, "byte_offset": offset, "byte_length": length,
            "first_line": first_line, "file_size": size, "file_mtime_ns": mtime_ns,
            "file_modified_at": _utc(mtime_ns / 1e9), "sha256": sha,
            "newlines": None if compressed else newlines, "ends_with_newline": None if compressed else ends_nl,
            "scanned_at": _utc(scanned_at),
        })
        next_unit += 1
    return ScanResult(units, known, changed)


def _utc(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, tz=timezone.utc)


def record_units(spark: SparkSession, ledger_path: files.AnyPath, units: list[dict], per_commit: int) -> None:
    """Append the scanned units to the ledger, `per_commit` units per commit: the ingest query's
    Delta source then plans at most one commit's file per micro-batch, in unit order."""
    for start in range(0, len(units), per_commit):
        chunk = units[start:start + per_commit]
        frame_of_rows(spark, [tuple(u[f] for f in LEDGER_SCHEMA.fieldNames()) for u in chunk], LEDGER_SCHEMA) \
            .coalesce(1).write.format("delta").mode("append").save(str(ledger_path))


# A new checkpoint reads a ledger of at most this many commits commit by commit from its first (each commit's
# JSON file, no Spark job), instead of as an initial snapshot (a Spark job listing it: 0.5–1.0 s of every first
# run). A longer ledger's snapshot, read from its Delta checkpoint, costs less than its commits one by one.
REPLAYABLE_LEDGER_COMMITS = 20


def ledger_replayable(spark: SparkSession, ledger_path: files.AnyPath) -> bool:
    """Whether a new query may read the ledger from version 0 and plan exactly the units its snapshot holds: every
    commit since its creation is still in the log and is an append (no OPTIMIZE since, whose compacted files VACUUM
    may have removed, and no row removed). Read from the log's commit files (`history_rows`), no Spark job."""
    latest = table_version(spark, ledger_path)
    if latest is None or latest > REPLAYABLE_LEDGER_COMMITS:
        return False
    history = history_rows(spark, ledger_path, latest=latest)
    return (len(history) == latest + 1
            and all(entry["operation"] == "CREATE TABLE"
                    or (entry["operation"] == "WRITE" and entry["operationParameters"].get("mode") == "Append")
                    for entry in history))


# jvm/src/statetables/jvm/SplitLines.java: a unit's bytes as its lines' bytes.
SPLITTER = "statetables_split_lines"
SPLITTER_CLASS = "statetables.jvm.SplitLines"
GZIP_RATIO = 10  # a compressed unit's landing bytes count this many times its size


@dataclass(frozen=True)
class BatchUnits:
    """A micro-batch of ledger units, and the few columns the driver needs of them, read in the batch's one Spark
    job over the ledger: which links to read, and how many landing bytes they hold."""

    frame: DataFrame
    rows: list  # unit, source_file, staged_name, compressed, byte_length of each unit

    @classmethod
    def of(cls, units: DataFrame) -> "BatchUnits":
        return cls(units, units.select("unit", "source_file", "staged_name", "compressed", "byte_length").collect())

    @property
    def landing_bytes(self) -> int:
        """The landing bytes the batch reads, a compressed unit at GZIP_RATIO times its size."""
        return sum(r["byte_length"] * (GZIP_RATIO if r["compressed"] else 1) for r in self.rows)


def read_units(units: BatchUnits, staging_dir: files.AnyPath) -> tuple[DataFrame, list[str], list[int]]:
    """The content of a micro-batch's units, one row per unit: unit, source_file (label),
    file_modified_at, first_line, content (the unit's bytes). Also the files that vanished before
    they could be read (deleted from landing before ingestion), and the numbers of the units read.

    Each link is read by its exact, safe path; `byte_offset`/`byte_length` keep only the unit's bytes
    (gzip files are always whole units, Spark decompresses them by their `.gz` name).
    """
    spark = units.frame.sparkSession
    wanted = [r for r in units.rows if r["staged_name"] is not None]
    present = [r for r in wanted if (staging_dir / r["staged_name"]).exists()]  # follows the link
    vanished = sorted({r["source_file"] for r in wanted if r not in present})
    schema = "unit bigint, source_file string, file_modified_at timestamp, first_line bigint, content binary"
    if not present:
        return frame_of_rows(spark, [], schema), vanished, []
    texts = (
        spark.read.format("text").option("wholetext", "true").option("ignoreMissingFiles", "true")
        .load([str(staging_dir / r["staged_name"]) for r in present])
        .select(F.col("value").cast("binary").alias("_content"), F.col("_metadata.file_name").alias("staged_name"))
    )
    whole = F.col("compressed") | ((F.col("byte_offset") == 0) & (F.length("_content") == F.col("byte_length")))
    content = F.when(whole, F.col("_content")).otherwise(
        F.substring(F.col("_content"), (F.col("byte_offset") + 1).cast("int"), F.col("byte_length").cast("int")))
    label = F.when(F.col("file_version") == 1, F.col("source_file")).otherwise(
        F.concat(F.col("source_file"), F.lit("#v"), F.col("file_version").cast("string")))
    return (
        units.frame.join(texts, "staged_name")
        .select("unit", label.alias("source_file"), "file_modified_at", "first_line", content.alias("content"))
    ), vanished, [r["unit"] for r in present]


def split_lines(units: DataFrame) -> DataFrame:
    """One row per input line: unit, source_file, file_modified_at, line_number, raw_bytes.

    The unit's bytes are cut at each newline in the JVM (`SPLITTER`), so the bytes of each line survive exactly as
    received. The newline that ends a unit is a terminator, not an empty last line; any other empty line is a line
    (and will be quarantined as not JSON). Spark's own `split` needs the bytes decoded to text and each line encoded
    back: 1.3M lines in 4.4-4.6 s against 1.3-1.6 s this way, the same rows (one warm process, noop writes).
    """
    register_jvm_function(units.sparkSession, SPLITTER, SPLITTER_CLASS, ArrayType(BinaryType()))
    return units.select(
        "unit", "source_file", "file_modified_at", "first_line",
        F.posexplode(F.call_function(SPLITTER, F.col("content"))).alias("_pos", "raw_bytes"),
    ).select(
        "unit",
        "source_file",
        "file_modified_at",
        (F.col("first_line") + F.col("_pos")).cast("bigint").alias("line_number"),
        "raw_bytes",
    )


