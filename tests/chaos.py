"""Fault-injection harness: `kill -9` the real pipeline again and again, then check every key.

Each round delivers more landing files (new events, re-delivered files, malformed lines), starts
`statetables run` (the Dagster job, in its own process group: Python and the JVM) and kills the
whole group with SIGKILL, either at a named fault point (pipelines/faults.py) or at a random
instant. Some rounds also delete or corrupt a checkpoint first. After the last kill one clean run
must succeed; then every state table, bronze and quarantine table is compared with the
independent oracle (tests/contract_oracle.py) read through `deltalake`, not Spark.

`payments_per_customer` runs with a short TTL (`CHAOS_TTL_DAYS`, 72 min of event time; deliveries
span hours), so keys expire in most batches, kills land between a MERGE and its expiry commit, and
rebuilds count from expiries. Which keys expire depends on how killed runs cut micro-batches, so that
table is compared by accounting: per key, its row plus every expired row of it in the changelog
equals the oracle's count and sum, and the running totals in the table's newest commit equal the
changelog's expired rows.

    python -m tests.chaos --kills 30 --continuous-kills 4 --engine-kills 4    # make chaos

The continuous rounds run `statetables run --job run_continuously` (every query kept running, files landing
while it runs) and kill it at a named point or a random instant. The engine rounds kill -9 a warm Spark Connect
server while a thin client's run goes through it. The clean run after them all is orchestrated and embedded.
    tests/test_chaos.py                         # the quick variant in the test suite
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path


from assets.keys import CHANGELOG_JOB
from pipelines import faults
from pipelines.event_time.watermark import LATE
from pipelines.ingest.generate import generate
from pipelines.runtime.spark import ENGINE_JAVA_OPTIONS_ENV, ONE_COMMAND_JIT
from pipelines.state.changelog import changelog_name
from pipelines.state.expiry import EXPIRED
from pipelines.storage.files import S3Path
from pipelines.storage.layout import StorageLayout
from tests.streams import MOVIE_TICKET_SALES, PAYMENTS, STREAMS, project_with_ttl, redeliver, with_kafka
from tests.contract_oracle import (
    expected_from_topic, expected_sessions, expected_state, expected_windows, independent_table, landing_files,
)

CHAOS_TTL_DAYS = {"payments_per_customer": 0.05}
# The shipped project's windowed and session tables.
(_HOURLY,), (_ACTIVITY,) = MOVIE_TICKET_SALES.event_time_tables, PAYMENTS.event_time_tables
HOURLY, TOP, TOP_N, ACTIVITY = _HOURLY.name, _HOURLY.tops[0].name, _HOURLY.tops[0].n, _ACTIVITY.name
SESSION_GAP, SESSION_TTL = _ACTIVITY.size, _ACTIVITY.ttl

# Named kills, in the order the issue lists them, then the rest; `delay` lands inside the work after the point.
NAMED_KILLS = [
    (faults.INGEST_AFTER_BRONZE_COMMIT, {}),  # bronze committed, checkpoint not
    (faults.STATE_AFTER_MERGE_COMMIT, {}),  # MERGE committed, checkpoint not
    (faults.STATE_MERGE_START, {"delay": 0.4}),  # inside the MERGE
    (faults.STATE_BATCH_END, {"delay": 0.05}),  # the expiry written; inside the event-time step
    (faults.INGEST_AFTER_QUARANTINE_COMMIT, {}),  # between the two appends of an ingest batch
    (faults.WINDOWS_AFTER_LATE_COMMIT, {}),  # late_events written, nothing else of the windows batch
    (faults.WINDOWS_AFTER_TOP_COMMIT, {}),  # late_events and top_titles_hourly written
    (faults.WINDOWS_AFTER_STATE_COMMIT, {}),  # ... and the open windows; the closing commit not
    (faults.WINDOWS_BEFORE_CLOSING_COMMIT, {"delay": 0.3}),  # inside the closing commit
    (faults.SESSIONS_AFTER_LATE_COMMIT, {}),  # late payments written, nothing else of the sessions batch
    (faults.SESSIONS_AFTER_STATE_COMMIT, {}),  # ... and the sessions' state; customer_activity not
    (faults.SESSIONS_BEFORE_CLOSING_COMMIT, {"delay": 0.3}),  # inside the closing commit
    (faults.STREAM_BATCH_END, {"delay": 0.05}),  # the batch's last commit written; while Spark writes the commit file
]


@dataclass
class Round:
    kind: str  # the fault point, "random", or "clean"
    seconds: float
    killed: bool
    note: str = ""
    damaged: bool = False  # a checkpoint was deleted or corrupted before this run


@dataclass
class ChaosReport:
    rounds: list[Round] = field(default_factory=list)
    keys_compared: dict[str, int] = field(default_factory=dict)
    keys_differing: dict[str, int] = field(default_factory=dict)
    rows_differing: dict[str, int] = field(default_factory=dict)

    @property
    def kills(self) -> int:
        return sum(r.killed for r in self.rounds)

    @property
    def differences(self) -> int:
        return sum(self.keys_differing.values()) + sum(self.rows_differing.values())


def _env(layout: StorageLayout, fault_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    # The Dagster instance is local whatever the root (pipelines/storage/layout.py): beside the faults folder.
    env.update({"STATETABLES_HOME": str(layout.home), "DAGSTER_HOME": str(fault_dir.parent / "dagster"),
                faults.FAULTS_ENV: str(fault_dir), "PYTHONUNBUFFERED": "1"})
    return env


# run_chaos(kafka=broker): the streams read topics of this broker and publish their changelog topics there. Held here
# for the harness's whole run, because every run's project file, delivery and comparison depends on it.
_KAFKA: dict = {"broker": None}


def _project_file(path: Path, ttl_days: dict[str, float]) -> Path:
    path = project_with_ttl(ttl_days, path)
    return with_kafka(path, _KAFKA["broker"].bootstrap) if _KAFKA["broker"] is not None else path


def _project(fault_dir: Path, ttl_days: dict[str, float]) -> list[str]:
    """`--project FILE`: the shipped project file with the runs' TTLs (settings live in the project file)."""
    return ["--project", str(_project_file(fault_dir.parent.parent / "statetables.yaml", ttl_days))]


