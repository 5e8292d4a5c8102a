"""The Delta log as the pipeline reads it: versions, commits and their metadata, the rows a version range
added or changed, and commits retried when another writer won.

Every commit of a micro-batch records its app id and batch id in its metadata (`commit_confs` sets the metadata
for a SQL commit): `made_by_batch` finds it, so a replayed micro-batch skips what it already wrote. Delta's own
transaction ids (`txnAppId`, `txnVersion`) would do the same, but delta-spark 4.3.1 rebuilds the table's whole
state from its log to check one (two or three Spark jobs, ~0.15 s warm, per commit).
"""

from __future__ import annotations

import json
import random
import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Callable, Iterator

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import StructType

from pipelines.errors import ConcurrentWriterError
from pipelines.storage import delta_sql, files

USER_METADATA = "spark.databricks.delta.commitInfo.userMetadata"
CONFLICT_RETRIES = 8
_CONFLICT = re.compile(r"DELTA_CONCURRENT_|io\.delta\.exceptions\.Concurrent\w*Exception|^Concurrent\w*Exception")
conflicts_retried = {"count": 0}  # in this process; shows that retries happen (tests, diagnostics)

# Per table, the newest version this process has seen: where its next look starts (files.newest_commit).
_SEEN_VERSION: dict[str, int] = {}


def new_app_id(query_name: str) -> str:
    """A new app id: a checkpoint, a rebuild, a refresh or a restore commits under one of its own."""
    return f"statetables/{query_name}/{uuid.uuid4()}"


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
    path = files.storage_path(path)
    log = path / "_delta_log"
    if log.is_dir() and not any(p.suffix == ".json" or ".checkpoint" in p.name for p in log.iterdir()):
        files.replace(log, path / f"_delta_log.uncommitted-{time.time_ns()}")
    try:
        delta_sql.create_table_if_missing(spark, path, schema, {
            **({"delta.enableChangeDataFeed": "true"} if change_data_feed else {}), **(properties or {})} or None)
    except Exception:
        if table_version(spark, path) is None:
            raise


@dataclass(frozen=True)
class NewTable:
    """A table a run needs, as `create_table_if_missing` makes it when it is missing."""

    path: Path
    schema: StructType
    change_data_feed: bool = True
    properties: dict[str, str] | None = None


CREATING_AT_ONCE = 8


def create_tables_if_missing(spark: SparkSession, tables: list[NewTable]) -> None:
    """`create_table_if_missing` for each table, those missing created at once: a first run creates 5 to 15 tables,
    and a creation is mostly waiting on its commit (12 tables on a warm engine: 2.3-2.9 s one after the other,
    1.3-1.5 s four at a time; 8 tables 0.84 s four at a time, 0.72 s eight at a time, as with twelve; measured). One
    session serves the threads (Spark Connect's too)."""
    missing = list({str(t.path): t for t in tables if table_version(spark, t.path) is None}.values())

    def create(table: NewTable) -> None:
        create_table_if_missing(spark, table.path, table.schema, change_data_feed=table.change_data_feed,
                                properties=table.properties)

    if len(missing) <= 1:
        for table in missing:
            create(table)
        return
    with ThreadPoolExecutor(min(CREATING_AT_ONCE, len(missing)), thread_name_prefix="create-table") as pool:
        for done in [pool.submit(create, table) for table in missing]:
            done.result()  # the first failure is raised, after every creation ended


def table_version(spark: SparkSession, path: Path) -> int | None:
    """The table's latest committed version, from its log's file names (Delta protocol: one
    `<version>.json` per commit); None if it is not a table yet. Asking Spark costs a job each time. A run asks
    some 30 to 80 times, so only the newest part of the log is looked at: from the version this process saw last,
    else from Delta's `_last_checkpoint`. The whole log is listed only when neither holds (a new table, or one
    deleted and created again)."""
    log = files.storage_path(path) / "_delta_log"
    start = _SEEN_VERSION.get(str(path))
    if start is None:
        start = _checkpointed_version(log)
    version = files.newest_commit(log, start) if start is not None else None
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
    first = files.storage_path(path) / "_delta_log" / f"{0:020d}.json"
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
    log = files.storage_path(path) / "_delta_log"
    for version in range(newest, -1 if count is None else max(-1, newest - count), -1):
        try:
            text = (log / f"{version:020d}.json").read_text(encoding="utf-8")
        except FileNotFoundError:
            return
        yield version, (json.loads(line) for line in text.splitlines() if line.strip())


