"""TTL for the all-time state tables: a key with no event for D days of event time is deleted.

Off by default, set per table (resources/state_policy.py). After each micro-batch that brought events,
the table's clock is its newest event time (the largest last-event column) and every key whose newest
event is more than D behind the clock is deleted, in one commit (a MERGE that deletes them) after the batch's MERGE. The
Change Data Feed records each expiry as a `delete` whose pre-image holds the key's totals, so the
changelog table keeps them and a restore from the changelog agrees with the table. A key with events
after its expiry starts a new row from those events.

Why event time and not Delta's or Spark's TTL: those count wall-clock time since a write, so a replay
or a rebuild from bronze would expire other keys than the live run did. On the event-time clock the
same events give the same table, and the one rule here serves the live path, the rebuild from bronze
and the deep check.

Two records travel in commit metadata, so the checks and the rebuild stay exact:
- `expired`: running totals (keys, events, value) of every row expired so far, carried by every commit
  of a table with a TTL. The per-run check adds them to the table's own totals before comparing with
  bronze's, reading one recent commit.
- `ttl_expiry.ingested_through` (expiry commits): the newest bronze `ingested_at` folded so far. A key's
  events before its expiry were ingested at or before it and its later events after it (ingest
  micro-batches run one at a time and are stamped when they start; this assumes the driver's clock
  does not step back), so "the key's events since its last expiry" is a filter on bronze rows.
The table property `statetables.keyTtlDays` marks a table that has had a TTL, so tables that never had
one skip every history lookup.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

from pipelines.declare.specs import StateTableSpec
from pipelines.errors import ExpiryHistoryError
from pipelines.storage import delta_sql
from pipelines.storage.delta_log import USER_METADATA, commit_confs, commit_metadata, history_rows, table_properties
from pipelines.storage.delta_sql import ident
from pipelines.storage.frames import frame_of_rows

EXPIRED = "expired"
EXPIRY = "ttl_expiry"
TTL_PROPERTY = "statetables.keyTtlDays"
RECENT_COMMITS = 20  # a table with a TTL carries `expired` in every commit: the newest few hold it


@dataclass(frozen=True)
class ExpiredTotals:
    keys: int = 0
    events: int = 0
    value: Decimal = Decimal(0)

    def plus(self, keys: int, events: int, value: Decimal) -> "ExpiredTotals":
        return ExpiredTotals(self.keys + keys, self.events + events, self.value + value)

    def as_metadata(self) -> dict:
        return {"keys": self.keys, "events": self.events, "value": str(self.value)}

    @classmethod
    def from_metadata(cls, meta: dict) -> "ExpiredTotals":
        return cls(int(meta["keys"]), int(meta["events"]), Decimal(meta["value"]))


def ttl_property(spark: SparkSession, table_path: str | Path) -> str | None:
    """The table's `statetables.keyTtlDays` ("off" once a TTL was removed), None if it never had one."""
    return table_properties(spark, table_path).get(TTL_PROPERTY)


def record_policy(spark: SparkSession, table_path: str | Path, ttl: timedelta | None) -> None:
    """Mark the table with its TTL (a metadata commit), only when that changes."""
    wanted = _days(ttl) if ttl else "off"
    current = ttl_property(spark, table_path)
    if current == wanted or (current is None and ttl is None):
        return
    delta_sql.set_property(spark, table_path, TTL_PROPERTY, wanted)


def _days(ttl: timedelta) -> str:
    return f"{ttl.total_seconds() / 86400:g}"


def expired_totals(spark: SparkSession, table_path: str | Path, *, as_of: int | None = None) -> ExpiredTotals:
    """The running totals of expired rows in effect at table version `as_of` (default: the latest), from
    the newest commit that carries them. A Delta RESTORE brings back the totals of the version it
    restored. Zero for a table that never had a TTL."""
    if ttl_property(spark, table_path) is None:
        return ExpiredTotals()
    for limit in (RECENT_COMMITS, None):
        rows = history_rows(spark, table_path, limit)
        target = as_of
        for row in rows:
            if target is not None and row["version"] > target:
                continue
            if row["operation"] == "RESTORE":
                target = int((row["operationParameters"] or {}).get("version") or -1)
                continue
            meta = commit_metadata(row)
            if EXPIRED in meta:
                return ExpiredTotals.from_metadata(meta[EXPIRED])
        if len(rows) < RECENT_COMMITS:
            break
    return ExpiredTotals()


EXPIRED_VALUE = "_expired_value"


def expired_value(table: StateTableSpec) -> Column:
    """The value an expired row takes out of the running totals: its SUM of the stream's value, if it has one."""
    return F.col(table.sum_column) if table.sum_column else F.lit(0).cast("decimal(28,2)")


