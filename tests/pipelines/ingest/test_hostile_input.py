"""Hostile landing data over two runs, against the independent oracle (tests/contract_oracle.py).

Covers: poison values (an amount of 1e16, a ticket value of 1e30, event times in year 0001 and 9999,
on 1582-10-10, two days ahead); file names with `:`, `[x]`, `{a,b}`, `*`, `?`, `%` and spaces; date
folders at any depth; a gzip file; in-flight names (`_x.jsonl`, `.y.jsonl`, files in `_tmp/` and
`.hidden/`) and other extensions ignored; a missing optional field against "\\u0000"; re-deliveries,
conflicting ids, and an mtime tie broken by path. Between the runs: lines appended to an ingested
file, an ingested file deleted and written again under the same name (some old events repeated),
a new file. Checks: both runs succeed; every line ever delivered is in exactly one of bronze,
quarantine or the recognised duplicates, with the oracle's counts, events and reasons; quarantine
names real files (`#v2` for the second version of a rewritten one); the state tables equal the
oracle's counts and exact sums key by key; `deltalake` reads every Delta table; run 2 reports the
changed files. Not covered: crashes and recovery (test_recovery.py, chaos), Dagster (tests/assets).
"""

from __future__ import annotations

import copy
import gzip
import json
import os
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path

from deltalake import DeltaTable as IndependentDeltaTable

from tests.streams import MOVIE_TICKET_SALES, PAYMENTS
from tests.contract_oracle import EPOCH, Oracle, file_lines, landing_files
from tests.streams import advance

MISSING = object()  # an optional field left out of the object
NOW = datetime.now(timezone.utc).replace(microsecond=0)
BASE = NOW - timedelta(days=2)  # every accepted event: well inside the dedup horizon
T0 = 1_763_000_000 * 10**9  # file modification times (ns), run 1
T1 = T0 + 3600 * 10**9  # ... and between the runs


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

    def __init__(self, folder: Path, stream: str):
        self.folder, self.oracle = folder, Oracle(stream)
        self.visible: set[Path] = set()
        self.ignored_ids: list[str] = []

    def file(self, name: str, lines: list[str | bytes], mtime_ns: int) -> Path:
        path = write(self.folder / name, lines, mtime_ns)
        self.visible.add(path)
        return path

    def in_flight(self, name: str, record_id: str) -> None:
        """A file the run must not read (in-flight name or folder, or not a landing extension)."""
        line = pay(record_id, "c-hidden", "1", at()) if "payments" in str(self.folder) else sale(
            record_id, "Hidden", "1", at())
        write(self.folder / name, [line], T0)
        self.ignored_ids.append(record_id)

    def deliver_present_files(self) -> None:
        """Run 1: everything visible, in arrival order (modification time, then full path)."""
        for path in sorted(self.visible, key=lambda p: (os.stat(p).st_mtime_ns, str(p))):
            self.oracle.deliver(str(path), file_lines(path))


def _landing_payments(folder: Path) -> tuple[Delivery, dict[str, Path]]:
    d = Delivery(folder, "payments")
    files = {
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
        ], T0 + 1 * 10**9),
        "deep": d.file("2026/11/22/deeper/a/b/{a,b} * ?.jsonl", [
            '{"paid_at":"%s","amount":10,"customer_id":"c1","payment_id":"p1"}' % at(0),  # same content
            pay("p2", "c2", "5.50", at(1)),  # the same instant in Z: same content
            pay("p9", "c2", "0.11", at(3)),  # conflicting_duplicate
            pay("p10", "c4", '"  7.25\\t"', at(5)),
            pay("p11", " c1", "3", at(6)),  # a customer id is kept as given: " c1" is not "c1"
        ], T0 + 2 * 10**9),
        "percent": d.file("100% sure.jsonl", [
            pay("p12", "c1", "1.01", at(7)),
            pay("p13", "c5", "2", at(8)),
            b"\xff\xfe{}",
            pay("p14", "c5", "0", at(9)),  # out_of_range: amounts are > 0
        ], T0 + 3 * 10**9),
        "gzip": d.file("batch.jsonl.gz", [
            pay("p15", "c6", "99.99", at(10)),
            pay("p1", "c1", "10.00", at(0)),
            pay("p16", "c6", '"1e2"', at(11)),
        ], T0 + 4 * 10**9),
        # Same modification time: arrival order is the full path, and " " (0x20) sorts before "!" (0x21)
        # while their URI forms ("%20", "!") sort the other way.
        "tie_first": d.file("a b.jsonl", [pay("p20", "c7", "1.00", at(12))], T0 + 5 * 10**9),
        "tie_second": d.file("a!b.jsonl", [pay("p20", "c7", "2.00", at(12))], T0 + 5 * 10**9),
    }
    for name, record_id in (("_x.jsonl", "p90"), (".y.jsonl", "p91"), ("_tmp/z.jsonl", "p92"),
                            ("2026/_tmp/w.jsonl", "p93"), (".hidden/v.jsonl", "p94"), ("notes.txt", "p95"),
                            ("x.jsonl.bak", "p96"), ("x.json", "p97"), ("2026/11/22/_part.jsonl.gz", "p98")):
        d.in_flight(name, record_id)
    return d, files


