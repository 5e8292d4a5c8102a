"""The quick variant of `make chaos`: real `statetables run` processes killed with SIGKILL (Python and
JVM) at named fault points, then one clean run; every key must equal the independent oracle.

One stream (`advance_payments`, with the TTL of payments_per_customer on) keeps it short; `make chaos`
covers both streams, every fault point, random instants and damaged checkpoints."""

from __future__ import annotations

import pytest

from pipelines import faults
from tests.chaos import run_chaos

pytestmark = pytest.mark.long


def test_kill_9_at_named_points_then_one_clean_run_counts_every_event_once(tmp_path):
    plan = [(faults.INGEST_AFTER_BRONZE_COMMIT, {}), (faults.STATE_AFTER_MERGE_COMMIT, {}),
            (faults.SESSIONS_BEFORE_CLOSING_COMMIT, {})]
    report = run_chaos(tmp_path / "home", kills=3, seed=7, events=300, named_only=True, plan=plan,
                       streams=["payments"])

    assert [r.kind for r in report.rounds if r.killed] == [point for point, _ in plan]
    assert report.rounds[-1].kind == "clean"
    assert report.keys_compared["payments_per_customer"] > 50
    assert report.keys_compared["customer_activity"] > 50  # the sessions were compared too
    assert report.keys_compared["payments_per_customer expired rows"] > 50  # with its TTL expiring keys
    assert report.differences == 0, (report.keys_differing, report.rows_differing)