def expired_rows(spark: SparkSession, table_path: str | Path, table: StateTableSpec) -> DataFrame | None:
    """Every row expired and still expired (a RESTORE or a savepoint restore undoes the expiries after the
    version it went back to), from the table's Change Data Feed, with its expiry's `ingested_through`.
    None when there are none. Reads the table's whole history: for rebuilds and the deep check."""
    if ttl_property(spark, table_path) is None:
        return None
    path = str(table_path)
    rows = history_rows(spark, table_path)
    undone: list[tuple[int, int]] = []  # (went back to version, at version)
    expiries: dict[int, int] = {}  # commit version → ingested_through, epoch µs
    for row in rows:
        meta = commit_metadata(row)
        if row["operation"] == "RESTORE":
            undone.append((int((row["operationParameters"] or {}).get("version") or -1), row["version"]))
        elif "restored_version" in meta:
            undone.append((int(meta["restored_version"]), row["version"]))
        elif EXPIRY in meta and not any(to < row["version"] < at for to, at in undone):
            expiries[row["version"]] = int(meta[EXPIRY]["ingested_through_us"])
    if not expiries:
        return None
    through = frame_of_rows(spark, sorted(expiries.items()), "_commit_version long, expired_through_us long")
    deletes = (spark.read.format("delta").option("readChangeFeed", "true")
               .option("startingVersion", min(expiries)).option("endingVersion", max(expiries)).load(path)
               .where(F.col("_change_type") == "delete"))
    return deletes.join(through, "_commit_version").select(
        table.key, table.count_column, expired_value(table).alias(EXPIRED_VALUE), "_commit_version", "expired_through_us")


def require_whole_history(expired: DataFrame | None, table: StateTableSpec, totals: ExpiredTotals,
                          table_path: str | Path) -> None:
    """Refuse to go on when the expired rows read back do not add up to the running totals: Delta's log
    cleanup or a VACUUM removed an expiry's commit or change data, and counting from bronze would count
    that expiry's events again."""
    found = (expired.agg(F.count("*"), F.sum(table.count_column), F.sum(EXPIRED_VALUE)).first()
             if expired is not None else (0, None, None))
    if (found[0], found[1] or 0, found[2] or 0) != (totals.keys, totals.events, totals.value):
        raise ExpiryHistoryError(
            f"{table_path}: the change feed holds {found[0]} expired rows, the commits record {totals.keys}; "
            f"the table's older history is gone, so it cannot be rebuilt from bronze exactly. Fix: keep the "
            f"history of tables with a TTL (`delta.logRetentionDuration`, VACUUM retention); to start over, delete "
            f"the table: it is rebuilt from all of bronze and the TTL applies from then on.")


def since_last_expiry(events: DataFrame, expired: DataFrame | None, keys: tuple[str, ...]) -> DataFrame:
    """The bronze events each key's current row counts: those ingested after the key's newest expiry."""
    if expired is None:
        return events
    (key,) = keys  # a table with a TTL has one key (pipelines/declare/project.py)
    newest = expired.groupBy(key).agg(F.max("expired_through_us").alias("_through"))
    return (events.join(newest, key, "left")
            .where(F.col("_through").isNull() | (F.unix_micros("ingested_at") > F.col("_through")))
            .drop("_through"))


def newest_ingested_us(events: DataFrame) -> int | None:
    """The newest `ingested_at` among bronze rows, in epoch µs (None when there are none)."""
    return events.agg(F.max(F.unix_micros("ingested_at"))).first()[0]


def expire_keys(spark: SparkSession, table_path: str | Path, table: StateTableSpec, ttl: timedelta, *,
                ingested_through_us: int | None, app_id: str, batch_id: int, expired: ExpiredTotals) -> int:
    """Delete every key whose newest event is more than `ttl` behind the table's newest event, in one
    commit recording the new running totals and `ingested_through`. Returns the keys deleted.

    Repeating it changes nothing (the keys are gone and the clock has not moved), so a replayed batch
    needs no transaction id here. `ingested_through_us` None (a batch with no events) moves no clock.
    Times stay epoch µs end to end: Python datetimes from Spark are naive and zone-dependent.
    """
    if ingested_through_us is None:
        return 0
    path = str(table_path)
    state = spark.read.format("delta").load(path)
    clock = state.agg(F.max(F.unix_micros(table.last_ts_column))).first()[0]
    if clock is None:
        return 0
    cutoff = clock - ttl // timedelta(microseconds=1)
    stale = F.col(table.last_ts_column) < F.timestamp_micros(F.lit(cutoff))
    row = state.where(stale).agg(F.count("*").alias("keys"), F.sum(table.count_column).alias("events"),
                                 F.sum(expired_value(table)).alias("value")).first()
    if not row["keys"]:
        return 0
    metadata = {"app_id": app_id, "batch_id": batch_id,
                EXPIRED: expired.plus(row["keys"], row["events"], row["value"]).as_metadata(),
                EXPIRY: {"clock": _iso(clock), "cutoff": _iso(cutoff), "ingested_through": _iso(ingested_through_us),
                         "ingested_through_us": ingested_through_us}}
    # A MERGE with the stale keys as its source, not DELETE ... WHERE: Delta's DELETE takes no bound
    # parameters, and the cutoff must not be written into SQL text (pipelines/storage/delta_sql.py).
    doomed = state.where(stale).select(table.key, F.timestamp_micros(F.lit(cutoff)).alias("cutoff"))
    key, last = ident(table.key), ident(table.last_ts_column)
    with commit_confs(spark, {USER_METADATA: json.dumps(metadata)}):
        delta_sql.merge(spark, path, doomed, on=f"t.{key} = s.{key}",
                        clauses=f"WHEN MATCHED AND t.{last} < s.cutoff THEN DELETE")
    return int(row["keys"])


def _iso(us: int) -> str:
    return (datetime(1970, 1, 1, tzinfo=timezone.utc) + timedelta(microseconds=us)).isoformat()
