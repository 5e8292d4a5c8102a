"""Customer activity sessions (keyed state, timers, TTL) against a plain-Python recomputation
(tests/contract_oracle.py `expected_sessions`), read with an independent Delta reader (`deltalake`).

Covers: a payment out of order within the watermark joins its session (here it joins two into one);
payments behind it land in `late_events` and still count in payments_per_customer; the event-time
watermark closes a session 30 minutes after its last payment; the previous session and the day's spend
come from the keyed state table, which TTL forgets; a batch replayed after a crash between any two of its
commits, and a lost checkpoint, give the outputs of runs that never failed.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from decimal import Decimal

import pytest
from delta.tables import DeltaTable
from deltalake import DeltaTable as IndependentDeltaTable
from pyspark.sql import functions as F

from pipelines import faults
from pipelines.errors import DefinitionChangedError
from pipelines.event_time.watermark import LATE, output_schema
from pipelines.ingest.generate import generate
from pipelines.operate import table_checks
from pipelines.operate.refresh import refresh_event_time_table
from pipelines.storage.delta_log import commits_since
from tests.contract_oracle import Oracle, expected_sessions, expected_state, file_lines, landing_files
from tests.streams import PAYMENTS, advance, declared

SPEC = PAYMENTS
(TABLE,) = SPEC.event_time_tables
ACTIVITY, STATE = TABLE.name, TABLE.state_table
UTC = timezone.utc
DELAY = timedelta(minutes=10)


@dataclass(frozen=True)
class Rules:
    """The declaration's settings a test runs under: the stream's watermark delay, the session table's TTL."""

    watermark_delay: timedelta = SPEC.watermark_delay
    state_ttl: timedelta = TABLE.ttl
    gap: timedelta = TABLE.size


def _rows(layout, name: str) -> list[dict]:
    return IndependentDeltaTable(str(layout.table(name))).to_pyarrow_table().to_pylist()


def _utc(moment: datetime | None) -> datetime | None:
    return moment.replace(tzinfo=UTC) if moment is not None and moment.tzinfo is None else moment


def _outputs(layout) -> tuple[dict, dict]:
    rows = _rows(layout, ACTIVITY)
    sessions = {(r["customer_id"], _utc(r["session_start"])): (
        _utc(r["session_end"]), r["payment_count"], r["total_amount"], r["last_payment_ids"],
        _utc(r["previous_session_end"]), r["day_amount"]) for r in rows}
    assert len(sessions) == len(rows), "a session was written twice"
    late_rows = [r for r in _rows(layout, LATE) if r["stream"] == SPEC.name]
    late = {r["event_id"]: (_utc(r["event_time"]), _utc(r["watermark"])) for r in late_rows}
    assert len(late) == len(late_rows), "a late payment was written twice"
    return sessions, late


class Deliveries:
    """Lands files, runs the stream once per delivery, and keeps each delivery's accepted payments (judged by
    the oracle, not by the pipeline) for the recomputation. A batch whose run failed after bronze is folded on
    its own by the next run, before that run's new files: as it would have been had it not failed."""

    def __init__(self, spark, layout, settings: Rules = Rules()):
        self.spark, self.layout, self.settings = spark, layout, settings
        self.oracle, self.batches, self.seen = Oracle(SPEC.name), [], set()
        self.unfinished: list[dict] = []  # payments of a batch that failed: the next run folds them first

    def run(self, *, lose_checkpoint: bool = False, fail_before_closing: bool = False, fail_at: str | None = None):
        fail_at = fail_at or (faults.SESSIONS_BEFORE_CLOSING_COMMIT if fail_before_closing else None)
        before = set(self.oracle.expected.events)
        for path in sorted(set(landing_files(self.layout.landing(SPEC.name))) - self.seen,
                           key=lambda p: (p.stat().st_mtime_ns, str(p))):
            self.oracle.deliver(str(path), file_lines(path))
            self.seen.add(path)
        batch = [e for i, e in self.oracle.expected.events.items() if i not in before]
        if lose_checkpoint:
            shutil.rmtree(self.layout.checkpoint(SPEC.name))
        if fail_at:
            faults.arm(self.layout.home / "faults", fail_at, "raise")
            with pytest.raises(Exception, match="fault injected"):
                advance(self.spark, self.layout, SPEC, watermark_delay=self.settings.watermark_delay,
                        session_ttl=self.settings.state_ttl)
            self.unfinished = batch
            return None
        self.batches += [b for b in (self.unfinished, batch) if b]
        self.unfinished = []
        return advance(self.spark, self.layout, SPEC, watermark_delay=self.settings.watermark_delay,
                       session_ttl=self.settings.state_ttl)

    def expected(self):
        return expected_sessions(self.batches, self.settings.watermark_delay, self.settings.gap,
                                 self.settings.state_ttl)


