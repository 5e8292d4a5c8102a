"""A stream and state tables that appear nowhere in the code, declared in a project file like the README's example.

The expected tables are computed here in plain Python (Decimal, datetime) from the events the test writes, and the
tables are read with an independent Delta reader (`deltalake`).
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from datetime import datetime, timedelta, timezone
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

import pytest
from deltalake import DeltaTable as IndependentDeltaTable

from pipelines.declare.project import PROJECT_ENV, load_project, project
from pipelines.errors import ConfigurationError, DefinitionChangedError
from pipelines.operate.refresh import refresh_state_table
from pipelines.runtime.micro_batch import StreamSettings, advance_stream
from pipelines.state.tables import changed_definitions

EXAMPLE = """\
streams:
  orders:
    id: order_id                 # the dedup key
    event_time: ordered_at
    fields:
      order_id:   {type: string}
      region:     {type: string, trim: true, max_length: 50}
      total:      {type: decimal, min: 0}
      ordered_at: {type: timestamp}
      coupon:     {type: string, required: false}

state_tables:
  - CREATE TABLE orders_per_region AS
    SELECT region, COUNT(*) AS orders, SUM(total) AS revenue,
           MAX(total) AS largest_order, MIN(ordered_at) AS first_order_at
    FROM orders GROUP BY region
"""
COUPONS = """\
  - CREATE TABLE coupon_use AS
    SELECT region, coupon, COUNT(coupon) AS with_coupon, AVG(total) AS average_total,
           MAX_BY(total, ordered_at) AS latest_total, MIN_BY(order_id, ordered_at) AS first_order
    FROM orders GROUP BY region, coupon
