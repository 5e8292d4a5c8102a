"""The continuous job under the real Dagster webserver and daemon (`dagster dev`), as an operator uses it.

Launched through the webserver (as the launchpad does) → files dropped into landing/ while it runs show up in
both state tables, equal to the independent oracle (read with `deltalake`) → the run reports materializations
and passing checks as it goes, and the landing sensor starts no orchestrated run meanwhile → kill -9 of its run
worker: the run-failure sensor starts it again, tagged with why, and it resumes from the checkpoints → more
files, still equal to the oracle (nothing counted twice) → a cancel stops it, CANCELED, tables intact.

As `make serve` runs it: every query in a warm Spark Connect server beside Dagster, windows and sessions on. The
continuous job on the run's own JVM, killed at a named point and resumed: tests/test_chaos.py (its continuous
round). Not covered here: freshness figures (`make bench-freshness`).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import dagster as dg
import pytest
from deltalake import DeltaTable as IndependentDeltaTable
from deltalake.exceptions import TableNotFoundError

from assets.keys import CONTINUOUS_JOB, RECOVERY_ATTEMPT_TAG, RECOVERY_CHAIN_TAG, RECOVERY_OF_TAG, RECOVERY_REASON_TAG
from pipelines.ingest.generate import generate
from tests.streams import STREAMS
from assets.automation import FAILURE_SENSOR_ENV
from statetables.servers import dagster_dev, free_port, launch_run, list_runs, run_status, sensor_ticks, terminate_run
from tests.contract_oracle import expected_state, landing_files

pytestmark = pytest.mark.long

# The run-failure sensor's interval under this test's daemon: a recovery starts seconds after the kill.
FAILURE_SENSOR_S = 5
CONFIG = {"ops": {"keep_streams_running": {"config": {
    "trigger_seconds": 1.0, "report_every_seconds": 5.0, "event_time_steps": True}}}}


def _state(layout, spec) -> dict | None:
    table = spec.state_tables[0]
    path = layout.table(table.name)
    try:
        rows = IndependentDeltaTable(str(path)).to_pyarrow_table().to_pylist()
    except TableNotFoundError:  # not created yet, or being created: `_delta_log/` before its first commit
        return None
    return {r[table.key]: (r[table.count_column], r[table.sum_column]) for r in rows}


def _expected(layout, spec) -> dict:
    expected = expected_state(spec.name, landing_files(layout.landing(spec.name)))
    return {k: (expected.counts[k], expected.sums[k]) for k in expected.counts}


def _wait_until_equal(layout, url: str, run_id: str, timeout_s: float) -> None:
    """Wait until both state tables equal the oracle while `run_id` runs. A run that ends meanwhile fails the test
    with its failures: the only failure this test expects is the one it causes (its kill -9), and it asserts that
    one's recovery."""
    deadline = time.monotonic() + timeout_s
    while not all(_state(layout, spec) == _expected(layout, spec) for spec in STREAMS.values()):
        status = run_status(url, run_id)
        assert status in ("STARTING", "STARTED", "QUEUED", "NOT_STARTED"), \
            f"run {run_id} is {status}: {[f[-1500:] for f in _failures(layout, run_id)]}"
        assert time.monotonic() < deadline, {s: (len(_state(layout, spec) or {}), len(_expected(layout, spec)))
                                             for s, spec in STREAMS.items()}
        time.sleep(1)


def _recoveries_of(url: str, run_id: str) -> list[dict]:
    return [r for r in list_runs(url) if r["tags"].get(RECOVERY_OF_TAG) == run_id]


def _recovery_of(url: str, run_id: str) -> dict:
    deadline = time.monotonic() + 240  # the run-failure sensor's tick, then the run's start
    while not (recoveries := _recoveries_of(url, run_id)):
        assert time.monotonic() < deadline, (f"no recovery of run {run_id}; runs: "
                                             f"{[(r['runId'], r['status'], r['tags']) for r in list_runs(url)]}")
        time.sleep(3)
    return recoveries[0]


def _wait_for_ticks_after(url: str, sensor: str, moment: float, ticks: int = 2) -> None:
    """Wait until the daemon has evaluated `sensor` `ticks` times since `moment` (epoch seconds)."""
    deadline = time.monotonic() + 120
    while sum(1 for t in sensor_ticks(url, sensor, limit=ticks) if t["timestamp"] > moment
              and t["status"] != "STARTED") < ticks:
        assert time.monotonic() < deadline, f"the daemon did not evaluate {sensor} twice in 120 s"
        time.sleep(2)


def _failures(layout, run_id: str) -> list[str]:
    """The run's step and run failure messages, with their causes: what a failed run says about itself."""
    found = []
    with dg.DagsterInstance.from_config(str(layout.dagster_home)) as instance:
        for kind in (dg.DagsterEventType.STEP_FAILURE, dg.DagsterEventType.RUN_FAILURE):
            for record in instance.all_logs(run_id, of_type=kind):
                error = getattr(record.dagster_event.event_specific_data, "error", None)
                found.append(error.to_string() if error is not None else record.dagster_event.message)
    return found


