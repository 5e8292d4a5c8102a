"""Configuration errors of the `statetables` command: one clear message naming the fix, exit code 2,
no traceback, and nothing created under the storage root. Runs the real command as a subprocess (no
Spark is started: every error here is found before). Not covered: errors inside a Dagster run
(tests/assets/test_dagster.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from statetables.servers import free_port

COMMAND = [sys.executable, "-m", "statetables.cli"]


def _statetables(home: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "STATETABLES_HOME": str(home)}
    env.pop("DAGSTER_HOME", None)
    return subprocess.run([*COMMAND, *args], env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args", [["run"], ["generate", "--events", "1"], ["savepoint", "list"]])
def test_a_file_as_storage_root_is_refused_with_the_fix(tmp_path, args):
    root = tmp_path / "not-a-folder"
    root.write_text("x")
    for home in (root, root / "below"):
        done = _statetables(home, *args)
        assert done.returncode == 2, done.stderr
        assert "is a file" in done.stderr and "Fix: set STATETABLES_HOME" in done.stderr
        assert "Traceback" not in done.stderr + done.stdout
    assert root.read_text() == "x"


def test_an_unknown_job_is_refused_before_anything_is_created(tmp_path):
    home = tmp_path / "home"
    done = _statetables(home, "run", "--job", "nope")
    assert done.returncode == 2
    assert "Unknown job 'nope'" in done.stderr and "advance_all" in done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    assert not home.exists()


@pytest.mark.parametrize("name", ["with:colon", "glob[x]", "{a,b}", "star*"])
def test_a_storage_root_spark_cannot_address_is_refused(tmp_path, name):
    done = _statetables(tmp_path / name, "run")
    assert done.returncode == 2 and "Fix: set STATETABLES_HOME" in done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    assert not (tmp_path / name).exists()


@pytest.mark.parametrize("item, message", [
    ("  - ttl_days: 0\n    sql: CREATE TABLE t AS SELECT customer_id, COUNT(*) AS n FROM payments GROUP BY customer_id",
     "ttl_days is 0"),
    ("  - CREATE TABLE t AS SELECT customer_id, amount AS n FROM payments GROUP BY customer_id",
     "`amount` is neither grouped nor aggregated"),
    ("  - CREATE TABLE t AS SELECT customer_id, COUNT(*) AS n FROM refunds GROUP BY customer_id", "no such stream"),
])
def test_a_bad_project_file_is_refused_before_anything_is_created(tmp_path, item, message):
    from pipelines.declare.project import SHIPPED

    project = tmp_path / "statetables.yaml"
    project.write_text(SHIPPED.read_text() + item + "\n")
    line = len(SHIPPED.read_text().splitlines()) + 1
    home = tmp_path / "home"
    done = _statetables(home, "--project", str(project), "run")
    assert done.returncode == 2 and message in done.stderr and "Fix:" in done.stderr, done.stderr
    assert f"statetables.yaml:{line}:" in done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    assert not home.exists()


@pytest.mark.parametrize("root, message", [
    ("abfss://lake@account.dfs.core.windows.net/st", "does not support"),
    ("s3://bucket/statetables", "write s3a://bucket/prefix"),
    # No server at the endpoint: refused before a JVM starts, naming the fix (tests/test_object_store.py has the
    # store that answers).
    ("s3a://bucket/statetables", "does not answer"),
])
def test_an_object_store_root_is_never_taken_for_a_local_folder(root, message, monkeypatch):
    # `Path("s3a://b/x")` is the local folder ./s3a:/b/x: the run must go to the store or refuse, never write there.
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "statetables")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "statetables-secret")
    done = _statetables(root, "run")
    assert done.returncode == 2 and message in done.stderr and "Fix:" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    assert not Path(root.split("/")[0]).exists()
