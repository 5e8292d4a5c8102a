"""The event-time rules as plain functions on hand-written rows, in the shared SparkSession, without a stream,
for the shipped project's declared tables: `fold_sessions` (the gap's edge, a payment out of order joining two open
sessions, late payments, the watermark, the TTL forgetting a previous session and its day's spend), `fold_windows`
(the hour's edge, the watermark's edge, an hour closing exactly when the watermark reaches its end), `top_rows`
(ties broken by tickets, value, title; ten per hour) and `table_from_changelog` (a key deleted and inserted in one
commit, a version cut).

The same rules through whole runs (the edges included), crashes and the Dagster checks: test_sessions.py,
test_windows.py, test_state_ttl.py. Not covered here: writing, replay, recovery. Each fold's outputs are collected
once: every action on them is a Spark job of its own.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import replace
from decimal import Decimal
from functools import reduce

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from pipelines.event_time import sessions, windows
from pipelines.event_time.sessions import fold_sessions
from pipelines.event_time.watermark import output_schema
from pipelines.event_time.windows import fold_windows, top_rows
from pipelines.state.changelog import changelog_schema, table_from_changelog
from tests.streams import MOVIE_TICKET_SALES, PAYMENTS, declared

(HOURLY,) = MOVIE_TICKET_SALES.event_time_tables
(TOP,) = HOURLY.tops
(ACTIVITY,) = PAYMENTS.event_time_tables

UTC = dt.timezone.utc


def at(hh_mm_ss: str, day: int = 1) -> dt.datetime:
    return dt.datetime.fromisoformat(f"2026-11-{day:02d}T{hh_mm_ss}+00:00")


def ms(moment: dt.datetime) -> int:
    return int(moment.timestamp() * 1000)


def bronze(spark, columns: str, rows):
    """Bronze rows of `columns` (id, key, value, event time), each from line n of one landing file."""
    return spark.createDataFrame(
        [(*row[:2], Decimal(row[2]), row[3], "f.jsonl", n) for n, row in enumerate(rows, start=1)],
        f"{columns}, source_file string, line_number long")


def payments(spark, rows):
    """(payment_id, customer_id, amount, paid_at)"""
    return bronze(spark, "payment_id string, customer_id string, amount decimal(18,2), paid_at timestamp", rows)


def sales(spark, rows):
    """(event_id, title, value, sale_ts)"""
    return bronze(spark, "event_id string, title string, ticket_total_value decimal(18,2), sale_ts timestamp", rows)


def _utc(moment):
    return moment.astimezone(UTC) if moment is not None else None


def _sessions(closed: list) -> dict:
    """Rows of a session table: (customer, start) → (end, count)."""
    return {(r["customer_id"], _utc(r["session_start"])): (_utc(r["session_end"]), r["payment_count"])
            for r in closed}


def _open(state: list) -> dict:
    """The open sessions of a session table's state rows: (customer, first payment) → (last payment, count)."""
    return {(r["customer_id"], _utc(r["_first"])): (_utc(r["_last"]), r["payment_count"]) for r in state if r["_open"]}


