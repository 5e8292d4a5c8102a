"""Landing lines → bronze / quarantine through the real streaming ingest (Spark + Delta, no Dagster), against rules
written out by hand and against the independent oracle (tests/contract_oracle.py).

One scenario per stream, each over one storage root: its landing folder holds a file (or a few) per rule, so one
micro-batch per run exercises them all, and three files of lines that Hypothesis draws anew on every run
(test_validation_properties.py's strategies), which only the oracle decides. Both streams: file names with `:`,
`[x]`, `{a,b}`, `*`, `?`, `%`, spaces (and for payments `+` and non-ASCII letters), date folders at any depth and gzip
files, each read once; in-flight names (`_x.jsonl`, `.y.jsonl`, files in `_tmp/` and `.hidden/`) and other
extensions ignored; between runs, lines appended to an ingested file and a file deleted and written again under its
name (its next version, `#v2`), both reported as changed files, and new files.
- payments: the amount must be positive; poison values (amounts of 1e16, 1e30, 1e400, 1e-30, "NaN", event times in
  year 0001, 1582-10-10, 9999 and 10000 in UTC, before the epoch, far ahead) quarantined and the stream goes on; an
  mtime tie broken by the full path; the dedup horizon of an event's own event time whatever the micro-batches: the
  same lines cut three ways (one micro-batch; micro-batches that never hold an id twice, so every line is judged
  against bronze alone; a cut that mixes both) give the same tables, written out by hand, and every micro-batch's
  accounting is the oracle's; a re-delivery whose original lies a month behind the stream's newest events counts
  once, an id reused with other content inside the horizon but before its batch's oldest event is
  `conflicting_duplicate`; after the changes, nothing read again; a line that makes the engine fail isolated as
  `unprocessable` while the rest of its batch goes on; timestamps written as INT64 for every reader.
- movie_ticket_sales: every malformed kind of the contract with its reason, field and raw bytes; type coercion,
  unknown fields accepted, the title trimmed; re-deliveries counted once (same batch and across runs) and conflicting
  ids quarantined; a missing optional field against "\\u0000" (and null, which is missing); event time at both ends
  of the default allowance (the epoch, one day after ingestion); an in-flight file read once renamed; a micro-batch
  replayed (its checkpoint commit lost after its tables' commits) writes nothing twice, and the next one goes on.
Payments' micro-batches are decided in the driver, as every small batch is; movie_ticket_sales' by joins, as a large
batch is (pipelines/ingest/bronze.py). `decide_in_order`, the dedup rule both apply, also on hand-written lines;
the driver's read of bronze's events of a batch's ids, against Spark's, on files whose statistics are cut short;
a large batch's bronze files, of bounded rows and disjoint event-time ranges.
After each run: every line ever delivered is in exactly one of bronze, quarantine or the recognised duplicates, with
the oracle's counts, events and reasons; quarantine names real files (`#v2` for the second version of a rewritten
one); the state table equals the oracle's counts and exact sums key by key; `deltalake` reads every Delta table.
Not covered: crashed processes and recovery (test_recovery.py, chaos), Dagster (tests/assets).
"""

from __future__ import annotations

import gzip
import json
import os
from collections import Counter
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable as IndependentDeltaTable
from hypothesis import given, settings
from hypothesis import strategies as st

from pipelines.faults import FAULTS_ENV, INGEST_POISON, arm
from pipelines.ingest import bronze
from pipelines.ingest.bronze import decide_in_order
from pipelines.storage.layout import StorageLayout
from tests.contract_oracle import DEFAULT_HORIZON, EPOCH, Oracle, file_lines, landing_files
from tests.pipelines.ingest.test_validation_properties import FIXED_TIMESTAMPS, SEARCH, line_batch
from tests.streams import MOVIE_TICKET_SALES, PAYMENTS, advance

MISSING = object()  # an optional field left out of the object
NOW = datetime.now(timezone.utc).replace(microsecond=0)
BASE = NOW - timedelta(days=2)  # the oracle-checked events: well inside the dedup horizon
SECOND = 10**9  # file modification times are in ns
T_DRAWN = 1_761_000_000 * SECOND  # the files of lines Hypothesis draws, run 1
T_RULES = 1_762_000_000 * SECOND  # the files of the rules written out by hand, run 1
T0 = 1_763_000_000 * SECOND  # the other files of run 1
T1 = T0 + 3600 * SECOND  # ... between runs 1 and 2
T2 = T1 + 3600 * SECOND  # ... between runs 2 and 3


def at(minutes: int = 0, offset_minutes: int = 0) -> str:
    local = (BASE + timedelta(minutes=minutes)).astimezone(timezone(timedelta(minutes=offset_minutes)))
    text = local.strftime("%Y-%m-%dT%H:%M:%S")
    return text + ("Z" if offset_minutes == 0 else local.strftime("%z")[:3] + ":" + local.strftime("%z")[3:])


def _line(members: dict) -> str:
    return "{" + ",".join(f"{json.dumps(k)}:{v}" for k, v in members.items() if v is not MISSING) + "}"


def pay(pid: str, customer: str, amount: str, paid_at: str) -> str:
    """A payment line; `amount` is JSON text (a number literal or a quoted string)."""
    return _line({"payment_id": json.dumps(pid), "customer_id": json.dumps(customer), "amount": amount,
                  "paid_at": json.dumps(paid_at)})


def sale(eid: str, title: str, value: str, sale_ts: str, customer=MISSING) -> str:
    """A sale line; `value` is JSON text; `customer` MISSING (left out), None (null) or a string."""
    customer_text = customer if customer is MISSING else json.dumps(customer)
    return _line({"event_id": json.dumps(eid), "title": json.dumps(title), "ticket_total_value": value,
                  "sale_ts": json.dumps(sale_ts), "customer_id": customer_text})


def _bytes(lines: list[str | bytes]) -> bytes:
    return b"".join((line.encode() if isinstance(line, str) else line) + b"\n" for line in lines)


