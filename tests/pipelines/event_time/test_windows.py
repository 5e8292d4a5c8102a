"""Event-time windows against a plain-Python recomputation (tests/contract_oracle.py `expected_windows`),
read with an independent Delta reader (`deltalake`).

Covers: sales out of order within the watermark count in their own window; sales behind it land in
`late_events` (and still in the all-time table); windows are written once the watermark passes their
end; the top 10 per hour; a crash between any two commits of a batch, and a lost checkpoint, give the outputs
of runs that never failed. Every delivery is one micro-batch; a batch that failed is folded on its own.
"""

from __future__ import annotations

import shutil
from datetime import datetime, timedelta, timezone
from decimal import Decimal

import pytest
from delta.tables import DeltaTable
from deltalake import DeltaTable as IndependentDeltaTable
from pyspark.sql import functions as F

from pipelines import faults
from pipelines.declare.project import SHIPPED, load_project
from pipelines.errors import DefinitionChangedError
from pipelines.event_time.watermark import LATE
from pipelines.ingest.generate import generate
from pipelines.operate import table_checks
from pipelines.operate.refresh import refresh_event_time_table
from pipelines.storage.delta_log import table_version
from tests.contract_oracle import Oracle, expected_state, expected_windows, file_lines, landing_files
from tests.streams import MOVIE_TICKET_SALES, advance

SPEC = MOVIE_TICKET_SALES
(TABLE,) = SPEC.event_time_tables
HOURLY, TOP = TABLE.name, TABLE.tops[0].name
UTC = timezone.utc


def _rows(layout, name: str) -> list[dict]:
    return IndependentDeltaTable(str(layout.table(name))).to_pyarrow_table().to_pylist()


def _utc(moment: datetime) -> datetime:
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def _outputs(layout) -> tuple[dict, dict, dict]:
    windows = {(r["title"], _utc(r["window_start"])): (r["tickets_sold"], r["total_ticket_value"])
               for r in _rows(layout, HOURLY)}
    assert len(windows) == len(_rows(layout, HOURLY)), "a window was written twice"
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
    return (f'{{"event_id":"{event_id}","title":"{title}","ticket_total_value":"{value}",'
            f'"sale_ts":"2026-11-01T{at}:00Z"}}')


def test_out_of_order_late_and_closed_windows_equal_the_recomputation(spark, layout, landing):
    runs = Deliveries(spark, layout)
    landing.write(SPEC.name, "1.jsonl", [_sale("a", "Dune", "10:05"), _sale("b", "Dune", "10:50", "12.50"),
                                         _sale("c", "Heat", "11:05")])
    runs.run()
    # 10:55 is behind the newest sale (11:05) but not behind the watermark (10:55 is not < 10:55 + 0).
    landing.write(SPEC.name, "2.jsonl", [_sale("d", "Dune", "12:30"), _sale("e", "Dune", "10:56"),
                                         _sale("f", "Heat", "11:10")])
    runs.run()
    # The watermark is now 12:20: 10:01 and 11:30 are late; 12:25 is not. 15:00 moves the watermark to
    # 14:50 once this batch is done, which closes the hours of 12 and 13 in the same run.
    landing.write(SPEC.name, "3.jsonl", [_sale("g", "Dune", "10:01"), _sale("h", "Alien", "11:30"),
                                         _sale("i", "Alien", "12:25", "7.25"), _sale("j", "Heat", "15:00")])
    result = runs.run()

    windows, late, top = _outputs(layout)
    expected = runs.expected()
    assert windows == expected.windows and late == expected.late and top == expected.top
    # The same facts by hand, so the recomputation itself is checked:
    ten, eleven, twelve = (datetime(2026, 11, 1, h, tzinfo=UTC) for h in (10, 11, 12))
    assert windows[("Dune", ten)] == (3, Decimal("32.50"))  # e (10:56) arrived a batch later, in its window
    assert windows[("Heat", eleven)] == (2, Decimal("20.00"))
    assert windows[("Alien", twelve)] == (1, Decimal("7.25"))
    assert set(late) == {"g", "h"} and late["g"][1] == datetime(2026, 11, 1, 12, 20, tzinfo=UTC)
    assert top[twelve] == [(1, "Dune", 1), (2, "Alien", 1)]  # tie on tickets: value decides
    assert ("Heat", datetime(2026, 11, 1, 15, tzinfo=UTC)) not in windows  # its hour is still open
    assert result.micro_batches >= 1
    # The Dagster checks' queries see the tables agree, and see a corrupted window and ranking.
    mismatched, figures = table_checks.event_time_mismatches(spark, layout, SPEC, TABLE)
    top_spec = TABLE.tops[0]
    assert mismatched.count() == 0 and table_checks.top_mismatches(spark, layout, top_spec).count() == 0
    # windows Dune 10, Heat 11, Dune 12, Alien 12 closed; g and h late; 10 sales in bronze
    assert (figures["rows_checked"], figures["events"], figures["late_events"]) == (4, 10, 2)
    assert figures["late_not_in_bronze"] == figures["late_not_behind_watermark"] == 0
    hourly_version = result.versions[HOURLY].after
    assert table_checks.event_time_mismatches(spark, layout, SPEC, TABLE, hourly_version)[1]["rows_checked"] == 0
    DeltaTable.forPath(spark, str(layout.table(HOURLY))).update(
        (F.col("title") == "Alien"), {"tickets_sold": F.col("tickets_sold") + 2})
    assert table_checks.event_time_mismatches(spark, layout, SPEC, TABLE)[0].count() == 2  # its row, either side
    assert table_checks.top_mismatches(spark, layout, top_spec).count() == 4  # Alien and Dune swap ranks
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


