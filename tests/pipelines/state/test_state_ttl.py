"""The optional TTL of the all-time state tables (pipelines/state/expiry.py) against a plain-Python
recomputation of its rule (tests/contract_oracle.py `expected_with_ttl`), read with `deltalake`.

Covers: a key expiring once the stream's event time is a TTL past its newest event; a key arriving already past it;
a key coming back after its expiry with a new row, and expiring again; a re-delivered payment of an expired key
counting nothing; a crash between the batch's MERGE and its expiry commit, the expiry done by the next run and the
batch replayed writing nothing; the changelog, published, holding the table's Change Data Feed, each row once, with
expiries as deletes, and a restore from the changelog equal to the table after every delivery; the per-run and deep
checks passing, then failing on a corrupted row. A key exactly the TTL behind the clock, and 1 µs more:
tests/pipelines/event_time/test_sessions.py.
"""

from __future__ import annotations

import json
from datetime import timedelta
from decimal import Decimal
from functools import reduce

import pytest
from deltalake import DeltaTable as IndependentDeltaTable
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from pipelines import faults
from pipelines.errors import ConfigurationError
from pipelines.operate import table_checks
from pipelines.operate.maintenance import publish_changelogs
from pipelines.state.changelog import changelog_name, table_from_changelog
from pipelines.state.expiry import expired_totals
from pipelines.state.tables import INGESTED_THROUGH
from tests.streams import PAYMENTS
from tests.contract_oracle import expected_with_ttl
from tests.streams import advance

SPEC, TABLE = PAYMENTS, PAYMENTS.state_tables[0]
TTL = timedelta(days=1)
LINE = '{"payment_id":"%s","customer_id":"%s","amount":%s,"paid_at":"%s"}'
DELIVERIES = [
    [("p1", "c1", "5", "2026-11-01T10:00:00Z"), ("p2", "c2", "7", "2026-11-01T11:00:00Z"),
     ("p3", "c3", "9", "2026-10-30T08:00:00Z")],  # c3 is past the TTL on arrival: expires in its own batch
    [("p4", "c1", "3", "2026-11-02T12:00:00Z")],  # the clock passes c2's newest payment + 1 day: c2 expires
    [("p5", "c2", "4", "2026-11-02T13:00:00Z"),  # c2 comes back: a new row...
     ("p2", "c2", "7", "2026-11-01T11:00:00Z"),  # ...its expired payment re-delivered counts nothing...
     ("p6", "c4", "1", "2026-11-04T00:00:00Z")],  # ...and the clock passes c1 and c2: both expire, c2 again
]


def _advance(spark, layout):
    return advance(spark, layout, SPEC, event_time=False, ttl=TTL)


def _rows(layout, version: int) -> dict[str, tuple[int, Decimal]]:
    table = IndependentDeltaTable(str(layout.table(TABLE.name)), version=version)
    return {r[TABLE.key]: (r[TABLE.count_column], r[TABLE.sum_column]) for r in table.to_pyarrow_table().to_pylist()}


def _folds(layout) -> list[int]:
    """The state table's versions that folded a delivery's events: each MERGE that did records their newest
    `ingested_at`; the empty MERGEs of batches that found their lines already in bronze record none."""
    history = IndependentDeltaTable(str(layout.table(TABLE.name))).history()
    return sorted(c["version"] for c in history if json.loads(c.get("userMetadata") or "{}").get(INGESTED_THROUGH))


