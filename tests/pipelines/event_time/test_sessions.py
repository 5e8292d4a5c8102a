"""Customer activity sessions (keyed state, timers, TTL) against a plain-Python recomputation
(tests/contract_oracle.py `expected_sessions`), read with an independent Delta reader (`deltalake`).

Covers: a payment out of order within the watermark joins its session (here it joins two into one);
payments behind it land in `late_events` and still count in payments_per_customer; the event-time
watermark closes a session 30 minutes after its last payment; the previous session and the day's spend
come from the keyed state table, which TTL forgets; a batch replayed after a crash between any two of its
commits, a lost checkpoint, and a table of an earlier statetables (refused until refreshed) give the outputs of
runs that never failed.

Where a blocking check and its operator meet an edge, they must agree (issue 26: a check that fails a correct
table is an outage), so the scenario holds payments exactly at the edges and one step inside them, and runs the
real checks' queries: payments exactly 30:00.000 apart are two sessions, 29:59.999 apart one; a payment arriving
out of order that bridges two sessions at exactly the gap leaves three, at 1 ms less joins them into one; a key of
payments_per_customer exactly its TTL behind the newest payment is kept, 1 µs more is expired. The folds' rules on
hand-written rows, without a stream: test_event_time_folds.py.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from decimal import Decimal

import pyarrow as pa
import pytest
from deltalake import DeltaTable as IndependentDeltaTable

from pipelines import faults
from pipelines.errors import DefinitionChangedError
from pipelines.event_time.watermark import LATE, output_schema
from pipelines.ingest.generate import generate
from pipelines.operate import table_checks
from pipelines.operate.refresh import refresh_event_time_table
from pipelines.storage.delta_log import commits_since, table_version
from tests.contract_oracle import (
    Oracle, accepted_per_file, expected_sessions, expected_with_ttl, file_lines, landing_files,
)
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


def _rows(layout, name: str, version: int | None = None) -> list[dict]:
    return IndependentDeltaTable(str(layout.table(name)), version=version).to_pyarrow_table().to_pylist()


def _utc(moment: datetime | None) -> datetime | None:
    return moment.replace(tzinfo=UTC) if moment is not None and moment.tzinfo is None else moment


def _outputs(layout, activity_version: int | None = None) -> tuple[dict, dict]:
    """(customer_activity at `activity_version`, default the latest; the payments' late_events rows)."""
    rows = _rows(layout, ACTIVITY, activity_version)
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


def _payment(payment_id: str, customer: str, at: str, amount: str = "10.00", day: str = "2026-11-01") -> str:
    """A payment line; `at` is HH:MM, or HH:MM:SS with a fraction."""
    at = f"{at}:00" if len(at) == 5 else at
    return (f'{{"payment_id":"{payment_id}","customer_id":"{customer}","amount":"{amount}",'
            f'"paid_at":"{day}T{at}Z"}}')


def test_sessions_late_payments_ttls_and_their_edges_equal_the_recomputation_and_the_checks(spark, layout, landing,
                                                                                           monkeypatch):
    """Two deliveries, each its own micro-batch of one run. A 2-hour watermark delay, so that a payment of the
    second batch can bridge two sessions the first left open; a session TTL of 40 minutes of event time, so that a
    customer idle that long is forgotten; a TTL of 1 day on payments_per_customer. Beside the customers' stories,
    payments at the gap's edge and at the state table's TTL: the checks must agree with the operators there
    (issue 26: a check that fails a correct table is an outage)."""
    rules = Rules(watermark_delay=timedelta(hours=2), state_ttl=timedelta(minutes=40))
    ttl = timedelta(days=1)
    files = [landing.write(SPEC.name, "1.jsonl", [
        _payment("a1", "ann", "10:00"), _payment("a2", "ann", "10:20", "5.50"), _payment("a3", "ann", "10:55"),
        _payment("b1", "bob", "10:05"), _payment("c1", "cy", "09:00"), _payment("c2", "cy", "09:25"),
        _payment("d1", "dee", "12:00"),  # the newest: the second batch's watermark is 10:00
        # 30:00.000 apart: two sessions; 29:59.999 apart: one.
        _payment("e1", "exact", "10:00:00.000"), _payment("e2", "exact", "10:30:00.000"),
        _payment("l1", "less", "10:00:00.000"), _payment("l2", "less", "10:29:59.999"),
        # Two sessions each, until the second batch's payment between them.
        _payment("be1", "bridge_exact", "10:00:00.000"), _payment("be3", "bridge_exact", "11:00:00.000"),
        _payment("bl1", "bridge_less", "10:00:00.000"), _payment("bl3", "bridge_less", "10:59:59.998"),
        # Exactly 1 day behind the newest payment once zed's 18:40 arrives: kept; 1 µs more: expired.
        _payment("t1", "exactly_ttl", "18:40:00.000000", day="2026-10-31"),
        _payment("t2", "ttl_and_1us", "18:39:59.999999", day="2026-10-31")])]
    files.append(landing.write(SPEC.name, "2.jsonl", [
        _payment("a4", "ann", "10:47"),  # behind the newest payment, ahead of the watermark: joins ann's two
        _payment("b2", "bob", "10:50", "3.00"), _payment("b3", "bob", "11:25"), _payment("b4", "bob", "12:20"),
        _payment("b5", "bob", "09:40"),  # behind the watermark: late
        _payment("c3", "cy", "10:03"),  # 38 minutes after cy's last payment: a new session, cy not forgotten
        _payment("be2", "bridge_exact", "10:30:00.000"),  # exactly 30:00.000 from both neighbours
        _payment("bl2", "bridge_less", "10:29:59.999"),  # 29:59.999 from both
        _payment("z1", "zed", "16:00"), _payment("z2", "zed", "18:40")]))  # watermark 16:40: z1 closes, z2 open
    result = advance(spark, layout, SPEC, watermark_delay=rules.watermark_delay, session_ttl=rules.state_ttl,
                     ttl=ttl, max_files_per_trigger=1)
    spec = declared(SPEC, watermark_delay=rules.watermark_delay, session_ttl=rules.state_ttl, ttl=ttl)
    assert result.micro_batches == 2, result
    batches = accepted_per_file(SPEC.name, layout.landing(SPEC.name))
    at = lambda hh_mm: datetime.fromisoformat(f"2026-11-01T{hh_mm}+00:00")  # noqa: E731

    # After the first batch (watermark 10:00) only cy's 09:00-09:25 and the day before's payments were a gap behind
    # the watermark: the timers of the sessions still open had not fired.
    closing = [c for c in result.commits[ACTIVITY] if "watermark_ms" in c["user"]]  # one per batch
    assert len(closing) == 2, result.commits[ACTIVITY]
    first_version = closing[0]["version"]
    first_sessions, _ = _outputs(layout, first_version)
    assert first_sessions == expected_sessions(batches[:1], rules.watermark_delay, rules.gap, rules.state_ttl).sessions
    assert sorted(customer for customer, _ in first_sessions) == ["cy", "exactly_ttl", "ttl_and_1us"]

    sessions, late = _outputs(layout)
    expected = expected_sessions(batches, rules.watermark_delay, rules.gap, rules.state_ttl)
    assert sessions == expected.sessions and late == expected.late
    # The same facts by hand, so the recomputation itself is checked:
    assert sessions[("ann", at("10:00"))] == (at("10:55"), 4, Decimal("35.50"), ["a3", "a4", "a2", "a1"], None,
                                              Decimal("35.50"))
    # bob's 10:50 came 45 minutes after his 10:05: forgotten (TTL); his 11:25 knows his 10:50 (value and
    # map state); his 12:20 came 55 minutes after it: forgotten again, the day total starts again.
    assert sessions[("bob", at("10:50"))][4] is None
    assert sessions[("bob", at("11:25"))][4:] == (at("10:50"), Decimal("13.00"))
    assert sessions[("bob", at("12:20"))][1:] == (1, Decimal("10.00"), ["b4"], None, Decimal("10.00"))
    # cy's previous session closed in the first batch: carried to the second by the state table.
    assert sessions[("cy", at("10:03"))][4:] == (at("09:25"), Decimal("30.00"))
    assert sessions[("dee", at("12:00"))][:2] == (at("12:00"), 1)  # closed by the watermark alone
    # At the gap's edge: 30:00.000 apart is two sessions, 29:59.999 one; a payment out of order exactly the gap
    # from both neighbours leaves three, at 1 ms less it joins them into one.
    spans = {(customer, start): (end, count) for (customer, start), (end, count, *_) in sessions.items()
             if customer in ("exact", "less", "bridge_exact", "bridge_less")}
    assert spans == {
        ("exact", at("10:00:00")): (at("10:00:00"), 1), ("exact", at("10:30:00")): (at("10:30:00"), 1),
        ("less", at("10:00:00")): (at("10:29:59.999"), 2),
        ("bridge_exact", at("10:00:00")): (at("10:00:00"), 1),
        ("bridge_exact", at("10:30:00")): (at("10:30:00"), 1),
        ("bridge_exact", at("11:00:00")): (at("11:00:00"), 1),
        ("bridge_less", at("10:00:00")): (at("10:59:59.998"), 3)}
    assert len(sessions) == 18
    assert ("zed", at("18:40")) not in sessions  # the timer has not fired: 18:40 + 30 min > 16:40
    assert set(late) == {"b5"} and late["b5"][1] == at("10:00")
    # The state moved: the second batch left a newer version of it than the first.
    assert closing[1]["user"]["state_versions"][STATE] > closing[0]["user"]["state_versions"][STATE]
    # The session TTL: every customer's keyed state is dropped once the watermark is 40 minutes past their last
    # session, but zed's: his 16:00 session closed, and his 18:40 is still open. Read from the operator's state.
    state = _rows(layout, STATE)
    assert sorted(r["customer_id"] for r in state if not r["_open"]) == ["zed"]
    assert sorted(r["customer_id"] for r in state if r["_open"]) == ["zed"]
    # Read whole, it keeps no column statistics, only the row counts (its figures in Dagster come from them).
    state_files = pa.table(IndependentDeltaTable(str(layout.table(STATE))).get_add_actions(flatten=True))
    assert state_files.column_names == ["path", "size_bytes", "modification_time", "num_records"]
    assert sum(state_files.column("num_records").to_pylist()) == len(state)

    # The per-run check of the second batch's sessions, before any corruption: nothing found.
    activity = layout.table(ACTIVITY)
    assert table_checks._files_added(activity, first_version, table_version(spark, activity))
    mismatched, by_files = table_checks.event_time_mismatches(spark, layout, spec, TABLE, first_version)
    assert mismatched.count() == 0 and by_files["keys_written"] > 1

    # The Dagster check's query, on the tables with two sessions corrupted (cy's 09:00, closed by the first batch,
    # and zed's, closed by the second), finds those two and nothing else: every other session agrees with bronze,
    # the gap's edges included.
    IndependentDeltaTable(str(layout.table(ACTIVITY))).update(  # a writer without the JVM: milliseconds
        predicate="customer_id = 'zed' OR (customer_id = 'cy' AND session_start < '2026-11-01T10:00:00Z')",
        updates={"payment_count": "3"})
    mismatched, figures = table_checks.event_time_mismatches(spark, layout, spec, TABLE)
    found = sorted((r["customer_id"], _utc(r["session_start"]), r["side"]) for r in mismatched.collect())
    assert found == [(customer, at(start), side) for customer, start in (("cy", "09:00"), ("zed", "16:00"))
                     for side in (f"missing from {ACTIVITY}", f"only in {ACTIVITY}")], found
    assert (figures["rows_checked"], figures["events"], figures["late_events"], figures["late_not_in_bronze"]) == (
        18, 27, 1, 0)
    # The per-run check reads only the keys of the sessions the last batch closed, from the first of them (10:00)
    # on, and their payments from a gap before it: cy's 09:00 is the deep check's to find, a wrong zed is its own.
    mismatched, figures = table_checks.event_time_mismatches(spark, layout, spec, TABLE, first_version)
    assert sorted(r["customer_id"] for r in mismatched.collect()) == ["zed", "zed"]
    assert (figures["rows_checked"], figures["events"]) == (15, 23)  # all but cy's 09:00 and the day before's
    written = figures["keys_written"]
    assert written == figures["keys_checked"] > 1
    # Before the update, the run's commits had only added files, and the keys written were read from those files;
    # the update removed files, and they come from the table's change feed: the same keys, sessions and events.
    assert table_checks._files_added(activity, first_version, table_version(spark, activity)) is None
    compared = ("rows_checked", "events", "keys_written", "keys_checked", "late_events")
    assert {k: figures[k] for k in compared} == {k: by_files[k] for k in compared}
    # Past RUN_CHECK_KEYS keys, a sample of them is checked: here one key, with its sessions and events only.
    monkeypatch.setattr(table_checks, "RUN_CHECK_KEYS", 1)
    mismatched, figures = table_checks.event_time_mismatches(spark, layout, spec, TABLE, first_version)
    assert (figures["keys_written"], figures["keys_checked"]) == (written, 1)
    assert 0 < figures["rows_checked"] < 15 and 0 < figures["events"] < 23
    assert {r["customer_id"] for r in mismatched.collect()} <= {"zed"}

    # payments_per_customer: late payments still count; the TTL expired the key 1 µs past it, kept the one at it,
    # and its checks agree.
    state_table = spec.state_tables[0]
    all_time = {r[state_table.key]: (r[state_table.count_column], r[state_table.sum_column])
                for r in _rows(layout, state_table.name)}
    with_ttl = expected_with_ttl(SPEC.name, [[f] for f in files], ttl)
    assert all_time == with_ttl.rows and all_time["bob"][0] == 5
    assert "exactly_ttl" in all_time and "ttl_and_1us" not in all_time
    assert [key for key, _, _ in with_ttl.expired] == ["ttl_and_1us"]
    assert table_checks.totals_match_bronze(spark, layout, spec, state_table)["passed"]
    mismatched, totals = table_checks.mismatches_with_bronze(spark, layout, spec, state_table)
    assert mismatched.count() == 0 and totals["sum_of_counts"] == totals["distinct_accepted_events"] == 27


def test_large_batches_fold_from_the_state_read_ahead_as_small_ones_do(spark, layout, landing, monkeypatch):
    """A large batch reads its operator state beside its ingest (`EventTimeStage.read_state_ahead`); the second
    batch folds from the state the first left, read that way: a payment joining an open session, a previous
    session carried, a late one."""
    rules = Rules(watermark_delay=timedelta(hours=2))
    landing.write(SPEC.name, "1.jsonl", [
        _payment("a1", "ann", "10:00"), _payment("a3", "ann", "10:55"), _payment("c1", "cy", "09:00"),
        _payment("c2", "cy", "09:25"), _payment("d1", "dee", "12:00")])
    landing.write(SPEC.name, "2.jsonl", [
        _payment("a2", "ann", "10:30", "5.50"), _payment("b5", "bob", "09:40"), _payment("c3", "cy", "10:03"),
        _payment("z2", "zed", "18:40")])
    from pipelines.event_time.watermark import EventTimeStage
    read_ahead, folded_from = [], []
    real_read, real_before = EventTimeStage.read_state_ahead, EventTimeStage.state_before

    def spied_read(stage, spark):
        version, frame = real_read(stage, spark)
        read_ahead.append(version)
        return version, frame

    def spied_before(stage, spark):
        ahead = stage.state_ahead
        frame = real_before(stage, spark)
        folded_from.append(ahead is not None and frame is ahead.result()[1])
        return frame

    monkeypatch.setattr(EventTimeStage, "read_state_ahead", spied_read)
    monkeypatch.setattr(EventTimeStage, "state_before", spied_before)
    result = advance(spark, layout, SPEC, watermark_delay=rules.watermark_delay, max_files_per_trigger=1,
                     large_from_bytes=0)
    assert result.micro_batches == 2, result
    # The first batch has no state to read; the second folds from the one the first left.
    assert read_ahead[0] is None and read_ahead[1] is not None and folded_from == [True], (read_ahead, folded_from)
    sessions, late = _outputs(layout)
    expected = expected_sessions(accepted_per_file(SPEC.name, layout.landing(SPEC.name)), rules.watermark_delay,
                                 rules.gap, rules.state_ttl)
    assert sessions == expected.sessions and late == expected.late
    at = lambda hh_mm: datetime.fromisoformat(f"2026-11-01T{hh_mm}+00:00")  # noqa: E731
    assert sessions[("ann", at("10:30"))][1] == 2  # a2 joined the session a3 left open
    assert sessions[("cy", at("10:03"))][4] == at("09:25")  # cy's previous session, carried by the state
    assert set(late) == {"b5"} and len(sessions) == 5


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
