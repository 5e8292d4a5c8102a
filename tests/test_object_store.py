"""The whole product on an `s3a://` storage root, against a real S3 server (s3proxy, started here:
tests/object_store.py), read back with an independent reader (`deltalake`) and the independent oracle.

Covers: the writer lease between OS processes (one holds, the other waits and is refused; a holder killed with
kill -9 loses it within its lifetime, the next takes over; the loser's fence refuses its next commit); two
deliveries of both contract streams through `statetables run` (as a user runs it), each run killed (kill -9) at a
named point between a batch's commits, the second after the checkpoints were lost, then a clean run through a Spark
Connect server in front of a standalone cluster whose worker shares nothing with the driver but the bucket: every
key, window and session equal to the oracle, nothing written to the working folder; bad configuration refused
before anything is written.
Not covered: a bucket on AWS itself (no network here)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path
from urllib.parse import unquote

import pytest

from pipelines import faults
from pipelines.declare.project import SHIPPED
from pipelines.errors import StreamBusyError
from pipelines.runtime.locks import Fence, LeaseLostError, lock_state, writer_lock
from pipelines.storage.files import S3Path
from pipelines.storage.layout import HOME_ENV, StorageLayout
from tests.chaos import ChaosReport, compare
from tests.object_store import s3_store
from statetables.servers import free_port, spark_connect_server, spark_standalone

pytestmark = pytest.mark.long

COMMAND = [sys.executable, "-m", "statetables.cli"]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """One S3 server for the module's tests (each under a prefix of its own), per pytest-xdist worker."""
    with s3_store(tmp_path_factory.mktemp("s3"), log_requests=True) as running:
        yield running


def _hold(root: str, ready: Path) -> subprocess.Popen:
    """Another process (another storage-root cache, as another machine would have) holding payments' lease."""
    code = textwrap.dedent(f"""
        import json
        import time
        from pathlib import Path
        from pipelines.storage.layout import HOME_ENV, StorageLayout
        from pipelines.runtime.locks import writer_lock
        with writer_lock(StorageLayout.under({root!r}).locks, "payments", 30) as fence:
            Path({str(ready)!r}).write_text(json.dumps([fence.lease, fence.token]))
            time.sleep(600)
    """)
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True)


def test_one_writer_across_processes_and_a_killed_holder_loses_its_lease(store, tmp_path):
    root = f"s3a://{store.bucket}/lease"
    locks = StorageLayout.under(root).locks
    ready = tmp_path / "holder-token"
    holder = _hold(root, ready)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert holder.poll() is None and time.monotonic() < deadline, "the holder did not get the lease"
            time.sleep(0.2)
        state = lock_state(locks, "payments")
        assert state["held"] and state["pid"] == holder.pid, state

        with pytest.raises(StreamBusyError, match=f"pid {holder.pid} .*Nothing was written"):
            with writer_lock(locks, "payments", 3):
                pass  # pragma: no cover - must not be reached

        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait()
        # The dead holder renewed nothing after this: the lease expires at its last renewal plus its lifetime, and
        # the next writer takes it over then (it waits up to 60 s, several lifetimes), naming whom it took it from.
        with writer_lock(locks, "payments", 60) as fence:
            lease = json.loads(S3Path.parse(fence.lease).read_text())
            assert lease["token"] == fence.token and f"pid {holder.pid}" in lease["took_over_from"]
            fence()  # this run's batches may commit
            with pytest.raises(LeaseLostError, match="no longer holds the writer lease"):
                Fence(*json.loads(ready.read_text()))()  # the dead holder's batches may not

        # Released, not expired: the next run takes it at once.
        started = time.monotonic()
        with writer_lock(locks, "payments", 2):
            assert time.monotonic() - started < 2
        assert lock_state(locks, "payments")["held"] is False
    finally:
        if holder.poll() is None:
            os.killpg(holder.pid, signal.SIGKILL)