def test_sessions_cut_at_the_gap_join_out_of_order_and_close_on_the_watermark(spark):
    assert PAYMENTS.event_time_field == "paid_at"
    spec = declared(PAYMENTS, watermark_delay=dt.timedelta(hours=2))
    empty = spark.createDataFrame([], sessions.state_schema(ACTIVITY))
    first = fold_sessions(ACTIVITY, spec, empty, payments(spark, [
        ("e1", "exact", "1", at("10:00:00")), ("e2", "exact", "1", at("10:30:00")),  # 30:00 apart: two
        ("l1", "less", "1", at("10:00:00")), ("l2", "less", "1", at("10:29:59.999999")),  # 1 µs less: one
        ("b1", "bridge", "1", at("10:00:00")), ("b3", "bridge", "1", at("10:50:00")),  # two, until b2 arrives
        ("n", "newest", "1", at("12:00:00"))]), 0)
    assert first.watermark_ms == ms(at("10:00:00"))  # the newest payment minus the delay
    assert first.closed.count() == 0 and first.late.count() == 0  # no session is a gap behind 10:00 yet
    assert _open(first.state.collect()) == {
        ("exact", at("10:00:00")): (at("10:00:00"), 1), ("exact", at("10:30:00")): (at("10:30:00"), 1),
        ("less", at("10:00:00")): (at("10:29:59.999999"), 2),
        ("bridge", at("10:00:00")): (at("10:00:00"), 1), ("bridge", at("10:50:00")): (at("10:50:00"), 1),
        ("newest", at("12:00:00")): (at("12:00:00"), 1)}

    second = fold_sessions(ACTIVITY, spec, first.state, payments(spark, [
        ("b2", "bridge", "2", at("10:25:00")),  # out of order, < 30 min from both: joins them into one
        ("late", "exact", "1", at("10:00:00")),  # at the watermark: late
        ("clock", "clock", "1", at("13:00:00.001"))]), first.watermark_ms)
    closed, state = second.closed.collect(), second.state.collect()
    assert second.watermark_ms == ms(at("11:00:00.001"))
    assert [(r["event_id"], r["late_by_ms"]) for r in second.late.collect()] == [("late", 0)]
    # Closed: every session whose end is a gap (30 min) or more behind 11:00:00.001.
    assert _sessions(closed) == {
        ("exact", at("10:00:00")): (at("10:00:00"), 1), ("exact", at("10:30:00")): (at("10:30:00"), 1),
        ("less", at("10:00:00")): (at("10:29:59.999999"), 2)}
    assert _open(state) == {
        ("bridge", at("10:00:00")): (at("10:50:00"), 3), ("newest", at("12:00:00")): (at("12:00:00"), 1),
        ("clock", at("13:00:00.001")): (at("13:00:00.001"), 1)}
    (bridge,) = [r for r in state if r["_open"] and r["customer_id"] == "bridge"]
    assert [p["value"] for p in bridge["_by_last_payment_ids"]] == ["b3", "b2", "b1"]  # newest first
    assert bridge["total_amount"] == Decimal("4.00")
    exact = {_utc(r["session_start"]): (_utc(r["previous_session_end"]), r["day_amount"])
             for r in closed if r["customer_id"] == "exact"}
    assert exact == {at("10:00:00"): (None, Decimal("1.00")), at("10:30:00"): (at("10:00:00"), Decimal("2.00"))}
    assert [r["last_payment_ids"] for r in closed if r["customer_id"] == "less"] == [["l2", "l1"]]
    assert {r["customer_id"]: (_utc(r["_last"]), _utc(r["_carried_previous_session_end"]), r["_carried_day_amount"])
            for r in state if not r["_open"]} == {
        "exact": (at("10:30:00"), at("10:30:00"), Decimal("2.00")),
        "less": (at("10:29:59.999999"), at("10:29:59.999999"), Decimal("2.00"))}


def test_a_first_fold_without_state_gives_what_a_fold_from_an_empty_state_gives(spark):
    """No state at all (a table's first batch, a rebuild) takes a shorter path: one aggregation of the events."""
    spec = declared(PAYMENTS, watermark_delay=dt.timedelta(hours=2))
    events = payments(spark, [
        ("e1", "exact", "1", at("10:00:00")), ("e2", "exact", "2", at("10:30:00")),
        ("l1", "less", "1", at("10:00:00")), ("l2", "less", "3", at("10:29:59.999999")),
        ("l3", "less", "4", at("10:05:00")), ("n", "newest", "1", at("13:00:00"))])
    folds = [fold_sessions(ACTIVITY, spec, state, events, 0)
             for state in (spark.createDataFrame([], sessions.state_schema(ACTIVITY)), None)]
    general, first = ({"state": sorted(map(tuple, f.state.collect())), "closed": sorted(map(tuple, f.closed.collect())),
                       "watermark": f.watermark_ms} for f in folds)
    assert first == general
    assert len(general["closed"]) == 3 and len(general["state"]) == 3  # 3 sessions closed, 1 open and 2 keys carried


def _open_list(state: list, customer: str) -> list:
    (row,) = [r for r in state if r["_open"] and r["customer_id"] == customer]
    return [p["value"] for p in row["_by_last_payment_ids"]]