def _payment(payment_id: str, customer: str, at: str, amount: str = "10.00", day: int = 1) -> str:
    return (f'{{"payment_id":"{payment_id}","customer_id":"{customer}","amount":"{amount}",'
            f'"paid_at":"2026-11-{day:02d}T{at}:00Z"}}')


def test_sessions_late_payments_and_ttl_equal_the_recomputation(spark, layout, landing):
    # A state TTL of 40 minutes of event time: a customer idle that long is forgotten.
    runs = Deliveries(spark, layout, Rules(watermark_delay=DELAY, state_ttl=timedelta(minutes=40)))
    landing.write(SPEC.name, "1.jsonl", [
        _payment("a1", "ann", "10:00"), _payment("a2", "ann", "10:20", "5.50"), _payment("a3", "ann", "10:55"),
        _payment("b1", "bob", "10:05"), _payment("b2", "bob", "10:50", "3.00")])
    runs.run()  # watermark 10:45: bob's 10:05 closes; ann's [10:00, 10:20] and [10:55] stay open
    # 10:47 (within the watermark, a run late) joins ann's two sessions into one.
    landing.write(SPEC.name, "2.jsonl", [_payment("a4", "ann", "10:47"), _payment("b3", "bob", "11:25"),
                                         _payment("b4", "bob", "12:20"), _payment("c1", "cy", "12:50")])
    runs.run()  # watermark 12:40: ann's 10:00-10:55 closes; bob's 10:50 and 11:25 close in one batch
    landing.write(SPEC.name, "3.jsonl", [_payment("b5", "bob", "10:06"), _payment("a5", "ann", "14:00"),
                                         _payment("c2", "cy", "13:10"), _payment("z1", "zed", "16:00")])
    result = runs.run()  # watermark 15:50: bob's 10:06 is late; bob's 12:20, cy's, ann's 14:00 close

    sessions, late = _outputs(layout)
    expected = runs.expected()
    assert sessions == expected.sessions and late == expected.late
    # The same facts by hand, so the recomputation itself is checked:
    at = lambda hh_mm: datetime.fromisoformat(f"2026-11-01T{hh_mm}:00+00:00")  # noqa: E731
    assert sessions[("ann", at("10:00"))] == (at("10:55"), 4, Decimal("35.50"), ["a3", "a4", "a2", "a1"], None,
                                              Decimal("35.50"))
    # bob's 10:50 came 45 minutes after his 10:05: forgotten (TTL); his 11:25 knows his 10:50 (value and
    # map state); his 12:20 came 55 minutes after it: forgotten again, the day total starts again.
    assert sessions[("bob", at("10:50"))][4] is None
    assert sessions[("bob", at("11:25"))][4:] == (at("10:50"), Decimal("13.00"))
    assert sessions[("bob", at("12:20"))][1:] == (1, Decimal("10.00"), ["b4"], None, Decimal("10.00"))
    assert len(sessions) == 7
    assert ("zed", at("16:00")) not in sessions  # the timer has not fired: 16:00 + 30 min > 15:50
    assert set(late) == {"b5"} and late["b5"][1] == at("12:40")
    assert result.versions[STATE].after > result.versions[STATE].before  # the state moved
    # The TTL: ann's, bob's and cy's keyed state is dropped once the watermark is 40 minutes past their
    # last session; zed's session (16:00) closes at 17:50 and his state stays, since his 18:00 is still open.
    # Read from the operator's state tables.
    landing.write(SPEC.name, "4.jsonl", [_payment("z2", "zed", "18:00")])
    before_last_run = runs.run().versions[ACTIVITY].before
    sessions, late = _outputs(layout)
    assert sessions == runs.expected().sessions and ("zed", at("16:00")) in sessions
    state = _rows(layout, STATE)
    assert sorted(r["customer_id"] for r in state if not r["_open"]) == ["zed"]
    assert sorted(r["customer_id"] for r in state if r["_open"]) == ["zed"]  # his 18:00, still open
    # The Dagster check's query sees the tables agree with bronze, then sees a corrupted session.
    mismatched, figures = table_checks.event_time_mismatches(spark, layout, SPEC, TABLE)
    assert mismatched.count() == 0, mismatched.collect()
    assert (figures["rows_checked"], figures["late_events"], figures["late_not_in_bronze"]) == (8, 1, 0)
    DeltaTable.forPath(spark, str(layout.table(ACTIVITY))).update(
        F.col("customer_id") == "cy", {"payment_count": F.lit(3)})
    assert table_checks.event_time_mismatches(spark, layout, SPEC, TABLE)[0].count() == 2  # its row, either side
    # The per-run check reads only the keys of the sessions the last run closed (zed's 16:00), from that session
    # on: cy's row, closed two runs before, is the deep check's to find; a wrong zed is the per-run check's.
    mismatched, figures = table_checks.event_time_mismatches(spark, layout, SPEC, TABLE, before_last_run)
    assert (mismatched.count(), figures["rows_checked"], figures["events"]) == (0, 1, 2)
    DeltaTable.forPath(spark, str(layout.table(ACTIVITY))).update(
        F.col("customer_id") == "zed", {"payment_count": F.lit(3)})
    assert table_checks.event_time_mismatches(spark, layout, SPEC, TABLE, before_last_run)[0].count() == 2
    # Late payments still count in the all-time table.
    all_time = {r["customer_id"]: r["payment_count"] for r in _rows(layout, SPEC.state_tables[0].name)}
    assert all_time == dict(expected_state(SPEC.name, landing_files(layout.landing(SPEC.name))).counts)
    assert all_time["bob"] == 5


