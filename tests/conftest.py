"""Shared fixtures: one SparkSession (one JVM) for the whole test session, a fresh storage root per test."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pipelines.runtime.spark import ENGINE_JAVA_OPTIONS_ENV, ONE_COMMAND_JIT, SparkSettings, build_spark_session
from pipelines.storage.layout import StorageLayout


# Seconds each of the longest tests takes on 2 cores with 2 workers (a fast day; a slow day doubles them all),
# by node id prefix (the longest prefix wins): the order below needs their ranks, not their exact values, but a test
# missing here is taken as short and drifts to a worker's end. A test not listed is taken as short.
EXPECTED_SECONDS = {
    # the long tier
    "tests/test_chaos.py": 181,
    "tests/test_engines.py::test_a_warm_connect": 182,  # with its servers' setup
    "tests/test_object_store.py::test_deliveries": 149,
    "tests/assets/test_ui.py": 126,
    "tests/assets/test_continuous.py": 122,
    "tests/test_kafka.py::test_topics": 120,
    "tests/test_kafka.py::test_chaos": 100,
    "tests/pipelines/event_time/test_windows.py::test_a_batch_replayed": 46,
    "tests/assets/test_maintenance.py": 42,
    "tests/test_contract_promises.py::test_savepoint": 35,
    "tests/pipelines/event_time/test_sessions.py::test_a_batch_replayed": 35,
    "tests/pipelines/event_time/test_windows.py::test_lost_checkpoint": 32,
    "tests/test_kafka.py::test_a_broker": 27,
    "tests/pipelines/event_time/test_sessions.py::test_lost_checkpoint": 25,
    # the fast tier
    "tests/pipelines/state/test_state_ttl.py::test_keys": 56,
    "tests/pipelines/state/test_state_tables.py::test_a_state_table_stays": 45,
    "tests/pipelines/ingest/test_ingest.py::test_payments_rules": 28,
    "tests/pipelines/event_time/test_declared_event_time.py::test_a_new": 27,
    "tests/pipelines/event_time/test_sessions.py::test_sessions_late": 25,
    "tests/test_engines.py::test_every_asset": 30,  # with its fixture's setup
    "tests/test_first_stream.py": 25,
    "tests/pipelines/event_time/test_windows.py::test_a_changed": 20,
    "tests/pipelines/declare/test_declared_streams.py::test_declared": 12,
    "tests/assets/test_dagster.py::test_without_event_time": 11,
    "tests/test_cli_run.py": 10,
    "tests/test_contract_promises.py::test_one_writer": 10,
    "tests/pipelines/state/test_changelog_savepoints.py::test_racing": 9,
    "tests/pipelines/ingest/test_ingest.py::test_movie": 8,
    "tests/test_contract_promises.py": 8,
    "tests/pipelines/event_time/test_sessions.py": 15,
    "tests/pipelines/event_time/test_windows.py": 15,
    "tests/test_kafka.py": 20,
    "tests/test_object_store.py": 10,
    "tests/test_engines.py": 10,
    "tests/pipelines/runtime/test_recovery.py": 12,
    "tests/assets/test_component.py": 30,
    "tests/test_status.py": 6,
}
SHORT_S = 5

# The Spark Connect servers tests start (their own, and `statetables dev`'s in the UI and continuous tests) live for a
# few runs: C1 only, as a one-command driver JVM. They had spent a quarter of the long tier's CPU; one run through
# such a server cost it 61-65 s of CPU with both compilers, 33-37 s with C1 only (docs/performance.md).
os.environ.setdefault(ENGINE_JAVA_OPTIONS_ENV, ONE_COMMAND_JIT)


def expected_seconds(nodeid: str) -> float:
    prefixes = [p for p in EXPECTED_SECONDS if nodeid.startswith(p)]
    return EXPECTED_SECONDS[max(prefixes, key=len)] if prefixes else SHORT_S


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "long: minutes each: whole processes killed and recovered (kill -9, the continuous job), the same "
                   "tables over Spark Connect and on a standalone cluster (server JVMs of their own), the Dagster UI "
                   "in a browser, checkpoints lost, damaged or set back. `make test` leaves them out; `make test-long` "
                   "runs them alone, and `make test-all` (what .ci/run runs) runs both tiers in one session")


def _sharing_a_module_fixture(item) -> bool:
    """Whether the test uses a module-scoped fixture (a server, a shared run): each worker that runs one of the
    module's tests sets it up again."""
    definitions = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    return any(defs and defs[-1].scope == "module" for defs in definitions.values())