def write(path: Path, lines: list[str | bytes], mtime_ns: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = _bytes(lines)
    path.write_bytes(gzip.compress(data) if path.name.endswith(".gz") else data)
    os.utime(path, ns=(mtime_ns, mtime_ns))
    return path


class Delivery:
    """Landing files of one stream and the oracle that receives the same content in arrival order."""

    def __init__(self, folder: Path, stream: str, horizon: timedelta = DEFAULT_HORIZON):
        self.folder, self.oracle = folder, Oracle(stream, horizon=horizon)
        self.visible: set[Path] = set()
        self.ignored_ids: list[str] = []
        self._rules_written = 0

    def file(self, name: str, lines: list[str | bytes], mtime_ns: int) -> Path:
        path = write(self.folder / name, lines, mtime_ns)
        self.visible.add(path)
        return path

    def rule_file(self, name: str, lines: list[str | bytes]) -> Path:
        """A file of a rule written out by hand: before the others, in the order written."""
        self._rules_written += 1
        return self.file(name, lines, T_RULES + self._rules_written * SECOND)

    def in_flight(self, name: str, record_id: str) -> None:
        """A file the run must not read (in-flight name or folder, or not a landing extension)."""
        line = pay(record_id, "c-hidden", "1", at()) if "payments" in str(self.folder) else sale(
            record_id, "Hidden", "1", at())
        write(self.folder / name, [line], T0)
        self.ignored_ids.append(record_id)

    def deliver_present_files(self) -> None:
        """Run 1: everything visible, in arrival order (modification time, then full path)."""
        assert set(landing_files(self.folder)) == self.visible  # the oracle's reading of the folder
        for path in sorted(self.visible, key=lambda p: (os.stat(p).st_mtime_ns, str(p))):
            self.oracle.deliver(str(path), file_lines(path))

    def new_file(self, name: str, lines: list[str | bytes], mtime_ns: int) -> Path:
        """A file that lands between runs (delivered to the oracle at once: call in arrival order)."""
        path = self.file(name, lines, mtime_ns)
        self.oracle.deliver(str(path), file_lines(path))
        return path

    def appended(self, path: Path, lines: list[str | bytes], mtime_ns: int) -> None:
        """Lines added to an ingested file: they continue its numbering."""
        already = len(file_lines(path))
        with open(path, "ab") as handle:
            handle.write(_bytes(lines))
        os.utime(path, ns=(mtime_ns, mtime_ns))
        self.oracle.deliver(str(path), [line.encode() if isinstance(line, str) else line for line in lines],
                            first_line_number=already + 1)

    def rewritten(self, path: Path, lines: list[str | bytes], mtime_ns: int) -> None:
        """Deleted and written again under the same name: its second version."""
        path.unlink()
        write(path, lines, mtime_ns)
        self.oracle.deliver(f"{path}#v2", file_lines(path))


DRAWN = ["first.jsonl", "2026/11/22/second [x].jsonl.gz", "2026/11/22/deeper/third:{a,b}.jsonl"]


def _drawn_files(d: Delivery, spec, data) -> list[Path]:
    """Run 1's files of lines that Hypothesis draws anew on every run (test_validation_properties.py's strategies:
    every field good, borderline, broken or absent), 20 to 80 each: only the oracle says where each lands."""
    now = datetime.now(timezone.utc).replace(microsecond=0)
    # Event times near the real clock, but never within an hour of the one-day allowance: the oracle and the run
    # read the clock a few seconds apart.
    near_limit = [(now + timedelta(days=1, hours=h)).strftime("%Y-%m-%dT%H:%M:%SZ") for h in (-1, 1)]
    drawn = [data.draw(line_batch(spec, data.draw(st.integers(20, 80)), around=now,
                                  boundaries=FIXED_TIMESTAMPS + near_limit), label=name) for name in DRAWN]
    return [d.file(name, lines, T_DRAWN + n * SECOND) for n, (name, lines) in enumerate(zip(DRAWN, drawn))]


def _layout(tmp_path_factory, stream: str) -> StorageLayout:
    """A storage root of its own for each execution of a Hypothesis test (a failing example is run again)."""
    return StorageLayout.under(tmp_path_factory.mktemp(stream) / "home")


def _read(path: Path) -> list[dict]:
    return IndependentDeltaTable(str(path)).to_pyarrow_table().to_pylist()


def _micros(moment: datetime) -> int:
    moment = moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)
    return (moment - EPOCH) // timedelta(microseconds=1)


def _totals(results, spec) -> dict[str, int]:
    totals = {k: 0 for k in ("lines", "accepted", "quarantined", "duplicates", "already_ingested")}
    for result in results:
        for commit in result.commits[spec.bronze_table]:
            for key in totals:
                totals[key] += commit["user"].get(key, 0)
    return totals


def _check_with_oracle(layout, spec, delivery: Delivery, results) -> None:
    """Every line delivered so far in exactly one place, as the oracle has it; the state table as the oracle's."""
    expected = delivery.oracle.expected
    # Exactly once: the accounting of every batch adds up to the oracle's, line for line.
    assert _totals(results, spec) == {"lines": expected.lines, "accepted": expected.accepted,
                                      "quarantined": expected.quarantined, "duplicates": expected.duplicates,
                                      "already_ingested": 0}, spec.name
    bronze = _read(layout.table(spec.bronze_table))
    quarantine = _read(layout.table(spec.quarantine_table))
    placed = [(r["source_file"], r["line_number"]) for r in bronze + quarantine]
    assert len(placed) == len(set(placed)) == expected.accepted + expected.quarantined

    assert sorted(r[spec.id_field] for r in bronze) == sorted(expected.accepted_ids)  # an id reused past the horizon
    # The event of every id accepted once (the oracle keeps only the newest of an id reused past the horizon).
    once = {i for i, n in Counter(expected.accepted_ids).items() if n == 1}
    fields = [f for f in spec.field_names if f != spec.event_time_field]
    actual_events = {r[spec.id_field]: ({f: r[f] for f in fields}, _micros(r[spec.event_time_field]))
                     for r in bronze if r[spec.id_field] in once}
    expected_events = {i: ({f: e[f] for f in fields}, _micros(e[spec.event_time_field]))
                       for i, e in expected.events.items() if i in once}
    assert actual_events == expected_events, spec.name
    actual_reasons = {(r["source_file"], r["line_number"]): r["reason"] for r in quarantine}
    expected_reasons = {(source, number): reason for source, number, reason in expected.quarantine}
    differ = sorted({key for key, _ in set(actual_reasons.items()) ^ set(expected_reasons.items())})
    assert not differ, f"{spec.name}: {len(differ)} lines disagree:\n" + "\n".join(
        f"{_raw_line(*key)!r}: oracle {expected_reasons.get(key)}, implementation {actual_reasons.get(key)}"
        for key in differ[:20])
    assert len(actual_reasons) == len(quarantine)

    # Labels are real paths (the second version of a rewritten file: "<path>#v2"), never URIs.
    for row in bronze + quarantine:
        path, _, version = row["source_file"].partition("#v")
        assert Path(path).is_file() and path.startswith(str(delivery.folder)), row["source_file"]
        assert version in ("", "2"), row["source_file"]
    ids = {r[spec.id_field] for r in bronze} | {r["record_id"] for r in quarantine}
    assert not ids & set(delivery.ignored_ids), "an in-flight or non-landing file was read"

    table = spec.state_tables[0]
    state = {r[table.key]: (r[table.count_column], r[table.sum_column]) for r in _read(layout.table(table.name))}
    assert state == {k: (expected.counts[k], expected.sums[k]) for k in expected.counts}, table.name
    assert all(isinstance(total, Decimal) for _, total in state.values())


def _raw_line(source_file: str, line_number: int) -> bytes | None:
    """A line as its file holds it now (a rewritten file: its latest version), for a failure's message."""
    lines = file_lines(Path(source_file.partition("#v")[0]))
    return lines[line_number - 1] if line_number <= len(lines) else None


def _every_table_reads(layout, names: set[str]) -> None:
    """An independent reader opens every Delta table the runs wrote."""
    delta_folders = sorted(p.parent for p in layout.tables_root.rglob("_delta_log"))
    assert {f.name for f in delta_folders} >= names
    for folder in delta_folders:
        IndependentDeltaTable(str(folder)).to_pyarrow_table()


def _reasons_outside_drawn(d: Delivery) -> dict[str, int]:
    """The oracle's count of each reason among the lines not drawn by Hypothesis."""
    drawn = {str(d.folder / name) for name in DRAWN}
    counts: dict[str, int] = {}
    for source, _, reason in d.oracle.expected.quarantine:
        if source.partition("#v")[0] not in drawn:
            counts[reason] = counts.get(reason, 0) + 1
    return counts


def _changed(result) -> list[tuple]:
    return sorted((c["file"], c["change"], c["version"]) for c in result.changed_files)


def _in(rows: list[dict], path: Path) -> list[dict]:
    """The rows whose line came from `path` (its first version)."""
    return [r for r in rows if r["source_file"] == str(path)]


# --- payments ------------------------------------------------------------------------------------------------------

PAY = '{"payment_id":"%s","customer_id":"c1","amount":%s,"paid_at":"%s"}'
TS = "2026-11-20T00:00:00Z"  # after the dedup horizon's lines: never the oldest event of their micro-batch
POISON = [  # (line, reason)
    (PAY % ("big", "10000000000000000", TS), "out_of_range"),
    (PAY % ("big2", "99999999999999999999999999999999999999999", TS), "out_of_range"),
    (PAY % ("big3", '"123456789012345678901234567890.5"', TS), "out_of_range"),
    (PAY % ("exp", "1e30", TS), "out_of_range"),
    (PAY % ("inf", "1e400", TS), "out_of_range"),
    (PAY % ("tiny", "1e-30", TS), "too_many_decimals"),
    (PAY % ("tiny2", '"0.0000000000000000000000001"', TS), "too_many_decimals"),
    (PAY % ("nan", '"NaN"', TS), "wrong_type"),
    (PAY % ("y1", "1", "0001-01-01T00:00:00Z"), "out_of_range"),
    (PAY % ("y9", "1", "9999-12-31T23:59:59Z"), "out_of_range"),
    (PAY % ("y10", "1", "9999-12-31T23:59:59-05:00"), "out_of_range"),
    (PAY % ("greg", "1", "1582-10-10T00:00:00Z"), "out_of_range"),
    (PAY % ("pre", "1", "1969-12-31T23:59:59Z"), "out_of_range"),
    (PAY % ("fut", "1", "2999-01-01T00:00:00Z"), "out_of_range"),
]
POISON_VALID = [PAY % ("ok1", "9999999999999999.99", TS), PAY % ("ok2", "1.5e1", "1970-01-01T00:00:00Z"),
                PAY % ("ok3", '"0.10000"', TS)]
