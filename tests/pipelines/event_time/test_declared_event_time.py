"""A stream the code has never seen, with a windowed table, a top N and a session table on its own field names, and
a state table and a windowed table that keep only the events a WHERE keeps, declared only in a project file, over
two micro-batches (one file each, in one run) with late, out-of-order, re-delivered, conflicting and malformed
lines.

The expected tables come from an oracle written here in plain Python (json, Decimal, datetime), importing no
product code: it reads the same landing files in arrival order, dedups them, replays the micro-batches' watermark
(the newest on-time event of the earlier batches minus the delay) and cuts windows and sessions by the declared
SQL's meaning. The tables are read with an independent Delta reader (`deltalake`).
"""

from __future__ import annotations

import json
import random
from collections import defaultdict
from datetime import datetime, timedelta, timezone
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

import pytest
from deltalake import DeltaTable as IndependentDeltaTable

from pipelines.declare.project import load_project
from pipelines.errors import ConfigurationError
from pipelines.operate import table_checks
from pipelines.runtime.micro_batch import StreamSettings, advance_stream

PROJECT = """\
streams:
  shipments:
    id: shipment_id
    event_time: sent_at
    fields:
      shipment_id: {type: string}
      depot:       {type: string, trim: true}
      carrier:     {type: string}
      weight:      {type: decimal, min: 0}
      sent_at:     {type: timestamp}
    watermark_delay_minutes: 5

state_tables:
  - CREATE TABLE depot_quarter_hours AS
    SELECT depot, window.start AS starts, window.end AS ends, COUNT(*) AS shipments, SUM(weight) AS weight,
           MAX(weight) AS heaviest, AVG(weight) AS mean_weight
    FROM shipments GROUP BY depot, window(sent_at, '15 minutes')

  - CREATE TABLE busiest_depots AS
    SELECT starts, rank, depot, shipments
    FROM (SELECT starts, depot, shipments, weight,
                 ROW_NUMBER() OVER (PARTITION BY starts ORDER BY shipments DESC, weight DESC, depot) AS rank
          FROM depot_quarter_hours)
    WHERE rank <= 2

  - CREATE TABLE heavy_quarter_hours AS
    SELECT depot, window.start AS starts, COUNT(*) AS shipments
    FROM shipments WHERE weight >= 1000 GROUP BY depot, window(sent_at, '15 minutes')

  - CREATE TABLE heavy_per_depot AS
    SELECT depot, COUNT(*) AS heavy, SUM(weight) AS weight
    FROM shipments WHERE weight >= 1000 AND carrier <> 'bolt' GROUP BY depot

  - sql: CREATE TABLE carrier_runs AS
      SELECT carrier, session_window.start AS run_start, session_window.end AS run_end, COUNT(*) AS shipments,
             SUM(weight) AS weight, MAX(sent_at) AS last_sent, MAX_BY(shipment_id, sent_at, 2) AS last_two,
             LAG(MAX(sent_at)) OVER (PARTITION BY carrier ORDER BY MIN(sent_at)) AS previous_last,
             SUM(COUNT(*)) OVER (PARTITION BY carrier, DATE(MAX(sent_at)) ORDER BY MIN(sent_at)) AS shipments_today
      FROM shipments GROUP BY carrier, session_window(sent_at, '10 minutes')
    ttl_days: 0.025
"""
DELAY, SIZE, GAP, TTL = timedelta(minutes=5), timedelta(minutes=15), timedelta(minutes=10), timedelta(days=0.025)
T0 = datetime(2026, 11, 20, 23, 0, tzinfo=timezone.utc)  # the runs cross midnight: day totals start again
EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def _iso(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%f") + "Z"


def _line(shipment_id: str, depot: str, carrier: str, weight: str, at: datetime) -> str:
    return json.dumps({"shipment_id": shipment_id, "depot": depot, "carrier": carrier, "weight": weight,
                       "sent_at": _iso(at)})


def _deliveries() -> list[list[str]]:
    """Two files: the first in time order with jitter; the second with later events, events behind the first
    run's watermark (late), out-of-order ones still ahead of it, re-deliveries, a conflicting re-use of an id and
    a malformed line. Carriers' steps of 4 to 14 minutes put gaps on both sides of the 10-minute gap; steps of 40
    minutes, past the 36-minute TTL, make a carrier forget its previous run."""
    rng = random.Random(45)
    at = {c: T0 for c in ("ace", "bolt", "cargo")}
    first, second = [], []
    for n in range(90):
        carrier = ("ace", "bolt", "cargo")[n % 3]
        at[carrier] += timedelta(minutes=rng.choice([4, 6, 9, 10, 11, 14, 40]), milliseconds=rng.randrange(0, 999))
        line = _line(f"s{n}", rng.choice(["north", " south", "east "]), carrier, f"{rng.randrange(1, 4000)}.{n % 100:02d}",
                     at[carrier])
        (first if n < 60 else second).append(line)
    newest_first = max(datetime.fromisoformat(json.loads(x)["sent_at"].replace("Z", "+00:00")) for x in first)
    second += [
        _line("late-1", "north", "ace", "5.00", T0 + timedelta(minutes=20)),  # far behind the watermark
        _line("late-2", "east", "bolt", "7.00", newest_first - DELAY),  # exactly at it: late
        _line("ontime-1", "north", "cargo", "8.00", newest_first - DELAY + timedelta(milliseconds=1)),  # 1 ms ahead
        first[3], first[10],  # re-delivered, the same content: counted once
        first[5].replace('"weight": "', '"weight": "9'),  # the same id, another weight: conflicting
        '{"shipment_id": "broken", "depot": ',  # not JSON
    ]
    rng.shuffle(second)
    return [first, second]


def _parse(line: str) -> dict | None:
    try:
        event = json.loads(line)
    except json.JSONDecodeError:
        return None
    return {"shipment_id": event["shipment_id"], "depot": event["depot"].strip(), "carrier": event["carrier"],
            "weight": Decimal(event["weight"]),
            "sent_at": datetime.fromisoformat(event["sent_at"].replace("Z", "+00:00"))}


def _micros(moment: datetime) -> int:
    return (moment - EPOCH) // timedelta(microseconds=1)


class Oracle:
    """The declared tables from the landing files, one micro-batch per file, in plain Python."""

    def __init__(self, files: list[list[str]]):
        seen: dict[str, dict] = {}
        self.batches: list[list[dict]] = []
        self.quarantined = 0
        for lines in files:
            batch = []
            for line in lines:
                event = _parse(line)
                if event is None or (event["shipment_id"] in seen and seen[event["shipment_id"]] != event):
                    self.quarantined += 1
                elif event["shipment_id"] not in seen:
                    seen[event["shipment_id"]] = event
                    batch.append(event)
            self.batches.append(batch)
        # Every table of the stream sees the same batches, so the same watermark and the same late events.
        watermark_ms, self.on_time, self.late = 0, [], {}
        for batch in self.batches:
            on_time = [e for e in batch if _micros(e["sent_at"]) > watermark_ms * 1000]
            self.late.update({e["shipment_id"]: watermark_ms for e in batch if e not in on_time})
            self.on_time += on_time
            if on_time:
                newest_ms = _micros(max(e["sent_at"] for e in on_time)) // 1000
                watermark_ms = max(watermark_ms, newest_ms - DELAY // timedelta(milliseconds=1))
        self.watermark = EPOCH + timedelta(milliseconds=watermark_ms)

    def windows(self, keep=lambda e: True) -> dict:
        grouped = defaultdict(list)
        for e in filter(keep, self.on_time):
            start = EPOCH + SIZE * ((e["sent_at"] - EPOCH) // SIZE)
            grouped[(e["depot"], start)].append(e["weight"])
        return {(depot, start): (start + SIZE, len(w), sum(w), max(w),
                                 (sum(w) / len(w)).quantize(Decimal("0.000001"), ROUND_HALF_UP))
                for (depot, start), w in grouped.items() if start + SIZE <= self.watermark}

    def heavy_per_depot(self) -> dict:
        """All accepted events, late ones included (a state table counts them), that its WHERE keeps."""
        rows = defaultdict(lambda: [0, Decimal(0)])
        for e in (e for batch in self.batches for e in batch):
            if e["weight"] >= 1000 and e["carrier"] != "bolt":
                rows[e["depot"]][0] += 1
                rows[e["depot"]][1] += e["weight"]
        return {depot: tuple(row) for depot, row in rows.items()}

    def top(self) -> set:
        by_start = defaultdict(list)
        for (depot, start), (_, count, weight, *_) in self.windows().items():
            by_start[start].append((-count, -weight, depot, count))
        return {(start, rank, depot, count) for start, rows in by_start.items()
                for rank, (_, _, depot, count) in enumerate(sorted(rows)[:2], start=1)}

    def sessions(self) -> dict:
        by_carrier = defaultdict(list)
        for e in self.on_time:
            by_carrier[e["carrier"]].append(e)
        rows = {}
        for carrier, events in by_carrier.items():
            events.sort(key=lambda e: e["sent_at"])
            cut = [[events[0]]]
            for e in events[1:]:
                if e["sent_at"] - cut[-1][-1]["sent_at"] >= GAP:
                    cut.append([])
                cut[-1].append(e)
            previous_last, day, today = None, None, 0
            for run in cut:
                start, last = run[0]["sent_at"], run[-1]["sent_at"]
                if last + GAP > self.watermark:
                    break  # open, and so is every later one
                forgot = previous_last is not None and start - previous_last >= TTL
                if forgot or last.date() != day:
                    today = 0
                today += len(run)
                newest = sorted(run, key=lambda e: (e["sent_at"], e["shipment_id"]), reverse=True)[:2]
                rows[(carrier, start)] = (last + GAP, len(run), sum(e["weight"] for e in run), last,
                                          [e["shipment_id"] for e in newest], None if forgot else previous_last,
                                          today)
                previous_last, day = last, last.date()
        return rows


def _rows(layout, name: str) -> list[dict]:
    return IndependentDeltaTable(str(layout.table(name))).to_pyarrow_table().to_pylist()


def _utc(moment):
    return moment.replace(tzinfo=timezone.utc) if moment is not None and moment.tzinfo is None else moment


def test_a_new_streams_windows_top_n_and_sessions_equal_an_independent_oracle(spark, layout, landing, tmp_path):
    spec = load_project(PROJECT, tmp_path / "statetables.yaml").streams["shipments"]
    files = _deliveries()
    for n, lines in enumerate(files):
        landing.write("shipments", f"{n}.jsonl", lines)
    # Each file its own micro-batch, in one run: the second batch's watermark is the first's.
    assert advance_stream(spark, layout, spec, StreamSettings(max_files_per_trigger=1)).micro_batches == len(files)
    oracle = Oracle(files)
    assert len(oracle.late) >= 2 and oracle.quarantined == 2  # the scenario exercises both

    windows = {(r["depot"], _utc(r["starts"])): (_utc(r["ends"]), r["shipments"], r["weight"], r["heaviest"],
                                                 r["mean_weight"]) for r in _rows(layout, "depot_quarter_hours")}
    assert len(windows) == len(_rows(layout, "depot_quarter_hours")), "a window was written twice"
    assert windows == oracle.windows() and len(windows) > 10
    top = {(_utc(r["starts"]), r["rank"], r["depot"], r["shipments"]) for r in _rows(layout, "busiest_depots")}
    assert top == oracle.top()
    runs = {(r["carrier"], _utc(r["run_start"])): (
        _utc(r["run_end"]), r["shipments"], r["weight"], _utc(r["last_sent"]), r["last_two"],
        _utc(r["previous_last"]), r["shipments_today"]) for r in _rows(layout, "carrier_runs")}
    expected = oracle.sessions()
    assert runs == expected and len(runs) > 15
    assert sum(row[5] is None for row in expected.values()) > 3  # beyond each carrier's first run: the TTL
    assert sum(row[5] is not None for row in expected.values()) > 5
    heavy = {(r["depot"], _utc(r["starts"])): r["shipments"] for r in _rows(layout, "heavy_quarter_hours")}
    assert heavy == {k: v[1] for k, v in oracle.windows(lambda e: e["weight"] >= 1000).items()} and heavy
    assert {r["depot"]: (r["heavy"], r["weight"]) for r in _rows(layout, "heavy_per_depot")} == oracle.heavy_per_depot()
    late = defaultdict(set)
    weights = {e["shipment_id"]: e["weight"] for batch in oracle.batches for e in batch}
    for r in _rows(layout, "late_events"):
        assert r["stream"] == "shipments"
        late[r["table_name"]].add((r["event_id"], _utc(r["watermark"])))
    wanted = {(i, EPOCH + timedelta(milliseconds=ms)) for i, ms in oracle.late.items()}
    late_heavy = {(i, at) for i, at in wanted if weights[i] >= 1000}  # late only for a table that keeps the event
    assert late == {"depot_quarter_hours": wanted, "carrier_runs": wanted,
                    **({"heavy_quarter_hours": late_heavy} if late_heavy else {})}
    # The blocking checks' queries agree: Spark's own window() and the declared top N over the tables.
    for table in spec.event_time_tables:
        assert table_checks.event_time_mismatches(spark, layout, spec, table)[0].count() == 0, table.name
    filtered = next(t for t in spec.state_tables if t.name == "heavy_per_depot")
    assert table_checks.totals_match_bronze(spark, layout, spec, filtered)["passed"] is None  # bronze's totals: all
    mismatched, totals = table_checks.mismatches_with_bronze(spark, layout, spec, filtered)
    assert mismatched.count() == 0 and totals["totals_agree"], totals
    assert table_checks.top_mismatches(spark, layout, spec.event_time_tables[0].tops[0]).count() == 0


WINDOWED = ("CREATE TABLE q AS SELECT depot, window.start AS starts, COUNT(*) AS n, SUM(weight) AS w "
            "FROM shipments GROUP BY depot, window(sent_at, '15 minutes')")
REFUSED = [
    (WINDOWED.replace("'15 minutes')", "'15 minutes', '5 minutes')"), "hopping windows"),
    (WINDOWED.replace("window(sent_at", "window(shipped_on"), "unknown column 'shipped_on'"),
    (WINDOWED.replace("window(sent_at, '15 minutes')", "window(sent_at, 'fortnightly')"),
     "write a whole number of seconds, minutes"),
    (WINDOWED.replace("window.start AS starts, ", ""), "select window.start"),
    (WINDOWED.replace("COUNT(*) AS n", "COUNT(*) AS n, LAG(COUNT(*)) OVER (PARTITION BY depot ORDER BY MIN(sent_at)) "
                                       "AS before"), "a window function is not kept in a windowed table"),
    (WINDOWED + "\n  - CREATE TABLE top AS SELECT * FROM (SELECT starts, depot, n, RANK() OVER (PARTITION BY starts "
                "ORDER BY n DESC, depot) AS r FROM q) WHERE r <= 3", "rank with ROW_NUMBER()"),
    (WINDOWED + "\n  - CREATE TABLE top AS SELECT * FROM (SELECT starts, depot, n, ROW_NUMBER() OVER (PARTITION BY "
                "starts ORDER BY n DESC) AS r FROM q) WHERE r <= 3", "can tie"),
    ("CREATE TABLE top AS SELECT * FROM (SELECT starts, ROW_NUMBER() OVER (PARTITION BY starts ORDER BY starts) "
     "AS r FROM q) WHERE r <= 3", "not a windowed table declared above this one"),
    ("CREATE TABLE s AS SELECT carrier, MIN(sent_at) AS first, COUNT(*) AS n, LAG(COUNT(*)) OVER (PARTITION BY "
     "depot ORDER BY MIN(sent_at)) AS before FROM shipments GROUP BY carrier, session_window(sent_at, '10 minutes')",
     "partition by the table's keys"),
    ("CREATE TABLE s AS SELECT carrier, COUNT(*) AS n FROM shipments GROUP BY carrier, "
     "session_window(sent_at, '10 minutes')", "select the session's start"),
    ("CREATE TABLE s AS SELECT depot, MAX_BY(carrier, sent_at, 2) AS last FROM shipments GROUP BY depot",
     "a state table keeps one value per column"),
    ("CREATE TABLE s AS SELECT depot, COUNT(*) AS n FROM shipments WHERE rand() < 0.5 GROUP BY depot",
     "changes between runs"),
    ("CREATE TABLE s AS SELECT depot, COUNT(*) AS n FROM shipments WHERE weight > AVG(weight) GROUP BY depot",
     "a WHERE keeps each event on its own"),
    ("CREATE TABLE s AS SELECT depot, COUNT(*) AS n FROM shipments WHERE volume > 3 GROUP BY depot",
     "unknown column 'volume'"),
]


@pytest.mark.parametrize("sql, message", REFUSED)
def test_event_time_sql_that_cannot_be_kept_fails_the_load_with_the_reason(sql, message):
    text = PROJECT.split("state_tables:")[0] + "state_tables:\n  - " + sql + "\n"
    with pytest.raises(ConfigurationError) as raised:
        load_project(text, Path("project.yaml"))
    assert message in str(raised.value) and "Fix:" in str(raised.value), str(raised.value)


def test_the_options_that_sql_replaced_fail_the_load_naming_the_replacement():
    text = PROJECT.replace("    watermark_delay_minutes: 5\n", "    windows: {watermark_delay_minutes: 5}\n")
    with pytest.raises(ConfigurationError, match=r"project.yaml:\d+:\d+: stream shipments: `windows:` is no longer an "
                                                 r"option\. Fix: declare a windowed table under `state_tables:`"):
        load_project(text, Path("project.yaml"))
