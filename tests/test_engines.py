"""Every asset of both streams end to end under Dagster, and the same pipeline on three Spark engines gives the
same tables.

Covers: the job `advance_all` (ingest, quarantine, all-time MERGE, windows and sessions over Delta state tables,
changelogs, the 13 blocking checks) executed by Dagster in process on the test session's embedded JVM, with the
metadata it reports; then the same landing files through `statetables run` as a thin client of a warm Spark Connect
server carrying Delta (`advance_all`, then a run with nothing new), and on a standalone master + worker
(`advance_payments`). Every Delta table of each run, read back with the independent `deltalake` reader, must equal
the embedded run's. The servers are the project's own (statetables/servers.py), on 127.0.0.1. A Connect server in
front of a standalone master whose worker shares only a bucket: tests/test_object_store.py (against the oracle).

The embedded run is made once per test session (the first worker that needs it runs it, the others read its
tables) and is the fast loop's end-to-end Dagster test; the Connect and standalone comparisons, each starting
server JVMs of their own, are in the long tier (`make test-long`; .ci/run runs both tiers).
Not covered here: continuous mode (over Connect: tests/assets/test_continuous.py), clusters of several hosts
(docs/deploy.md).
"""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import dagster as dg
import pytest
from filelock import FileLock

from pipelines.ingest.generate import generate
from pipelines.runtime.spark import JVM_START_NOISE
from pipelines.storage.layout import HOME_ENV, StorageLayout
from tests.contract_oracle import independent_table
from tests.streams import STREAMS
from assets.automation import spark_engine_health
from resources import SparkSessionResource
from statetables.definitions import defs
from statetables.servers import free_port, spark_connect_server, spark_standalone

STATETABLES = str(Path(sys.executable).parent / "statetables")
# Columns that record when or in which run something was written, not what: they differ by nature.
# The event-time tables of one stream's job (late_events is shared, per `stream` column).
STREAM_ONLY_TABLES = {"movie_ticket_sales": {"tickets_per_title_hourly", "top_titles_hourly",
                                             "tickets_per_title_hourly_state"},
                      "payments": {"customer_activity", "customer_activity_state"}}
WHEN_WRITTEN = {"updated_at", "ingested_at", "_commit_timestamp", "scanned_at", "ingest_batch_id"}


@contextmanager
def made_once(tmp_path_factory, worker_id: str, name: str) -> Iterator[tuple[Path, bool]]:
    """A folder of this test session that the first pytest-xdist worker to get here fills and the others read
    (under a file lock): (folder, whether it is already filled)."""
    if worker_id == "master":  # one process: nothing to share
        yield tmp_path_factory.mktemp(name), False
        return
    shared = tmp_path_factory.getbasetemp().parent / name  # the session's folder, above every worker's own
    with FileLock(f"{shared}.lock"):
        done = shared / ".made"
        yield shared, done.exists()
        shared.mkdir(exist_ok=True)
        done.touch()


@pytest.fixture(scope="module")
def landing_files(tmp_path_factory, worker_id) -> Path:
    """Both streams' landing files (malformed lines, re-deliveries, late events), written once per session: every
    engine's run reads copies of the same files (names and modification times included)."""
    with made_once(tmp_path_factory, worker_id, "engines-source") as (home, made):
        layout = StorageLayout.under(home)
        if not made:
            for seed, spec in enumerate(STREAMS.values(), start=11):
                generate(spec, layout.landing(spec.name), events=1500, malformed=0.01, duplicates=0.02, late=0.03,
                         seed=seed, events_per_file=500)
    return layout.home / "landing"


