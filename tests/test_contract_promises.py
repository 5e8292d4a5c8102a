"""Promises of ../shared/contract.md that no other test held the product to, each end to end on real Spark, Delta
and Dagster, each assertion one that fails when the promise breaks:

- the event-time range with `event_time_max_ahead_hours` set in the project file, which the next Dagster run follows
  without a reload (tests/pipelines/ingest/test_ingest.py has both ends of the default allowance, and the dedup
  horizon: a re-delivery far behind counts once, an id reused with other content inside the horizon is
  `conflicting_duplicate`);
- one writer between two OS processes: a run is refused, naming the lock and its holder, while another process
  holds the stream's writer lock; two runs that wait for it at once then advance the stream one after the other,
  and nothing counts twice;
- `statetables savepoint create|list|restore` and `statetables restore-changelog`, the commands themselves
  (`make test-long`).

Tables are read with the independent `deltalake` reader and compared with tests/contract_oracle.py where the
whole landing folder decides them.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path

import dagster as dg
import pytest
from deltalake import DeltaTable as IndependentDeltaTable

from pipelines.declare.project import PROJECT_ENV, SHIPPED
from pipelines.errors import StreamBusyError
from pipelines.ingest.generate import generate
from pipelines.storage.delta_log import table_version
from statetables import cli
from statetables.definitions import defs
from tests.contract_oracle import expected_state, landing_files
from tests.streams import MOVIE_TICKET_SALES, STREAMS, advance

ROOT = Path(__file__).resolve().parents[1]
SALES = MOVIE_TICKET_SALES


def _iso(moment: datetime) -> str:
    return moment.astimezone(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _sale(event_id: str, title: str, value: str, sale_ts: str | datetime) -> str:
    at = _iso(sale_ts) if isinstance(sale_ts, datetime) else sale_ts
    return json.dumps({"event_id": event_id, "title": title, "ticket_total_value": value, "sale_ts": at})


def _read(layout, name: str, version: int | None = None) -> list[dict]:
    return IndependentDeltaTable(str(layout.table(name)), version=version).to_pyarrow_table().to_pylist()


def _state(layout, spec=SALES) -> dict:
    """key → (count, sum) of the stream's state table."""
    table = spec.state_tables[0]
    return {r[table.key]: (r[table.count_column], r[table.sum_column]) for r in _read(layout, table.name)}


def _expected(layout, spec) -> dict:
    """key → (count, sum) the contract expects from every file in the stream's landing folder."""
    expected = expected_state(spec.name, landing_files(layout.landing(spec.name)))
    return {k: (expected.counts[k], expected.sums[k]) for k in expected.counts}


# --- 1. the event-time allowance -----------------------------------------------------------------------------------