PROPERTIES_SEARCHED = 200  # newest commit files searched for the table's metadata


def logged_properties(path: Path | str) -> dict[str, str] | None:
    """The table's properties as its newest `metaData` action sets them (Delta protocol: each one replaces the
    last), read from its newest commit files without Spark; None when none of the newest PROPERTIES_SEARCHED
    holds one (older ones checkpointed away) or it is not a table."""
    latest = table_version(None, path)
    if latest is None:
        return None
    for _, actions in commit_actions(path, latest, PROPERTIES_SEARCHED):
        for action in actions:
            if "metaData" in action:
                return dict(action["metaData"].get("configuration") or {})
    return None


def table_properties(spark: SparkSession, path: Path | str) -> dict[str, str]:
    """The table's properties: from its log (`logged_properties`), else asked of Delta (SHOW TBLPROPERTIES, a Spark
    job: 0.8 s of a cold `statetables run`, measured)."""
    logged = logged_properties(path)
    return logged if logged is not None else delta_sql.properties(spark, path)


def holds_no_rows(spark: SparkSession, path: Path) -> bool:
    """Whether no commit of the table ever added a file (a table created, then only altered), read from its commit
    files; False when log retention has cleaned some of them up, as nothing then proves it."""
    latest = table_version(spark, path)
    if latest is None:
        return False
    seen = 0
    for _, actions in commit_actions(path, latest):
        seen += 1
        if any("add" in action for action in actions):
            return False
    return seen == latest + 1


def history_rows(spark: SparkSession, path: Path, limit: int | None = None, *,
                 latest: int | None = None) -> list[dict]:
    """DESCRIBE HISTORY's version, operation, operationParameters, operationMetrics, userMetadata and timestamp
    (`timestamp_ms`, epoch milliseconds) of the newest `limit` commits (all when None), newest first, read from the
    commit files of the table's log (each holds the commit's `commitInfo`); the commits cleaned up by log retention
    are left out, as DESCRIBE HISTORY leaves them. DESCRIBE HISTORY costs a Spark job, and a run asks some ten
    times; it answers instead for a log without commitInfo (another writer's). `latest`: the table's version when
    the caller has just read it."""
    return list(_history_newest_first(spark, path, limit, latest))


def _history_newest_first(spark: SparkSession, path: Path | str, limit: int | None,
                          latest: int | None) -> Iterator[dict]:
    """`history_rows`, one commit file read at a time, so a caller that stops early reads no more."""
    if latest is None:
        latest = table_version(spark, path)
    if latest is None:
        return
    for version, actions in commit_actions(path, latest, limit):
        info = next((a["commitInfo"] for a in actions if "commitInfo" in a), None)
        if info is None:
            columns = ("version", "operation", "operationParameters", "operationMetrics", "userMetadata")
            yield from (r.asDict() for r in delta_sql.history(spark, path, limit)
                        .select(*columns, F.unix_millis("timestamp").alias("timestamp_ms")).collect()
                        if r["version"] <= version)
            return
        yield {"version": version, "operation": info.get("operation"),
               "operationParameters": info.get("operationParameters") or {},
               "operationMetrics": info.get("operationMetrics") or {}, "userMetadata": info.get("userMetadata"),
               "timestamp_ms": info.get("inCommitTimestamp", info.get("timestamp"))}


def rows_written_by(spark: SparkSession, path: Path | str, metadata: dict, limit: int) -> int | None:
    """The rows the newest commit among the newest `limit` whose metadata is `metadata` wrote (its
    `numOutputRows`), read newest first and stopping there (most often at the newest); None when none is."""
    for row in _history_newest_first(spark, path, limit, None):
        if commit_metadata(row) == metadata:
            return int(row["operationMetrics"].get("numOutputRows", 0))
    return None


BATCH_COMMITS_SEARCHED = 20  # newest commits searched for a replayed batch's own (`made_by_batch`)