def test_a_long_session_keeps_the_extreme_five_of_all_its_pieces(spark):
    """A session's MAX_BY(..., 5) list over many payments and over pieces of several batches (an open session's list
    and new payments): each piece is ranked, and the five of the greatest time, ties to the greater id, come from
    all of them; MIN_BY the same from the other end."""
    spec = declared(PAYMENTS, watermark_delay=dt.timedelta(hours=2))
    many = [(f"p{i:03d}", "hot", "1", at("10:00:00")) for i in range(300)]  # 300 at one instant: ties by id
    first = fold_sessions(ACTIVITY, spec, None, payments(spark, [
        *many, ("q", "hot", "1", at("10:00:01")), ("c", "cold", "1", at("10:00:00"))]), 0)
    state = first.state.collect()
    assert _open_list(state, "hot") == ["q", "p299", "p298", "p297", "p296"]
    assert _open_list(state, "cold") == ["c"]
    second = fold_sessions(ACTIVITY, spec, first.state, payments(spark, [
        *((f"r{i:03d}", "hot", "1", at("10:00:00.5")) for i in range(200)), ("a", "hot", "1", at("10:00:02")),
        ("p999", "hot", "1", at("10:00:00"))]), first.watermark_ms)  # ties with the open list's p2xx, greater
    assert _open_list(second.state.collect(), "hot") == ["a", "q", "r199", "r198", "r197"]
    third = fold_sessions(ACTIVITY, spec, second.state, payments(spark, [("clock", "clock", "1", at("13:00:00"))]),
                          second.watermark_ms)  # the watermark moves to 11:00: the session closes
    assert [r["last_payment_ids"] for r in third.closed.collect() if r["customer_id"] == "hot"] == [
        ["a", "q", "r199", "r198", "r197"]]

    least = replace(ACTIVITY, aggregates=tuple(replace(a, function="min_by") if a.function == "max_by" else a
                                               for a in ACTIVITY.aggregates))
    first = fold_sessions(least, spec, None, payments(spark, [*many, ("q", "hot", "1", at("09:59:59"))]), 0)
    assert _open_list(first.state.collect(), "hot") == ["q", "p000", "p001", "p002", "p003"]
    second = fold_sessions(least, spec, first.state, payments(spark, [
        ("b", "hot", "1", at("09:59:58")), ("o", "hot", "1", at("10:00:00")), ("p0000", "hot", "1", at("10:00:00"))]),
        first.watermark_ms)
    assert _open_list(second.state.collect(), "hot") == ["b", "q", "o", "p000", "p0000"]  # p0000 before p001


def test_the_ttl_forgets_the_previous_session_and_the_days_spend(spark):
    spec = declared(PAYMENTS, watermark_delay=dt.timedelta(0), session_ttl=dt.timedelta(hours=1))
    (table,) = spec.event_time_tables
    schema = sessions.state_schema(table)

    def carried(customer, last, day_amount):
        """A key's row: its newest closed session ended at `last`, `day_amount` spent that day."""
        row = {name: None for name in schema.fieldNames()}
        row.update({"customer_id": customer, "_open": False, "_last": last, "_carried_previous_session_end": last,
                    "_carried_day_amount": day_amount})
        return tuple(row.values())

    state = spark.createDataFrame([carried("kept", at("09:00:00"), Decimal("5.00")),
                                   carried("forgot", at("08:00:00"), Decimal("7.00"))], schema)
    fold = fold_sessions(table, spec, state, payments(spark, [
        ("k", "kept", "1", at("09:59:59.999999")),  # 1 µs less than the TTL after 09:00: remembered
        ("f", "forgot", "1", at("09:00:00")),  # exactly the TTL after 08:00: forgotten
        ("clock", "clock", "1", at("12:00:00"))]), 0)
    closed = {r["customer_id"]: (_utc(r["previous_session_end"]), r["day_amount"]) for r in fold.closed.collect()}
    assert closed == {"kept": (at("09:00:00"), Decimal("6.00")), "forgot": (None, Decimal("1.00"))}
    # A customer with nothing open, idle the TTL: forgotten by the state too.
    assert {r["customer_id"] for r in fold.state.where("NOT _open").collect()} == set()


