"""Savepoints: a restore rolls every state table back and the next run resumes exactly. Racing writers of one
state table: Delta's conflicts retried, every batch counted once. The changelog (CDF → changelog table → rebuilt
table), one writer per stream and storage faults: tests/pipelines/state/test_state_tables.py and
test_state_ttl.py."""

from __future__ import annotations

import threading
from decimal import Decimal

import pytest
from deltalake import DeltaTable as IndependentDeltaTable
from pyspark.sql import functions as F

from pipelines.ingest.generate import generate
from pipelines.operate.savepoints import create_savepoint, list_savepoints, restore_savepoint
from tests.streams import PAYMENTS, STREAMS
from tests.contract_oracle import expected_state, landing_files
from tests.streams import advance


def _deliver(layout, spec, seed, events=300):
    generate(spec, layout.landing(spec.name), events=events, malformed=0.03, duplicates=0.05, conflicts=0.01,
             late=0.05, seed=seed, events_per_file=events)


def _advance(spark, layout, spec, **settings):
    return advance(spark, layout, spec, event_time=False, **settings)


def _rows(spark, path, version=None):
    reader = spark.read.format("delta")
    if version is not None:
        reader = reader.option("versionAsOf", version)
    return sorted(tuple(r) for r in reader.load(str(path)).drop("updated_at").collect())


def _state(layout, spec):
    table = spec.state_tables[0]
    rows = IndependentDeltaTable(str(layout.table(table.name))).to_pyarrow_table().to_pylist()
    return {r[table.key]: (r[table.count_column], r[table.sum_column]) for r in rows}


def _expected(layout, spec):
    expected = expected_state(spec.name, landing_files(layout.landing(spec.name)))
    return {k: (expected.counts[k], expected.sums[k]) for k in expected.counts}


@pytest.mark.long
def test_savepoint_restore_rolls_back_and_resumes_exactly(spark, layout):
    for spec in STREAMS.values():
        _deliver(layout, spec, seed=1)
        _deliver(layout, spec, seed=2)
        _advance(spark, layout, spec)
        _deliver(layout, spec, seed=3)
        _advance(spark, layout, spec)  # real micro-batches
    manifest = create_savepoint(spark, layout, "before-deploy")
    assert [m["name"] for m in list_savepoints(layout)] == ["before-deploy"]
    for spec in STREAMS.values():
        _deliver(layout, spec, seed=4)
        _advance(spark, layout, spec)

    restore_savepoint(spark, layout, "before-deploy")
    for spec in STREAMS.values():
        path = layout.table(spec.state_tables[0].name)
        assert _rows(spark, path) == _rows(spark, path, manifest["tables"][spec.state_tables[0].name]["version"])
    for spec in STREAMS.values():
        result = _advance(spark, layout, spec)
        assert result.recovery is None and result.micro_batches >= 1  # folded bronze after the savepoint again
        assert _state(layout, spec) == _expected(layout, spec)


def test_racing_writers_conflict_retry_and_count_exactly_once(spark, layout):
    """Two writers MERGE into one state table at once (as if a manual job raced the pipeline): Delta's
    concurrent-modification errors are retried, and every batch counts once. The collision is made, not hoped
    for: both start each MERGE at the same instant (a barrier), and a MERGE takes far longer than the gap."""
    from pipelines.state.tables import aggregate, ensure_state_table, upsert
    from pipelines.storage.delta_log import conflicts_retried

    spec = PAYMENTS
    ensure_state_table(spark, layout, spec.state_tables[0])
    path = str(layout.table(spec.state_tables[0].name))
    retried_before = conflicts_retried["count"]
    errors = []
    together = threading.Barrier(2, timeout=120)

    def writer(app_id):
        session = spark.newSession()  # own SQL conf: one writer's commit metadata does not leak into the other's
        events = session.createDataFrame([("c1", "1.00")], "customer_id string, amount string").select(
            "customer_id", F.col("amount").cast("decimal(18,2)").alias("amount"),
            F.lit("2026-11-01 10:00:00").cast("timestamp").alias("paid_at"))
        try:
            batch = aggregate(events, spec.state_tables[0])
            for batch_id in [0, 1]:
                together.wait()
                upsert(session, path, spec.state_tables[0], batch, batch_id, {"app_id": app_id, "batch_id": batch_id})
        except Exception as exc:  # surfaced by the assertion below
            errors.append(exc)
            together.abort()

    threads = [threading.Thread(target=writer, args=(f"racer-{n}",)) for n in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert conflicts_retried["count"] > retried_before  # the writers really collided
    assert _state(layout, spec) == {"c1": (4, Decimal("4.00"))}