ODD_NAMES = ["2026-01-01T00:00:00.jsonl", "x [x].jsonl", "{a,b}.jsonl", "star*.jsonl", "what?.jsonl",
             "100%.jsonl", "sp ace.jsonl", "plus+sign.jsonl", "ünï.jsonl"]


def _payment_rules(d: Delivery) -> dict[str, Path]:
    """Run 1's files of the payments rules written out by hand."""
    base = '{"payment_id":"%s","customer_id":"c1","amount":%s,"paid_at":"2026-11-01T10:00:00Z"}'
    files = {"amount": d.rule_file("amount.jsonl", [base % ("amt1", "0"), base % ("amt2", '"0.01"'),
                                                     base % ("amt3", "10")]),
             "poison": d.rule_file("poison.jsonl", [line for line, _ in POISON] + POISON_VALID)}
    for n, name in enumerate(ODD_NAMES):
        files[name] = d.rule_file(name, [PAY % (f"odd{n}", "1", TS), "not json"])
    files["plain"] = d.rule_file("plain.jsonl", [PAY % ("plain1", "1", TS), PAY % ("plain2", "1", TS)])
    files["date_folder"] = d.rule_file("2026/11/22/deep.jsonl", [PAY % ("deep", "1", TS)])
    files["deep_folder"] = d.rule_file("a/b/c/d/e/deeper.jsonl", [PAY % ("deeper", "1", TS)])
    files["zipped"] = d.rule_file("zipped.jsonl.gz", [PAY % ("gz", "1", TS)])
    files["grows"] = d.rule_file("grows.jsonl", [PAY % ("g1", "1", TS)])
    files["redo"] = d.rule_file("redo.jsonl", [PAY % ("r1", "1", TS), PAY % ("r2", "2", TS)])
    return files


def _hostile_payments(d: Delivery) -> dict[str, Path]:
    """Run 1's other files: their lines' outcomes are the oracle's to say."""
    return {
        "dated": d.file("2026/11/22/p:1 [x].jsonl", [
            pay("p1", "c1", "10.00", at(0)),
            pay("p2", "c2", '"5.5"', at(1, 120)),
            pay("p3", "c1", "10000000000000000", at(2)),  # out_of_range: one cent above DECIMAL(18,2)'s max
            pay("p4", "c1", "1", "0001-01-01T00:00:00Z"),
            pay("p5", "c3", "1", "9999-12-31T23:59:59Z"),
            pay("p6", "c3", "1", "9999-12-31T23:59:59-05:00"),  # year 10000 in UTC
            pay("p7", "c3", "1", "1582-10-10T00:00:00Z"),  # not a day in the Julian/Gregorian hybrid calendar
            pay("p8", "c3", "1", (NOW + timedelta(days=2)).strftime("%Y-%m-%dT%H:%M:%SZ")),
            pay("p9", "c2", "0.10", at(3)),
            "not json",
            pay("p60", "c1", "9999999999999999.99", at(4)),  # the largest amount: c1's total outgrows DECIMAL(18,2)
        ], T0 + 1 * SECOND),
        "deep": d.file("2026/11/22/deeper/a/b/{a,b} * ?.jsonl", [
            '{"paid_at":"%s","amount":10,"customer_id":"c1","payment_id":"p1"}' % at(0),  # same content
            pay("p2", "c2", "5.50", at(1)),  # the same instant in Z: same content
            pay("p9", "c2", "0.11", at(3)),  # conflicting_duplicate
            pay("p10", "c4", '"  7.25\\t"', at(5)),
            pay("p11", " c1", "3", at(6)),  # a customer id is kept as given: " c1" is not "c1"
        ], T0 + 2 * SECOND),
        "percent": d.file("100% sure.jsonl", [
            pay("p12", "c1", "1.01", at(7)),
            pay("p13", "c5", "2", at(8)),
            b"\xff\xfe{}",
            pay("p14", "c5", "0", at(9)),  # out_of_range: amounts are > 0
        ], T0 + 3 * SECOND),
        "gzip": d.file("batch.jsonl.gz", [
            pay("p15", "c6", "99.99", at(10)),
            pay("p1", "c1", "10.00", at(0)),
            pay("p16", "c6", '"1e2"', at(11)),
        ], T0 + 4 * SECOND),
        # Same modification time: arrival order is the full path, and " " (0x20) sorts before "!" (0x21)
        # while their URI forms ("%20", "!") sort the other way.
        "tie_first": d.file("a b.jsonl", [pay("p20", "c7", "1.00", at(12))], T0 + 5 * SECOND),
        "tie_second": d.file("a!b.jsonl", [pay("p20", "c7", "2.00", at(12))], T0 + 5 * SECOND),
    }


# The dedup horizon: the contract compares an event with the accepted events of its id whose event time lies within
# the horizon of its own; same content is a duplicate, other content `conflicting_duplicate`, none there a new event.
# The payments runs keep a one-day horizon. The same lines are cut three ways into micro-batches; each cut has ids and
# customers of its own (lines of different ids never meet under the rule), so part k of every cut lands in the same
# file, in micro-batch k: run 1's, then run 2's four.
HORIZON = timedelta(days=1)
RUN_2_FILES_PER_BATCH = 3


def _nov(day: int, hh_mm: str) -> str:
    return f"2026-11-{day:02d}T{hh_mm}:00Z"


LINES = [  # in arrival order: (id, customer, amount, event time)
    ("r1", "ann", "10.00", _nov(1, "10:00")),  # accepted
    ("r3", "cy", "1.00", _nov(1, "09:00")),  # accepted
    ("r2", "bob", "5.00", _nov(2, "08:00")),  # accepted
    ("r1", "ann", "10.00", _nov(1, "10:00")),  # the same content: a duplicate
    ("r3", "cy", "2.00", _nov(1, "23:00")),  # 14 h after r3's 09:00, other content: conflicting
    ("r1", "ann", "20.00", _nov(4, "10:00")),  # 3 days after r1's accepted event: a new event
    ("r2", "bob", "6.00", _nov(2, "20:00")),  # 12 h after r2: conflicting
    ("r3", "cy", "3.00", _nov(2, "12:00")),  # 27 h after r3's 09:00 (the conflicting 23:00 was not accepted): new
    ("r1", "ann", "30.00", _nov(4, "11:00")),  # 1 h after r1's day-4 event: conflicting
    ("r1", "ann", "20.00", _nov(4, "10:00")),  # the day-4 event again: a duplicate
    ("r4", "dee", "7.00", _nov(3, "10:00")),  # accepted
    ("r3", "cy", "3.00", _nov(2, "12:00")),  # r3's day-2 event again: a duplicate
]
ACCEPTED = {("r1", "2026-11-01 10:00"), ("r3", "2026-11-01 09:00"), ("r2", "2026-11-02 08:00"),
            ("r1", "2026-11-04 10:00"), ("r3", "2026-11-02 12:00"), ("r4", "2026-11-03 10:00")}
