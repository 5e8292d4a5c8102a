"""Where a blocking check and its operator meet an edge, they must agree (issue 26): a check that fails a
correct table is an outage. Each test drives the real operator on real Delta tables with events exactly at
the edge and one step inside it, then runs the real check's query, which must pass.

- sessions: payments exactly 30:00.000 apart are two sessions, 29:59.999 apart one; a payment arriving out of
  order that bridges two sessions at exactly the gap leaves three, at 1 ms less joins them into one;
- windows: a sale at exactly 11:00:00.000 is in the 11:00 hour, 1 ms before in the 10:00 hour;
- lateness: a sale exactly at the watermark is late (late_by_ms 0), 1 ms after it counts in its window;
- state-table TTL: a key exactly D behind the table's newest event is kept, 1 µs more is expired.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from decimal import Decimal

from deltalake import DeltaTable as IndependentDeltaTable

from pipelines.operate import table_checks
from tests.streams import MOVIE_TICKET_SALES, PAYMENTS
from tests.contract_oracle import expected_with_ttl
from tests.pipelines.event_time import test_sessions, test_windows
from tests.streams import advance

UTC = timezone.utc


def _at(moment: str) -> datetime:
    return datetime.fromisoformat(f"2026-11-01T{moment}+00:00")


def _payment(payment_id: str, customer: str, at: str) -> str:
    return f'{{"payment_id":"{payment_id}","customer_id":"{customer}","amount":"1.00","paid_at":"2026-11-01T{at}Z"}}'


def _sale(event_id: str, title: str, at: str) -> str:
    return f'{{"event_id":"{event_id}","title":"{title}","ticket_total_value":"2.50","sale_ts":"2026-11-01T{at}Z"}}'


def test_sessions_check_agrees_with_the_operator_at_exactly_the_gap(spark, layout, landing):
    # A 2-hour watermark delay, so that the bridging payments of the second delivery are on time.
    runs = test_sessions.Deliveries(spark, layout, test_sessions.Rules(watermark_delay=timedelta(hours=2)))
    landing.write(PAYMENTS.name, "1.jsonl", [
        _payment("e1", "exact", "10:00:00.000"), _payment("e2", "exact", "10:30:00.000"),
        _payment("l1", "less", "10:00:00.000"), _payment("l2", "less", "10:29:59.999"),
        _payment("be1", "bridge_exact", "10:00:00.000"), _payment("be3", "bridge_exact", "11:00:00.000"),
        _payment("bl1", "bridge_less", "10:00:00.000"), _payment("bl3", "bridge_less", "10:59:59.998")])
    runs.run()
    landing.write(PAYMENTS.name, "2.jsonl", [
        _payment("be2", "bridge_exact", "10:30:00.000"),  # exactly 30:00.000 from both neighbours
        _payment("bl2", "bridge_less", "10:29:59.999"),  # 29:59.999 from both
        _payment("clock", "clock", "15:00:00.000")])  # watermark 13:00: every session above closes
    runs.run()

    sessions, late = test_sessions._outputs(layout)
    assert not late
    assert sessions == runs.expected().sessions
    spans = {(customer, start): (end, count) for (customer, start), (end, count, *_) in sessions.items()}
    assert spans == {
        ("exact", _at("10:00:00")): (_at("10:00:00"), 1), ("exact", _at("10:30:00")): (_at("10:30:00"), 1),
        ("less", _at("10:00:00")): (_at("10:29:59.999"), 2),
        ("bridge_exact", _at("10:00:00")): (_at("10:00:00"), 1),
        ("bridge_exact", _at("10:30:00")): (_at("10:30:00"), 1),
        ("bridge_exact", _at("11:00:00")): (_at("11:00:00"), 1),
        ("bridge_less", _at("10:00:00")): (_at("10:59:59.998"), 3)}
    mismatched, figures = table_checks.event_time_mismatches(spark, layout, PAYMENTS, test_sessions.TABLE)
    assert mismatched.count() == 0, mismatched.collect()
    assert (figures["rows_checked"], figures["events"]) == (7, 11)


def test_windows_check_agrees_with_the_operator_at_the_hour_and_the_watermark(spark, layout, landing):
    spec = MOVIE_TICKET_SALES
    runs = test_windows.Deliveries(spark, layout)
    landing.write(spec.name, "1.jsonl", [
        _sale("before", "A", "10:59:59.999"), _sale("on_the_hour", "A", "11:00:00.000"),
        _sale("newest", "B", "12:00:00.000")])  # the next batch's watermark: 11:50:00.000
    runs.run()
    landing.write(spec.name, "2.jsonl", [
        _sale("at_watermark", "A", "11:50:00.000"),  # at the watermark: late
        _sale("after_watermark", "A", "11:50:00.001"),  # 1 ms after it: counts in the 11:00 hour
        _sale("clock", "C", "13:10:00.000")])  # watermark 13:00: the 10:00, 11:00 and 12:00 hours close
    runs.run()

    windows, late, _ = test_windows._outputs(layout)
    value = Decimal("2.50")
    assert windows == {("A", _at("10:00:00")): (1, value), ("A", _at("11:00:00")): (2, 2 * value),
                       ("B", _at("12:00:00")): (1, value)}
    assert late == {"at_watermark": (_at("11:50:00"), _at("11:50:00"))}
    late_rows = IndependentDeltaTable(str(layout.table("late_events"))).to_pyarrow_table().to_pylist()
    assert [r["late_by_ms"] for r in late_rows] == [0]
    # The check runs the declared query with Spark's own window(): the same edges as the operator's.
    mismatched, figures = table_checks.event_time_mismatches(spark, layout, spec, test_windows.TABLE)
    assert mismatched.count() == 0, mismatched.collect()
    assert (figures["rows_checked"], figures["events"], figures["late_events"]) == (3, 6, 1)
    assert figures["late_not_behind_watermark"] == figures["late_not_in_bronze"] == 0


def test_state_ttl_checks_agree_at_exactly_the_ttl(spark, layout, landing):
    spec, table, ttl = PAYMENTS, PAYMENTS.state_tables[0], timedelta(days=1)
    line = '{"payment_id":"%s","customer_id":"%s","amount":"1.00","paid_at":"%s"}'
    files = [landing.write(spec.name, "1.jsonl", [
        line % ("p1", "exactly_ttl", "2026-11-01T10:00:00.000000Z"),  # exactly 1 day behind the clock: kept
        line % ("p2", "ttl_and_1us", "2026-11-01T09:59:59.999999Z"),  # 1 µs more: expired
        line % ("p3", "clock", "2026-11-02T10:00:00.000000Z")])]
    advance(spark, layout, spec, event_time=False, ttl=ttl)

    rows = IndependentDeltaTable(str(layout.table(table.name))).to_pyarrow_table().to_pylist()
    assert sorted(r[table.key] for r in rows) == ["clock", "exactly_ttl"]
    expected = expected_with_ttl(spec.name, [files], ttl)
    assert {r[table.key]: (r[table.count_column], r[table.sum_column]) for r in rows} == expected.rows
    assert [key for key, _, _ in expected.expired] == ["ttl_and_1us"]
    assert table_checks.totals_match_bronze(spark, layout, spec, spec.state_tables[0])["passed"]
    mismatched, totals = table_checks.mismatches_with_bronze(spark, layout, spec, spec.state_tables[0])
    assert mismatched.count() == 0 and totals["sum_of_counts"] == totals["distinct_accepted_events"] == 3