def _specs(names: list[str]) -> list:
    """The streams as the runs declare them: with their topics under run_chaos(kafka=...)."""
    if _KAFKA["broker"] is None:
        return [STREAMS[name] for name in names]
    from pipelines.declare.project import load_project
    path = _project_file(Path(tempfile.mkdtemp(prefix="chaos-project-")) / "statetables.yaml", {})
    declared = load_project(path.read_text(), path).streams
    return [declared[name] for name in names]


def _run_pipeline(layout: StorageLayout, fault_dir: Path, log: Path, kill_after: float | None,
                  job: str = "advance_all", ttl_days: dict[str, float] | None = None) -> tuple[int, float]:
    """One `statetables run` in a new process group; SIGKILL the group after `kill_after` s if given."""
    started = time.monotonic()
    ttl = _project(fault_dir, ttl_days or {})
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "statetables.cli", *ttl, "run", "--job", job, "--log-level", "WARNING"],
                                env=_env(layout, fault_dir), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=kill_after)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            code = proc.wait()
    _wait_group_gone(proc.pid)
    return code, time.monotonic() - started


def _run_continuous(layout: StorageLayout, fault_dir: Path, log: Path, rng: random.Random, streams: list[str],
                    events: int, kill_after: float, ttl_days: dict[str, float]) -> tuple[int, float]:
    """`statetables run --job run_continuously` (every query kept running); files are delivered while it runs
    (after a random part of `kill_after`), and the process group is killed after `kill_after` s unless an
    armed fault point kills it first."""
    started = time.monotonic()
    ttl = _project(fault_dir, ttl_days)
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "statetables.cli", *ttl, "run", "--job", "run_continuously",
                                 "--log-level", "WARNING"],
                                env=_env(layout, fault_dir), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=rng.uniform(0.3, 0.8) * kill_after)
        except subprocess.TimeoutExpired:
            _deliver(layout, rng, events, streams)  # lands while the queries run
            try:
                code = proc.wait(timeout=max(1.0, kill_after - (time.monotonic() - started)))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                code = proc.wait()
    _wait_group_gone(proc.pid)
    return code, time.monotonic() - started


