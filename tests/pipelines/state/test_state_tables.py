"""State tables against an independent oracle, read with an independent Delta reader (`deltalake`).

Covers: generated data (malformed lines, re-deliveries, conflicting ids, late events) delivered in
two runs; both state tables equal the seed query computed by tests/contract_oracle.py with exact
decimals; Change Data Feed on; a MERGE replayed after its commit but before the checkpoint commit
is skipped. Not covered: Dagster (tests/assets).
"""

from __future__ import annotations

import shutil
from decimal import Decimal

import pytest
from deltalake import DeltaTable as IndependentDeltaTable

from pipelines.errors import ChangelogError
from pipelines.ingest.generate import generate
from pipelines.state.changelog import changelog_name
from pipelines.storage.delta_log import table_version
from tests.streams import MOVIE_TICKET_SALES, PAYMENTS, STREAMS
from tests.contract_oracle import expected_state, landing_files
from tests.streams import advance


def _read_state(layout, spec) -> dict[str, tuple[int, Decimal]]:
    table = spec.state_tables[0]
    rows = IndependentDeltaTable(str(layout.table(table.name))).to_pyarrow_table().to_pylist()
    return {r[table.key]: (r[table.count_column], r[table.sum_column]) for r in rows}


def _advance(spark, layout, spec):
    return advance(spark, layout, spec, event_time=False, max_files_per_trigger=2)


def test_state_tables_equal_the_seed_query_over_two_deliveries(spark, layout):
    for phase in (1, 2):
        for spec in STREAMS.values():
            generate(spec, layout.landing(spec.name), events=1500, malformed=0.02, duplicates=0.03,
                     conflicts=0.01, late=0.05, seed=phase, events_per_file=400)
            _advance(spark, layout, spec)

    for spec in STREAMS.values():
        expected = expected_state(spec.name, landing_files(layout.landing(spec.name)))
        actual = _read_state(layout, spec)
        assert expected.accepted > 2500 and expected.duplicates > 25 and expected.quarantined > 40
        assert {k: (expected.counts[k], expected.sums[k]) for k in expected.counts} == actual
        quarantined = IndependentDeltaTable(str(layout.table(spec.quarantine_table))).to_pyarrow_table().num_rows
        assert quarantined == expected.quarantined


def test_change_data_feed_is_on_and_records_every_upsert(spark, layout, landing):
    line = '{"payment_id":"%s","customer_id":"c1","amount":5,"paid_at":"2026-11-01T10:00:00Z"}'
    landing.write("payments", "a.jsonl", [line % "p1"])
    _advance(spark, layout, PAYMENTS)
    landing.write("payments", "b.jsonl", [line % "p2"])
    _advance(spark, layout, PAYMENTS)
    changes = (spark.read.format("delta").option("readChangeFeed", "true").option("startingVersion", 0)
               .load(str(layout.table("payments_per_customer"))).orderBy("_commit_version", "_change_type").collect())
    assert [(c["_change_type"], c["payment_count"]) for c in changes] == [
        ("insert", 1), ("update_postimage", 2), ("update_preimage", 1)]


def test_replayed_merge_is_not_applied_twice(spark, layout, landing):
    """The stream's query dies after the batch's last commit, before Spark wrote the batch's commit file."""
    good = '{"event_id":"%s","title":"Dune","ticket_total_value":10.25,"sale_ts":"2026-11-01T10:00:00Z"}'
    landing.write("movie_ticket_sales", "a.jsonl", [good % "e1"])
    _advance(spark, layout, MOVIE_TICKET_SALES)  # micro-batch 0
    landing.write("movie_ticket_sales", "a2.jsonl", [good % "e2"])
    _advance(spark, layout, MOVIE_TICKET_SALES)  # micro-batch 1
    commits = layout.checkpoint(MOVIE_TICKET_SALES.name) / "commits"
    (commits / "1").unlink()
    (commits / ".1.crc").unlink(missing_ok=True)

    result = advance(spark, layout, MOVIE_TICKET_SALES, event_time=False)

    assert result.micro_batches == 1 and (commits / "1").exists()  # the batch was replayed...
    assert result.versions["movie_tickets_sold"].before == result.versions["movie_tickets_sold"].after  # ...as a no-op
    assert _read_state(layout, MOVIE_TICKET_SALES) == {"Dune": (2, Decimal("20.50"))}
    # and the next batch still applies
    landing.write("movie_ticket_sales", "b.jsonl", [good % "e3"])
    _advance(spark, layout, MOVIE_TICKET_SALES)
    assert _read_state(layout, MOVIE_TICKET_SALES) == {"Dune": (3, Decimal("30.75"))}


def test_a_state_table_that_records_no_bronze_version_is_rebuilt_from_bronze(spark, layout):
    """A state table deleted (with its changelog) is built again from all of bronze, exactly, in one commit that
    records the bronze version; the changelog then starts from the new table's first version."""
    spec = PAYMENTS
    generate(spec, layout.landing(spec.name), events=600, malformed=0.02, duplicates=0.03, seed=5, events_per_file=300)
    _advance(spark, layout, spec)
    shutil.rmtree(layout.table(spec.state_tables[0].name))
    with pytest.raises(ChangelogError, match="deleted and created again.*Fix: move"):
        _advance(spark, layout, spec)
    shutil.rmtree(layout.table(changelog_name(spec.state_tables[0])))
    result = _advance(spark, layout, spec)
    assert result.built_through[spec.state_tables[0].name] == table_version(spark, layout.table(spec.bronze_table))
    expected = expected_state(spec.name, landing_files(layout.landing(spec.name)))
    assert _read_state(layout, spec) == {k: (expected.counts[k], expected.sums[k]) for k in expected.counts}
    changelog = IndependentDeltaTable(str(layout.table(changelog_name(spec.state_tables[0])))).to_pyarrow_table()
    assert changelog.num_rows == len(expected.counts)  # the rebuild's inserts