@pytest.hookimpl(trylast=True)  # after `-m` has deselected: only the tests that will run are ordered
def pytest_collection_modifyitems(config, items):
    """Longest first on every worker. pytest-xdist's worksteal gives each of N workers one contiguous 1/N of the list
    (by count), then moves tests from the end of a busy worker's share to an idle one. So the list is cut into N
    shares of equal count, each filled longest first by greedy balancing of the expected seconds: every worker
    starts with a long test, and what is left to steal at the end is short.

    A module's tests that share a module-scoped fixture go to one share, side by side, as one unit of their summed
    seconds: split over two workers, each would start the module's server (or make its run) once more."""
    workers = int(getattr(config, "workerinput", {}).get("workercount", 1))
    by_module: dict[str, list] = {}
    units: list[list] = []
    for item in items:
        if _sharing_a_module_fixture(item):
            by_module.setdefault(item.nodeid.split("::")[0], []).append(item)
        else:
            units.append([item])
    units += list(by_module.values())
    for unit in units:
        unit.sort(key=lambda item: (-expected_seconds(item.nodeid), item.nodeid))
    ranked = sorted(units, key=lambda unit: (-sum(expected_seconds(i.nodeid) for i in unit), unit[0].nodeid))
    sizes = [len(items) // workers + (1 if n < len(items) % workers else 0) for n in range(workers)]
    sizes.sort()  # worksteal's first share is the smaller one
    shares: list[list] = [[] for _ in range(workers)]
    loads = [0.0] * workers
    for unit in ranked:
        left = list(unit)
        while left:  # a unit larger than any share's room is split, its longest tests first
            fitting = [n for n in range(workers) if sizes[n] - len(shares[n]) >= len(left)]
            roomy = [n for n in range(workers) if len(shares[n]) < sizes[n]]
            n = min(fitting or roomy, key=lambda k: loads[k])
            placed, left = left[:sizes[n] - len(shares[n])], left[sizes[n] - len(shares[n]):]
            shares[n] += placed
            loads[n] += sum(expected_seconds(item.nodeid) for item in placed)
    items[:] = [item for share in shares for item in share]


def pytest_terminal_summary(terminalreporter):
    """Each tier's tests and their seconds (setup, call and teardown, summed over the workers): what `make test` and
    `make test-long` would each cost, read off one session of both (`make test-all`)."""
    tests: dict[str, set] = {"fast": set(), "long": set()}
    seconds = {"fast": 0.0, "long": 0.0}
    for reports in terminalreporter.stats.values():
        for report in reports:
            if getattr(report, "when", None) not in ("setup", "call", "teardown"):
                continue
            tier = "long" if "long" in report.keywords else "fast"
            tests[tier].add(report.nodeid)
            seconds[tier] += report.duration
    if tests["fast"] or tests["long"]:
        terminalreporter.write_line("test seconds by tier (summed over workers): " + ", ".join(
            f"{tier} {len(tests[tier])} tests {seconds[tier]:.0f} s" for tier in tests if tests[tier]))


@pytest.fixture(scope="session")
def spark():
    # The worker's JVM ends with the test session, one command: C1 only, as `statetables run`'s. The fast tier took
    # 197 and 201 s instead of 271 and 266 s (two pairs in turn; test seconds 378 and 389 instead of 529 and 518):
    # C2 compiled for minutes, on the cores the tests needed, code whose runs were over before it could pay back.
    session = build_spark_session(SparkSettings(one_command=True))
    yield session
    session.stop()


@pytest.fixture
def layout(tmp_path: Path) -> StorageLayout:
    return StorageLayout.under(tmp_path / "home")


class Landing:
    """Writes landing files the way producers must: hidden name first, then rename; distinct mtimes."""

    def __init__(self, layout: StorageLayout):
        self.layout = layout
        self.written = 0

    def write(self, stream: str, name: str, lines: list[str | bytes]) -> Path:
        final = self.layout.landing(stream) / name  # `name` may hold sub-folders
        folder = final.parent
        folder.mkdir(parents=True, exist_ok=True)
        data = b"".join((line.encode() if isinstance(line, str) else line) + b"\n" for line in lines)
        hidden = folder / f".{final.name}"
        hidden.write_bytes(data)
        self.written += 1
        stamp = 1_700_000_000 + self.written  # strictly increasing arrival order
        os.utime(hidden, (stamp, stamp))
        os.replace(hidden, final)
        return final


@pytest.fixture
def landing(layout: StorageLayout) -> Landing:
    return Landing(layout)