def _said(layout, run_id: str) -> dict[str, list[str]]:
    """The ends of what the run and the engine logged (the run's captured stderr, the Connect server's log): what a
    run that does not end was doing."""
    said = {}
    for log in [*(Path(layout.dagster_home) / "storage" / run_id).glob("compute_logs/*.err"),
                Path(layout.home) / "logs" / "spark-connect.log"]:
        said[log.name] = [line[:300] for line in log.read_text(errors="replace").splitlines()
                          if not line.startswith(("\t", " "))][-40:]
    return said


def _run_worker_pid(instance: dg.DagsterInstance, run_id: str) -> int:
    for record in instance.all_logs(run_id, of_type=dg.DagsterEventType.ENGINE_EVENT):
        data = record.dagster_event.engine_event_data
        if data and "pid" in data.metadata:
            return int(data.metadata["pid"].value)
    raise AssertionError(f"no run worker pid in the events of {run_id}")


def _drop(layout, seed: int, sub: str) -> None:
    for spec in STREAMS.values():
        generate(spec, layout.landing(spec.name) / sub, events=300, malformed=0.03, duplicates=0.03, conflicts=0.01,
                 seed=seed, events_per_file=150)


def test_continuous_job_follows_landing_survives_kill_9_and_cancels(layout, monkeypatch):
    """Every query in a warm Spark Connect server, each from a Connect session of its own; the kill -9 kills the
    client only, and the recovery run's queries take over the checkpoints from the queries the dead client left
    running."""
    monkeypatch.setenv(FAILURE_SENSOR_ENV, str(FAILURE_SENSOR_S))  # the daemon's copy of the code location reads it
    with dagster_dev(layout, port=free_port(), engine_port=free_port()) as url:
        dagster_home = Path(layout.dagster_home)
        # With the windows and sessions: their first state is kept frames made in each query's thread.
        run_id = launch_run(url, CONTINUOUS_JOB, CONFIG)
        _drop(layout, seed=11, sub="first")  # while the run starts: the files land during the run
        # Generous: on 2 oversubscribed cores a run took 100 s to start its queries, and a Python worker that misses
        # its connect-back is tried again for minutes (pipelines/runtime/query.py). A passing run waits far less.
        _wait_until_equal(layout, url, run_id, timeout_s=420)

        with dg.DagsterInstance.from_config(str(dagster_home)) as instance:
            # It reports as it goes: materializations of the state tables with their figures, and passing checks.
            deadline = time.monotonic() + 60
            while True:
                event = instance.get_latest_materialization_event(dg.AssetKey("payments_per_customer"))
                if (event is not None and event.run_id == run_id
                        and event.asset_materialization.metadata["keys"].value > 0):
                    break
                assert time.monotonic() < deadline, f"no materialization of the data by run {run_id}"
                time.sleep(2)
            metadata = event.asset_materialization.metadata
            assert metadata["mode"].value == "continuous"
            assert metadata["latest_event_time"].value > 0  # a timestamp
            # totals_match_bronze is reported once the newest batch says which bronze version it covers: a report
            # or two after the first materialization.
            deadline = time.monotonic() + 60
            while True:
                checks = [r for r in instance.all_logs(run_id, of_type=dg.DagsterEventType.ASSET_CHECK_EVALUATION)]
                names = {(c.dagster_event.event_specific_data.asset_key.to_user_string(),
                          c.dagster_event.event_specific_data.check_name, c.dagster_event.event_specific_data.passed)
                         for c in checks}
                if ("payments_per_customer", "totals_match_bronze", True) in names:
                    break
                assert time.monotonic() < deadline, names
                time.sleep(2)
            assert not [n for n in names if not n[2]], names

            # kill -9 the run worker: the code server reports the run failed, the sensor starts it again.
            os.kill(_run_worker_pid(instance, run_id), signal.SIGKILL)
            recovery = _recovery_of(url, run_id)
            assert recovery["jobName"] == CONTINUOUS_JOB, recovery
            assert (recovery["tags"][RECOVERY_CHAIN_TAG], recovery["tags"][RECOVERY_ATTEMPT_TAG]) == (run_id, "1")
            assert recovery["tags"][RECOVERY_REASON_TAG].startswith(f"run {run_id} failed")
            assert run_status(url, run_id) == "FAILURE"

            _drop(layout, seed=12, sub="second")
            live = recovery["runId"]
            _wait_until_equal(layout, url, live, timeout_s=420)
            # One writer: while a continuous run was in progress, or its recovery due, no orchestrated run started.
            assert {r["jobName"] for r in list_runs(url)} == {CONTINUOUS_JOB}

            # Dagster cannot cancel a run still STARTING.
            deadline = time.monotonic() + 180
            while (status := run_status(url, live)) != "STARTED":
                assert status in ("QUEUED", "NOT_STARTED", "STARTING") and time.monotonic() < deadline, status
                time.sleep(2)
            terminate_run(url, live)
            deadline = time.monotonic() + 180
            while (status := run_status(url, live)) != "CANCELED":
                assert status in ("STARTED", "CANCELING"), status
                assert time.monotonic() < deadline, (status, _said(layout, live))
                time.sleep(2)
            # Cancelled is not failed: the run-failure sensor, evaluated twice since, started no recovery of it (it
            # did start one of the killed run above).
            _wait_for_ticks_after(url, "recover_failed_stream", time.time())
            assert not _recoveries_of(url, live)
    for spec in STREAMS.values():
        assert _state(layout, spec) == _expected(layout, spec)