def _statetables(home: str, dagster: Path, *args: str, cwd: Path, faults_dir: Path | None = None
                 ) -> subprocess.CompletedProcess:
    """A command as a user runs it; with `faults_dir`, its armed fault point must kill it (SIGKILL)."""
    # From a folder of its own: the project file is named (a command never falls back to the checkout's).
    env = {**os.environ, "STATETABLES_HOME": home, "DAGSTER_HOME": str(dagster), "STATETABLES_PROJECT": str(SHIPPED),
           **({faults.FAULTS_ENV: str(faults_dir)} if faults_dir else {})}
    # A session of its own: the fault point kills the command's whole process group (its Spark JVM too).
    done = subprocess.run([*COMMAND, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=900,
                          start_new_session=True)
    wanted = -signal.SIGKILL if faults_dir else 0
    assert done.returncode == wanted, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def test_deliveries_kills_lost_checkpoints_and_a_cluster_on_an_object_store_equal_the_oracle(store, tmp_path,
                                                                                              monkeypatch):
    """Every command a user runs on a bucket, from an empty working folder that stays empty: nothing of the product
    is written locally (the Dagster instance is DAGSTER_HOME's, outside it). The first delivery's run is killed
    (kill -9) after a state table's MERGE, before Spark's checkpoint commit: the next run replays that batch, which
    finds its commits in the tables' logs on the store. The checkpoints are then lost, and the second delivery's run
    is killed while Spark writes a checkpoint's commit file: a batch the next run must see as unfinished. One clean
    run on a cluster that shares only the bucket, and every key, window and session equals the oracle. After
    bronze's commit: tests/test_chaos.py."""
    root = f"s3a://{store.bucket}/two-runs"
    dagster, work = tmp_path / "dagster", tmp_path / "work"
    work.mkdir()
    layout = StorageLayout.under(root)
    statetables = lambda *args, **kw: _statetables(root, dagster, *args, cwd=work, **kw)  # noqa: E731

    def killed_at(point: str, **options) -> None:
        folder = tmp_path / f"faults-{point}"
        faults.arm(folder, point, "kill", **options)
        statetables("run", faults_dir=folder)

    statetables("generate", "--events", "1000", "--malformed", "0.02", "--duplicates", "0.03", "--conflicts", "0.01",
                "--late", "0.05", "--seed", "1", "--events-per-file", "500")
    killed_at(faults.STATE_AFTER_MERGE_COMMIT)
    assert [p.name for p in S3Path.parse(f"{root}/landing/payments").iterdir()], "the files went to the bucket"
    # The second delivery finds the checkpoints lost: every landing file is read again, nothing is counted twice.
    for path, _ in layout.checkpoints_root.files():
        path.unlink()
    statetables("generate", "--events", "600", "--duplicates", "0.03", "--late", "0.05", "--seed", "2",
                "--events-per-file", "300")
    killed_at(faults.STREAM_BATCH_END, delay=0.05)
    # The clean run: the thin client of a Spark Connect server in front of a standalone cluster whose worker runs as
    # another user (nobody), in a folder and an environment of its own, without the storage root or the credentials
    # (its executors get them from the driver's confs): more than one machine, as one host allows.
    monkeypatch.setenv(HOME_ENV, root)  # the Connect server takes the S3 connector and its settings from it
    cluster = tmp_path / "cluster"
    with spark_standalone(port=free_port(), log_dir=cluster / "standalone-logs", worker_memory="3g",
                          worker_apart_as="nobody") as master, \
            spark_connect_server(port=free_port(), log=cluster / "connect-in-front.log",
                                 conf={"spark.master": master, "spark.executor.memory": "1g"}) as url:
        assert "SUCCESS" in statetables("run", "--remote", url).stdout
    # The batches' tasks ran in executors of the worker apart.
    assert "Asked to launch executor" in (cluster / "standalone-logs" / "worker.log").read_text(errors="replace")

    # Operating it on a bucket: the status (landing listed from the store, the lease read back), a savepoint.
    status = json.loads(statetables("status", "--json").stdout)
    assert status["storage_root"] == root
    payments = status["streams"]["payments"]
    assert payments["landing"]["pending"] == 0 and payments["writer_lock"]["held"] is False
    assert payments["writer_lock"]["file"].startswith(f"{root}/locks/payments.lease")
    statetables("savepoint", "create", "on-s3")
    assert statetables("savepoint", "list").stdout.startswith("on-s3\t")
    assert list(work.iterdir()) == [], "a command wrote to the working folder"

    report = ChaosReport()
    compare(layout, report, ["movie_ticket_sales", "payments"], {})
    assert report.keys_compared["movie_tickets_sold"] > 20 and report.keys_compared["payments_per_customer"] > 50
    assert report.keys_compared["customer_activity"] > 50 and report.keys_compared["tickets_per_title_hourly"] > 20
    assert report.differences == 0, (report.keys_differing, report.rows_differing)
    assert not Path("s3a:").exists() and not (tmp_path / "s3a:").exists()  # nothing went to a local folder
    requests = store.requests()
    assert requests.get("PutObject", 0) > 100 and requests.get("GetObject", 0) > 100, requests
    # A table's log holds every commit for 30 days: looking for new commits must not list it from its beginning.
    # Delta's log store (S3A's listings of 5,000 keys) and table_version (boto3's) list after a version; a whole
    # listing is only a first look at a table without a checkpoint, at most once per table and process.
    listings = [q for q in store.listings("_delta_log")  # this test's tables; not S3A's folder probes
                if unquote(q.get("prefix", [""])[0]).startswith("two-runs/") and q.get("max-keys") != ["2"]]
    delta = [q for q in listings if q.get("max-keys") == ["5000"]]
    assert delta and all("start-after" in q for q in delta)
    whole = Counter(q["prefix"][0] for q in listings if "start-after" not in q)
    # Each process above that reads tables (three runs and their Dagster steps, the Connect server, status, two
    # savepoint commands)
    # looks at a table once without a version to start from. When every look listed the whole log it was some 7 a
    # table and run (one +2k run measured).
    assert max(whole.values()) <= 20, whole


@pytest.mark.parametrize("change, message", [
    ({"STATETABLES_HOME": "s3a://no-such-bucket/x"}, "the bucket no-such-bucket does not exist"),
    ({"AWS_SECRET_ACCESS_KEY": "wrong"}, "refused the credentials"),
    ({"AWS_ACCESS_KEY_ID": None, "AWS_SECRET_ACCESS_KEY": None}, "no credentials were found"),
    ({"STATETABLES_JARS_DIR": "EMPTY"}, "make jars-s3"),
])
def test_bad_object_store_configuration_fails_before_anything_is_written(store, tmp_path, change, message):
    root = f"s3a://{store.bucket}/refused"
    env = {**os.environ, "STATETABLES_HOME": root, "DAGSTER_HOME": str(tmp_path / "dagster"),
           "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"), "AWS_CONFIG_FILE": str(tmp_path / "none"),
           "AWS_EC2_METADATA_DISABLED": "true"}
    for key, value in change.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = str(tmp_path) if value == "EMPTY" else value
    done = subprocess.run([*COMMAND, "run"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and message in done.stderr and "Fix:" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    assert not S3Path.parse(root).is_dir()  # nothing written under the root
    assert not (tmp_path / "dagster").exists()