def test_a_changed_window_is_refused_until_a_refresh_rebuilds_the_table_from_bronze(spark, layout, landing):
    """The table's rows were cut into hours; the project file now says 30 minutes. A run refuses to fold into it,
    naming the refresh; the refresh rebuilds the table (and its top N) from bronze in one commit each, as one
    batch would from nothing (no sale late), and the next run goes on from there."""
    landing.write(SPEC.name, "1.jsonl", [_sale("a", "Dune", "10:05"), _sale("b", "Heat", "10:50"),
                                         _sale("c", "Dune", "11:20"), _sale("d", "Dune", "12:40")])
    advance(spark, layout, SPEC)
    text = SHIPPED.read_text().replace("window(sale_ts, '1 hour')", "window(sale_ts, '30 minutes')")
    halves = load_project(text, SHIPPED).streams[SPEC.name]
    with pytest.raises(DefinitionChangedError, match=f"statetables refresh {HOURLY}"):
        advance(spark, layout, halves)
    before = table_version(spark, layout.table(HOURLY))
    figures = refresh_event_time_table(spark, layout, halves, halves.event_time_tables[0])
    assert figures["table_version"] == before + 1  # the rows in one commit
    rows = {(r["title"], _utc(r["window_start"]), _utc(r["window_end"])) for r in _rows(layout, HOURLY)}
    half = lambda h, m: datetime(2026, 11, 1, h, m, tzinfo=UTC)  # noqa: E731
    # The watermark is 12:30 (12:40 minus 10 minutes): every half hour ending by then is closed.
    assert rows == {("Dune", half(10, 0), half(10, 30)), ("Heat", half(10, 30), half(11, 0)),
                    ("Dune", half(11, 0), half(11, 30))}
    landing.write(SPEC.name, "2.jsonl", [_sale("e", "Heat", "12:45"), _sale("f", "Dune", "13:30")])
    advance(spark, layout, halves)
    (table,) = halves.event_time_tables
    assert table_checks.event_time_mismatches(spark, layout, halves, table)[0].count() == 0
    assert table_checks.top_mismatches(spark, layout, table.tops[0]).count() == 0
    assert ("Dune", half(12, 30), half(13, 0)) in {
        (r["title"], _utc(r["window_start"]), _utc(r["window_end"])) for r in _rows(layout, HOURLY)}