"""
T0 = datetime(2026, 11, 20, 8, 0, tzinfo=timezone.utc)


def _iso(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def _events(first: int, count: int) -> list[dict]:
    """Orders with distinct event times (MAX_BY/MIN_BY have no ties to break), padded regions, optional coupons,
    totals as numbers and as numeric strings."""
    events = []
    for n in range(first, first + count):
        event = {"order_id": f"o-{n}", "region": ["north", " south ", "east", "west"][n % 4],
                 "total": f"{(n * 37) % 900}.{n % 100:02d}" if n % 2 else (n * 53) % 700 + 0.25,
                 "ordered_at": _iso(T0 + timedelta(seconds=41 * n + (n % 7)))}
        if n % 3:
            event["coupon"] = f"c{n % 5}"
        events.append(event)
    return events


BAD = [  # (line, reason, field)
    ('{"order_id": "b1", "region": "north", "total": 1', "not_json", None),
    ('{"order_id": "b2", "total": 1, "ordered_at": "2026-11-20T09:00:00Z"}', "missing_field", "region"),
    ('{"order_id": "b3", "region": "   ", "total": 1, "ordered_at": "2026-11-20T09:00:00Z"}', "empty_field", "region"),
    ('{"order_id": "b4", "region": "' + "x" * 51 + '", "total": 1, "ordered_at": "2026-11-20T09:00:00Z"}',
     "too_long", "region"),
    ('{"order_id": "b5", "region": "north", "total": -1, "ordered_at": "2026-11-20T09:00:00Z"}', "out_of_range", "total"),
    ('{"order_id": "b6", "region": "north", "total": "1.234", "ordered_at": "2026-11-20T09:00:00Z"}',
     "too_many_decimals", "total"),
    ('{"order_id": "b7", "region": "north", "total": true, "ordered_at": "2026-11-20T09:00:00Z"}', "wrong_type", "total"),
    ('{"order_id": "b8", "region": "north", "total": 2, "ordered_at": "2026-11-20T09:00:00"}',
     "invalid_timestamp", "ordered_at"),
    ('{"order_id": "b9", "region": "north", "total": 2, "ordered_at": "2999-01-01T00:00:00Z"}',
     "out_of_range", "ordered_at"),
    ('["not", "an", "object"]', "not_object", None),
]


def _expected(events: list[dict]) -> tuple[dict, dict]:
    """Both declared queries over `events` (accepted, each once), in Python."""
    per_region: dict = {}
    coupon_rows: dict = defaultdict(lambda: {"with_coupon": 0, "sum": Decimal(0), "n": 0, "latest": None, "first": None})
    for e in events:
        region, total = e["region"].strip(), Decimal(str(e["total"]))
        at = datetime.fromisoformat(e["ordered_at"].replace("Z", "+00:00"))
        row = per_region.setdefault(region, {"orders": 0, "revenue": Decimal(0), "largest_order": total,
                                             "first_order_at": at})
        row["orders"] += 1
        row["revenue"] += total
        row["largest_order"] = max(row["largest_order"], total)
        row["first_order_at"] = min(row["first_order_at"], at)
        c = coupon_rows[(region, e.get("coupon"))]
        c["with_coupon"] += "coupon" in e
        c["sum"] += total
        c["n"] += 1
        if c["latest"] is None or at > c["latest"][0]:
            c["latest"] = (at, total)
        if c["first"] is None or at < c["first"][0]:
            c["first"] = (at, e["order_id"])
    coupons = {}
    for key, c in coupon_rows.items():
        # Spark's AVG of a DECIMAL(18,2): the exact sum divided at scale 12, then kept as DECIMAL(22,6)
        average = (c["sum"] / c["n"]).quantize(Decimal("1e-12"), ROUND_HALF_UP).quantize(Decimal("1e-6"), ROUND_HALF_UP)
        coupons[key] = {"with_coupon": c["with_coupon"], "average_total": average, "latest_total": c["latest"][1],
                        "first_order": c["first"][1]}
    return per_region, coupons


def _rows(layout, table: str, keys: tuple[str, ...]) -> dict:
    rows = IndependentDeltaTable(str(layout.table(table))).to_pyarrow_table().to_pylist()
    out = {}
    for row in rows:
        key = tuple(row.pop(k) for k in keys)
        assert key not in out, f"{table}: key {key} twice"
        row.pop("updated_at")
        for name in [n for n in row if n.startswith("_")]:
            row.pop(name)
        for name, value in row.items():
            if isinstance(value, datetime):
                row[name] = value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value
        out[key if len(keys) > 1 else key[0]] = row
    return out


def _quarantined(layout) -> list[tuple]:
    rows = IndependentDeltaTable(str(layout.table("orders_quarantine"))).to_pyarrow_table().to_pylist()
    return [(q["raw_line"], q["reason"], q["reason_field"]) for q in rows]


def _write(landing, name: str, lines: list[str]) -> None:
    landing.write("orders", name, lines)


def test_declared_stream_two_runs_refresh_and_a_new_table(spark, layout, landing, tmp_path, monkeypatch):
    project_file = tmp_path / "statetables.yaml"
    project_file.write_text(EXAMPLE)
    monkeypatch.setenv(PROJECT_ENV, str(project_file))
    assert [t.name for t in project().stream("orders").state_tables] == ["orders_per_region"]
    run = lambda: advance_stream(spark, layout, project().stream("orders"), StreamSettings(event_time=False))  # noqa: E731

    first, second = _events(0, 120), _events(120, 80)
    _write(landing, "2026/11/20/a.jsonl", [json.dumps(e) for e in first] + [line for line, _, _ in BAD[:5]])
    _write(landing, "b.jsonl", [json.dumps(e) for e in second] + [line for line, _, _ in BAD[5:]])
    run()

    accepted = first + second
    per_region, _ = _expected(accepted)
    assert _rows(layout, "orders_per_region", ("region",)) == per_region
    assert sorted(_quarantined(layout)) == sorted(BAD)
    assert IndependentDeltaTable(str(layout.table("orders_bronze"))).to_pyarrow_table().num_rows == len(accepted)

    # A changed aggregate is refused until the table is refreshed; then the table holds the new definition.
    changed_example = EXAMPLE.replace("MAX(total) AS largest_order", "MAX(total) AS largest_order, "
                                      "SUM(total) AS revenue_again")
    project_file.write_text(changed_example)
    # ... when the code location loads (read from the table's log, no Spark) and when a run starts:
    changed = changed_definitions(layout, project().state_tables)
    assert len(changed) == 1 and "statetables refresh orders_per_region" in changed[0]
    with pytest.raises(DefinitionChangedError, match=r"orders_per_region.*statetables refresh orders_per_region"):
        run()
    spec = project().stream("orders")
    figures = refresh_state_table(spark, layout, spec, spec.state_tables[0])
    assert figures["keys"] == len(per_region)
    refreshed = _rows(layout, "orders_per_region", ("region",))
    assert refreshed == {k: {**v, "revenue_again": v["revenue"]} for k, v in per_region.items()}

    # A table added to an existing stream is built from its bronze; later events reach every table (one in a group
    # no earlier event had), and lines delivered again in the later run count once in each.
    project_file.write_text(changed_example + COUPONS)
    assert [t.name for t in project().stream("orders").state_tables] == ["orders_per_region", "coupon_use"]
    third = _events(200, 30) + [{"order_id": "o-new", "region": "north", "total": "12.34",
                                 "ordered_at": _iso(T0 + timedelta(days=1)), "coupon": "c-new"}]
    reused = dict(first[3], total="999.99")  # an accepted id with other content
    _write(landing, "c.jsonl", [json.dumps(e) for e in third] + [json.dumps(first[7]), json.dumps(second[8]),
                                                                  json.dumps(reused)])
    run()
    everything = accepted + third
    per_region, coupons = _expected(everything)
    assert _rows(layout, "orders_per_region", ("region",)) == {k: {**v, "revenue_again": v["revenue"]}
                                                               for k, v in per_region.items()}
    assert _rows(layout, "coupon_use", ("region", "coupon")) == coupons
    assert ("north", "c-new") in coupons
    assert sorted(_quarantined(layout)) == sorted([*BAD, (json.dumps(reused), "conflicting_duplicate", "order_id")])
    assert IndependentDeltaTable(str(layout.table("orders_bronze"))).to_pyarrow_table().num_rows == len(everything)


REFUSED = [
    ("SELECT region, COUNT(*) AS n FROM orders o JOIN orders p ON o.order_id = p.order_id GROUP BY region",
     "a join cannot be kept incrementally"),
    ("SELECT region, coupon, COUNT(*) AS n FROM orders GROUP BY region", "`coupon` is neither grouped nor aggregated"),
    ("SELECT region, COUNT(DISTINCT coupon) AS n FROM orders GROUP BY region", "DISTINCT cannot be kept incrementally"),
    ("SELECT region, COUNT(*) AS n FROM orders GROUP BY region HAVING COUNT(*) > 1", "a HAVING cannot be kept"),
    ("SELECT region, SUM(amount) AS n FROM orders GROUP BY region", "unknown column 'amount'"),
    ("SELECT region, COUNT(*) AS n FROM shipments GROUP BY region", "FROM shipments: no such stream"),
    ("SELECT region, COUNT(*) FROM orders GROUP BY region", "needs a column name: add `AS name`"),
    ("SELECT region, SUM(region) AS n FROM orders GROUP BY region", "SUM needs a decimal or integer"),
    ("SELECT region, COUNT(*) AS n FROM orders", "no GROUP BY"),
    ("SELECT region, percentile(total, 0.5) AS p FROM orders GROUP BY region", "not an aggregate the table can merge"),
]


@pytest.mark.parametrize("select, message", REFUSED)
def test_sql_that_cannot_be_kept_incrementally_fails_the_load_naming_the_line(select, message):
    text = EXAMPLE.split("state_tables:")[0] + "state_tables:\n  - CREATE TABLE t AS " + select + "\n"
    with pytest.raises(ConfigurationError) as raised:
        load_project(text, Path("project.yaml"))
    assert message in str(raised.value)
    assert re.match(r"project.yaml:13:\d+: ", str(raised.value)) and "Fix:" in str(raised.value)


SMALL_STREAM = """\
streams:
  s:
    id: i
    event_time: t
    fields:
      i: {type: string}
      t: {type: timestamp}