def test_keys_expire_on_event_time_and_the_changelog_agrees(spark, layout, landing, monkeypatch):
    monkeypatch.setenv(faults.FAULTS_ENV, str(layout.home / "faults"))
    files = []

    def deliver(*numbers):
        for number in numbers:
            lines = [LINE % p for p in DELIVERIES[number - 1]]
            files.append([landing.write("payments", f"d{number}.jsonl", lines)])

    deliver(1)
    _advance(spark, layout)
    deliver(2)  # the run dies after the batch's MERGE committed, before its expiry commit
    faults.arm(layout.home / "faults", faults.STATE_AFTER_MERGE_COMMIT, "raise")
    with pytest.raises(Exception, match="fault injected"):
        _advance(spark, layout)
    deliver(3)
    # Delivery 2's batch replayed (its MERGE skipped, its cut-off expiry made), then 3's: a micro-batch each.
    assert _advance(spark, layout).micro_batches == 2

    folds = _folds(layout)
    assert len(folds) == len(DELIVERIES), folds  # each delivery folded once, the crash's too
    # After each delivery's batch (its MERGE, then its expiry): the version before the next one's MERGE.
    versions = [version - 1 for version in folds[1:]] + [IndependentDeltaTable(str(layout.table(TABLE.name))).version()]
    expected_after = [expected_with_ttl("payments", files[:number], TTL) for number in range(1, len(files) + 1)]
    for number, (version, expected) in enumerate(zip(versions, expected_after), start=1):
        assert _rows(layout, version) == expected.rows, f"after delivery {number}"
    # Between delivery 3's MERGE and its expiry, c2's new row counted its new payment only.
    assert _rows(layout, folds[2]) == {"c1": (2, Decimal("8.00")), "c2": (1, Decimal("4.00")),
                                       "c4": (1, Decimal("1.00"))}
    expected = expected_after[-1]
    assert expected.expired == [("c3", 1, Decimal("9.00")), ("c2", 1, Decimal("7.00")), ("c1", 2, Decimal("8.00")),
                                ("c2", 1, Decimal("4.00"))]
    assert expected.rows == {"c4": (1, Decimal("1.00"))}
    expired = expired_totals(spark, layout.table(TABLE.name))
    assert (expired.keys, expired.events, expired.value) == (4, 5, Decimal("28.00"))  # counted once, crash or not

    # The changelog, published, holds the table's Change Data Feed, each row once (the crash's MERGE once, its
    # replay added nothing); expiries are deletes in it, with the expired rows' totals.
    def change(r) -> tuple:
        return r["_commit_version"], r["_change_type"], r[TABLE.key], r[TABLE.count_column], r[TABLE.sum_column]

    publish_changelogs(spark, layout, SPEC)

    published = IndependentDeltaTable(str(layout.table(changelog_name(TABLE)))).to_pyarrow_table().to_pylist()
    feed = (spark.read.format("delta").option("readChangeFeed", "true").option("startingVersion", 0)
            .load(str(layout.table(TABLE.name))).collect())
    assert sorted(map(change, published)) == sorted(map(change, feed))
    deletes = sorted(change(r) for r in published if r["_change_type"] == "delete")
    assert [(key, count, total) for _, _, key, count, total in deletes] == expected.expired
    # A restore from the changelog alone after every delivery, in one Spark job.
    changelog = spark.read.format("delta").load(str(layout.table(changelog_name(TABLE))))
    restores = reduce(DataFrame.unionByName, [
        table_from_changelog(changelog, TABLE, version).withColumn("_delivery", F.lit(number))
        for number, version in enumerate(versions, start=1)])
    restored: dict[int, dict] = {number: {} for number in range(1, len(versions) + 1)}
    for r in restores.collect():
        restored[r["_delivery"]][r[TABLE.key]] = (r[TABLE.count_column], r[TABLE.sum_column])
    for number, rows in restored.items():
        assert rows == expected_after[number - 1].rows, f"restore after delivery {number}"

    per_run = table_checks.totals_match_bronze(spark, layout, SPEC, SPEC.state_tables[0])
    mismatched, totals = table_checks.mismatches_with_bronze(spark, layout, SPEC, SPEC.state_tables[0])
    assert per_run["passed"] and per_run["expired_events"] == 5
    assert mismatched.count() == 0 and totals["expiries_match_change_feed"]
    assert totals["sum_of_counts"] == totals["distinct_accepted_events"] == 6

    spark.sql(f"UPDATE delta.`{layout.table(TABLE.name)}` SET {TABLE.count_column} = {TABLE.count_column} + 1")
    assert not table_checks.totals_match_bronze(spark, layout, SPEC, SPEC.state_tables[0])["passed"]
    assert table_checks.mismatches_with_bronze(spark, layout, SPEC, SPEC.state_tables[0])[0].count() == 1


def test_a_ttl_that_is_not_positive_is_refused(spark, layout):
    with pytest.raises(ConfigurationError, match="must be positive"):
        advance(spark, layout, SPEC, ttl=timedelta(0))