def _landing_sales(folder: Path) -> tuple[Delivery, dict[str, Path]]:
    d = Delivery(folder, "movie_ticket_sales")
    files = {
        "colon": d.file("2026-11-22T10:00:00.jsonl", [
            sale("m1", "Dune", "12.50", at(0)),  # no customer_id
            sale("m2", "Dune", "1e30", at(1)),
            sale("m3", "  Heat\t", "8", at(2)),
            sale("m4", "Dune", "12.5", at(3), customer="\u0000"),
            sale("m5", "Dune", "3.333", at(4)),
        ], T0 + 1 * 10**9),
        "gzip": d.file("2026/11/22/sales*.jsonl.gz", [
            sale("m1", "Dune", "12.50", at(0), customer="\u0000"),  # missing ≠ "\u0000": conflict
            sale("m4", " Dune ", '"12.50"', at(3), customer="\u0000"),  # same content
            sale("m6", "Heat", "0", at(5)),
            sale("m7", "Dune", "4.00", at(6), customer=None),
            sale("m7", "Dune", "4", at(6)),  # null and missing are the same: a re-delivery
        ], T0 + 2 * 10**9),
        "brackets": d.file("[x] {a,b} ?.jsonl", [
            sale("m8", "Amélie", "5.55", at(7)),
            sale("m9", "x" * 501, "1", at(8)),
            sale("m10", " \t ", "1", at(9)),
        ], T0 + 3 * 10**9),
    }
    for name, record_id in (("_x.jsonl", "m90"), (".y.jsonl", "m91"), ("_tmp/z.jsonl", "m92"),
                            ("2026/11/.partial/v.jsonl", "m93"), ("notes.jsonl.tmp", "m94")):
        d.in_flight(name, record_id)
    return d, files


def _change_payments(d: Delivery, files: dict[str, Path]) -> None:
    """Between the runs: an append, a delete-and-rewrite under the same name, a new file."""
    appended = [pay("p30", "c1", "4.00", at(20)), pay("p12", "c1", "1.01", at(7)), pay("p31", "c8", '"abc"', at(21))]
    already = len(file_lines(files["percent"]))
    with open(files["percent"], "ab") as handle:
        handle.write(_bytes(appended))
    os.utime(files["percent"], ns=(T1 + 1 * 10**9,) * 2)

    rewritten = [pay("p1", "c1", "10.00", at(0)), pay("p2", "c2", "5.50", at(1)), pay("p40", "c9", "6.66", at(22)),
                 pay("p9", "c2", "9.99", at(3)), pay("p41", "c9", "1", "9999-12-31T23:59:59Z")]
    files["dated"].unlink()
    write(files["dated"], rewritten, T1 + 2 * 10**9)

    new = d.file("2026/11/23/new%20file.jsonl", [pay("p50", "c1", "1.00", at(23)), pay("p10", "c4", "7.25", at(5)),
                                                  pay("p51", "c10", "2", at(24))], T1 + 3 * 10**9)
    d.oracle.deliver(str(files["percent"]), [line.encode() for line in appended], first_line_number=already + 1)
    d.oracle.deliver(f"{files['dated']}#v2", [line.encode() for line in rewritten])
    d.oracle.deliver(str(new), file_lines(new))


def _change_sales(d: Delivery, files: dict[str, Path]) -> None:
    appended = [sale("m11", "Dune", "1.00", at(20)), sale("m8", "Amélie", "5.55", at(7))]
    already = len(file_lines(files["brackets"]))
    with open(files["brackets"], "ab") as handle:
        handle.write(_bytes(appended))
    os.utime(files["brackets"], ns=(T1 + 1 * 10**9,) * 2)

    rewritten = [sale("m6", "Heat", '"0.00"', at(5)), sale("m12", "Heat", "2.5", at(21)),
                 sale("m1", "Dune", "12.50", at(0))]
    files["gzip"].unlink()
    write(files["gzip"], rewritten, T1 + 2 * 10**9)

    new = d.file("2026/11/23/deeper/more/late.jsonl", [sale("m13", "Dune", "7.77", at(22))], T1 + 3 * 10**9)
    d.oracle.deliver(str(files["brackets"]), [line.encode() for line in appended], first_line_number=already + 1)
    d.oracle.deliver(f"{files['gzip']}#v2", [line.encode() for line in rewritten])
    d.oracle.deliver(str(new), file_lines(new))


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