def test_the_event_time_allowance_set_in_the_project_file_is_followed_by_the_next_dagster_run(spark, layout, landing,
                                                                                             monkeypatch):
    """Contract: event time, in UTC, lies between 1970-01-01T00:00:00Z and one day (configurable) after the line's
    ingestion; otherwise `out_of_range`. A Dagster run of advance_movie_ticket_sales after the project file set
    `event_time_max_ahead_hours: 2`: 1 h ahead is accepted (also written with a +05:00 offset, 6 h ahead on the wall
    clock), 3 h ahead is quarantined, and so is 23 h ahead, which the default accepts (both ends of the default:
    tests/pipelines/ingest/test_ingest.py)."""
    monkeypatch.setenv("STATETABLES_HOME", str(layout.home))  # the code location's storage resource reads it
    now = datetime.now(timezone.utc)
    ahead_1h_offset = (now + timedelta(hours=1)).astimezone(timezone(timedelta(hours=5)))
    landing.write(SALES.name, "two-hours.jsonl", [
        _sale("ahead-1h", "Dune", "2.00", now + timedelta(hours=1)),
        _sale("ahead-1h-offset", "Dune", "2.00", ahead_1h_offset.isoformat(timespec="seconds")),
        _sale("ahead-3h", "Dune", "2.00", now + timedelta(hours=3)),
        _sale("ahead-23h", "Dune", "2.00", now + timedelta(hours=23)),
    ])
    project = layout.home.parent / "statetables.yaml"
    shipped = SHIPPED.read_text()
    assert shipped.count("event_time_max_ahead_hours: 24") == 2
    project.write_text(shipped.replace("event_time_max_ahead_hours: 24", "event_time_max_ahead_hours: 2", 1))
    monkeypatch.setenv(PROJECT_ENV, str(project))
    with dg.DagsterInstance.ephemeral() as instance:
        result = defs.resolve_job_def(f"advance_{SALES.name}").execute_in_process(instance=instance)
    assert result.success
    assert {r["event_id"] for r in _read(layout, SALES.bronze_table)} == {"ahead-1h", "ahead-1h-offset"}
    quarantined = {r["record_id"]: r for r in _read(layout, SALES.quarantine_table)}
    assert {k: (r["reason"], r["reason_field"], Path(r["source_file"]).name) for k, r in quarantined.items()} == {
        "ahead-3h": ("out_of_range", "sale_ts", "two-hours.jsonl"),
        "ahead-23h": ("out_of_range", "sale_ts", "two-hours.jsonl")}
    assert "2 h after ingestion" in quarantined["ahead-3h"]["detail"]
    assert _state(layout) == {"Dune": (2, Decimal("4.00"))}


# --- 2. one writer between two processes ---------------------------------------------------------------------------

# Another process holding the stream's writer lock as a run does (pipelines/runtime/locks.py), until told to let go.
HOLD_LOCK = """
import sys, time
from pathlib import Path
from pipelines.runtime.locks import writer_lock
locks, stream, holding, release = sys.argv[1:5]
with writer_lock(Path(locks), stream, 30):
    Path(holding).touch()
    deadline = time.monotonic() + 600
    while not Path(release).exists():
        if time.monotonic() > deadline:
            sys.exit(3)
        time.sleep(0.05)
"""

# Another process advancing the stream: its own embedded Spark, the same pipeline call a run makes.
ADVANCE = """
import json, sys
from pipelines.storage.layout import StorageLayout
from pipelines.runtime.spark import build_spark_session
from pipelines.runtime.micro_batch import StreamSettings, advance_stream
from pipelines.declare.project import stream_spec
home, stream, timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])
spark = build_spark_session()
try:
    result = advance_stream(spark, StorageLayout.under(home), stream_spec(stream),
                            StreamSettings(event_time=False, lock_timeout_s=timeout))
    print("RESULT " + json.dumps({"micro_batches": result.micro_batches}), flush=True)
finally:
    spark.stop()
"""


def _python(code: str, *args: str, **popen) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen([sys.executable, "-c", code, *args], env=env, cwd=ROOT, text=True, **popen)