CONFLICTING = 3
CUTS = {  # cut → its parts, part k in micro-batch k
    "one": [LINES],
    # Each part as long as no id comes twice: no line is compared with a line of its own batch, only with bronze,
    # as one line per micro-batch would be.
    "no-id-twice": [LINES[0:3], LINES[3:5], LINES[5:8], LINES[8:9], LINES[9:12]],
    "another": [LINES[:5], LINES[5:7], LINES[7:]],
}
# A re-delivery far behind, and a reuse inside the horizon before its batch's oldest event. A month before LINES, so
# micro-batch 4's event-time range starts at its h1 and only the horizon's widening of it reaches d2's original.
FAR_T0 = datetime(2026, 10, 1, 10, tzinfo=timezone.utc)


def _far(**delta) -> str:
    return (FAR_T0 + timedelta(**delta)).strftime("%Y-%m-%dT%H:%M:%SZ")


FAR = {  # micro-batch → lines
    1: [("d1", "dune", "10.00", _far()), ("d2", "dune", "10.00", _far(hours=1)),
        ("h1", "heat", "5.00", _far(hours=2))],
    # h1 again (the very same line); d2 with another value 12 h after its original, which lies 1 h before this
    # batch's oldest event time (h1's); a new sale.
    4: [("h1", "heat", "5.00", _far(hours=2)), ("d2", "dune", "99.00", _far(hours=13)),
        ("n1", "dune", "7.00", _far(hours=14))],
    # Ten horizons later: new sales, and d1's line once more, ten days behind them.
    5: [("n2", "heat", "6.00", _far(days=10)), ("d1", "dune", "10.00", _far()),
        ("n3", "heat", "4.00", _far(days=10, hours=1))],
}
# What the far case's lines leave after micro-batches 1, 4 and 5 (batches 2 and 3 hold none of them).
FAR_STATE = {1: {"dune": (2, Decimal("20.00")), "heat": (1, Decimal("5.00"))},
             4: {"dune": (3, Decimal("27.00")), "heat": (1, Decimal("5.00"))},
             5: {"dune": (3, Decimal("27.00")), "heat": (3, Decimal("15.00"))}}
HORIZON_BATCHES = 5


def _tagged(tag: str, lines) -> list[str]:
    """The lines with the cut's own ids and customers: `tag/id`, `tag/customer`."""
    return [json.dumps({"payment_id": f"{tag}/{pid}", "customer_id": f"{tag}/{customer}", "amount": amount,
                        "paid_at": paid_at}) for pid, customer, amount, paid_at in lines]


def _horizon_files() -> list[list[str]]:
    """The dedup horizon's landing files, one per micro-batch: part k of every cut, and the far case's lines."""
    files = [[] for _ in range(HORIZON_BATCHES)]
    for tag, parts in CUTS.items():
        for k, part in enumerate(parts):
            files[k] += _tagged(tag, part)
    for batch, lines in FAR.items():
        files[batch - 1] += _tagged("far", lines)
    return files


def _untagged(tag: str, rows: list[dict], column: str) -> list[dict]:
    """The rows of one cut, its tag taken off `column`."""
    return [{**r, column: r[column].split("/", 1)[1]} for r in rows if (r[column] or "").startswith(tag + "/")]


def _per_customer(rows: list[dict], tag: str) -> dict:
    return {r["customer_id"]: (r["payment_count"], r["total_amount"]) for r in _untagged(tag, rows, "customer_id")}


def _counts(d: Delivery) -> tuple[int, int, int, int]:
    e = d.oracle.expected
    return e.lines, e.accepted, e.quarantined, e.duplicates


def _check_every_batch_with_oracle(results, oracle_after_each: list[tuple]) -> None:
    """Every micro-batch's accounting, as the oracle has it after the units of that batch."""
    commits = [c for result in results for c in result.commits[PAYMENTS.bronze_table]]
    assert [c["user"]["batch_id"] for c in commits] == list(range(len(oracle_after_each)))
    before = (0, 0, 0, 0)
    for commit, after in zip(commits, oracle_after_each):
        user = commit["user"]
        assert (user["lines"], user["accepted"], user["quarantined"], user["duplicates"]) == tuple(
            a - b for a, b in zip(after, before)), user["batch_id"]
        before = after


def _check_the_cuts(layout) -> None:
    """The same tables from every cut, and the outcomes written out by hand above."""
    for tag, parts in CUTS.items():
        assert len(parts) <= HORIZON_BATCHES and sum(parts, []) == LINES, tag
    assert all(len({line[0] for line in part}) == len(part) for part in CUTS["no-id-twice"])
    bronze, quarantine = _read(layout.table("payments_bronze")), _read(layout.table("payments_quarantine"))
    state = _read(layout.table("payments_per_customer"))
    found = {}
    for tag in CUTS:
        found[tag] = ({(r["payment_id"], r["paid_at"].strftime("%Y-%m-%d %H:%M"))
                       for r in _untagged(tag, bronze, "payment_id")},
                      sorted(r["reason"] for r in _untagged(tag, quarantine, "record_id")),
                      _per_customer(state, tag))
    bronze_of_one, reasons, per_customer = found["one"]
    assert bronze_of_one == ACCEPTED and reasons == ["conflicting_duplicate"] * CONFLICTING
    assert per_customer == {"ann": (2, Decimal("30.00")), "cy": (2, Decimal("4.00")), "bob": (1, Decimal("5.00")),
                            "dee": (1, Decimal("7.00"))}
    assert found["no-id-twice"] == found["one"] == found["another"]


def _check_the_far_case(layout, results) -> None:
    """Its state after each of its micro-batches, then what bronze and quarantine hold of it."""
    path = layout.table("payments_per_customer")
    merges = {c["user"]["batch_id"]: c["version"] for result in results
              for c in result.commits["payments_per_customer"] if "batch_id" in c["user"]}
    for batch, expected in FAR_STATE.items():
        state = IndependentDeltaTable(str(path), version=merges[batch - 1]).to_pyarrow_table().to_pylist()
        assert _per_customer(state, "far") == expected, batch
    quarantine = _untagged("far", _read(layout.table("payments_quarantine")), "record_id")
    assert [(r["record_id"], r["reason"], r["reason_field"], Path(r["source_file"]).name) for r in quarantine] == [
        ("d2", "conflicting_duplicate", "payment_id", "horizon-3.jsonl")]
    bronze = sorted((r["payment_id"], r["amount"]) for r in _untagged("far", _read(layout.table("payments_bronze")),
                                                                     "payment_id"))
    assert bronze == [("d1", Decimal("10.00")), ("d2", Decimal("10.00")), ("h1", Decimal("5.00")),
                      ("n1", Decimal("7.00")), ("n2", Decimal("6.00")), ("n3", Decimal("4.00"))]


def _landing_payments(folder: Path, data) -> tuple[Delivery, dict[str, Path]]:
    """Run 1's landing folder: drawn lines, the rules' files, the others, the dedup horizon's first file."""
    d = Delivery(folder, "payments", HORIZON)
    _drawn_files(d, PAYMENTS, data)
    rules, others = _payment_rules(d), _hostile_payments(d)
    assert not rules.keys() & others.keys()
    files = {**rules, **others, "horizon-0": d.file("horizon-0.jsonl", _horizon_files()[0], T0 + 6 * SECOND)}
    for name, record_id in (("_x.jsonl", "p90"), (".y.jsonl", "p91"), ("_tmp/z.jsonl", "p92"),
                            ("2026/_tmp/w.jsonl", "p93"), (".hidden/v.jsonl", "p94"), ("notes.txt", "p95"),
                            ("x.jsonl.bak", "p96"), ("x.json", "p97"), ("2026/11/22/_part.jsonl.gz", "p98")):
        d.in_flight(name, record_id)
    return d, files