def engine_pid(port: int) -> int | None:
    """The pid of the Connect server JVM listening on `port` (its command line names the port)."""
    found = subprocess.run(["pgrep", "-f", f"spark.connect.grpc.binding.port={port}"], capture_output=True, text=True)
    pids = [int(pid) for pid in found.stdout.split()]
    return min(pids) if pids else None


def _run_through_engine(layout: StorageLayout, fault_dir: Path, log: Path, port: int, kill_after: float | None,
                        job: str, ttl_days: dict[str, float]) -> tuple[int, float, bool]:
    """`statetables run --remote` against the supervised Connect server on `port`; the server is killed with
    SIGKILL after `kill_after` s, or by an armed fault point in its foreachBatch (which kills its whole process
    group: the server's). Returns the client's exit code, the seconds and whether the server died."""
    started = time.monotonic()
    ttl = _project(fault_dir, ttl_days)
    server = engine_pid(port)
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "statetables.cli", *ttl, "run", "--job", job, "--log-level", "WARNING",
                                 "--remote", f"sc://127.0.0.1:{port}"],
                                env=_env(layout, fault_dir), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=kill_after)
        except subprocess.TimeoutExpired:
            if server is not None:
                os.kill(server, signal.SIGKILL)
            code = proc.wait()
    _wait_group_gone(proc.pid)
    return code, time.monotonic() - started, server is not None and engine_pid(port) != server


def _wait_group_gone(pgid: int, timeout: float = 30) -> None:
    """The JVM is in the same group; the next run must not race a dying one."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.killpg(pgid, signal.SIGKILL)


def _deliver(layout: StorageLayout, rng: random.Random, events: int, streams: list[str]) -> None:
    """New events, plus (sometimes) a whole earlier file delivered again under a new name; from topics, new records
    plus (sometimes) some earlier records produced again."""
    if _KAFKA["broker"] is not None:
        for spec in _specs(streams):
            generate(spec, spec.topic, events=events, malformed=0.03, duplicates=0.03, conflicts=0.01, late=0.05,
                     seed=rng.randrange(1 << 30), events_per_file=max(events // 2, 1))
            if rng.random() < 0.5:
                redeliver(_KAFKA["broker"].bootstrap, spec.topic.topic, spec.id_field, max(events // 10, 1), rng)
        return
    for spec in (STREAMS[name] for name in streams):
        folder = layout.landing(spec.name)
        old = sorted(folder.glob("*.jsonl"))
        generate(spec, folder, events=events, malformed=0.03, duplicates=0.03, conflicts=0.01, late=0.05,
                 seed=rng.randrange(1 << 30), events_per_file=max(events // 2, 1))
        if old and rng.random() < 0.5:
            source = rng.choice(old)
            name = f"redelivery-{rng.randrange(1 << 30)}.jsonl"
            if isinstance(folder, S3Path):
                source.copy_to(folder / name)  # a PUT is whole: no hidden name needed
            else:
                hidden = folder / f".{name}"
                shutil.copyfile(source, hidden)
                os.replace(hidden, folder / name)


def _delete_folder(folder) -> None:
    if isinstance(folder, S3Path):
        for path, _ in folder.files():
            path.unlink(missing_ok=True)
    else:
        shutil.rmtree(folder)


def _damage_checkpoint(layout: StorageLayout, rng: random.Random) -> str:
    """Delete or corrupt one checkpoint (or all of them), the way disks and people do."""
    queries = [p for p in layout.checkpoints_root.iterdir() if p.is_dir() and not p.name.startswith("_")] \
        if layout.checkpoints_root.exists() else []
    if not queries:
        return "no checkpoint to damage"
    choice = rng.choice(["delete all", "delete one", "truncate commit", "garbage offsets"])
    if choice == "delete all":
        for query in queries:
            _delete_folder(query)
        return "deleted every checkpoint"
    query = rng.choice(queries)
    if choice == "delete one":
        _delete_folder(query)
        return f"deleted {query.name}"
    folder = query / ("commits" if choice == "truncate commit" else "offsets")
    files = sorted((p for p in folder.glob("[0-9]*")), key=lambda p: int(p.name))
    if not files:
        return f"{query.name} has no {folder.name} yet"
    if choice == "truncate commit":
        files[-1].write_bytes(files[-1].read_bytes()[:5])
    else:
        files[-1].write_bytes(os.urandom(64))
    return f"{choice} of {query.name}/{folder.name}/{files[-1].name}"


def _watermark(layout: StorageLayout, table: str) -> datetime | None:
    """The watermark recorded by the newest batch committed to an event-time query's closing table."""
    history = independent_table(layout.table(table)).history(20)
    for commit in history:  # newest first
        user = json.loads(commit.get("userMetadata") or "{}")
        if "watermark_ms" in user:
            return datetime.fromtimestamp(user["watermark_ms"] / 1000, timezone.utc)
    return None


