"""The dedup horizon of an event's own event time, whatever the micro-batches.

The contract: an event is compared with the accepted events of its id whose event time lies within the dedup
horizon of its own; same content is a duplicate, other content `conflicting_duplicate`, none there a new event.
The same lines are delivered three ways (one micro-batch; micro-batches that never hold an id twice, so every line
is judged against bronze alone, as one line per micro-batch would be; and a cut that mixes both) and must give the
same tables; the outcomes are also written out by hand below. A re-delivery whose original lies a month behind the
stream's newest events counts once, and an id reused with other content inside the horizon, before its batch's
oldest event, is `conflicting_duplicate` (the promise of ../shared/contract.md's dedup horizon).

Each cut has ids and customers of its own, so the cuts share one storage root and one run: micro-batch k holds part
k of every cut. Lines of different ids never meet under the rule. Every micro-batch's accounting and the final
tables are also compared with tests/contract_oracle.py; the far case's state after each of its micro-batches is
written out by hand. Read with an independent Delta reader (`deltalake`).
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path

from deltalake import DeltaTable as IndependentDeltaTable

from pipelines.storage.layout import StorageLayout
from tests.conftest import Landing
from tests.contract_oracle import Oracle
from tests.streams import PAYMENTS, advance

SPEC = PAYMENTS
HORIZON = timedelta(days=1)


def _payment(payment_id: str, customer: str, amount: str, paid_at: str) -> str:
    return json.dumps({"payment_id": payment_id, "customer_id": customer, "amount": amount, "paid_at": paid_at})


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

# Cut → its parts, part k in micro-batch k.
CUTS = {
    "one": [LINES],
    # Each part as long as no id comes twice: no line is compared with a line of its own batch, only with bronze.
    "no-id-twice": [LINES[0:3], LINES[3:5], LINES[5:8], LINES[8:9], LINES[9:12]],
    "another": [LINES[:5], LINES[5:7], LINES[7:]],
}

# A re-delivery far behind, and a reuse inside the horizon before its batch's oldest event. A month before LINES, so
# micro-batch 4's event-time range starts at its h1 and only the horizon's widening of it reaches d2's original.
T0 = datetime(2026, 10, 1, 10, tzinfo=timezone.utc)


def _at(**delta) -> str:
    return (T0 + timedelta(**delta)).strftime("%Y-%m-%dT%H:%M:%SZ")


FAR = {
    1: [("d1", "dune", "10.00", _at()), ("d2", "dune", "10.00", _at(hours=1)), ("h1", "heat", "5.00", _at(hours=2))],
    # h1 again (the very same line); d2 with another value 12 h after its original, which lies 1 h before this
    # batch's oldest event time (h1's); a new sale.
    4: [("h1", "heat", "5.00", _at(hours=2)), ("d2", "dune", "99.00", _at(hours=13)),
        ("n1", "dune", "7.00", _at(hours=14))],
    # Ten horizons later: new sales, and d1's line once more, ten days behind them.
    5: [("n2", "heat", "6.00", _at(days=10)), ("d1", "dune", "10.00", _at()),
        ("n3", "heat", "4.00", _at(days=10, hours=1))],
}
# What the far case's lines leave after micro-batches 1, 4 and 5 (batches 2 and 3 hold none of them).
FAR_STATE = {1: {"dune": (2, Decimal("20.00")), "heat": (1, Decimal("5.00"))},
             4: {"dune": (3, Decimal("27.00")), "heat": (1, Decimal("5.00"))},
             5: {"dune": (3, Decimal("27.00")), "heat": (3, Decimal("15.00"))}}
BATCHES = 5


def _tagged(tag: str, lines) -> list[str]:
    """The lines with the cut's own ids and customers: `tag/id`, `tag/customer`."""
    return [_payment(f"{tag}/{pid}", f"{tag}/{customer}", amount, at) for pid, customer, amount, at in lines]


def _files() -> list[list[str]]:
    """The landing files in arrival order, one per micro-batch: part k of every cut, and the far case's lines."""
    files = [[] for _ in range(BATCHES)]
    for tag, parts in CUTS.items():
        for k, part in enumerate(parts):
            files[k] += _tagged(tag, part)
    for batch, lines in FAR.items():
        files[batch - 1] += _tagged("far", lines)
    return files


def _untagged(tag: str, rows: list[dict], column: str) -> list[dict]:
    """The rows of one cut, its tag taken off `column`."""
    return [{**r, column: r[column].split("/", 1)[1]} for r in rows if r[column].startswith(tag + "/")]


def _rows(layout: StorageLayout, name: str, version: int | None = None) -> list[dict]:
    return IndependentDeltaTable(str(layout.table(name)), version=version).to_pyarrow_table().to_pylist()


def _state(rows: list[dict], tag: str) -> dict:
    return {r["customer_id"]: (r["payment_count"], r["total_amount"]) for r in _untagged(tag, rows, "customer_id")}


