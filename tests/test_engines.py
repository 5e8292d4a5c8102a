"""The same pipeline on three Spark engines gives the same tables.

Covers: `statetables run` (every asset of both streams: ingest, quarantine, all-time MERGE, windows
and sessions with transformWithState, changelogs, the blocking checks) on the embedded JVM, over a
Spark Connect server carrying Delta, and on a standalone master + worker; every Delta table of each
run, read back with the independent `deltalake` reader, must equal the embedded engine's.
The servers are the project's own (statetables/servers.py), on 127.0.0.1, started once per module.

Not covered here: continuous mode on these engines, and clusters of several hosts (docs/deploy.md).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from deltalake import DeltaTable as IndependentDeltaTable

from pipelines.generate import generate
from pipelines.layout import HOME_ENV, StorageLayout
from pipelines.streams import STREAMS
from statetables.servers import spark_connect_server, spark_standalone

STATETABLES = str(Path(sys.executable).parent / "statetables")
# Columns that record when or in which run something was written, not what: they differ by nature.
WHEN_WRITTEN = {"updated_at", "ingested_at", "_commit_timestamp", "scanned_at", "ingest_batch_id"}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def landing_files(tmp_path_factory) -> Path:
    """Both streams' landing files (malformed lines, re-deliveries, late events), written once."""
    home = tmp_path_factory.mktemp("engines-source")
    layout = StorageLayout.under(home)
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
    return StorageLayout.under(home)


def table_rows(layout: StorageLayout) -> dict[str, list[tuple]]:
    root = str(layout.home)
    tables = {}
    for path in sorted(layout.table("x").parent.iterdir()):
        rows = IndependentDeltaTable(str(path)).to_pyarrow_table().to_pylist()
        normalised = [tuple(sorted((k, v.replace(root, "<root>") if isinstance(v, str) else v)
                                   for k, v in row.items() if k not in WHEN_WRITTEN)) for row in rows]
        tables[path.name] = sorted(normalised, key=repr)
    return tables


@pytest.fixture(scope="module")
def embedded_tables(landing_files, tmp_path_factory) -> dict[str, list[tuple]]:
    tables = table_rows(run_pipeline(landing_files, tmp_path_factory.mktemp("embedded")))
    assert len(tables["payments_per_customer"]) > 100 and tables["payments_quarantine"] and tables["customer_activity"]
    return tables


def assert_same_tables(tables: dict, expected: dict) -> None:
    assert sorted(tables) == sorted(expected)
    differing = {name: (len(tables[name]), len(expected[name])) for name in expected if tables[name] != expected[name]}
    assert not differing, f"tables that differ from the embedded engine's (rows, expected rows): {differing}"


def test_spark_connect_gives_the_embedded_engines_tables(landing_files, embedded_tables, tmp_path_factory):
    home = tmp_path_factory.mktemp("connect")
    with spark_connect_server(port=free_port(), log=home.parent / "connect-server.log") as url:
        layout = run_pipeline(landing_files, home, "--remote", url)
    assert_same_tables(table_rows(layout), embedded_tables)


def test_standalone_cluster_gives_the_embedded_engines_tables(landing_files, embedded_tables, tmp_path_factory):
    home = tmp_path_factory.mktemp("standalone")
    with spark_standalone(port=free_port(), log_dir=home.parent / "standalone-logs", worker_memory="3g") as url:
        layout = run_pipeline(landing_files, home, "--master", url)
    assert_same_tables(table_rows(layout), embedded_tables)