def _change_payments(d: Delivery, files: dict[str, Path]) -> list[tuple]:
    """Between runs 1 and 2, in arrival order, RUN_2_FILES_PER_BATCH units for each of run 2's micro-batches, each
    led by the dedup horizon's file: appends, deletes-and-rewrites under the same name, new files. Returns the
    oracle's counts after each micro-batch."""
    horizon, after = _horizon_files(), []
    d.new_file("horizon-1.jsonl", horizon[1], T1)
    d.appended(files["percent"], [pay("p30", "c1", "4.00", at(20)), pay("p12", "c1", "1.01", at(7)),
                                  pay("p31", "c8", '"abc"', at(21))], T1 + 1 * SECOND)
    d.rewritten(files["dated"], [pay("p1", "c1", "10.00", at(0)), pay("p2", "c2", "5.50", at(1)),
                                 pay("p40", "c9", "6.66", at(22)), pay("p9", "c2", "9.99", at(3)),
                                 pay("p41", "c9", "1", "9999-12-31T23:59:59Z")], T1 + 2 * SECOND)
    after.append(_counts(d))
    d.new_file("horizon-2.jsonl", horizon[2], T1 + 3 * SECOND)
    d.new_file("2026/11/23/new%20file.jsonl", [pay("p50", "c1", "1.00", at(23)), pay("p10", "c4", "7.25", at(5)),
                                               pay("p51", "c10", "2", at(24))], T1 + 4 * SECOND)
    d.appended(files["grows"], [PAY % ("g2", "1", TS), "broken"], T1 + 5 * SECOND)
    after.append(_counts(d))
    d.new_file("horizon-3.jsonl", horizon[3], T1 + 6 * SECOND)
    d.rewritten(files["redo"], [PAY % ("r1", "1", TS), PAY % ("r2", "5", TS), PAY % ("r3", "3", TS)], T1 + 7 * SECOND)
    files["next"] = d.new_file("next.jsonl", [PAY % ("after", "1", TS)], T1 + 8 * SECOND)
    after.append(_counts(d))
    d.new_file("horizon-4.jsonl", horizon[4], T1 + 9 * SECOND)
    after.append(_counts(d))
    return after


def _check_payment_rules(layout, files: dict[str, Path]) -> None:
    """Run 1: the amount rule, the poison values, and every odd name read once (line 1 accepted, line 2 not)."""
    bronze, quarantine = _read(layout.table("payments_bronze")), _read(layout.table("payments_quarantine"))
    assert {r["record_id"]: r["reason"] for r in _in(quarantine, files["amount"])} == {"amt1": "out_of_range"}
    assert sorted(r["payment_id"] for r in _in(bronze, files["amount"])) == ["amt2", "amt3"]

    assert {r["record_id"]: r["reason"] for r in _in(quarantine, files["poison"])} == {
        line.split('"')[3]: reason for line, reason in POISON}, "poison values"
    assert {r["payment_id"]: str(r["amount"]) for r in _in(bronze, files["poison"])} == {
        "ok1": "9999999999999999.99", "ok2": "15.00", "ok3": "0.10"}, "poison values"

    for n, name in enumerate(ODD_NAMES):
        assert [r["payment_id"] for r in _in(bronze, files[name])] == [f"odd{n}"], name
        assert [(r["line_number"], r["reason"]) for r in _in(quarantine, files[name])] == [(2, "not_json")], name
    for key, ids in (("plain", ["plain1", "plain2"]), ("date_folder", ["deep"]), ("deep_folder", ["deeper"]),
                     ("zipped", ["gz"])):
        assert sorted(r["payment_id"] for r in _in(bronze, files[key])) == ids, key


def _check_changed_payments(layout, files: dict[str, Path], second) -> None:
    """Run 2: appended lines are ingested, a rewritten file is its next version, the next file is read."""
    assert _changed(second) == sorted([(str(files["percent"]), "appended", 1), (str(files["dated"]), "rewritten", 2),
                                       (str(files["grows"]), "appended", 1), (str(files["redo"]), "rewritten", 2)])
    grows, redo = str(files["grows"]), str(files["redo"])
    bronze = _read(layout.table("payments_bronze"))
    assert {r["payment_id"]: (r["source_file"], r["line_number"]) for r in bronze
            if r["source_file"] in (grows, redo, f"{redo}#v2")} == {
        "g1": (grows, 1), "g2": (grows, 2), "r1": (redo, 1), "r2": (redo, 2), "r3": (f"{redo}#v2", 3)}
    quarantine = sorted((r["source_file"], r["line_number"], r["reason"]) for r in _read(
        layout.table("payments_quarantine")) if r["source_file"] in (grows, redo, f"{redo}#v2"))
    assert quarantine == [(grows, 3, "not_json"), (f"{redo}#v2", 2, "conflicting_duplicate")]
    assert [r["payment_id"] for r in _in(bronze, files["next"])] == ["after"], "the stream went on after the poison"


def _check_unprocessable(layout, d: Delivery, third, poisoned: Path, after: Path) -> None:
    """Run 3: a line that makes Spark itself fail (injected, as an engine bug would) is found by bisection and
    quarantined as `unprocessable` with the error; the rest of its batch goes on. Nothing changed in the files read
    before: only the new files' lines are read."""
    assert third.changed_files == []
    (commit,) = third.commits[PAYMENTS.bronze_table]
    assert tuple(commit["user"][k] for k in ("lines", "accepted", "quarantined", "unprocessable")) == (4, 3, 1, 1)
    quarantine = _in(_read(layout.table("payments_quarantine")), poisoned)
    assert [(r["line_number"], r["reason"]) for r in quarantine] == [(2, "unprocessable")]
    assert "POISON-7" in quarantine[0]["detail"] and quarantine[0]["raw_bytes"].startswith(b'{"payment_id":"POISON-7"')
    bronze = _read(layout.table("payments_bronze"))
    assert sorted(r["payment_id"] for r in _in(bronze, poisoned)) == ["u1", "u2"]
    assert [r["payment_id"] for r in _in(bronze, after)] == ["b1"]
    placed = [(r["source_file"], r["line_number"]) for r in bronze + _read(layout.table("payments_quarantine"))]
    assert len(placed) == len(set(placed)) == d.oracle.expected.accepted + d.oracle.expected.quarantined + 4


def _check_int64_timestamps(layout, poison: Path) -> None:
    """Timestamps are written as INT64 (not INT96), which every Parquet reader reads; 1970-01-01 reads back."""
    path = layout.table("payments_bronze")
    data_files = list(path.glob("*.parquet"))
    assert data_files
    for data_file in data_files:
        parquet = pq.ParquetFile(data_file)
        assert parquet.metadata.schema.column(parquet.schema_arrow.get_field_index("paid_at")).physical_type == "INT64"
    (ok2,) = [r for r in _in(_read(path), poison) if r["payment_id"] == "ok2"]
    assert (ok2["paid_at"].year, ok2["paid_at"].month, ok2["paid_at"].day, ok2["paid_at"].hour) == (1970, 1, 1, 0)


@settings(max_examples=1, **SEARCH)  # each example is three runs of the stream: the search is in its drawn lines
@given(data=st.data())
def test_payments_rules_poison_values_odd_names_dedup_horizon_changed_files_and_an_unprocessable_line(
        spark, tmp_path_factory, data):
    layout = _layout(tmp_path_factory, "payments")
    d, files = _landing_payments(layout.landing("payments"), data)
    d.deliver_present_files()
    oracle_after_each = [_counts(d)]

    first = advance(spark, layout, PAYMENTS, event_time=False, dedup_horizon=HORIZON)
    assert first.micro_batches == 1 and first.changed_files == []
    _check_with_oracle(layout, PAYMENTS, d, [first])
    _check_payment_rules(layout, files)

    oracle_after_each += _change_payments(d, files)
    second = advance(spark, layout, PAYMENTS, event_time=False, dedup_horizon=HORIZON,
                     max_files_per_trigger=RUN_2_FILES_PER_BATCH)
    assert second.micro_batches == HORIZON_BATCHES - 1
    _check_with_oracle(layout, PAYMENTS, d, [first, second])
    _check_every_batch_with_oracle([first, second], oracle_after_each)
    _check_changed_payments(layout, files, second)
    _check_the_cuts(layout)
    _check_the_far_case(layout, [first, second])
    # The poison and the conflicts really were exercised (the oracle agrees with itself on them).
    reasons = _reasons_outside_drawn(d)
    assert (reasons["out_of_range"], reasons["conflicting_duplicate"]) == (20, 4 + 3 * CONFLICTING + 1)

    faults = layout.home.parent / "faults"
    arm(faults, INGEST_POISON, "poison POISON-7")
    poisoned = write(d.folder / "unprocessable.jsonl", [
        PAY % ("u1", "1", TS), '{"payment_id":"POISON-7","customer_id":"c1","amount":1,"paid_at":"%s"}' % TS,
        PAY % ("u2", "1", TS)], T2)
    after = write(d.folder / "after-unprocessable.jsonl", [PAY % ("b1", "1", TS)], T2 + SECOND)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(FAULTS_ENV, str(faults))
        third = advance(spark, layout, PAYMENTS, event_time=False, dedup_horizon=HORIZON)
    _check_unprocessable(layout, d, third, poisoned, after)

    _check_int64_timestamps(layout, files["poison"])
    _every_table_reads(layout, {"payments_bronze", "payments_quarantine", "payments_per_customer"})