def run_pipeline(landing: Path, home: Path, *engine: str) -> StorageLayout:
    shutil.copytree(landing, home / "landing", copy_function=shutil.copy2)  # same names and mtimes
    env = {**os.environ, HOME_ENV: str(home)}
    env.pop("DAGSTER_HOME", None)
    done = subprocess.run([STATETABLES, "run", "--log-level", "WARNING", *engine], env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "SUCCESS" in done.stdout and "FAILED" not in done.stdout, done.stdout[-3000:]
    # The product's output only: a driver JVM's start-up lines are filtered out (pipelines/runtime/spark.py).
    noise = [line for line in done.stderr.splitlines() if line.encode().startswith(JVM_START_NOISE)]
    assert not noise, noise
    return StorageLayout.under(home)


def assert_warms_up(url: str, home: Path) -> None:
    """`statetables warm-up` runs its micro-batches of every stream in the engine on a scratch root it deletes (the
    small ones, then two run as large batches), and writes nothing under the storage root."""
    scratch = home / "scratch"
    scratch.mkdir()
    env = {**os.environ, HOME_ENV: str(home), "TMPDIR": str(scratch)}
    done = subprocess.run([STATETABLES, "warm-up", "--remote", url, "--batches", "2", "--large-events", "300",
                           "--large-batches", "2"],
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for stream in ("payments", "movie_ticket_sales"):
        assert f"{stream}: 4 micro-batches in" in done.stdout, done.stdout
    assert not list(scratch.iterdir()) and sorted(p.name for p in home.iterdir()) == ["scratch"]
    scratch.rmdir()


def table_rows(layout: StorageLayout) -> dict[str, list[tuple]]:
    root = str(layout.home)
    tables = {}
    for path in sorted(layout.table("x").parent.iterdir()):
        rows = independent_table(path).to_pyarrow_table().to_pylist()
        normalised = [tuple(sorted((k, v.replace(root, "<root>") if isinstance(v, str) else v)
                                   for k, v in row.items() if k not in WHEN_WRITTEN)) for row in rows]
        tables[path.name] = sorted(normalised, key=repr)
    return tables


def run_embedded(landing: Path, home: Path) -> StorageLayout:
    """`advance_all` executed by Dagster in this process, on the test session's SparkSession (what `statetables
    run` does in its own process); asserts what Dagster reports of it."""
    shutil.copytree(landing, home / "landing", copy_function=shutil.copy2)
    with pytest.MonkeyPatch.context() as patch, dg.DagsterInstance.ephemeral() as instance:
        patch.setenv(HOME_ENV, str(home))
        result = defs.resolve_job_def("advance_all").execute_in_process(instance=instance)
    assert result.success
    checks = [e.event_specific_data for e in result.all_events if e.event_type_value == "ASSET_CHECK_EVALUATION"]
    assert len(checks) == 13 and all(c.passed for c in checks), [(c.check_name, c.metadata) for c in checks
                                                                 if not c.passed]
    def materialized(node: str, asset: str):
        return next(m.metadata for m in result.asset_materializations_for_node(node) if m.asset_key.path == [asset])

    hourly = materialized("movie_ticket_sales", "tickets_per_title_hourly")
    assert hourly["windows_closed_this_run"].value > 0 and hourly["watermark"].value.startswith("2026-")
    activity = materialized("payments", "customer_activity")
    assert activity["sessions_closed_this_run"].value > 0 and activity["operator_state_rows"].value > 0
    newest = [r.data for r in activity["newest_rows"].records]  # the newest closed sessions, newest first (delta-rs)
    assert len(newest) == 10 and newest == sorted(newest, key=lambda r: r["session_start"], reverse=True)
    assert activity["newest_rows"].schema.columns[0].name == "customer_id"
    hourly_newest = [r.data["window_start"] for r in hourly["newest_rows"].records]
    assert hourly_newest and hourly_newest == sorted(hourly_newest, reverse=True)
    bronze = materialized("movie_ticket_sales", "movie_ticket_sales_bronze")
    assert bronze["lines_read"].value == 1500
    assert hourly["bronze_rows_read"].value == bronze["rows_accepted"].value  # each bronze row read once
    state = materialized("movie_ticket_sales", "movie_tickets_sold")
    assert state["events_counted"].value == bronze["rows_accepted"].value
    assert state["lines_read"].value == 1500 and state["rows_accepted"].value == bronze["rows_accepted"].value
    # Every key inserted once (a new table's first fold appends them, a MERGE inserts the later ones), each batch's
    # other keys updated.
    assert state["rows_inserted"].value == state["keys"].value > 0
    assert state["keys_in_batches"].value == state["rows_inserted"].value + state["rows_updated"].value
    top = state["top_rows"]  # a real table in the UI: typed columns, the 10 titles with most tickets
    assert top.schema.columns[0].name == "title" and len(top.records) == 10
    assert top.records[0].data["tickets_sold"] >= top.records[-1].data["tickets_sold"]
    return StorageLayout.under(home)


def assert_same_tables(tables: dict, expected: dict) -> None:
    assert sorted(tables) == sorted(expected)
    differing = {name: (len(tables[name]), len(expected[name])) for name in expected if tables[name] != expected[name]}
    assert not differing, f"tables that differ from the embedded engine's (rows, expected rows): {differing}"


def one_stream(tables: dict, stream: str) -> dict:
    """What one stream's job writes, from a run of both: its tables, and its own rows of the shared late_events."""
    spec = STREAMS[stream]
    mine = {spec.bronze_table, spec.quarantine_table, f"{stream}_files", spec.state_tables[0].name} | \
        STREAM_ONLY_TABLES[stream]
    subset = {name: rows for name, rows in tables.items() if name in mine}
    subset["late_events"] = [row for row in tables["late_events"] if dict(row)["stream"] == stream]
    return subset


@pytest.fixture(scope="module")
def embedded(landing_files, tmp_path_factory, worker_id, request) -> dict:
    """Every table of `advance_all` run under Dagster on the embedded JVM: the reference of the other engines. Run
    once per session, by the first worker that needs it (its assertions on Dagster's report included)."""
    with made_once(tmp_path_factory, worker_id, "engines-embedded") as (folder, made):
        tables = folder / "tables.pickle"
        if not made:
            request.getfixturevalue("spark")  # this worker's session, started before the run uses it
            folder.mkdir(exist_ok=True)
            tables.write_bytes(pickle.dumps(table_rows(run_embedded(landing_files, folder / "home"))))
        return pickle.loads(tables.read_bytes())


def test_every_asset_of_both_streams_under_dagster_on_the_embedded_jvm(embedded):
    assert len(embedded["payments_per_customer"]) > 100 and embedded["payments_quarantine"]
    assert embedded["customer_activity"] and embedded["tickets_per_title_hourly"]


@pytest.mark.long
def test_a_warm_connect_server_and_a_standalone_cluster_give_the_embedded_tables(embedded, landing_files,
                                                                                 tmp_path_factory):
    """Through one warm Connect server: `advance_all` gives every table the embedded run gave, and a second run
    with nothing new changes none; the health sensor sees the server. Then a standalone master + worker reached
    directly (`--master`, payments). A Connect server in front of a master, on a bucket: tests/test_object_store.py."""
    home = tmp_path_factory.mktemp("connect")
    with spark_connect_server(port=free_port(), log=home.parent / "connect-server.log") as url:
        assert_warms_up(url, home)
        with dg.build_sensor_context(resources={"spark": SparkSessionResource(remote=url)}) as context:
            assert f"{url} answers" in spark_engine_health(context).skip_message
        connect = table_rows(run_pipeline(landing_files, home, "--remote", url))
        assert_same_tables(connect, embedded)
        shutil.rmtree(home / "landing")
        assert table_rows(run_pipeline(landing_files, home, "--remote", url)) == connect

    home = tmp_path_factory.mktemp("standalone")
    with spark_standalone(port=free_port(), log_dir=home.parent / "standalone-logs", worker_memory="3g") as master:
        standalone = table_rows(run_pipeline(landing_files, home, "--master", master, "--job", "advance_payments"))
    assert_same_tables(standalone, one_stream(embedded, "payments"))