def made_by_batch(spark: SparkSession, path: Path | str, app_id: str, batch_id: int) -> bool:
    """Whether one of the table's newest commits was made by micro-batch `batch_id` of `app_id` (its metadata
    says so). Spark replays only a checkpoint's last batch, and a stream has one writer (its lock), so that batch's
    commit, if it was made, is among the newest: only maintenance (OPTIMIZE, VACUUM) commits after it."""
    return any((meta := commit_metadata(row)).get("app_id") == app_id and meta.get("batch_id") == batch_id
               for row in history_rows(spark, path, BATCH_COMMITS_SEARCHED))


def newest_commit_with(spark: SparkSession, path: Path | str, key: str, limit: int = 20, *,
                       unless_after: str | None = None) -> tuple[int, dict] | None:
    """(version, metadata) of the table's newest commit, among its newest `limit`, whose metadata holds `key`: what a
    step records of its progress in its own commits. Read newest first, a commit file at a time, stopping at the
    first that holds it (most often the newest): a step asks before each batch. None as well when a newer commit
    is an `unless_after` operation (a RESTORE, which brings back an older version's record)."""
    for row in _history_newest_first(spark, path, limit, None):
        if row["operation"] == unless_after:
            return None
        if (meta := commit_metadata(row)).get(key) is not None:
            return row["version"], meta
    return None


def commit_metadata(row: dict) -> dict:
    """A commit's userMetadata as statetables writes it (a JSON object); {} for none, or for another writer's text
    (not JSON, or not an object): a commit someone else made never breaks a run."""
    try:
        meta = json.loads(row["userMetadata"]) if row.get("userMetadata") else {}
    except ValueError:
        return {}
    return meta if isinstance(meta, dict) else {}


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
            "user": commit_metadata(r),
        }
        for r in rows
    ]


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
    """The bronze commit a micro-batch has just made: its version, its rows (a kept frame: `frames.kept`) and their
    newest and oldest event times in ms (None: no row), counted with the batch's outcomes."""

    version: int
    rows: DataFrame
    newest_ms: int | None = None
    oldest_ms: int | None = None


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
        if self._own(folded):
            return self.appended.rows
        return rows_added(self.spark, self.path, folded, self.through)

    def newest_ms(self, folded: int) -> int | None:
        """The newest event time (ms) of `after(folded)`'s rows when known without a Spark job (this batch's own
        append); None otherwise, or when they hold no row."""
        return self.appended.newest_ms if self._own(folded) else None

    def oldest_ms(self, folded: int) -> int | None:
        """The oldest event time (ms, floored) of `after(folded)`'s rows when known without a Spark job, as
        `newest_ms`."""
        return self.appended.oldest_ms if self._own(folded) else None

    def _own(self, folded: int) -> bool:
        if self.appended is None or self.appended.version != self.through:
            return False
        # A step that has folded nothing yet (-1) lacks version 0 too: the table's creation, which adds no row, so
        # after a first load's append it lacks only that (otherwise a first load would be read back from bronze's
        # change data, and the session step would keep its aggregation to learn the rows' newest event time).
        return folded + 1 == self.through or (folded == -1 and self.through == 1 and self._creation_holds_no_row)

    @cached_property
    def _creation_holds_no_row(self) -> bool:
        first = commits_since(self.spark, self.path, -1)[:1]
        return bool(first) and first[0]["operation"] == "CREATE TABLE"

    def count_after(self, folded: int) -> int:
        return rows_appended(self.spark, self.path, folded, self.through)


def rows_appended(spark: SparkSession, path: Path, after: int, through: int) -> int:
    """How many rows `rows_added` over the same versions holds, from the appends' commit metrics in the log: no
    Spark job."""
    return sum(int(c["metrics"].get("numOutputRows", 0)) for c in commits_since(spark, path, after)
               if c["version"] <= through and c["operation"] == "WRITE")


def retry_on_conflict(commit: Callable[[], None], what: str) -> None:
    """Run one Delta commit, again if another writer committed first.

    A failed optimistic commit wrote nothing, and the retry re-reads the table: retrying never counts twice;
    giving up raises with the reason.
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
