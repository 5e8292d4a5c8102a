"""The dedup horizon of an event's own event time, whatever the micro-batches.

The contract: an event is compared with the accepted events of its id whose event time lies within the dedup
horizon of its own; same content is a duplicate, other content `conflicting_duplicate`, none there a new event.
The same lines are delivered three ways (one file in one micro-batch, one file per line in as many micro-batches,
three files of another cut) to three storage roots, which must hold the same tables; the outcomes are also
written out by hand below. Read with an independent Delta reader (`deltalake`).
"""

from __future__ import annotations

import json
from datetime import timedelta

from deltalake import DeltaTable as IndependentDeltaTable

from pipelines.storage.layout import StorageLayout
from tests.conftest import Landing
from tests.streams import PAYMENTS, advance

SPEC = PAYMENTS
HORIZON = timedelta(days=1)


def _payment(payment_id: str, customer: str, amount: str, day: int, hh_mm: str) -> str:
    return json.dumps({"payment_id": payment_id, "customer_id": customer, "amount": amount,
                       "paid_at": f"2026-11-{day:02d}T{hh_mm}:00Z"})


LINES = [  # in arrival order
    _payment("r1", "ann", "10.00", 1, "10:00"),  # accepted
    _payment("r3", "cy", "1.00", 1, "09:00"),  # accepted
    _payment("r2", "bob", "5.00", 2, "08:00"),  # accepted
    _payment("r1", "ann", "10.00", 1, "10:00"),  # the same content: a duplicate
    _payment("r3", "cy", "2.00", 1, "23:00"),  # 14 h after r3's 09:00, other content: conflicting
    _payment("r1", "ann", "20.00", 4, "10:00"),  # 3 days after r1's accepted event: a new event
    _payment("r2", "bob", "6.00", 2, "20:00"),  # 12 h after r2: conflicting
    _payment("r3", "cy", "3.00", 2, "12:00"),  # 27 h after r3's 09:00 (the conflicting 23:00 was not accepted): new
    _payment("r1", "ann", "30.00", 4, "11:00"),  # 1 h after r1's day-4 event: conflicting
    _payment("r1", "ann", "20.00", 4, "10:00"),  # the day-4 event again: a duplicate
    _payment("r4", "dee", "7.00", 3, "10:00"),  # accepted
    _payment("r3", "cy", "3.00", 2, "12:00"),  # r3's day-2 event again: a duplicate
]
ACCEPTED = {("r1", "2026-11-01 10:00"), ("r3", "2026-11-01 09:00"), ("r2", "2026-11-02 08:00"),
            ("r1", "2026-11-04 10:00"), ("r3", "2026-11-02 12:00"), ("r4", "2026-11-03 10:00")}
CONFLICTING = 3


def _tables(layout: StorageLayout) -> tuple[set, list, dict]:
    def rows(name):
        return IndependentDeltaTable(str(layout.table(name))).to_pyarrow_table().to_pylist()
    bronze = {(r["payment_id"], r["paid_at"].strftime("%Y-%m-%d %H:%M")) for r in rows(SPEC.bronze_table)}
    reasons = sorted(r["reason"] for r in rows(SPEC.quarantine_table))
    state = {r["customer_id"]: (r["payment_count"], r["total_amount"]) for r in rows(SPEC.state_tables[0].name)}
    return bronze, reasons, state


def test_the_same_lines_give_the_same_tables_in_one_batch_in_many_and_in_another_cut(spark, tmp_path):
    cuts = {"one batch": [LINES], "a batch per line": [[line] for line in LINES],
            "another cut": [LINES[:5], LINES[5:7], LINES[7:]]}
    found = {}
    for name, files in cuts.items():
        layout = StorageLayout.under(tmp_path / name.replace(" ", "_"))
        landing = Landing(layout)
        for n, lines in enumerate(files):
            landing.write(SPEC.name, f"{n:02d}.jsonl", lines)
        result = advance(spark, layout, SPEC, dedup_horizon=HORIZON, event_time=False, max_files_per_trigger=1)
        assert result.micro_batches == len(files)
        found[name] = _tables(layout)
    bronze, reasons, state = found["one batch"]
    assert bronze == ACCEPTED and reasons == ["conflicting_duplicate"] * CONFLICTING
    assert state["ann"][0] == 2 and state["cy"][0] == 2 and state["bob"][0] == 1
    assert found["a batch per line"] == found["one batch"] == found["another cut"]
