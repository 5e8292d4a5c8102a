"""Event-time windows against a plain-Python recomputation (tests/contract_oracle.py `expected_windows`),
read with an independent Delta reader (`deltalake`).

Covers: sales out of order within the watermark count in their own window; sales behind it land in
`late_events` (and still in the all-time table); windows are written once the watermark passes their
end; the top 10 per hour; the checks passing, then failing on a corrupted window and ranking; a changed window
refused until a refresh rebuilds the table from bronze; a crash between any two commits of a batch, and a lost
checkpoint, give the outputs of runs that never failed. Every delivery is one micro-batch; a batch that failed is
folded on its own.

Where a blocking check and its operator meet an edge, they must agree (issue 26: a check that fails a correct
table is an outage), so the scenario holds sales exactly at the edges and one step inside them, and runs the real
checks' queries: a sale at exactly 10:00:00.000 is in the 10:00 hour, 1 ms before in the 09:00 hour; a sale
exactly at the watermark is late (late_by_ms 0), 1 ms after it counts in its window. The folds' rules on
hand-written rows, without a stream: test_event_time_folds.py.
"""

from __future__ import annotations

import shutil
from datetime import datetime, timedelta, timezone
from decimal import Decimal

import pytest
from deltalake import DeltaTable as IndependentDeltaTable

from pipelines import faults
from pipelines.declare.project import SHIPPED, load_project
from pipelines.errors import DefinitionChangedError
from pipelines.event_time.watermark import LATE
from pipelines.ingest.generate import generate
from pipelines.operate import table_checks
from pipelines.operate.refresh import refresh_event_time_table
from tests.contract_oracle import (
    Oracle, accepted_per_file, expected_state, expected_windows, file_lines, landing_files,
)
from tests.streams import MOVIE_TICKET_SALES, advance

SPEC = MOVIE_TICKET_SALES
(TABLE,) = SPEC.event_time_tables
HOURLY, TOP = TABLE.name, TABLE.tops[0].name
UTC = timezone.utc


def _rows(layout, name: str, version: int | None = None) -> list[dict]:
    return IndependentDeltaTable(str(layout.table(name)), version=version).to_pyarrow_table().to_pylist()


def _utc(moment: datetime) -> datetime:
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def _outputs(layout, hourly_version: int | None = None) -> tuple[dict, dict, dict]:
    """(tickets_per_title_hourly at `hourly_version`, default the latest; late_events; top_titles_hourly)."""
    hourly = _rows(layout, HOURLY, hourly_version)
    windows = {(r["title"], _utc(r["window_start"])): (r["tickets_sold"], r["total_ticket_value"]) for r in hourly}
    assert len(windows) == len(hourly), "a window was written twice"
    late = {r["event_id"]: (_utc(r["event_time"]), _utc(r["watermark"])) for r in _rows(layout, LATE)}
    assert len(late) == len(_rows(layout, LATE)), "a late event was written twice"
    top: dict[datetime, list] = {}
    for r in sorted(_rows(layout, TOP), key=lambda r: (r["window_start"], r["rank"])):
        top.setdefault(_utc(r["window_start"]), []).append((r["rank"], r["title"], r["tickets_sold"]))
    return windows, late, top


class Deliveries:
    """Lands files, runs the stream once per delivery, and keeps each delivery's accepted sales (judged by the
    oracle, not by the pipeline) for the recomputation. A batch whose run failed after bronze is folded on its
    own by the next run, before that run's new files: as it would have been had it not failed."""

    def __init__(self, spark, layout):
        self.spark, self.layout = spark, layout
        self.oracle, self.batches, self.seen = Oracle(SPEC.name), [], set()
        self.unfinished: list[dict] = []  # sales of a batch that failed: the next run folds them first

    def run(self, *, lose_checkpoint: bool = False, fail_before_closing: bool = False, fail_at: str | None = None):
        fail_at = fail_at or (faults.WINDOWS_BEFORE_CLOSING_COMMIT if fail_before_closing else None)
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
                advance(self.spark, self.layout, SPEC)
            self.unfinished = batch
            return None
        self.batches += [b for b in (self.unfinished, batch) if b]
        self.unfinished = []
        return advance(self.spark, self.layout, SPEC)

    def expected(self):
        return expected_windows(self.batches, SPEC.watermark_delay, watermark_after_last=True)


def _sale(event_id: str, title: str, at: str, value: str = "10.00") -> str:
    """A sale line; `at` is HH:MM, or HH:MM:SS with a fraction."""
    at = f"{at}:00" if len(at) == 5 else at
    return (f'{{"event_id":"{event_id}","title":"{title}","ticket_total_value":"{value}",'
            f'"sale_ts":"2026-11-01T{at}Z"}}')


