"""The jobs that change tables on request, under the real Dagster instance: table maintenance and the full refresh."""

from __future__ import annotations

import json
from datetime import timedelta

import dagster as dg
import pytest
from deltalake import DeltaTable as IndependentDeltaTable

from pipelines.errors import ConfigurationError
from pipelines.ingest.generate import generate
from pipelines.operate.maintenance import maintain_stream
from pipelines.operate.savepoints import create_savepoint, restore_savepoint
from pipelines.storage.delta_log import history_rows, table_version
from statetables.definitions import defs
from tests.contract_oracle import expected_state, landing_files
from tests.streams import MOVIE_TICKET_SALES as SALES, PAYMENTS, advance

TABLE = PAYMENTS.state_tables[0]


def _state(layout) -> dict:
    rows = IndependentDeltaTable(str(layout.table(TABLE.name))).to_pyarrow_table().to_pylist()
    return {r["customer_id"]: (r["payment_count"], r["total_amount"]) for r in rows}


def _expected(layout) -> dict:
    expected = expected_state(PAYMENTS.name, landing_files(layout.landing(PAYMENTS.name)))
    return {k: (expected.counts[k], expected.sums[k]) for k in expected.counts}


@pytest.mark.long  # OPTIMIZE and VACUUM of every table of both streams: minutes
def test_maintenance_compacts_keeps_savepoints_readable_and_refresh_rebuilds(spark, layout, monkeypatch):
    monkeypatch.setenv("STATETABLES_HOME", str(layout.home))  # the code location's storage resource reads it
    generate(SALES, layout.landing(SALES.name), events=50, seed=9)  # a savepoint covers every stream
    advance(spark, layout, SALES, event_time=False)
    for seed in (1, 2, 3):  # three runs: bronze and the state table in several files each
        generate(PAYMENTS, layout.landing("payments"), events=200, seed=seed, events_per_file=200)
        advance(spark, layout, PAYMENTS, event_time=False)
        if seed == 1:
            saved = create_savepoint(spark, layout, "first")["tables"][TABLE.name]["version"]
    before = _state(layout)
    assert before == _expected(layout)

    with dg.DagsterInstance.ephemeral() as instance:
        result = defs.resolve_job_def("maintain_tables").execute_in_process(instance=instance)
    assert result.success
    (output,) = [e for e in result.all_events if e.event_type_value == "STEP_OUTPUT"]
    records = {r.data["table"]: r.data for r in output.event_specific_data.metadata["tables"].value.records}
    assert records["payments_bronze"]["files_compacted"] >= 3 and records["payments_bronze"]["files_written"] >= 1
    assert "OPTIMIZE" in {c["operation"] for c in history_rows(spark, layout.table("payments_bronze"), 5)}
    assert _state(layout) == before  # compaction changes no row
    # The savepoint's version is still readable, and a restore to it still works.
    assert IndependentDeltaTable(str(layout.table(TABLE.name)), version=saved).to_pyarrow_table().num_rows > 0
    restore_savepoint(spark, layout, "first")
    advance(spark, layout, PAYMENTS, event_time=False)  # folds everything after the savepoint again, once
    assert _state(layout) == before

    with pytest.raises(ConfigurationError, match="safety floor.*Fix: retain at least 168 hours"):
        maintain_stream(spark, layout, PAYMENTS, retain=timedelta(hours=1))

    # The full refresh from Dagster: one commit that records the bronze version it reflects.
    with dg.DagsterInstance.ephemeral() as instance:
        job = defs.resolve_job_def("refresh_state_table")
        done = job.execute_in_process(instance=instance, run_config={
            "ops": {"refresh_table": {"config": {"table": TABLE.name}}}})
        assert done.success
        newest = history_rows(spark, layout.table(TABLE.name), 1)[0]
        assert newest["operation"] == "CREATE OR REPLACE TABLE AS SELECT"
        assert json.loads(newest["userMetadata"])["refreshed"] == TABLE.name
        assert _state(layout) == before
        failed = job.execute_in_process(instance=instance, raise_on_error=False, run_config={
            "ops": {"refresh_table": {"config": {"table": "nope"}}}})
        assert not failed.success
        error = failed.get_step_failure_events()[0].event_specific_data.error
        text = error.message + "".join(c.message for c in [error.cause] if c)
        assert "No table 'nope'" in text and "payments_per_customer" in text and "customer_activity" in text
    assert table_version(spark, layout.table(TABLE.name)) is not None