def _check_the_cuts(layout: StorageLayout) -> None:
    """The same tables from every cut, and the outcomes written out by hand above."""
    bronze, quarantine = _rows(layout, SPEC.bronze_table), _rows(layout, SPEC.quarantine_table)
    state = _rows(layout, SPEC.state_tables[0].name)
    found = {}
    for tag in CUTS:
        found[tag] = ({(r["payment_id"], r["paid_at"].strftime("%Y-%m-%d %H:%M"))
                       for r in _untagged(tag, bronze, "payment_id")},
                      sorted(r["reason"] for r in _untagged(tag, quarantine, "record_id")),
                      _state(state, tag))
    bronze_of_one, reasons, per_customer = found["one"]
    assert bronze_of_one == ACCEPTED and reasons == ["conflicting_duplicate"] * CONFLICTING
    assert per_customer == {"ann": (2, Decimal("30.00")), "cy": (2, Decimal("4.00")), "bob": (1, Decimal("5.00")),
                            "dee": (1, Decimal("7.00"))}
    assert found["no-id-twice"] == found["one"] == found["another"]


def _check_the_far_case(layout: StorageLayout, result) -> None:
    """Its state after each of its micro-batches, then what bronze and quarantine hold of it."""
    merges = {c["user"]["batch_id"]: c["version"] for c in result.commits[SPEC.state_tables[0].name]
              if "batch_id" in c["user"]}
    for batch, expected in FAR_STATE.items():
        assert _state(_rows(layout, SPEC.state_tables[0].name, merges[batch - 1]), "far") == expected, batch
    quarantine = _untagged("far", _rows(layout, SPEC.quarantine_table), "record_id")
    assert [(r["record_id"], r["reason"], r["reason_field"], Path(r["source_file"]).name) for r in quarantine] == [
        ("d2", "conflicting_duplicate", "payment_id", "03.jsonl")]
    bronze = sorted((r["payment_id"], r["amount"]) for r in _untagged("far", _rows(layout, SPEC.bronze_table),
                                                                     "payment_id"))
    assert bronze == [("d1", Decimal("10.00")), ("d2", Decimal("10.00")), ("h1", Decimal("5.00")),
                      ("n1", Decimal("7.00")), ("n2", Decimal("6.00")), ("n3", Decimal("4.00"))]


def _check_with_oracle(layout: StorageLayout, result, oracle_after_each: list[tuple], expected) -> None:
    """Every micro-batch's accounting, and the final tables, as the oracle has them."""
    commits = result.commits[SPEC.bronze_table]
    assert [c["user"]["batch_id"] for c in commits] == list(range(BATCHES))
    before = (0, 0, 0, 0)
    for commit, after in zip(commits, oracle_after_each):
        user = commit["user"]
        assert (user["lines"], user["accepted"], user["quarantined"], user["duplicates"]) == tuple(
            a - b for a, b in zip(after, before)), user["batch_id"]
        before = after
    assert sorted(r["payment_id"] for r in _rows(layout, SPEC.bronze_table)) == sorted(expected.accepted_ids)
    assert sorted((r["source_file"], r["line_number"], r["reason"]) for r in _rows(layout, SPEC.quarantine_table)
                  ) == sorted(expected.quarantine)
    state = {r["customer_id"]: (r["payment_count"], r["total_amount"])
             for r in _rows(layout, SPEC.state_tables[0].name)}
    assert state == {k: (expected.counts[k], expected.sums[k]) for k in expected.counts}


def test_the_same_lines_give_the_same_tables_in_one_batch_in_many_and_in_another_cut(spark, tmp_path):
    """One run over the five landing files, a micro-batch each (the oracle given the same files in the same order);
    then the cuts, the far case, and everything against the oracle."""
    for tag, parts in CUTS.items():
        assert len(parts) <= BATCHES and sum(parts, []) == LINES, tag
    assert all(len({line[0] for line in part}) == len(part) for part in CUTS["no-id-twice"])
    layout = StorageLayout.under(tmp_path / "home")
    landing, oracle, oracle_after_each = Landing(layout), Oracle(SPEC.name, horizon=HORIZON), []
    for k, lines in enumerate(_files()):
        path = landing.write(SPEC.name, f"{k:02d}.jsonl", lines)
        oracle.deliver(str(path), [line.encode() for line in lines])
        e = oracle.expected
        oracle_after_each.append((e.lines, e.accepted, e.quarantined, e.duplicates))

    result = advance(spark, layout, SPEC, dedup_horizon=HORIZON, event_time=False, max_files_per_trigger=1)

    assert result.micro_batches == BATCHES
    _check_the_cuts(layout)
    _check_the_far_case(layout, result)
    _check_with_oracle(layout, result, oracle_after_each, oracle.expected)