def test_a_changed_window_is_refused_until_a_refresh_then_out_of_order_late_and_edge_sales_equal_the_recomputation(
        spark, layout, landing):
    """An earlier project file cut the table into 30 minutes; the shipped one says an hour. A run refuses to fold into
    the half hours, naming the refresh; the refresh rebuilds the table (and its top N) from bronze in one commit, as
    one batch would from nothing, and the next run goes on from there under the shipped declaration (a 10-minute
    watermark delay) with sales out of order, late, and at the hour's edge and the watermark's: the checks must
    agree with the operator there (issue 26: a check that fails a correct table is an outage)."""
    text = SHIPPED.read_text().replace("window(sale_ts, '1 hour')", "window(sale_ts, '30 minutes')")
    halves = load_project(text, SHIPPED).streams[SPEC.name]
    landing.write(SPEC.name, "1.jsonl", [
        _sale("before", "A", "09:59:59.999", "2.50"), _sale("on_the_hour", "A", "10:00:00.000", "2.50"),
        _sale("a", "Dune", "10:05"), _sale("b", "Dune", "10:50", "12.50"),
        _sale("c", "Heat", "11:05")])  # the newest: the watermark is 10:55 once this batch is done
    advance(spark, layout, halves)
    hour = lambda h, m=0: datetime(2026, 11, 1, h, m, tzinfo=UTC)  # noqa: E731
    half = timedelta(minutes=30)
    assert {(r["title"], _utc(r["window_start"]), _utc(r["window_end"])) for r in _rows(layout, HOURLY)} == {
        ("A", hour(9, 30), hour(10)), ("A", hour(10), hour(10) + half), ("Dune", hour(10), hour(10) + half)}
    with pytest.raises(DefinitionChangedError, match=f"statetables refresh {HOURLY}"):
        advance(spark, layout, SPEC)
    before = IndependentDeltaTable(str(layout.table(HOURLY))).version()
    figures = refresh_event_time_table(spark, layout, SPEC, TABLE)
    assert figures["table_version"] == before + 1  # the rows in one commit
    refreshed_version = figures["table_version"]
    # As one batch from nothing: the watermark 10:55 (11:05 minus 10 minutes) has passed only the 09:00 hour's end.
    refreshed, _, top = _outputs(layout)
    assert refreshed == expected_windows(accepted_per_file(SPEC.name, layout.landing(SPEC.name)),
                                         SPEC.watermark_delay,
                                         watermark_after_last=True).windows
    assert refreshed == {("A", hour(9)): (1, Decimal("2.50"))} and top == {hour(9): [(1, "A", 1)]}

    landing.write(SPEC.name, "2.jsonl", [
        _sale("d", "Dune", "12:30"),
        _sale("e", "Dune", "10:56"),  # behind the newest sale, ahead of the watermark: counts in its hour
        _sale("f", "Heat", "11:10"),
        _sale("g", "Dune", "10:01"), _sale("h", "Alien", "10:30"),  # behind the watermark: late
        _sale("at_watermark", "A", "10:55:00.000", "2.50"),  # exactly at it: late, by 0 ms
        _sale("after_watermark", "A", "10:55:00.001", "2.50"),  # 1 ms after it: counts in the 10:00 hour
        _sale("i", "Alien", "12:25", "7.25"),
        _sale("j", "Heat", "15:00")])  # the watermark moves to 14:50 once this batch is done: 10, 11, 12 close
    advance(spark, layout, SPEC)
    windows, late, top = _outputs(layout)
    expected = expected_windows(accepted_per_file(SPEC.name, layout.landing(SPEC.name)), SPEC.watermark_delay,
                                watermark_after_last=True)
    assert windows == expected.windows and late == expected.late and top == expected.top
    # The same facts by hand, so the recomputation itself is checked:
    assert windows[("Dune", hour(10))] == (3, Decimal("32.50"))  # e (10:56) arrived a batch later, in its window
    assert windows[("Heat", hour(11))] == (2, Decimal("20.00"))
    assert windows[("Alien", hour(12))] == (1, Decimal("7.25"))
    # The hour's edge: 09:59:59.999 is in the 09:00 hour, 10:00:00.000 in the 10:00 hour, with 10:55:00.001.
    assert windows[("A", hour(10))] == (2, Decimal("5.00"))
    assert set(late) == {"g", "h", "at_watermark"} and late["g"][1] == hour(10, 55)
    late_by_ms = {r["event_id"]: r["late_by_ms"] for r in _rows(layout, LATE)}
    assert late_by_ms == {"g": 54 * 60_000, "h": 25 * 60_000, "at_watermark": 0}
    assert top[hour(12)] == [(1, "Dune", 1), (2, "Alien", 1)]  # tie on tickets: value decides
    assert top[hour(10)] == [(1, "Dune", 3), (2, "A", 2)]
    assert ("Heat", hour(15)) not in windows  # its hour is still open
    assert len(windows) == 6

    # The Dagster checks' queries (Spark's own window(), the declared top N), on the tables with Alien's 12:00
    # window corrupted, find that window and the ranking it upsets, and nothing else: every other window and rank
    # agrees, the hour's and the watermark's edges included.
    IndependentDeltaTable(str(layout.table(HOURLY))).update(  # a writer without the JVM: milliseconds
        predicate="title = 'Alien'", updates={"tickets_sold": "tickets_sold + 2"})
    mismatched, figures = table_checks.event_time_mismatches(spark, layout, SPEC, TABLE)
    found = sorted((r["title"], _utc(r["window_start"]), r["side"]) for r in mismatched.collect())
    assert found == [("Alien", hour(12), f"missing from {HOURLY}"), ("Alien", hour(12), f"only in {HOURLY}")], found
    # 6 windows closed; g, h and at_watermark late; 14 sales in bronze
    assert (figures["rows_checked"], figures["events"], figures["late_events"]) == (6, 14, 3)
    assert figures["late_not_in_bronze"] == figures["late_not_behind_watermark"] == 0
    reranked = table_checks.top_mismatches(spark, layout, TABLE.tops[0]).collect()
    stored, recomputed = f"only in {TOP}", f"missing from {TOP}"
    assert sorted((_utc(r["window_start"]), r["rank"], r["title"], r["side"]) for r in reranked) == [
        (hour(12), 1, "Alien", recomputed), (hour(12), 1, "Dune", stored),
        (hour(12), 2, "Alien", stored), (hour(12), 2, "Dune", recomputed)]  # Alien and Dune swap ranks
    # The per-run check reads only the windows the last run closed: not A's 09:00, which the refresh wrote.
    mismatched, figures = table_checks.event_time_mismatches(spark, layout, SPEC, TABLE, refreshed_version)
    assert (mismatched.count(), figures["rows_checked"]) == (2, 5)
    # Late sales still count in the all-time table.
    all_time = {r["title"]: r["tickets_sold"] for r in _rows(layout, SPEC.state_tables[0].name)}
    assert all_time == dict(expected_state(SPEC.name, landing_files(layout.landing(SPEC.name))).counts)
    assert all_time["Alien"] == 2 and all_time["Dune"] == 5