def _wait_for(condition, what: str, timeout_s: float = 180, alive: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if alive is not None and alive.poll() is not None:
            out, err = alive.communicate()
            raise AssertionError(f"process {alive.pid} ended (rc {alive.returncode}) before {what}:\n{out}\n{err}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _has_open(pid: int, path: Path) -> bool:
    """Whether process `pid` holds `path` open: a run holds its lock file open from its first attempt to take the
    lock until it lets go (pipelines/runtime/locks.py, writer_lock), so while another process holds the lock, this is
    a run waiting for it."""
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            if os.readlink(fd) == str(path):
                return True
        except OSError:  # closed meanwhile
            continue
    return False


def test_one_writer_between_two_processes(spark, layout, landing, tmp_path):
    """Contract: two runs that would advance the same stream at once cannot both do so; the second waits or is
    refused, and nothing is double counted. The runs here are OS processes, as a hand-started run beside an
    orchestrated one would be: the lock is a kernel file lock per stream (pipelines/runtime/locks.py `writer_lock`).

    1. While another process holds the lock, a run with a 1 s lock timeout is refused with StreamBusyError naming
       the stream, the lock file and the holder's pid, and writes nothing.
    2. Two runs then wait for the lock at once, this process and a second one with its own Spark (each seen
       waiting, its lock file open, before the holder lets go): both succeed, one after the other; the first
       folds every landing line, the second finds nothing new, and the state table equals the contract's count."""
    generate(SALES, layout.landing(SALES.name), events=200, malformed=0.03, duplicates=0.05, conflicts=0.02,
             seed=7, events_per_file=100)
    lock = layout.locks / f"{SALES.name}.lock"
    holding, release = tmp_path / "holding", tmp_path / "release"
    holder = _python(HOLD_LOCK, str(layout.locks), SALES.name, str(holding), str(release))
    other = None
    try:
        _wait_for(holding.exists, "the other process to hold the lock", alive=holder)
        # Started now, so its JVM starts while this process's run is refused.
        other = _python(ADVANCE, str(layout.home), SALES.name, "600", stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        with pytest.raises(StreamBusyError) as refused:
            advance(spark, layout, SALES, event_time=False, lock_timeout_s=1)
        message = str(refused.value)
        assert f"Another run is advancing {SALES.name}" in message
        assert str(lock) in message and f"pid {holder.pid} " in message and "Nothing was written" in message
        assert table_version(spark, layout.table(SALES.bronze_table)) is None  # not even created

        here: dict = {}

        def run_here():
            try:
                here["result"] = advance(spark, layout, SALES, event_time=False, lock_timeout_s=600)
            except BaseException as exc:  # re-raised below
                here["error"] = exc

        thread = threading.Thread(target=run_here)
        thread.start()
        _wait_for(lambda: _has_open(os.getpid(), lock) or "error" in here, "this process to wait for the lock")
        _wait_for(lambda: _has_open(other.pid, lock), "the other process to wait for the lock", alive=other)
        assert holder.poll() is None and not here  # both are waiting while the holder holds the lock
        release.touch()
        assert holder.wait(60) == 0
        thread.join(600)
        out, err = other.communicate(timeout=600)
    finally:
        release.touch()
        for process in (holder, other):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()
    assert "error" not in here, here.get("error")
    assert other.returncode == 0, err
    theirs = json.loads(out.split("RESULT ", 1)[1])["micro_batches"]
    ours = here["result"].micro_batches
    assert sorted([ours, theirs])[0] == 0 and max(ours, theirs) >= 1, (ours, theirs)  # one folded, one found nothing
    assert _state(layout) == _expected(layout, SALES)
    bronze_ids = [r["event_id"] for r in _read(layout, SALES.bronze_table)]
    assert len(bronze_ids) == len(set(bronze_ids))


# --- 3. savepoints and the changelog from the command line ---------------------------------------------------------

def _statetables(home: Path, *args: str) -> subprocess.CompletedProcess:
    """The real `statetables` command in a process of its own (an embedded Spark where it needs one)."""
    env = {**os.environ, "STATETABLES_HOME": str(home),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.pop("DAGSTER_HOME", None)
    done = subprocess.run([sys.executable, "-m", "statetables.cli", *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, f"statetables {' '.join(args)}: rc {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done


def _run(job: str, capsys) -> None:
    """`statetables run --job JOB` through the command's own entry point, in this process (its Spark session is the
    run's, as in tests/test_cli_run.py): a run in a process of its own costs a minute on this machine."""
    assert cli.main(["run", "--job", job, "--log-level", "WARNING"]) == 0
    printed = capsys.readouterr().out
    # Every blocking check passed; quarantine_rate may warn (the generated data holds malformed lines on purpose).
    assert "SUCCESS" in printed and not re.search(r"FAILED(?! \(WARN\))", printed), printed


def _rows(layout, name: str, version: int | None = None) -> list[tuple]:
    return sorted(tuple(sorted(r.items())) for r in _read(layout, name, version))


def _redeliver(layout, spec, count: int) -> None:
    """A file of the first `count` lines of the stream's oldest landing file again, written as producers must."""
    first = sorted(layout.landing(spec.name).glob("*.jsonl"), key=os.path.getmtime)[0]
    lines = first.read_bytes().split(b"\n")[:count]
    hidden = first.with_name(".redelivered.jsonl")
    hidden.write_bytes(b"\n".join(lines) + b"\n")
    os.replace(hidden, first.with_name("redelivered.jsonl"))


@pytest.mark.long
def test_savepoint_and_restore_changelog_commands(spark, layout, monkeypatch, capsys):
    """Long tier (2-4 min: three runs of the pipeline and three commands that each start a JVM), as the savepoint
    restore of tests/pipelines/state/test_changelog_savepoints.py is.

    README and docs/recovery.md: `statetables savepoint create NAME`, `savepoint list`, `savepoint restore NAME`,
    `statetables restore-changelog --table T --version V --into X`, each the real command in its own process.

    After a restore, every state table holds again what it held at the savepoint's version (read with deltalake,
    every column); the next run folds every event accepted after the savepoint exactly once (the contract's
    counts). restore-changelog writes, from the changelog alone, a table equal to the state table at version V,
    here a version the restore has since undone."""
    monkeypatch.setenv("STATETABLES_HOME", str(layout.home))
    monkeypatch.setenv("DAGSTER_HOME", str(layout.home / "dagster"))
    for spec in STREAMS.values():
        generate(spec, layout.landing(spec.name), events=150, malformed=0.03, duplicates=0.05, conflicts=0.02,
                 seed=11, events_per_file=150)
    _run("advance_all", capsys)
    state = {spec.name: spec.state_tables[0].name for spec in STREAMS.values()}
    at_savepoint = {name: _rows(layout, name) for name in state.values()}

    created = _statetables(layout.home, "savepoint", "create", "before-deploy").stdout
    taken = dict(re.findall(r"(\w+) v(\d+)", created.split("taken:", 1)[1]))
    assert set(taken) == set(state.values()), created
    versions = {name: int(v) for name, v in taken.items()}
    listed = _statetables(layout.home, "savepoint", "list").stdout.splitlines()
    assert len(listed) == 1 and listed[0].startswith("before-deploy\t"), listed
    assert listed[0].endswith(", ".join(f"{name} v{versions[name]}" for name in taken))

    generate(SALES, layout.landing(SALES.name), events=150, malformed=0.03, duplicates=0.05, conflicts=0.02,
             seed=12, events_per_file=150)
    _redeliver(layout, SALES, 40)  # accepted lines re-delivered, malformed ones again, after the savepoint
    _run(f"advance_{SALES.name}", capsys)
    mts = SALES.state_tables[0].name
    undone = IndependentDeltaTable(str(layout.table(mts))).version()
    assert undone > versions[mts] and _rows(layout, mts) != at_savepoint[mts]
    assert _state(layout, SALES) == _expected(layout, SALES)

    restored = _statetables(layout.home, "savepoint", "restore", "before-deploy").stdout
    assert "savepoint before-deploy restored" in restored, restored
    for name in state.values():
        assert _rows(layout, name) == at_savepoint[name] == _rows(layout, name, versions[name]), name

    _run(f"advance_{SALES.name}", capsys)  # folds the bronze rows accepted after the savepoint, once
    for spec in STREAMS.values():
        assert _state(layout, spec) == _expected(layout, spec), spec.name

    into = f"{mts}_v{undone}"
    rebuilt = _statetables(layout.home, "restore-changelog", "--table", mts, "--version", str(undone),
                           "--into", into).stdout
    assert str(layout.table(into)) in rebuilt, rebuilt
    assert _rows(layout, into) == _rows(layout, mts, undone)
    assert len(_rows(layout, into)) > 0