def test_windows_edges_the_watermark_and_when_an_hour_closes(spark):
    assert MOVIE_TICKET_SALES.event_time_field == "sale_ts"
    spec = declared(MOVIE_TICKET_SALES, watermark_delay=dt.timedelta(minutes=10))
    first = fold_windows(HOURLY, spec, spark.createDataFrame([], windows.state_schema(HOURLY)), sales(spark, [
        ("before", "A", "1.00", at("10:59:59.999")), ("on_the_hour", "A", "2.00", at("11:00:00")),
        ("newest", "B", "4.00", at("12:00:00"))]), 0)
    assert first.watermark_ms == ms(at("11:50:00"))
    # 10:00's end (11:00) is behind the watermark: closed in the batch that moved it there.
    assert {(r["title"], _utc(r["window_start"])): (r["tickets_sold"], r["total_ticket_value"])
            for r in first.closed.collect()} == {("A", at("10:00:00")): (1, Decimal("1.00"))}
    second = fold_windows(HOURLY, spec, first.open_windows, sales(spark, [
        ("at_watermark", "A", "1.00", at("11:50:00")), ("after", "A", "1.00", at("11:50:00.001")),
        ("clock", "C", "1.00", at("13:10:00"))]), first.watermark_ms)
    assert [(r["event_id"], r["late_by_ms"]) for r in second.late.collect()] == [("at_watermark", 0)]
    assert second.watermark_ms == ms(at("13:00:00"))  # exactly 12:00's end: that hour closes too
    assert {(r["title"], _utc(r["window_start"])): r["tickets_sold"] for r in second.closed.collect()} == {
        ("A", at("11:00:00")): 2, ("B", at("12:00:00")): 1}
    assert [(r["title"], _utc(r["_window_start"])) for r in second.open_windows.collect()] == [("C", at("13:00:00"))]


def test_the_top_n_breaks_ties_by_tickets_value_then_title_and_keeps_ten(spark):
    hour = at("10:00:00")
    rows = [(f"T{n:02d}", hour, hour + dt.timedelta(hours=1), 5, Decimal("1.00")) for n in range(11)]
    rows += [("Z", hour, hour + dt.timedelta(hours=1), 9, Decimal("1.00")),  # most tickets
             ("Y", hour, hour + dt.timedelta(hours=1), 5, Decimal("3.00"))]  # tie on tickets: more value first
    top = top_rows(TOP, HOURLY, spark.createDataFrame(rows, output_schema(HOURLY))).orderBy("rank").collect()
    assert TOP.n == 10 and [(r["rank"], r["title"]) for r in top] == [
        (1, "Z"), (2, "Y"), *((n + 3, f"T{n:02d}") for n in range(8))]


def test_the_changelog_gives_the_table_at_any_version(spark):
    table = PAYMENTS.state_tables[0]
    schema = changelog_schema(table)
    columns = schema.fieldNames()
    base = {name: None for name in columns}

    def change(key, count, kind, version):
        return tuple({**base, table.key: key, table.count_column: count, table.sum_column: Decimal(count),
                      "_change_type": kind, "_commit_version": version}[c] for c in columns)

    changelog = spark.createDataFrame([
        change("a", 1, "insert", 1), change("b", 1, "insert", 1),
        change("a", 1, "update_preimage", 2), change("a", 2, "update_postimage", 2),
        change("b", 1, "delete", 3),
        change("a", 2, "delete", 4), change("a", 3, "insert", 4),  # a file rewrite: the row exists
    ], schema)

    # Every version's table in one Spark job.
    versions = (1, 2, 3, 4)
    rows = reduce(DataFrame.unionByName, [table_from_changelog(changelog, table, v).withColumn("_at", F.lit(v))
                                          for v in versions]).collect()
    at_version = {v: {r[table.key]: r[table.count_column] for r in rows if r["_at"] == v} for v in versions}
    assert [at_version[v] for v in versions] == [{"a": 1, "b": 1}, {"a": 2, "b": 1}, {"a": 2}, {"a": 3}]