# --- movie_ticket_sales --------------------------------------------------------------------------------------------

GOOD = '{"event_id":"%s","title":"Dune","ticket_total_value":12.50,"sale_ts":"2026-11-01T10:00:00Z"}'

# (line, expected reason, expected reason_field)
MALFORMED = [
    (b"\xff\xfe{}", "invalid_utf8", None),
    ("not json at all", "not_json", None),
    ("", "not_json", None),
    ('{"event_id":"x1","title":"Dune"', "not_json", None),
    ((GOOD % "t1") + " trailing", "not_json", None),
    ((GOOD % "t2") + (GOOD % "t3"), "not_json", None),
    ((GOOD % "t4") + "]", "not_json", None),
    ((GOOD % "t5").replace("}", ",}"), "not_json", None),
    ((GOOD % "t6").replace('"', "'"), "not_json", None),
    ("   ", "not_json", None),
    ('["event_id","x"]', "not_object", None),
    ('"just a string"', "not_object", None),
    ('{"title":"Dune","ticket_total_value":1,"sale_ts":"2026-11-01T10:00:00Z"}', "missing_field", "event_id"),
    ('{"event_id":null,"title":"Dune","ticket_total_value":1,"sale_ts":"2026-11-01T10:00:00Z"}', "missing_field", "event_id"),
    ('{"event_id":"","title":"Dune","ticket_total_value":1,"sale_ts":"2026-11-01T10:00:00Z"}', "empty_field", "event_id"),
    ('{"event_id":"x2","title":"   ","ticket_total_value":1,"sale_ts":"2026-11-01T10:00:00Z"}', "empty_field", "title"),
    ('{"event_id":42,"title":"Dune","ticket_total_value":1,"sale_ts":"2026-11-01T10:00:00Z"}', "wrong_type", "event_id"),
    ('{"event_id":"x3","title":7,"ticket_total_value":1,"sale_ts":"2026-11-01T10:00:00Z"}', "wrong_type", "title"),
    ('{"event_id":"x4","title":"Dune","ticket_total_value":true,"sale_ts":"2026-11-01T10:00:00Z"}', "wrong_type", "ticket_total_value"),
    ('{"event_id":"x5","title":"Dune","ticket_total_value":"ten","sale_ts":"2026-11-01T10:00:00Z"}', "wrong_type", "ticket_total_value"),
    ('{"event_id":"x6","title":"Dune","ticket_total_value":{"v":1},"sale_ts":"2026-11-01T10:00:00Z"}', "wrong_type", "ticket_total_value"),
    ('{"event_id":"x7","title":"Dune","ticket_total_value":-0.01,"sale_ts":"2026-11-01T10:00:00Z"}', "out_of_range", "ticket_total_value"),
    ('{"event_id":"x8","title":"Dune","ticket_total_value":1.005,"sale_ts":"2026-11-01T10:00:00Z"}', "too_many_decimals", "ticket_total_value"),
    ('{"event_id":"x9","title":"Dune","ticket_total_value":1,"sale_ts":"2026-11-01T10:00:00"}', "invalid_timestamp", "sale_ts"),
    ('{"event_id":"x10","title":"Dune","ticket_total_value":1,"sale_ts":"2026-02-30T10:00:00Z"}', "invalid_timestamp", "sale_ts"),
    ('{"event_id":"x11","title":"Dune","ticket_total_value":1,"sale_ts":"yesterday"}', "invalid_timestamp", "sale_ts"),
    ('{"event_id":"x12","title":"Dune","ticket_total_value":1,"sale_ts":1762000000}', "wrong_type", "sale_ts"),
    ('{"event_id":"x13","title":"%s","ticket_total_value":1,"sale_ts":"2026-11-01T10:00:00Z"}' % ("a" * 501), "too_long", "title"),
    ('{"event_id":"x14","title":"Dune","ticket_total_value":1,"sale_ts":"2026-11-01T10:00:00Z","customer_id":5}', "wrong_type", "customer_id"),
    # An escaped lone surrogate is valid JSON but no UTF-8 text: kept, it would be stored as '?'.
    ('{"event_id":"x15","title":"Dune\\ud83c","ticket_total_value":1,"sale_ts":"2026-11-01T10:00:00Z"}', "invalid_utf8", "title"),
    ('{"event_id":"x16","title":"Dune","ticket_total_value":1,"sale_ts":"2026-11-01T10:00:00Z","customer_id":"\\udfab"}', "invalid_utf8", "customer_id"),
]

VALID = [
    GOOD % "ok1",
    # numeric string, offset timestamp, unknown extra field, optional customer_id, padded title
    '{"event_id":"ok2","title":"  Dune ","ticket_total_value":"7.5","sale_ts":"2026-11-01T11:00:00.123+01:00",'
    '"customer_id":"c1","promo":{"code":"X"}}',
    '{"event_id":"ok3","title":"Heat","ticket_total_value":0,"sale_ts":"2026-11-01T10:00:00+0200"}',
]
CONFLICT = GOOD.replace("12.50", "99.00")


