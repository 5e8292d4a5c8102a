"""Two copies of one micro-batch: over Spark Connect, a killed run's query goes on in the server, and until the fence
stops it (test_locks.py), its batch can commit a step after the next run has read its tables' progress. Each step
asks its table's progress again when the batch reaches it, so the later copy folds nothing twice."""

from __future__ import annotations

import pytest
from deltalake import DeltaTable as IndependentDeltaTable

from pipelines import faults
from pipelines.ingest.generate import generate
from pipelines.runtime.micro_batch import StreamBatch, StreamSettings, _event_time_stages
from pipelines.state.tables import state_table_stage
from pipelines.storage.delta_log import table_version
from tests.contract_oracle import expected_state, landing_files
from tests.streams import PAYMENTS, advance


def _stages(spark, layout, spec) -> StreamBatch:
    """A run's steps after bronze, with the progress their tables record now (as a run reads it when it starts)."""
    states = [state_table_stage(spark, layout, spec, table) for table in spec.state_tables]
    event_time = _event_time_stages(spark, layout, spec, StreamSettings())
    return StreamBatch(layout, spec, None, states, event_time)


@pytest.mark.long
def test_a_batch_folded_by_another_copy_after_the_run_started_is_not_folded_again(spark, layout, monkeypatch):
    spec = PAYMENTS
    generate(spec, layout.landing(spec.name), events=300, seed=1, events_per_file=150)
    advance(spark, layout, spec)
    generate(spec, layout.landing(spec.name), events=300, seed=2, events_per_file=150)
    monkeypatch.setenv(faults.FAULTS_ENV, str(layout.home / "faults"))
    faults.arm(layout.home / "faults", faults.INGEST_AFTER_BRONZE_COMMIT, "raise")
    with pytest.raises(Exception, match="fault injected"):
        advance(spark, layout, spec)  # bronze holds the second delivery; no later step has folded it

    later, killed = _stages(spark, layout, spec), _stages(spark, layout, spec)  # both read the same progress
    killed.fold(spark, "killed-run", 1)  # the killed run's copy commits every step first
    tables = [t.name for t in spec.state_tables] + [t.name for t in spec.event_time_tables] + \
        [t.state_table for t in spec.event_time_tables]
    versions = {name: table_version(spark, layout.table(name)) for name in tables}
    later.fold(spark, "later-run", 1)
    assert {name: table_version(spark, layout.table(name)) for name in tables} == versions  # nothing committed

    expected = expected_state(spec.name, landing_files(layout.landing(spec.name)))
    table = spec.state_tables[0]
    rows = IndependentDeltaTable(str(layout.table(table.name))).to_pyarrow_table().to_pylist()
    assert {r[table.key]: (r[table.count_column], r[table.sum_column]) for r in rows} == \
        {k: (expected.counts[k], expected.sums[k]) for k in expected.counts}
