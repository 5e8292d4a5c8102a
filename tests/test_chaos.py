"""The quick variant of `make chaos`: real `statetables run` processes killed with SIGKILL (Python and
JVM) at named fault points, then one clean run; every key must equal the independent oracle.

One stream (`advance_payments`, with the TTL of payments_per_customer on) keeps it short: three kills of
`statetables run`, then one of the continuous job (`run_continuously`) and one of a warm Spark Connect server
while a thin client's run goes through it, each at a named point. `make chaos` covers both streams, every fault
point, random instants and damaged checkpoints."""

from __future__ import annotations

import pytest

from pipelines import faults
from tests.chaos import run_chaos

pytestmark = pytest.mark.long


def test_kill_9_at_named_points_then_one_clean_run_counts_every_event_once(tmp_path):
    plan = [(faults.INGEST_AFTER_BRONZE_COMMIT, {}), (faults.STATE_AFTER_MERGE_COMMIT, {}),
            (faults.SESSIONS_BEFORE_CLOSING_COMMIT, {})]
    report = run_chaos(tmp_path / "home", kills=3, seed=7, events=300, named_only=True, plan=plan,
                       streams=["payments"], continuous_kills=1, engine_kills=1)

    first = plan[0][0]  # after every point once, the continuous kill starts the plan again
    assert [r.kind for r in report.rounds if r.killed][:4] == [*(point for point, _ in plan), f"continuous {first}"]
    # The engine died at a named point in its foreachBatch (a round whose client died in its catch-up goes on to
    # the next point).
    engine = [r for r in report.rounds if r.kind.startswith("engine ")]
    assert any(r.note.startswith("client exit") for r in engine), [(r.kind, r.note) for r in engine]
    assert report.rounds[-1].kind == "clean"
    assert report.keys_compared["payments_per_customer"] > 50
    assert report.keys_compared["customer_activity"] > 50  # the sessions were compared too
    assert report.keys_compared["payments_per_customer expired rows"] > 50  # with its TTL expiring keys
    assert report.differences == 0, (report.keys_differing, report.rows_differing)