@pytest.mark.long
def test_a_batch_replayed_after_a_crash_between_any_two_commits_writes_what_it_would_have(spark, layout, monkeypatch):
    """A sessions batch commits late_events, its state, then customer_activity. Each
    delivery's run dies at the next of those points; the run after it replays the batch from the state versions
    the previous batch recorded. The outputs, previous sessions and day totals included, must equal the
    recomputation of runs that never failed."""
    monkeypatch.setenv(faults.FAULTS_ENV, str(layout.home / "faults"))
    runs = Deliveries(spark, layout, Rules(watermark_delay=DELAY, state_ttl=timedelta(hours=2)))
    points = [faults.SESSIONS_AFTER_LATE_COMMIT, faults.SESSIONS_AFTER_STATE_COMMIT,
              faults.SESSIONS_BEFORE_CLOSING_COMMIT]
    start = datetime(2026, 10, 20, 22, tzinfo=UTC)  # crosses midnight: day totals start again
    for n, point in enumerate([*points, None]):
        generate(SPEC, layout.landing(SPEC.name), events=200, malformed=0.02, duplicates=0.03, late=0.1,
                 seed=90 + n, events_per_file=200, start=start + timedelta(hours=2 * n), max_step_s=60,
                 customers=15)
        if point:
            runs.run(fail_at=point)
        runs.run()  # the replay of the failed batch (or the last delivery)
    sessions, late = _outputs(layout)
    expected = runs.expected()
    assert len(expected.sessions) > 30 and len(expected.late) > 5  # the scenario exercises both
    assert sum(1 for s in expected.sessions.values() if s[4] is not None) > 10  # previous sessions, TTL or not
    assert sessions == expected.sessions and late == expected.late
    assert table_checks.event_time_mismatches(spark, layout, SPEC, TABLE)[0].count() == 0