def _utc(moment):
    return moment.replace(tzinfo=timezone.utc) if moment is not None and moment.tzinfo is None else moment


def compare_event_time(layout: StorageLayout, report: ChaosReport, spec_name: str, events: dict[str, dict]) -> None:
    """The windowed outputs against a plain-Python recomputation from the oracle's accepted events.

    Which events were late depends on how the killed runs cut micro-batches, so late_events is taken as
    given, but checked: each is an accepted event, at or behind the watermark it names, written once.
    The rest is then decided: every on-time event of a closed window (or session) counted there once,
    the rankings, previous sessions and day totals included."""
    late_rows = [r for r in independent_table(layout.table(LATE)).to_pyarrow_table().to_pylist()
                 if r["stream"] == spec_name]
    late = {r["event_id"] for r in late_rows}
    bad_late = (len(late_rows) - len(late)) + sum(
        r["event_id"] not in events or _utc(r["event_time"]) > _utc(r["watermark"]) for r in late_rows)
    report.rows_differing[f"{LATE} ({spec_name})"] = bad_late
    on_time = [e for i, e in events.items() if i not in late]
    if spec_name == MOVIE_TICKET_SALES.name:
        watermark = _watermark(layout, HOURLY)
        # One batch holding every on-time sale; then the windows the recorded watermark has passed.
        every_window = expected_windows([on_time], timedelta(0), watermark_after_last=True).windows
        closed = {k: v for k, v in every_window.items()
                  if watermark is not None and k[1] + timedelta(hours=1) <= watermark}
        rows = independent_table(layout.table(HOURLY)).to_pyarrow_table().to_pylist()
        actual = {(r["title"], _utc(r["window_start"])): (r["tickets_sold"], r["total_ticket_value"]) for r in rows}
        keys = set(actual) | set(closed)
        report.keys_compared[HOURLY] = len(keys)
        report.keys_differing[HOURLY] = sum(actual.get(k) != closed.get(k) for k in keys) + len(rows) - len(actual)
        top = [(_utc(r["window_start"]), r["rank"], r["title"], r["tickets_sold"])
               for r in independent_table(layout.table(TOP)).to_pyarrow_table().to_pylist()]
        wanted = []
        for start in {s for _, s in closed}:
            ranked = sorted(((n, v, t) for (t, s), (n, v) in closed.items() if s == start), key=lambda x: (-x[0], -x[1], x[2]))
            wanted += [(start, rank, t, n) for rank, (n, _, t) in enumerate(ranked[:TOP_N], start=1)]
        report.rows_differing[TOP] = len(set(top) ^ set(wanted)) + len(top) - len(set(top))
    else:
        watermark = _watermark(layout, ACTIVITY)
        newest = max((e["paid_at"] for e in on_time), default=None)
        # One batch holding every on-time payment, its watermark the one the query recorded.
        delay = newest - watermark if newest is not None and watermark is not None else timedelta(days=36500)
        expected = expected_sessions([on_time], delay, SESSION_GAP, SESSION_TTL).sessions
        rows = independent_table(layout.table(ACTIVITY)).to_pyarrow_table().to_pylist()
        actual = {(r["customer_id"], _utc(r["session_start"])): (
            _utc(r["session_end"]), r["payment_count"], r["total_amount"], r["last_payment_ids"],
            _utc(r["previous_session_end"]), r["day_amount"]) for r in rows}
        keys = set(actual) | set(expected)
        report.keys_compared[ACTIVITY] = len(keys)
        report.keys_differing[ACTIVITY] = sum(actual.get(k) != expected.get(k) for k in keys) + len(rows) - len(actual)


