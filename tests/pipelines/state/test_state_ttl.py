"""The optional TTL of the all-time state tables (pipelines/state/expiry.py) against a plain-Python
recomputation of its rule (tests/contract_oracle.py `expected_with_ttl`), read with `deltalake`.

Covers: a key expiring once the stream's event time is a TTL past its newest event; a key arriving
already past it; a key coming back after its expiry with a new row; a crash between the batch's
MERGE and its expiry commit; expiries as deletes in the changelog, and a restore from the changelog
equal to the table at every version; a lost checkpoint rebuilt from bronze with the same rows; the
per-run and deep checks passing, then failing on a corrupted row.
"""

from __future__ import annotations

import shutil
from datetime import timedelta
from decimal import Decimal

import pytest
from deltalake import DeltaTable as IndependentDeltaTable

from pipelines import faults
from pipelines.errors import ConfigurationError
from pipelines.operate import table_checks
from pipelines.state.changelog import changelog_name, table_from_changelog
from pipelines.state.expiry import expired_totals
from pipelines.storage.delta_log import table_version
from tests.streams import PAYMENTS
from tests.contract_oracle import expected_with_ttl
from tests.streams import advance

SPEC, TABLE = PAYMENTS, PAYMENTS.state_tables[0]
TTL = timedelta(days=1)
LINE = '{"payment_id":"%s","customer_id":"%s","amount":%s,"paid_at":"%s"}'
DELIVERIES = [
    [("p1", "c1", "5", "2026-11-01T10:00:00Z"), ("p2", "c2", "7", "2026-11-01T11:00:00Z")],
    [("p3", "c1", "3", "2026-11-02T12:00:00Z")],  # the clock passes c2's newest payment + 1 day: c2 expires
    [("p4", "c2", "4", "2026-11-02T13:00:00Z"),  # c2 comes back: a new row
     ("p5", "c3", "9", "2026-10-30T08:00:00Z")],  # c3 is past the TTL on arrival: expires in its own batch
    [("p6", "c4", "1", "2026-11-04T00:00:00Z")],  # c1 and c2 expire (the run dies before the expiry commit)
    [("p7", "c1", "2", "2026-11-04T01:00:00Z"),  # c1 comes back
     ("p3", "c1", "3", "2026-11-02T12:00:00Z")],  # a re-delivered payment counts nothing
    [("p8", "c4", "6", "2026-11-06T00:00:00Z")],  # after the lost checkpoint: c1 expires again
]


def _rows(layout) -> dict[str, tuple[int, Decimal]]:
    rows = IndependentDeltaTable(str(layout.table(TABLE.name))).to_pyarrow_table().to_pylist()
    return {r[TABLE.key]: (r[TABLE.count_column], r[TABLE.sum_column]) for r in rows}


def test_keys_expire_on_event_time_and_the_changelog_agrees(spark, layout, landing, monkeypatch):
    monkeypatch.setenv(faults.FAULTS_ENV, str(layout.home / "faults"))
    files, versions = [], []
    for number, payments in enumerate(DELIVERIES, start=1):
        files.append([landing.write("payments", f"d{number}.jsonl", [LINE % p for p in payments])])
        if number == 4:  # dies after the batch's MERGE committed, before its expiry commit
            faults.arm(layout.home / "faults", faults.STATE_AFTER_MERGE_COMMIT, "raise")
            with pytest.raises(Exception, match="fault injected"):
                advance(spark, layout, SPEC, event_time=False, ttl=TTL)
        if number == 6:  # the checkpoint is lost: the table resumes from the bronze version it records
            shutil.rmtree(layout.checkpoint(SPEC.name))
        advance(spark, layout, SPEC, event_time=False, ttl=TTL)
        expected = expected_with_ttl("payments", files, TTL)
        assert _rows(layout) == expected.rows, f"after delivery {number}"
        versions.append(table_version(spark, layout.table(TABLE.name)))

    assert expected.rows == {"c4": (2, Decimal("7.00"))}
    assert [key for key, _, _ in expected.expired] == ["c2", "c3", "c1", "c2", "c1"]
    expired = expired_totals(spark, layout.table(TABLE.name))
    assert (expired.keys, expired.events, expired.value) == (5, 6, Decimal("30.00"))  # counted once, fault or not

    # Expiries are deletes in the changelog, with the expired rows' totals; a restore from it agrees.
    changelog = spark.read.format("delta").load(str(layout.table(changelog_name(TABLE))))
    deletes = changelog.where("_change_type = 'delete'").orderBy("_commit_version", TABLE.key).collect()
    assert [(r[TABLE.key], r[TABLE.count_column], r[TABLE.sum_column]) for r in deletes] == expected.expired
    for number, version in enumerate(versions, start=1):
        restored = table_from_changelog(changelog, TABLE, version).collect()
        assert {r[TABLE.key]: (r[TABLE.count_column], r[TABLE.sum_column]) for r in restored} == \
            expected_with_ttl("payments", files[:number], TTL).rows, f"restore at delivery {number}"

    per_run = table_checks.totals_match_bronze(spark, layout, SPEC, SPEC.state_tables[0])
    mismatched, totals = table_checks.mismatches_with_bronze(spark, layout, SPEC, SPEC.state_tables[0])
    assert per_run["passed"] and per_run["expired_events"] == 6
    assert mismatched.count() == 0 and totals["expiries_match_change_feed"]
    assert totals["sum_of_counts"] == totals["distinct_accepted_events"] == 8

    spark.sql(f"UPDATE delta.`{layout.table(TABLE.name)}` SET {TABLE.count_column} = {TABLE.count_column} + 1")
    assert not table_checks.totals_match_bronze(spark, layout, SPEC, SPEC.state_tables[0])["passed"]
    assert table_checks.mismatches_with_bronze(spark, layout, SPEC, SPEC.state_tables[0])[0].count() == 1


def test_a_ttl_that_is_not_positive_is_refused(spark, layout):
    with pytest.raises(ConfigurationError, match="must be positive"):
        advance(spark, layout, SPEC, ttl=timedelta(0))
