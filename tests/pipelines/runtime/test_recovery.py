"""Lost, corrupt and out-of-step checkpoints and tables: detected, set aside, and nothing counted twice.

Every scenario ends by comparing the state tables and quarantine with the independent oracle
(tests/contract_oracle.py) read through the independent `deltalake` reader. Damaged checkpoint files detected, and a
batch replayed after its last commit: tests/pipelines/state/test_state_tables.py.
"""

from __future__ import annotations

import json
import shutil

import pyarrow as pa
import pytest
from delta.tables import DeltaTable
from deltalake import CommitProperties, write_deltalake
from deltalake import DeltaTable as IndependentDeltaTable

from pipelines.ingest.generate import generate
from pipelines.runtime.checkpoints import RECENT_WINDOW, table_batches
from pipelines.storage import delta_sql
from tests.streams import MOVIE_TICKET_SALES, PAYMENTS
from tests.contract_oracle import expected_state, landing_files
from tests.streams import advance


def _deliver(layout, spec, seed, events=400):
    generate(spec, layout.landing(spec.name), events=events, malformed=0.05, duplicates=0.05, conflicts=0.02,
             late=0.05, seed=seed, events_per_file=150)


def _advance(spark, layout, spec):
    return advance(spark, layout, spec, event_time=False, max_files_per_trigger=10)


def _two_runs(spark, layout, spec):
    """Two deliveries, one run each: the stream's query then has real micro-batches in its checkpoint."""
    for seed in (1, 2):
        _deliver(layout, spec, seed=seed)
        _advance(spark, layout, spec)


def _assert_exact(layout, spec):
    expected = expected_state(spec.name, landing_files(layout.landing(spec.name)))
    table = spec.state_tables[0]
    rows = IndependentDeltaTable(str(layout.table(table.name))).to_pyarrow_table().to_pylist()
    actual = {r[table.key]: (r[table.count_column], r[table.sum_column]) for r in rows}
    assert actual == {k: (expected.counts[k], expected.sums[k]) for k in expected.counts}
    assert IndependentDeltaTable(str(layout.table(spec.bronze_table))).to_pyarrow_table().num_rows == expected.accepted
    assert IndependentDeltaTable(str(layout.table(spec.quarantine_table))).to_pyarrow_table().num_rows == \
        expected.quarantined


@pytest.mark.long
def test_all_checkpoints_deleted_between_runs_counts_nothing_twice(spark, layout):
    spec = PAYMENTS
    _two_runs(spark, layout, spec)
    # Compacted, the ledger is read as its snapshot, not commit by commit (pipelines/ingest/landing.py).
    delta_sql.optimize(spark, layout.table(spec.files_table))
    shutil.rmtree(layout.checkpoints_root)
    _deliver(layout, spec, seed=3)
    result = _advance(spark, layout, spec)
    assert result.recovery is None  # a missing checkpoint is a fresh start: nothing to set aside
    assert result.commits[spec.bronze_table][0]["user"]["already_ingested"] > 0  # old lines were read again...
    _assert_exact(layout, spec)  # ...and counted once


@pytest.mark.long
def test_a_corrupt_checkpoint_is_set_aside_and_nothing_counts_twice(spark, layout):
    spec = PAYMENTS
    _two_runs(spark, layout, spec)
    commits = layout.checkpoint(spec.name) / "commits"
    last = max(p.name for p in commits.iterdir() if p.name.isdigit())
    (commits / last).write_text("v1\n{\"nextBatchWatermarkMs\":0")  # torn write

    _deliver(layout, spec, seed=3)
    result = _advance(spark, layout, spec)

    assert "checksum" in result.recovery["problem"]
    assert (layout.set_aside_checkpoints / result.recovery["set_aside"].rsplit("/", 1)[1]).is_dir()
    _assert_exact(layout, spec)


@pytest.mark.long
def test_state_table_restored_behind_the_stream_folds_bronze_again(spark, layout):
    """After a Delta RESTORE, the table holds what the version it went back to held: the bronze version that
    version's commit recorded says what to fold again."""
    spec = MOVIE_TICKET_SALES
    _two_runs(spark, layout, spec)
    state_path = str(layout.table(spec.state_tables[0].name))
    DeltaTable.forPath(spark, state_path).restoreToVersion(1)  # back to the first run's MERGE

    _deliver(layout, spec, seed=3)
    result = _advance(spark, layout, spec)

    assert "restored to version 1" in result.recovery["problem"]
    _assert_exact(layout, spec)


@pytest.mark.long
def test_checkpoint_older_than_the_table_is_not_trusted(spark, layout):
    """A checkpoint put back from an old backup would skip batches the table already holds."""
    spec = MOVIE_TICKET_SALES
    _deliver(layout, spec, seed=1)
    _advance(spark, layout, spec)
    backup = layout.home / "backup"
    shutil.copytree(layout.checkpoints_root, backup)
    _deliver(layout, spec, seed=2)
    _advance(spark, layout, spec)
    shutil.rmtree(layout.checkpoints_root)
    shutil.copytree(backup, layout.checkpoints_root)

    _deliver(layout, spec, seed=3)
    result = _advance(spark, layout, spec)

    assert "older than the table" in result.recovery["problem"]
    _assert_exact(layout, spec)


def test_a_checkpoints_last_batch_is_found_behind_many_newer_commits(spark, tmp_path):
    """The verdict first reads the newest commits only; a batch further back (other writers committed
    since, or a RESTORE undid it) is still found, and a restore still undoes it."""
    path = tmp_path / "table"
    for batch_id in (0, 1):
        (spark.range(1).write.format("delta").mode("append")
         .option("userMetadata", json.dumps({"app_id": "a", "batch_id": batch_id})).save(str(path)))
    for n in range(RECENT_WINDOW):  # another writer (delta-rs: no Spark job per commit)
        write_deltalake(path, pa.table({"id": pa.array([n], pa.int64())}), mode="append",
                        commit_properties=CommitProperties(
                            custom_metadata={"userMetadata": json.dumps({"app_id": "other", "batch_id": n})}))
    assert table_batches(spark, path, "a") == (1, 1)
    DeltaTable.forPath(spark, str(path)).restoreToVersion(0)  # undoes batch 1
    assert table_batches(spark, path, "a") == (1, 0)


def test_a_python_worker_that_misses_its_connect_back_is_tried_again_for_a_budget_then_raised(monkeypatch, caplog):
    """Spark waits a fixed 10 s for a new Python worker; a busy machine misses it now and then (CI). The query is
    started again for up to WORKER_START_BUDGET_S, each try logged; any other error, or a spent budget, raises."""
    from pipelines.runtime import query
    pauses = []
    monkeypatch.setattr(query.time, "sleep", pauses.append)
    missed = RuntimeError("[PYTHON_WORKER] Python worker failed to connect back.")
    since = query._retry_worker_start(missed, "payments", 1, None)
    assert query._retry_worker_start(missed, "payments", 2, since) == since and pauses == [2, 4]
    assert "payments: its Python worker did not connect back within Spark's 10 s" in caplog.text
    spent = since - query.WORKER_START_BUDGET_S
    with pytest.raises(RuntimeError) as raised:
        query._retry_worker_start(missed, "payments", 3, spent)
    assert raised.value is missed and pauses == [2, 4]
    other = RuntimeError("DELTA_CONCURRENT_APPEND")
    with pytest.raises(RuntimeError) as raised:
        query._retry_worker_start(other, "payments", 1, None)
    assert raised.value is other