def _expired(layout: StorageLayout, report: ChaosReport, table) -> dict:
    """Per key, the count and sum of every row the TTL expired (the changelog's deletes); and whether the
    running totals of the table's newest commit that carries them agree."""
    changes = independent_table(layout.table(changelog_name(table))).to_pyarrow_table().to_pylist()
    expired: dict = {}
    for change in (c for c in changes if c["_change_type"] == "delete"):
        count, total = expired.get(change[table.key], (0, 0))
        expired[change[table.key]] = (count + change[table.count_column], total + change[table.sum_column])
    deletes = sum(c["_change_type"] == "delete" for c in changes)
    commits = independent_table(layout.table(table.name)).history(50)
    running = next((json.loads(c["userMetadata"])[EXPIRED] for c in commits
                    if EXPIRED in json.loads(c.get("userMetadata") or "{}")), None)
    in_feed = (deletes, sum(c for c, _ in expired.values()), sum(t for _, t in expired.values()))
    report.keys_compared[f"{table.name} expired rows"] = deletes
    report.keys_differing[f"{table.name} expired rows"] = int(
        running is None or (running["keys"], running["events"], Decimal(running["value"])) != in_feed)
    return expired


def compare(layout: StorageLayout, report: ChaosReport, streams: list[str], ttl_days: dict[str, float]) -> None:
    for spec in _specs(streams):
        expected = (expected_state(spec.name, landing_files(layout.landing(spec.name))) if spec.topic is None
                    else expected_from_topic(spec.name, spec.topic.servers, spec.topic.topic))
        compare_event_time(layout, report, spec.name, expected.events)
        table = spec.state_tables[0]
        rows = independent_table(layout.table(table.name)).to_pyarrow_table().to_pylist()
        actual = {r[table.key]: (r[table.count_column], r[table.sum_column]) for r in rows}
        repeated_keys = len(rows) - len(actual)
        if table.name in ttl_days:  # a key's row plus its expired rows hold all its events
            for key, (count, total) in _expired(layout, report, table).items():
                now = actual.get(key, (0, 0))
                actual[key] = (now[0] + count, now[1] + total)
        wanted = {k: (expected.counts[k], expected.sums[k]) for k in expected.counts}
        keys = set(actual) | set(wanted)
        report.keys_compared[table.name] = len(keys)
        report.keys_differing[table.name] = sum(actual.get(k) != wanted.get(k) for k in keys) + repeated_keys
        for name, want in ((spec.bronze_table, expected.accepted), (spec.quarantine_table, expected.quarantined)):
            got = independent_table(layout.table(name)).to_pyarrow_table().num_rows
            report.rows_differing[name] = abs(got - want)