def _iso(moment: datetime) -> str:
    return moment.astimezone(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _sale_rules(d: Delivery) -> dict[str, Path]:
    """Run 1's files of the sales rules written out by hand."""
    nul = '{"event_id":"nul1","title":"Dune","ticket_total_value":1,"sale_ts":"2026-11-01T10:00:00Z"%s}'
    now = datetime.now(timezone.utc)  # ingestion is later: only further from the upper limit than written here
    files = {
        "mixed": d.rule_file("mixed.jsonl", [line for line, _, _ in MALFORMED] + VALID),
        # a re-delivery in the same file, and a conflict of ids
        "redelivered": d.rule_file("redelivered.jsonl", [GOOD % "rd1", GOOD % "rd2", GOOD % "rd1", CONFLICT % "rd2"]),
        "nul_first": d.rule_file("nul-a.jsonl", [nul % ""]),
        "nul_second": d.rule_file("nul-b.jsonl", [nul % ',"customer_id":"\\u0000"', nul % ',"customer_id":null']),
        "done": d.rule_file("done.jsonl", [GOOD % "visible"]),
        # the default allowance: event time in UTC from 1970-01-01T00:00:00Z to one day after ingestion
        "allowance": d.rule_file("allowance.jsonl", [
            sale("epoch", "Dune", "1.00", "1970-01-01T00:00:00Z"),
            sale("before-epoch", "Dune", "1.00", "1969-12-31T23:59:59.999Z"),
            sale("before-epoch-offset", "Dune", "1.00", "1970-01-01T00:30:00+01:00"),  # 1969-12-31T23:30Z
            sale("ahead-23h", "Dune", "1.00", _iso(now + timedelta(hours=23))),
            sale("ahead-25h", "Dune", "1.00", _iso(now + timedelta(hours=25))),
        ]),
    }
    # Still being written: read once renamed (the first), never (the second).
    write(d.folder / "_partial.jsonl", [GOOD % "hidden1"], T_RULES)
    write(d.folder / ".partial.jsonl", [GOOD % "hidden2"], T_RULES)
    d.ignored_ids.append("hidden2")
    return files


def _hostile_sales(d: Delivery) -> dict[str, Path]:
    """Run 1's other files: their lines' outcomes are the oracle's to say."""
    return {
        "colon": d.file("2026-11-22T10:00:00.jsonl", [
            sale("m1", "Dune", "12.50", at(0)),  # no customer_id
            sale("m2", "Dune", "1e30", at(1)),
            sale("m3", "  Heat\t", "8", at(2)),
            sale("m4", "Dune", "12.5", at(3), customer="\u0000"),
            sale("m5", "Dune", "3.333", at(4)),
        ], T0 + 1 * SECOND),
        "gzip": d.file("2026/11/22/sales*.jsonl.gz", [
            sale("m1", "Dune", "12.50", at(0), customer="\u0000"),  # missing ≠ "\u0000": conflict
            sale("m4", " Dune ", '"12.50"', at(3), customer="\u0000"),  # same content
            sale("m6", "Heat", "0", at(5)),
            sale("m7", "Dune", "4.00", at(6), customer=None),
            sale("m7", "Dune", "4", at(6)),  # null and missing are the same: a re-delivery
        ], T0 + 2 * SECOND),
        "brackets": d.file("[x] {a,b} ?.jsonl", [
            sale("m8", "Amélie", "5.55", at(7)),
            sale("m9", "x" * 501, "1", at(8)),
            sale("m10", " \t ", "1", at(9)),
        ], T0 + 3 * SECOND),
    }


def _landing_sales(folder: Path, data) -> tuple[Delivery, dict[str, Path]]:
    """Run 1's landing folder: drawn lines, the rules' files, the others."""
    d = Delivery(folder, "movie_ticket_sales")
    _drawn_files(d, MOVIE_TICKET_SALES, data)
    rules, others = _sale_rules(d), _hostile_sales(d)
    assert not rules.keys() & others.keys()
    files = {**rules, **others}
    for name, record_id in (("_x.jsonl", "m90"), (".y.jsonl", "m91"), ("_tmp/z.jsonl", "m92"),
                            ("2026/11/.partial/v.jsonl", "m93"), ("notes.jsonl.tmp", "m94")):
        d.in_flight(name, record_id)
    return d, files


def _change_sales(d: Delivery, files: dict[str, Path]) -> None:
    """Between runs 1 and 2: an append, a delete-and-rewrite under the same name, new files, a rename."""
    d.appended(files["brackets"], [sale("m11", "Dune", "1.00", at(20)), sale("m8", "Amélie", "5.55", at(7))],
               T1 + 1 * SECOND)
    d.rewritten(files["gzip"], [sale("m6", "Heat", '"0.00"', at(5)), sale("m12", "Heat", "2.5", at(21)),
                                sale("m1", "Dune", "12.50", at(0))], T1 + 2 * SECOND)
    d.new_file("2026/11/23/deeper/more/late.jsonl", [sale("m13", "Dune", "7.77", at(22))], T1 + 3 * SECOND)
    # a re-delivery and a conflict of ids accepted in run 1, and a new id
    files["redelivered_again"] = d.new_file("redelivered-again.jsonl", [GOOD % "rd1", CONFLICT % "rd1", GOOD % "rd3"],
                                            T1 + 4 * SECOND)
    renamed = d.folder / "renamed.jsonl"
    os.replace(d.folder / "_partial.jsonl", renamed)
    os.utime(renamed, ns=(T1 + 5 * SECOND,) * 2)
    d.visible.add(renamed)
    d.oracle.deliver(str(renamed), file_lines(renamed))
    files["renamed"] = renamed


def _check_sale_rules(layout, d: Delivery, files: dict[str, Path], first) -> None:
    """Run 1: each malformed kind with its reason; the valid lines typed; the batch's accounting; the first delivery
    of re-delivered lines; a missing customer against "\\u0000"; the allowance's ends; in-flight files unread."""
    bronze, quarantine = _read(layout.table("movie_ticket_sales_bronze")), _read(
        layout.table("movie_ticket_sales_quarantine"))
    by_line = {r["line_number"]: r for r in _in(quarantine, files["mixed"])}
    for number, (line, reason, field) in enumerate(MALFORMED, start=1):
        row = by_line[number]
        assert (row["reason"], row["reason_field"]) == (reason, field), f"line {number}: {line!r}"
        assert row["raw_bytes"] == (line if isinstance(line, bytes) else line.encode()), f"line {number}"
    assert len(by_line) == len(MALFORMED)
    valid = {r["event_id"]: r for r in _in(bronze, files["mixed"])}
    assert set(valid) == {"ok1", "ok2", "ok3"}
    assert (valid["ok2"]["title"], str(valid["ok2"]["ticket_total_value"]), valid["ok2"]["customer_id"]) == (
        "Dune", "7.50", "c1")

    user = dict(first.commits[MOVIE_TICKET_SALES.bronze_table][-1]["user"])
    assert user.pop("app_id").startswith("statetables/movie_ticket_sales/")
    expected = d.oracle.expected
    # running totals of bronze after this commit (what the per-run state check compares with)
    value_total = str(sum(r["ticket_total_value"] for r in bronze))
    assert user == {"batch_id": 0, "files": len(d.visible), "lines": expected.lines, "accepted": expected.accepted,
                    "quarantined": expected.quarantined, "duplicates": expected.duplicates, "already_ingested": 0,
                    "unprocessable": 0, "files_vanished": [], "accepted_total": len(bronze),
                    "accepted_value_total": value_total}

    assert sorted(r["event_id"] for r in _in(bronze, files["redelivered"])) == ["rd1", "rd2"]
    assert [(r["record_id"], r["line_number"], r["reason"]) for r in _in(quarantine, files["redelivered"])] == [
        ("rd2", 4, "conflicting_duplicate")]

    assert [r["event_id"] for r in _in(bronze, files["nul_first"])] == ["nul1"]
    assert [(r["line_number"], r["reason"]) for r in _in(quarantine, files["nul_second"])] == [
        (1, "conflicting_duplicate")], "a missing customer_id is not \\u0000, and null is missing"

    assert sorted(r["event_id"] for r in _in(bronze, files["allowance"])) == ["ahead-23h", "epoch"]
    outside = {r["record_id"]: r for r in _in(quarantine, files["allowance"])}
    assert {k: (r["reason"], r["reason_field"]) for k, r in outside.items()} == {
        "before-epoch": ("out_of_range", "sale_ts"), "before-epoch-offset": ("out_of_range", "sale_ts"),
        "ahead-25h": ("out_of_range", "sale_ts")}
    assert "24 h after ingestion" in outside["ahead-25h"]["detail"]

    assert [r["event_id"] for r in _in(bronze, files["done"])] == ["visible"]
    assert not {"hidden1", "hidden2"} & {r["event_id"] for r in bronze}


def _check_changed_sales(layout, files: dict[str, Path], second) -> None:
    """Run 2: re-delivered ids count once across runs, a conflict is quarantined where it arrived; a renamed
    in-flight file is read."""
    assert _changed(second) == sorted([(str(files["brackets"]), "appended", 1), (str(files["gzip"]), "rewritten", 2)])
    bronze = _read(layout.table("movie_ticket_sales_bronze"))
    redelivered = _in(bronze, files["redelivered"]) + _in(bronze, files["redelivered_again"])
    assert sorted(r["event_id"] for r in redelivered) == ["rd1", "rd2", "rd3"]
    assert {r["ticket_total_value"] for r in redelivered} == {Decimal("12.50")}
    quarantine = _read(layout.table("movie_ticket_sales_quarantine"))
    conflicts = [(r["record_id"], Path(r["source_file"]).name)
                 for r in _in(quarantine, files["redelivered"]) + _in(quarantine, files["redelivered_again"])]
    assert sorted(conflicts) == [("rd1", "redelivered-again.jsonl"), ("rd2", "redelivered.jsonl")]
    assert [r["event_id"] for r in _in(bronze, files["renamed"])] == ["hidden1"]


def _lose_the_last_checkpoint_commit(layout) -> None:
    """A crash after the tables' commits but before Spark's checkpoint commit: the next run replays the batch."""
    commits = layout.checkpoint(MOVIE_TICKET_SALES.name) / "commits"
    last = max((p for p in commits.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    last.unlink()  # as if the process died before Spark recorded the batch as done
    (commits / f".{last.name}.crc").unlink(missing_ok=True)


def test_decide_in_order_takes_lines_in_arrival_order_within_the_horizon_of_each():
    hour = 3600 * 10**6
    prior = [("a", 0, "A")]  # bronze holds a at 00:00 with content A
    lines = [
        (2, 1, "c", 5 * hour, "C2"),  # after the line below: conflicts with it
        (1, 1, "a", hour, "A"),  # within the horizon of bronze's a, same content
        (1, 2, "a", 2 * hour, "X"),  # within it, other content
        (1, 3, "a", 3 * hour, "X"),  # exactly at the horizon's edge: still within
        (1, 4, "a", 3 * hour + 1, "X"),  # one microsecond past it: a new event, accepted...
        (1, 5, "a", 4 * hour, "X"),  # ...and now the line it is compared with
        (1, 6, "c", 5 * hour, "C1"),
        (1, 7, "b", 0, "B"),
        (1, 8, "b", 0, "B"),
    ]
    assert decide_in_order(lines, prior, 3 * hour) == {
        (1, 1): "duplicates", (1, 2): "conflicting", (1, 3): "conflicting", (1, 4): "accepted",
        (1, 5): "duplicates", (1, 6): "accepted", (1, 7): "accepted", (1, 8): "duplicates", (2, 1): "conflicting"}


def test_bronze_events_of_the_batch_ids_are_all_found_whatever_the_files_statistics_say(spark, tmp_path):
    """A small batch reads bronze's events of its ids with delta-rs: exactly what Spark finds, though Delta's
    statistics truncate event times to the millisecond and strings to 32 characters."""
    from pyspark.sql import functions as F
    from pipelines.ingest.bronze import _accepted_of_ids, bronze_schema
    from pipelines.ingest.validate import content_identity

    path = str(tmp_path / "bronze")
    long_id = "x" * 40  # past the statistics' 32 characters: its max statistic is cut short
    base = datetime(2026, 11, 1, tzinfo=timezone.utc)
    edge = base + timedelta(microseconds=999)  # 999 us past the millisecond its file's max statistic records
    files = [[("a", base), (long_id, edge)], [("other", base)], [("b", base - timedelta(days=30))],
             [("b", base + timedelta(seconds=1)), ("a", edge)]]
    columns = bronze_schema(PAYMENTS).fieldNames()
    for number, events in enumerate(files):
        rows = [{"payment_id": i, "customer_id": "c", "amount": Decimal("1.50"), "paid_at": at,
                 "content_hash": "h", "source_file": "f", "line_number": number, "ingest_batch_id": number,
                 "ingested_at": base} for i, at in events]
        spark.createDataFrame(rows, bronze_schema(PAYMENTS)).select(*columns).coalesce(1).write.format(
            "delta").mode("append").save(path)
    ids, micros = {"a", "b", long_id}, int(edge.timestamp()) * 10**6 + 999
    lo, hi = micros - 500, micros  # the first file's max statistic (the millisecond before `edge`) is short of `lo`
    expected = (spark.read.format("delta").load(path)
                .where(F.col("paid_at").between(F.timestamp_micros(F.lit(lo)), F.timestamp_micros(F.lit(hi))))
                .where(F.col("payment_id").isin(sorted(ids)))
                .select("payment_id", F.unix_micros("paid_at"), content_identity(PAYMENTS)).collect())
    found = _accepted_of_ids(spark, path, PAYMENTS, ids, lo, hi)
    assert sorted(found) == sorted(tuple(r) for r in expected)
    assert sorted((i, at) for i, at, _ in found) == [("a", micros), (long_id, micros)]


# Every micro-batch decided as a large one (its lines not read into the driver, its frames kept on disk).
EVERY_BATCH_LARGE = {"large_from_bytes": 0, "kept_on_disk_from_bytes": 0}


@pytest.mark.parametrize("suspects_in_driver", [bronze.SUSPECTS_IN_DRIVER, 0], ids=["suspects in the driver", "joins"])
@settings(max_examples=1, **SEARCH)  # each example is two runs of the stream: the search is in its drawn lines
@given(data=st.data())
def test_movie_ticket_sales_malformed_kinds_redeliveries_allowance_in_flight_files_and_a_replayed_batch(
        spark, tmp_path_factory, data, suspects_in_driver):
    """A large batch decides its suspect lines in the driver, or, with more than SUSPECTS_IN_DRIVER, all by joins."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(bronze, "SUSPECTS_IN_DRIVER", suspects_in_driver)
        _movie_ticket_sales_scenario(spark, tmp_path_factory, data)


def _movie_ticket_sales_scenario(spark, tmp_path_factory, data) -> None:
    layout = _layout(tmp_path_factory, "movie_ticket_sales")
    d, files = _landing_sales(layout.landing("movie_ticket_sales"), data)
    d.deliver_present_files()

    first = advance(spark, layout, MOVIE_TICKET_SALES, event_time=False, **EVERY_BATCH_LARGE)
    assert first.micro_batches == 1 and first.changed_files == []
    _check_with_oracle(layout, MOVIE_TICKET_SALES, d, [first])
    _check_sale_rules(layout, d, files, first)

    _lose_the_last_checkpoint_commit(layout)
    _change_sales(d, files)
    second = advance(spark, layout, MOVIE_TICKET_SALES, event_time=False, **EVERY_BATCH_LARGE)
    assert second.micro_batches == 2  # run 1's batch really was replayed, then the new one ran...
    for table in (MOVIE_TICKET_SALES.bronze_table, MOVIE_TICKET_SALES.state_tables[0].name):
        assert [c["user"]["batch_id"] for c in second.commits[table]] == [1], table  # ...and the replay wrote nothing
    quarantine = second.versions[MOVIE_TICKET_SALES.quarantine_table]
    assert quarantine.after == quarantine.before + 1  # the new batch's one append
    _check_with_oracle(layout, MOVIE_TICKET_SALES, d, [first, second])
    _check_changed_sales(layout, files, second)
    assert _reasons_outside_drawn(d)["conflicting_duplicate"] == 4
    _every_table_reads(layout, {"movie_ticket_sales_bronze", "movie_ticket_sales_quarantine", "movie_tickets_sold"})


def test_a_large_batch_writes_bronze_files_of_bounded_rows_each_one_range_of_event_time(spark, tmp_path, monkeypatch):
    """A large batch's bronze rows go into files of about BRONZE_FILE_ROWS rows (never fewer files than cores), and
    no two files' event times overlap: a later batch's dedup lookup reads only the files its range meets."""
    monkeypatch.setattr(bronze, "BRONZE_FILE_ROWS", 10)
    base = datetime(2026, 11, 1, tzinfo=timezone.utc)
    # 60 events an hour apart, in shuffled order, so the layout is not the input's
    order = [(i * 37) % 60 for i in range(60)]
    rows = [{"payment_id": f"p{i}", "customer_id": "c", "amount": Decimal("1.00"), "paid_at": base + timedelta(hours=i),
             "content_hash": "h", "source_file": "f", "line_number": i, "ingest_batch_id": 0, "ingested_at": base}
            for i in order]
    path = str(tmp_path / "bronze")
    frame = spark.createDataFrame(rows, bronze.bronze_schema(PAYMENTS))
    bronze._by_event_time(frame, PAYMENTS, len(rows)).write.format("delta").save(path)
    files = IndependentDeltaTable(path).get_add_actions(flatten=True)
    files = pa.table(files).to_pylist()  # an Arrow C-stream table: read through pyarrow
    assert len(files) == 6 and sum(f["num_records"] for f in files) == 60
    ranges = sorted((f["min.paid_at"], f["max.paid_at"]) for f in files)
    assert all(earlier[1] < later[0] for earlier, later in zip(ranges, ranges[1:])), ranges
