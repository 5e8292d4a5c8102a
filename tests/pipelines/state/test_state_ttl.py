"""The optional TTL of the all-time state tables (pipelines/state/expiry.py) against a plain-Python
recomputation of its rule (tests/contract_oracle.py `expected_with_ttl`), read with `deltalake`.

Covers: a key expiring once the stream's event time is a TTL past its newest event; a key arriving
already past it; a key coming back after its expiry with a new row, and expiring again; a re-delivered payment
of an expired key counting nothing; a crash between the batch's MERGE and its expiry commit; a lost checkpoint,
whose landing files are read again without bringing an expired key back; expiries as deletes in the changelog,
which holds nothing twice, and a restore from the changelog equal to the table after every delivery; the per-run
and deep checks passing, then failing on a corrupted row. The rule at exactly the TTL is
tests/pipelines/operate/test_check_boundaries.py's.
"""

from __future__ import annotations

import json
import shutil
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
    [("p5", "c2", "4", "2026-11-02T13:00:00Z"),  # c2 comes back: a new row
     ("p2", "c2", "7", "2026-11-01T11:00:00Z")],  # its expired payment re-delivered counts nothing
    [("p6", "c4", "1", "2026-11-04T00:00:00Z")],  # c1 and c2 (again) expire
]


def _advance(spark, layout):
    """One run; each landing file is a micro-batch of its own (the expiry follows each batch's MERGE)."""
    return advance(spark, layout, SPEC, event_time=False, ttl=TTL, max_files_per_trigger=1)


def _rows(layout, version: int) -> dict[str, tuple[int, Decimal]]:
    table = IndependentDeltaTable(str(layout.table(TABLE.name)), version=version)
    return {r[TABLE.key]: (r[TABLE.count_column], r[TABLE.sum_column]) for r in table.to_pyarrow_table().to_pylist()}


def _versions_after_each_delivery(layout) -> list[int]:
    """The state table's version after each delivery's micro-batch (its MERGE, then its expiry): the one before the
    next delivery's MERGE, and the latest after the last. A MERGE that folded events records their newest
    `ingested_at`; the empty MERGEs of batches that found their lines already in bronze record none."""
    table = IndependentDeltaTable(str(layout.table(TABLE.name)))
    folds = sorted(c["version"] for c in table.history()
                   if json.loads(c.get("userMetadata") or "{}").get(INGESTED_THROUGH) is not None)
    assert len(folds) == len(DELIVERIES), folds  # each delivery folded once, the crash and the lost checkpoint too
    return [version - 1 for version in folds[1:]] + [table.version()]


def test_keys_expire_on_event_time_and_the_changelog_agrees(spark, layout, landing, monkeypatch):
    monkeypatch.setenv(faults.FAULTS_ENV, str(layout.home / "faults"))
    files = []

    def deliver(*numbers):
        for number in numbers:
            lines = [LINE % p for p in DELIVERIES[number - 1]]
            files.append([landing.write("payments", f"d{number}.jsonl", lines)])

    deliver(1)
    _advance(spark, layout)
    deliver(2)  # the run dies after the batch's MERGE committed, before its expiry commit...
    faults.arm(layout.home / "faults", faults.STATE_AFTER_MERGE_COMMIT, "raise")
    with pytest.raises(Exception, match="fault injected"):
        _advance(spark, layout)
    shutil.rmtree(layout.checkpoint(SPEC.name))  # ...and its checkpoint is lost
    deliver(3, 4)
    # The cut-off expiry and the changelog first, then deliveries 1-2 read again (their lines are in bronze:
    # nothing counts, c2 stays expired), then 3-4: a micro-batch each.
    assert _advance(spark, layout).micro_batches == 1 + 4

    versions = _versions_after_each_delivery(layout)
    expected_after = [expected_with_ttl("payments", files[:number], TTL) for number in range(1, len(files) + 1)]
    for number, (version, expected) in enumerate(zip(versions, expected_after), start=1):
        assert _rows(layout, version) == expected.rows, f"after delivery {number}"
    expected = expected_after[-1]
    assert [key for key, _, _ in expected.expired] == ["c3", "c2", "c1", "c2"]
    assert expected.rows == {"c4": (1, Decimal("1.00"))} and ("c2", 1, Decimal("4.00")) in expected.expired
    expired = expired_totals(spark, layout.table(TABLE.name))
    assert (expired.keys, expired.events, expired.value) == (4, 5, Decimal("28.00"))  # counted once, crash or not

    # Expiries are deletes in the changelog, with the expired rows' totals; nothing is in it twice.
    changes = IndependentDeltaTable(str(layout.table(changelog_name(TABLE)))).to_pyarrow_table().to_pylist()
    deletes = sorted((r["_commit_version"], r[TABLE.key], r[TABLE.count_column], r[TABLE.sum_column])
                     for r in changes if r["_change_type"] == "delete")
    assert [delete[1:] for delete in deletes] == expected.expired
    published = [(r["_commit_version"], r[TABLE.key], r["_change_type"]) for r in changes]
    assert len(published) == len(set(published))
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