def run_chaos(home: Path, *, kills: int, seed: int, events: int = 600, random_share: float = 0.4,
              damage_share: float = 0.15, typical_run_s: float = 60.0, named_only: bool = False,
              plan: list[tuple[str, dict]] | None = None, streams: list[str] | None = None,
              ttl_days: dict[str, float] | None = None, continuous_kills: int = 0, engine_kills: int = 0,
              root: str | None = None, kafka=None, say=print) -> ChaosReport:
    """`plan`: the named kills to make, in order (default: NAMED_KILLS, cycled); `streams`: default all;
    `ttl_days`: the state tables' TTL in every run (default CHAOS_TTL_DAYS); `continuous_kills`: then as
    many kills of the continuous job (`run_continuously`), every other one at a named point (every query
    runs in it, so each point is on its path), the others at a random instant, files landing meanwhile;
    `engine_kills`: then as many kills of a supervised Spark Connect server (statetables/servers.py) while a thin
    client's run goes through it, every other one at a named point (in the server's foreachBatch), the others at
    a random instant; the supervisor starts it again, and the next round's run waits for it. `root`: the storage
    root (default `home`), e.g. s3a://bucket/prefix; `home` keeps the faults, the log and the Dagster instance.
    `kafka`: a started KafkaBroker (statetables/servers.py): the streams read its topics and publish changelog
    topics to it, and after every round of the runs it is restarted, every other time after a kill -9."""
    _KAFKA["broker"] = kafka
    try:
        return _run_chaos(home, kills=kills, seed=seed, events=events, random_share=random_share,
                          damage_share=damage_share, typical_run_s=typical_run_s, named_only=named_only, plan=plan,
                          streams=streams, ttl_days=ttl_days, continuous_kills=continuous_kills,
                          engine_kills=engine_kills, root=root, say=say)
    finally:
        _KAFKA["broker"] = None


def _restart_broker(report: "ChaosReport") -> str:
    broker = _KAFKA["broker"]
    if broker is None:
        return ""
    if len(report.rounds) % 2:
        broker.kill()
        broker.start()
        return "broker killed and started again"
    broker.restart()
    return "broker restarted"


