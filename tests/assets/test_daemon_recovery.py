"""Recovery without a person, through the real Dagster webserver and daemon (`dagster dev`).

Landing files appear → the daemon's landing sensor launches `advance_payments` → an injected fault
fails that run after its bronze commit → the daemon's run-failure sensor launches a recovery run,
tagged with why it ran → it resumes from the checkpoint and succeeds → the state table equals the
independent oracle. Everything is observed through the webserver's GraphQL API, as the UI sees it.
"""

from __future__ import annotations

import time

import pytest
from deltalake import DeltaTable as IndependentDeltaTable

from assets.keys import RECOVERY_ATTEMPT_TAG, RECOVERY_OF_TAG, RECOVERY_REASON_TAG
from pipelines import faults
from pipelines.generate import generate
from pipelines.streams import PAYMENTS
from statetables.servers import dagster_dev, free_port, list_runs
from tests.contract_oracle import expected_state, landing_files

pytestmark = pytest.mark.long





def test_failed_run_is_recovered_by_the_daemon(layout):
    spec = PAYMENTS
    generate(spec, layout.landing(spec.name), events=600, malformed=0.03, duplicates=0.03, conflicts=0.01,
             seed=5, events_per_file=300)
    fault_dir = layout.home / "faults"
    faults.arm(fault_dir, faults.INGEST_AFTER_BRONZE_COMMIT, "raise")

    with dagster_dev(layout, port=free_port(), extra_env={faults.FAULTS_ENV: str(fault_dir)}) as url:
        deadline = time.monotonic() + 480
        recovered = None
        while time.monotonic() < deadline and recovered is None:
            time.sleep(5)
            runs = list_runs(url)
            recovered = next((r for r in runs if RECOVERY_OF_TAG in r["tags"] and r["status"] == "SUCCESS"), None)
            assert not [r for r in runs if r["tags"].get(RECOVERY_OF_TAG) and r["status"] == "FAILURE"], runs
        assert recovered, f"no successful recovery run within the deadline: {list_runs(url)}"

        failed = [r for r in runs if r["status"] == "FAILURE"]
        assert [r["runId"] for r in failed] == [recovered["tags"][RECOVERY_OF_TAG]]  # the sensor's run failed...
        assert failed[0]["jobName"] == recovered["jobName"] == "advance_payments"
        assert recovered["tags"][RECOVERY_ATTEMPT_TAG] == "1"  # ...and the recovery says why it ran
        assert "fault injected at ingest.after_bronze_commit" in recovered["tags"][RECOVERY_REASON_TAG]

    assert not (fault_dir / faults.INGEST_AFTER_BRONZE_COMMIT).exists()  # the fault really fired
    expected = expected_state(spec.name, landing_files(layout.landing(spec.name)))
    table = spec.state_table
    rows = IndependentDeltaTable(str(layout.table(table.name))).to_pyarrow_table().to_pylist()
    assert {r[table.key]: (r[table.count_column], r[table.sum_column]) for r in rows} == {
        k: (expected.counts[k], expected.sums[k]) for k in expected.counts}
