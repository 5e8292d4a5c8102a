"""Shared fixtures: one SparkSession (one JVM) for the whole test session, a fresh storage root per test."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pipelines.layout import StorageLayout
from pipelines.session import build_spark_session


# The longest tests start whole processes (kill -9 runs, dagster dev + daemon, Spark servers). Each starts
# a share of the list: pytest-xdist's worksteal hands every worker one contiguous share, so each worker
# begins with one of them, and neither runs alone at the end while the other worker sits idle.
LONG_FIRST = ("tests/test_chaos.py", "tests/assets/test_ui.py", "tests/assets/test_continuous.py",
              "tests/test_engines.py")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "long: minutes each: whole processes killed and recovered (kill -9, the continuous job), the same "
                   "tables over Spark Connect and on a standalone cluster (server JVMs of their own), checkpoints lost, "
                   "damaged or set back. `make test` leaves them out (it takes 18 to 20 minutes on 2 cores); "
                   "`make test-long` runs them, and .ci/run runs both")


def pytest_collection_modifyitems(items):
    long = [item for item in items if item.nodeid.startswith(LONG_FIRST)]
    rest = [item for item in items if not item.nodeid.startswith(LONG_FIRST)]
    share = -(-len(items) // max(len(long), 1))
    for i, item in enumerate(long):
        rest.insert(i * share, item)
    items[:] = rest


@pytest.fixture(scope="session")
def spark():
    session = build_spark_session()
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
