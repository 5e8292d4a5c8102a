"""The changelog (CDF → changelog table → rebuilt table), savepoints, one writer, storage faults."""

from __future__ import annotations

import subprocess
import threading
from decimal import Decimal

import pytest
from deltalake import DeltaTable as IndependentDeltaTable

from pipelines.errors import StorageError, StreamBusyError
from pipelines.ingest.generate import generate
from pipelines.operate.savepoints import create_savepoint, list_savepoints, restore_savepoint
from pipelines.runtime.locks import writer_lock
from pipelines.state.changelog import changelog_name, restore_from_changelog
from pipelines.storage.delta_log import table_version
from tests.streams import MOVIE_TICKET_SALES, PAYMENTS, STREAMS
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


def test_changelog_alone_rebuilds_the_table_at_every_version(spark, layout):
    spec, table = PAYMENTS, PAYMENTS.state_tables[0]
    for seed in (1, 2):
        _deliver(layout, spec, seed)
        _advance(spark, layout, spec)
    changelog = spark.read.format("delta").load(str(layout.table(changelog_name(table))))
    published = changelog.count()
    assert published > 0
    # its checkpoint lost, the stream reads every landing file again, and the changelog gets nothing twice
    layout.checkpoint(spec.name).rename(layout.home / "lost")
    assert _advance(spark, layout, spec).micro_batches >= 1
    assert spark.read.format("delta").load(str(layout.table(changelog_name(table)))).count() == published
    assert published == changelog.dropDuplicates(["_commit_version", table.key, "_change_type"]).count()

    state_path = layout.table(table.name)
    for version in range(1, table_version(spark, state_path) + 1):
        target = restore_from_changelog(spark, layout, table, version, f"rebuilt_v{version}")
        assert _rows(spark, target) == _rows(spark, state_path, version), version


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


def test_second_writer_of_a_stream_is_refused_and_nothing_is_written(spark, layout):
    spec = MOVIE_TICKET_SALES
    _deliver(layout, spec, seed=1)
    holding, release = threading.Event(), threading.Event()

    def other_run():
        with writer_lock(layout.locks, spec.name, 5):
            holding.set()
            release.wait(60)

    thread = threading.Thread(target=other_run)
    thread.start()
    holding.wait(10)
    try:
        with pytest.raises(StreamBusyError, match="Another run is advancing movie_ticket_sales "):
            _advance(spark, layout, spec, lock_timeout_s=1)
    finally:
        release.set()
        thread.join()
    assert table_version(spark, layout.table(spec.bronze_table)) is None  # nothing was created or written
    _advance(spark, layout, spec)
    assert _state(layout, spec) == _expected(layout, spec)


def test_read_only_storage_fails_with_the_fix_and_the_next_run_is_exact(spark, layout):
    spec = PAYMENTS
    _deliver(layout, spec, seed=1)
    _advance(spark, layout, spec)
    _deliver(layout, spec, seed=2)
    log = layout.table(spec.state_tables[0].name) / "_delta_log"
    # As root, permissions do not stop writes; the immutable flag does (EPERM), like a read-only mount.
    subprocess.run(["chattr", "+i", str(log)], check=True)
    try:
        with pytest.raises(StorageError, match=r"Cannot write to .*_delta_log.*Fix: make the folder writable"):
            _advance(spark, layout, spec)
    finally:
        subprocess.run(["chattr", "-i", str(log)], check=True)
    _advance(spark, layout, spec)
    assert _state(layout, spec) == _expected(layout, spec)


def test_racing_writers_conflict_retry_and_count_exactly_once(spark, layout):
    """Two writers MERGE into one state table at once (as if a manual job raced the pipeline): Delta's
    concurrent-modification errors are retried, and every batch counts once. The collision is made, not hoped
    for: both start each MERGE at the same instant (a barrier), and a MERGE takes far longer than the gap."""
    from pyspark.sql import functions as F

    from pipelines.state.tables import aggregate, ensure_state_table, upsert
    from pipelines.storage.delta_log import conflicts_retried

    spec = PAYMENTS
    ensure_state_table(spark, layout, spec.state_tables[0])
    path = str(layout.table(spec.state_tables[0].name))
    retried_before = conflicts_retried["count"]
    errors = []
    together = threading.Barrier(2, timeout=120)

    def writer(app_id):
        session = spark.newSession()  # own SQL conf: the txn confs of one writer do not leak into the other
        events = session.createDataFrame([("c1", "1.00")], "customer_id string, amount string").select(
            "customer_id", F.col("amount").cast("decimal(18,2)").alias("amount"),
            F.lit("2026-11-01 10:00:00").cast("timestamp").alias("paid_at"))
        try:
            batch = aggregate(events, spec.state_tables[0])
            for batch_id in [0, 1, 2, 3, 3]:  # the second 3 is a replay: skipped by its txn id
                together.wait()
                upsert(session, path, spec.state_tables[0], batch, app_id, batch_id, {"app_id": app_id})
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
    assert _state(layout, spec) == {"c1": (8, Decimal("8.00"))}