def _run_chaos(home: Path, *, kills: int, seed: int, events: int, random_share: float, damage_share: float,
               typical_run_s: float, named_only: bool, plan: list[tuple[str, dict]] | None, streams: list[str] | None,
               ttl_days: dict[str, float] | None, continuous_kills: int, engine_kills: int, root: str | None,
               say) -> ChaosReport:
    ttl_days = CHAOS_TTL_DAYS if ttl_days is None else ttl_days
    streams = streams or list(STREAMS)
    job = "advance_all" if len(streams) == len(STREAMS) else f"advance_{streams[0]}"
    plan = plan or NAMED_KILLS
    rng = random.Random(seed)
    layout = StorageLayout.under(root or home)
    fault_dir = home / "faults"
    log = home / "chaos.log"
    report = ChaosReport()
    _deliver(layout, rng, events, streams)
    named = 0
    while report.kills < kills:
        if len(report.rounds) > 4 * kills + 4:
            raise RuntimeError(f"only {report.kills} of {kills} kills landed in {len(report.rounds)} rounds; see {log}")
        _deliver(layout, rng, events // 3, streams)  # every round has work, so every fault point is on the path
        note = _damage_checkpoint(layout, rng) if not named_only and rng.random() < damage_share else ""
        damaged = note.startswith(("deleted", "truncate", "garbage"))
        # Every named point once first (KILLS >= len(NAMED_KILLS) kills at each), then named or random instants.
        if named_only or named < len(plan) or rng.random() >= random_share:
            point, options = plan[named % len(plan)]  # moves on only once this point has killed a run
            shutil.rmtree(fault_dir, ignore_errors=True)
            faults.arm(fault_dir, point, "kill", **options)
            code, seconds = _run_pipeline(layout, fault_dir, log, None, job, ttl_days)
            kind = point
            named += code == -signal.SIGKILL
            if code != -signal.SIGKILL:
                note = (note + "; " if note else "") + f"point not reached (exit {code})"
        else:
            kind = "random"
            code, seconds = _run_pipeline(layout, fault_dir, log, rng.uniform(3.0, typical_run_s), job, ttl_days)
        shutil.rmtree(fault_dir, ignore_errors=True)
        report.rounds.append(Round(kind, seconds, code == -signal.SIGKILL, note, damaged))
        if broker_note := _restart_broker(report):
            report.rounds[-1].note = (note + "; " if note else "") + broker_note
        r = report.rounds[-1]
        say(f"round {len(report.rounds):>3}: {kind:<32} {'killed' if r.killed else f'exit {code}':<8} "
            f"after {seconds:5.1f} s  {note}")
    continuous_made = 0
    while continuous_made < continuous_kills:
        if len(report.rounds) > 4 * (kills + continuous_kills) + 4:
            raise RuntimeError(f"only {continuous_made} of {continuous_kills} continuous kills landed; see {log}")
        _deliver(layout, rng, events // 3, streams)
        kind, limit = "continuous random", rng.uniform(30.0, 2 * typical_run_s)
        if continuous_made % 2 == 0:
            point, options = plan[(named + continuous_made // 2) % len(plan)]
            faults.arm(fault_dir, point, "kill", **options)
            kind, limit = f"continuous {point}", 4 * typical_run_s
        code, seconds = _run_continuous(layout, fault_dir, log, rng, streams, events // 3, limit, ttl_days)
        shutil.rmtree(fault_dir, ignore_errors=True)
        continuous_made += code == -signal.SIGKILL
        report.rounds.append(Round(kind, seconds, code == -signal.SIGKILL, "" if code == -signal.SIGKILL
                                   else f"not killed (exit {code})"))
        if broker_note := _restart_broker(report):
            report.rounds[-1].note = "; ".join(filter(None, (report.rounds[-1].note, broker_note)))
        r = report.rounds[-1]
        say(f"round {len(report.rounds):>3}: {kind:<32} {'killed' if r.killed else f'exit {code}':<8} "
            f"after {seconds:5.1f} s  {r.note}")
    if engine_kills:
        _engine_rounds(layout, fault_dir, log, rng, report, engine_kills, plan, named, events, streams, job, ttl_days,
                       typical_run_s, say)
    code, seconds = _run_pipeline(layout, fault_dir, log, None, job, ttl_days)
    report.rounds.append(Round("clean", seconds, False, f"exit {code}"))
    say(f"clean run: exit {code} after {seconds:.1f} s")
    if code != 0:
        raise RuntimeError(f"the clean run after the kills failed (exit {code}); see {log}")
    if ttl_days:  # the expired rows are counted from the changelogs, which the runs leave to this job
        code, _ = _run_pipeline(layout, fault_dir, log, None, CHANGELOG_JOB, ttl_days)
        if code != 0:
            raise RuntimeError(f"publishing the changelogs after the clean run failed (exit {code}); see {log}")
    compare(layout, report, streams, ttl_days)
    return report


def _engine_rounds(layout: StorageLayout, fault_dir: Path, log: Path, rng: random.Random, report: ChaosReport,
                   engine_kills: int, plan: list, named: int, events: int, streams: list[str], job: str,
                   ttl_days: dict[str, float], typical_run_s: float, say) -> None:
    from statetables.servers import free_port, spark_connect_server

    port = free_port()
    made = attempts = named_rounds = 0
    with spark_connect_server(port=port, log=fault_dir.parent / "spark-connect.log", supervise=True,
                              extra_env={faults.FAULTS_ENV: str(fault_dir)}):
        while made < engine_kills:
            attempts += 1
            if attempts > 4 * engine_kills + 4:
                raise RuntimeError(f"only {made} of {engine_kills} engine kills landed; see {log}")
            _deliver(layout, rng, events // 3, streams)
            kind, kill_after = "engine random", rng.uniform(3.0, typical_run_s / 2)
            if made % 2 == 0:
                # The next point each time: after a kill mid-batch, the next run's catch-up (in the client, before
                # its query starts) may reach a point first, and kill the client instead of the engine.
                point, options = plan[(named + named_rounds) % len(plan)]
                named_rounds += 1
                faults.arm(fault_dir, point, "kill", **options)
                kind, kill_after = f"engine {point}", None
            code, seconds, died = _run_through_engine(layout, fault_dir, log, port, kill_after, job, ttl_days)
            shutil.rmtree(fault_dir, ignore_errors=True)
            made += died
            client_killed = code == -signal.SIGKILL
            report.rounds.append(Round(kind, seconds, died or client_killed, f"client exit {code}" if died else
                                       "the client killed in its catch-up" if client_killed
                                       else f"engine not killed (client exit {code})"))
            r = report.rounds[-1]
            say(f"round {len(report.rounds):>3}: {kind:<32} {'killed' if r.killed else 'alive':<8} "
                f"after {seconds:5.1f} s  {r.note}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kills", type=int, default=30)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--events", type=int, default=2000, help="events per stream in the first delivery")
    parser.add_argument("--random-share", type=float, default=0.4, help="share of kills at random instants")
    parser.add_argument("--continuous-kills", type=int, default=4,
                        help="then kills of the continuous job (run_continuously), named points and random instants")
    parser.add_argument("--engine-kills", type=int, default=4,
                        help="then kills of a warm Spark Connect server while a run goes through it")
    parser.add_argument("--home", help="storage root to use (default: a new temporary folder, kept)")
    parser.add_argument("--kafka", action="store_true",
                        help="both streams read topics of a Kafka broker started here (its data under the home "
                             "folder) and publish changelog topics; the broker is restarted after every round")
    parser.add_argument("--object-store", action="store_true",
                        help="the storage root in a bucket of an S3 server started here (`statetables s3-server`), "
                             "its data under the home folder; the writer lock is then the lease")
    args = parser.parse_args(argv)
    # The engines this harness starts live a few runs each, killed or not: C1 only, as the test suite's.
    os.environ.setdefault(ENGINE_JAVA_OPTIONS_ENV, ONE_COMMAND_JIT)
    home = Path(args.home or tempfile.mkdtemp(prefix="statetables-chaos-")).resolve()
    if args.kafka:
        from statetables.servers import kafka_broker

        with kafka_broker(home / "kafka") as broker:
            print(f"chaos: {args.kills} kills, seed {args.seed}, storage root {home}, topics on {broker.bootstrap}")
            report = run_chaos(home, kills=args.kills, seed=args.seed, events=args.events,
                               random_share=args.random_share, continuous_kills=args.continuous_kills,
                               engine_kills=args.engine_kills, kafka=broker)
            return summary(report)
    if not args.object_store:
        print(f"chaos: {args.kills} kills, seed {args.seed}, storage root {home}")
        report = run_chaos(home, kills=args.kills, seed=args.seed, events=args.events, random_share=args.random_share,
                           continuous_kills=args.continuous_kills, engine_kills=args.engine_kills)
        return summary(report)
    from tests.object_store import s3_store

    with s3_store(home / "s3") as store:
        root = f"s3a://{store.bucket}/chaos"
        os.environ["STATETABLES_HOME"] = root  # the engine rounds' Connect server takes the S3 connector from it
        print(f"chaos: {args.kills} kills, seed {args.seed}, storage root {root} ({store.endpoint}, "
              f"lease {os.environ['STATETABLES_LEASE_SECONDS']} s)")
        report = run_chaos(home, kills=args.kills, seed=args.seed, events=args.events, random_share=args.random_share,
                           continuous_kills=args.continuous_kills, engine_kills=args.engine_kills, root=root)
        print(f"object-store requests: {store.requests()}")
        return summary(report)


def summary(report: ChaosReport) -> int:
    by_kind: dict[str, int] = {}
    for r in report.rounds:
        if r.killed:
            by_kind[r.kind] = by_kind.get(r.kind, 0) + 1
    print(f"\nkills made: {report.kills} in {len(report.rounds) - 1} rounds")
    for kind, count in sorted(by_kind.items()):
        print(f"  {kind:<32} {count}")
    print(f"rounds with a checkpoint deleted or corrupted first: {sum(r.damaged for r in report.rounds)}")
    survived = [r.seconds for r in report.rounds if not r.killed]
    print(f"runs that completed: {len(survived)}, median {statistics.median(survived):.1f} s; "
          f"final clean run {report.rounds[-1].seconds:.1f} s")
    for name, keys in report.keys_compared.items():
        print(f"{name}: {keys} keys compared, {report.keys_differing[name]} differ")
    for name, diff in report.rows_differing.items():
        print(f"{name}: row count differs from the oracle by {diff}")
    print("RESULT:", "every key equal" if report.differences == 0 else f"{report.differences} DIFFERENCES")
    return 0 if report.differences == 0 else 1


if __name__ == "__main__":
    code = main()
    # The verdict is the exit code, whatever a library does at interpreter teardown (delta-rs's runtime has aborted
    # there, "terminate called without an active exception", turning a correct run's 0 into 2): leave without it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