def _check(layout, spec, delivery: Delivery, results) -> None:
    expected = delivery.oracle.expected
    # Exactly once: the accounting of every batch adds up to the oracle's, line for line.
    assert _totals(results, spec) == {"lines": expected.lines, "accepted": expected.accepted,
                                "quarantined": expected.quarantined, "duplicates": expected.duplicates,
                                "already_ingested": 0}, spec.name
    bronze = _read(layout.table(spec.bronze_table))
    quarantine = _read(layout.table(spec.quarantine_table))
    placed = [(r["source_file"], r["line_number"]) for r in bronze + quarantine]
    assert len(placed) == len(set(placed)) == expected.accepted + expected.quarantined

    fields = [f for f in spec.field_names if f != spec.event_time_field]
    actual_events = {r[spec.id_field]: ({f: r[f] for f in fields}, _micros(r[spec.event_time_field])) for r in bronze}
    expected_events = {i: ({f: e[f] for f in fields}, _micros(e[spec.event_time_field]))
                       for i, e in expected.events.items()}
    assert actual_events == expected_events, spec.name
    assert sorted((r["source_file"], r["line_number"], r["reason"]) for r in quarantine) == sorted(
        expected.quarantine), spec.name

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


def _run(spark, layout, spec):
    # Four files per micro-batch: run 1 has two batches for payments, so ids meet both within a
    # batch and across batches (and across runs).
    return advance(spark, layout, spec, event_time=False, max_files_per_trigger=4)


def test_hostile_landing_data_over_two_runs(spark, layout):
    payments, payment_files = _landing_payments(layout.landing("payments"))
    sales, sale_files = _landing_sales(layout.landing("movie_ticket_sales"))
    for delivery in (payments, sales):
        assert set(landing_files(delivery.folder)) == delivery.visible  # the oracle's reading of the folder
        delivery.deliver_present_files()
    specs = ((PAYMENTS, payments), (MOVIE_TICKET_SALES, sales))

    first = {spec.name: _run(spark, layout, spec) for spec, _ in specs}
    for spec, delivery in specs:
        assert first[spec.name].changed_files == []
        _check(layout, spec, delivery, [first[spec.name]])
    after_first = {spec.name: copy.deepcopy(delivery.oracle.expected) for spec, delivery in specs}

    _change_payments(payments, payment_files)
    _change_sales(sales, sale_files)
    second = {spec.name: _run(spark, layout, spec) for spec, _ in specs}

    for spec, delivery in specs:
        _check(layout, spec, delivery, [first[spec.name], second[spec.name]])
        assert delivery.oracle.expected.lines > after_first[spec.name].lines
    changed = {spec.name: sorted((c["file"], c["change"], c["version"]) for c in second[spec.name].changed_files)
               for spec, _ in specs}
    assert changed == {
        "payments": sorted([(str(payment_files["percent"]), "appended", 1),
                            (str(payment_files["dated"]), "rewritten", 2)]),
        "movie_ticket_sales": sorted([(str(sale_files["brackets"]), "appended", 1),
                                      (str(sale_files["gzip"]), "rewritten", 2)]),
    }
    # The poison and the conflicts really were exercised (the oracle agrees with itself on them).
    reasons = {spec.name: dict(delivery.oracle.expected.reasons) for spec, delivery in specs}
    assert reasons["payments"]["out_of_range"] == 8 and reasons["payments"]["conflicting_duplicate"] == 3
    assert reasons["movie_ticket_sales"]["conflicting_duplicate"] == 1

    # An independent reader opens every Delta table the runs wrote.
    delta_folders = sorted(p.parent for p in layout.tables_root.rglob("_delta_log"))
    assert {f.name for f in delta_folders} >= {"payments_bronze", "payments_quarantine", "payments_per_customer",
                                               "movie_ticket_sales_bronze", "movie_ticket_sales_quarantine",
                                               "movie_tickets_sold"}
    for folder in delta_folders:
        IndependentDeltaTable(str(folder)).to_pyarrow_table()