"""


@pytest.mark.parametrize("fields, message", [
    ("      total: {type: money}", "type 'money' is not one of"),
    ("      total: {type: string, min: 0}", "`min` does not apply to a string"),
    ("      total: {type: decimal, min: 0, min_exclusive: 0}", "both `min` and `min_exclusive`"),
    ("      total: {type: decimal, required: maybe}", "is not true or false"),
])
def test_bad_field_declarations_fail_the_load(fields, message):
    text = SMALL_STREAM + fields + "\n"
    with pytest.raises(ConfigurationError, match=message):
        load_project(text, Path("p.yaml"))


def test_the_shipped_project_declares_the_contract_streams_as_before():
    from pipelines.declare.project import SHIPPED
    from pipelines.state.tables import state_schema

    shipped = project(SHIPPED)
    (sold,) = shipped.stream("movie_ticket_sales").state_tables
    assert [(f.name, f.dataType.simpleString(), f.nullable) for f in state_schema(sold)] == [
        ("title", "string", False), ("tickets_sold", "bigint", False), ("total_ticket_value", "decimal(28,2)", False),
        ("first_sale_ts", "timestamp", True), ("last_sale_ts", "timestamp", True), ("updated_at", "timestamp", True)]
    payments = shipped.stream("payments")
    amount = payments.field("amount")
    assert (amount.min_value, amount.min_inclusive) == ("0", False)
    assert payments.value_field == "amount"
    # The event-time tables, declared by SQL, with the columns they have always had.
    from pipelines.event_time.watermark import output_schema, top_schema
    (hourly,), (activity,) = shipped.stream("movie_ticket_sales").event_time_tables, payments.event_time_tables
    columns = lambda schema: [(f.name, f.dataType.simpleString()) for f in schema]  # noqa: E731
    assert columns(output_schema(hourly)) == [
        ("title", "string"), ("window_start", "timestamp"), ("window_end", "timestamp"), ("tickets_sold", "bigint"),
        ("total_ticket_value", "decimal(28,2)")]
    assert columns(top_schema(hourly.tops[0], hourly)) == [
        ("window_start", "timestamp"), ("window_end", "timestamp"), ("rank", "bigint"), ("title", "string"),
        ("tickets_sold", "bigint")]
    assert columns(output_schema(activity)) == [
        ("customer_id", "string"), ("session_start", "timestamp"), ("session_end", "timestamp"),
        ("payment_count", "bigint"), ("total_amount", "decimal(28,2)"), ("last_payment_ids", "array<string>"),
        ("previous_session_end", "timestamp"), ("day_amount", "decimal(28,2)")]
    assert (hourly.size, hourly.tops[0].n, activity.size, activity.ttl) == (
        timedelta(hours=1), 10, timedelta(minutes=30), timedelta(days=30))
    assert payments.watermark_delay == shipped.stream("movie_ticket_sales").watermark_delay == timedelta(minutes=10)


KAFKA_STREAM = SMALL_STREAM + "      v: {type: decimal}\n"


def test_a_stream_read_from_a_topic_and_a_table_published_to_one(monkeypatch):
    text = KAFKA_STREAM.replace("    id: i\n", "    id: i\n    source: {topic: s.events, max_records_per_batch: 500}\n") + \
        "state_tables:\n  - changelog_topic: s-per-i\n    sql: CREATE TABLE per_i AS SELECT i, SUM(v) AS total FROM s GROUP BY i\n" \
        "kafka: {bootstrap_servers: 'broker-a:9092'}\n"
    monkeypatch.delenv("STATETABLES_KAFKA_BOOTSTRAP_SERVERS", raising=False)
    spec = load_project(text, Path("p.yaml")).stream("s")
    assert (spec.topic.topic, spec.topic.servers, spec.topic.max_records_per_batch) == ("s.events", "broker-a:9092", 500)
    assert spec.state_tables[0].changelog_topic.topic == "s-per-i"
    # One project file, several deployments: the environment names the brokers.
    monkeypatch.setenv("STATETABLES_KAFKA_BOOTSTRAP_SERVERS", "broker-b:9092")
    assert spec.topic.servers == "broker-b:9092"
    # The default source is the landing folder, said or not.
    folder = load_project(KAFKA_STREAM.replace("    id: i\n", "    id: i\n    source: {landing: folder}\n"),
                          Path("p.yaml")).stream("s")
    assert folder.topic is None


@pytest.mark.parametrize("source, message", [
    ("{topic: 'a b'}", "is not a Kafka topic name"),
    ("{topic: t, landing: folder}", "names both a topic and the landing folder"),
    ("{}", "names neither a topic nor the landing folder"),
    ("{topic: t, max_records_per_batch: 0}", "max_records_per_batch 0"),
    ("{landing: s3}", "landing 's3'"),
    ("{topic: t, group: g}", "unknown setting 'group'"),
])
def test_a_bad_source_fails_the_load_naming_the_fix(source, message):
    text = KAFKA_STREAM.replace("    id: i\n", f"    id: i\n    source: {source}\n")
    with pytest.raises(ConfigurationError, match=message) as raised:
        load_project(text, Path("p.yaml"))
    assert "Fix:" in str(raised.value)


def test_a_topic_without_brokers_fails_naming_the_fix(monkeypatch):
    monkeypatch.delenv("STATETABLES_KAFKA_BOOTSTRAP_SERVERS", raising=False)
    spec = load_project(KAFKA_STREAM.replace("    id: i\n", "    id: i\n    source: {topic: t}\n"),
                        Path("p.yaml")).stream("s")
    with pytest.raises(ConfigurationError, match="has no brokers.*Fix: add `kafka: {bootstrap_servers"):
        spec.topic.servers