@pytest.mark.long
def test_a_batch_replayed_after_a_crash_between_any_two_commits_writes_what_it_would_have(spark, layout, monkeypatch):
    """A windows batch commits late_events, top_titles_hourly, its state, then tickets_per_title_hourly.
    Each delivery's run dies at the next of those points; the run after it replays the batch from the state
    the previous batch left. The outputs must equal the recomputation of runs that never failed."""
    monkeypatch.setenv(faults.FAULTS_ENV, str(layout.home / "faults"))
    runs = Deliveries(spark, layout)
    points = [faults.WINDOWS_AFTER_LATE_COMMIT, faults.WINDOWS_AFTER_TOP_COMMIT,
              faults.WINDOWS_AFTER_STATE_COMMIT, faults.WINDOWS_BEFORE_CLOSING_COMMIT]
    start = datetime(2026, 10, 20, tzinfo=UTC)
    for n, point in enumerate([*points, None]):
        generate(SPEC, layout.landing(SPEC.name), events=150, malformed=0.02, duplicates=0.03, late=0.15,
                 seed=80 + n, events_per_file=150, start=start + timedelta(hours=2 * n), max_step_s=60)
        if point:
            runs.run(fail_at=point)
        runs.run()  # the replay of the failed batch (or the last delivery)
    windows, late, top = _outputs(layout)
    expected = runs.expected()
    assert len(expected.windows) > 20 and len(expected.late) > 5  # the scenario exercises both
    assert (windows, late, top) == (expected.windows, expected.late, expected.top)
    assert table_checks.event_time_mismatches(spark, layout, SPEC, TABLE)[0].count() == 0


@pytest.mark.long
def test_lost_checkpoint_after_a_failed_batch_gives_the_outputs_of_runs_that_never_failed(spark, layout, monkeypatch):
    """Generated sales (late ones included) in four deliveries. The second run dies after writing
    late_events and top_titles_hourly, before its closing commit; then the stream's checkpoint is deleted.
    The outputs must equal the recomputation of runs that never failed."""
    monkeypatch.setenv(faults.FAULTS_ENV, str(layout.home / "faults"))
    runs = Deliveries(spark, layout)
    start = datetime(2026, 10, 20, tzinfo=UTC)
    for n in range(4):
        generate(SPEC, layout.landing(SPEC.name), events=250, malformed=0.02, duplicates=0.03, late=0.15,
                 seed=40 + n, events_per_file=250, start=start + timedelta(hours=3 * n), max_step_s=60)
        result = runs.run(fail_before_closing=(n == 1), lose_checkpoint=(n == 2))
        if n == 2:  # the unfinished batch's writes were undone, and said so
            assert result.recovery and "died before" in result.recovery["problem"], result.recovery
            assert f"{LATE}:" in result.recovery["action"] and f"{TOP} restored" in result.recovery["action"]
    windows, late, top = _outputs(layout)
    expected = runs.expected()
    assert len(expected.windows) > 20 and len(expected.late) > 10  # the scenario exercises both
    assert windows == expected.windows
    assert late == expected.late
    assert top == expected.top