@pytest.mark.long
def test_lost_checkpoint_after_a_failed_batch_gives_the_sessions_of_runs_that_never_failed(spark, layout, monkeypatch):
    """Generated payments of 20 customers (late ones included) in four deliveries. The second run dies
    after writing late_events, before its closing commit; then the stream's checkpoint is deleted. The
    outputs, previous sessions and day totals included, must equal the recomputation of runs that never
    failed."""
    monkeypatch.setenv(faults.FAULTS_ENV, str(layout.home / "faults"))
    runs = Deliveries(spark, layout)
    start = datetime(2026, 10, 20, 22, tzinfo=UTC)  # crosses midnight: day totals start again
    for n in range(4):
        generate(SPEC, layout.landing(SPEC.name), events=200, malformed=0.02, duplicates=0.03, late=0.1,
                 seed=60 + n, events_per_file=200, start=start + timedelta(hours=3 * n), max_step_s=60,
                 customers=20)
        result = runs.run(fail_before_closing=(n == 1), lose_checkpoint=(n == 2))
        if n == 2:  # the unfinished batch's late payments were deleted, and said so
            assert result.recovery and "died before" in result.recovery["problem"], result.recovery
            assert f"{LATE}:" in result.recovery["action"], result.recovery
    sessions, late = _outputs(layout)
    expected = runs.expected()
    assert len(expected.sessions) > 40 and len(expected.late) > 10  # the scenario exercises both
    assert sum(1 for s in expected.sessions.values() if s[4] is not None) > 20
    assert sessions == expected.sessions
    assert late == expected.late
    assert table_checks.event_time_mismatches(spark, layout, SPEC, TABLE)[0].count() == 0


@pytest.mark.long
def test_a_table_of_an_earlier_statetables_is_refused_until_a_refresh_rebuilds_it(spark, layout, landing):
    """An earlier statetables kept the sessions' state elsewhere and recorded no version of this one's state. Its
    customer_activity (a closing commit whose progress names no customer_activity_state version) is refused,
    naming the refresh; the refresh rebuilds it from bronze in one commit, and later deliveries give the outputs
    of runs that never changed version."""
    rules = Rules(watermark_delay=DELAY, state_ttl=timedelta(hours=3))
    runs = Deliveries(spark, layout, rules)
    landing.write(SPEC.name, "1.jsonl", [_payment("a1", "ann", "10:00"), _payment("a2", "ann", "10:20"),
                                         _payment("b1", "bob", "10:05"), _payment("b2", "bob", "11:10")])
    runs.run()  # watermark 11:00: ann's 10:00-10:20 closes; bob's 10:05 closes at 10:35; his 11:10 is open
    last = commits_since(spark, layout.table(ACTIVITY), None)[-1]["user"]
    legacy = {k: v for k, v in last.items() if k != "state_versions"}
    spark.createDataFrame([], output_schema(TABLE)).write.format("delta").mode("append").option(
        "userMetadata", json.dumps(legacy)).option("txnAppId", "legacy").option("txnVersion", 0).save(
        str(layout.table(ACTIVITY)))
    landing.write(SPEC.name, "2.jsonl", [_payment("b3", "bob", "11:30"), _payment("a3", "ann", "12:40"),
                                         _payment("z1", "zed", "14:00")])
    with pytest.raises(DefinitionChangedError, match=f"statetables refresh {ACTIVITY}"):
        runs.run()
    spec = declared(SPEC, watermark_delay=rules.watermark_delay, session_ttl=rules.state_ttl)
    refresh_event_time_table(spark, layout, spec, spec.event_time_tables[0])
    result = runs.run()
    assert result.recovery is None
    sessions, late = _outputs(layout)
    assert sessions == runs.expected().sessions and not late
    at = lambda hh_mm: datetime.fromisoformat(f"2026-11-01T{hh_mm}:00+00:00")  # noqa: E731
    # bob's open 11:10 came back from bronze and took 11:30; his previous session and day total with it
    assert sessions[("bob", at("11:10"))][:2] == (at("11:30"), 2)
    assert sessions[("bob", at("11:10"))][4:] == (at("10:05"), Decimal("30.00"))
