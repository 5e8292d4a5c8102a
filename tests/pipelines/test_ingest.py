"""Landing lines → bronze / quarantine through the real streaming ingest (Spark + Delta, no Dagster).

Covers: every malformed kind of the contract with its reason, type coercion caught, unknown
fields accepted, re-deliveries counted once (same batch and across runs), conflicting ids
quarantined, a replayed ingest batch not written twice. Not covered here: state tables (test_state_tables).
"""

from __future__ import annotations

import shutil

from pyspark.sql import functions as F

from pipelines.bronze import ingest_stream
from pipelines.streams import MOVIE_TICKET_SALES, PAYMENTS

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
]

VALID = [
    GOOD % "ok1",
    # numeric string, offset timestamp, unknown extra field, optional customer_id, padded title
    '{"event_id":"ok2","title":"  Dune ","ticket_total_value":"7.5","sale_ts":"2026-11-01T11:00:00.123+01:00",'
    '"customer_id":"c1","promo":{"code":"X"}}',
    '{"event_id":"ok3","title":"Heat","ticket_total_value":0,"sale_ts":"2026-11-01T10:00:00+0200"}',
]


def _table(spark, layout, name):
    return spark.read.format("delta").load(str(layout.table(name)))


def test_every_malformed_kind_is_quarantined_with_its_reason(spark, layout, landing):
    lines = [line for line, _, _ in MALFORMED] + VALID
    landing.write("movie_ticket_sales", "mixed.jsonl", lines)

    result = ingest_stream(spark, layout, MOVIE_TICKET_SALES)

    quarantine = {r["line_number"]: r for r in _table(spark, layout, "movie_ticket_sales_quarantine").collect()}
    for number, (line, reason, field) in enumerate(MALFORMED, start=1):
        row = quarantine[number]
        assert (row["reason"], row["reason_field"]) == (reason, field), f"line {number}: {line!r}"
        assert row["raw_bytes"] == (line if isinstance(line, bytes) else line.encode())
        assert row["source_file"].endswith("mixed.jsonl")
    assert len(quarantine) == len(MALFORMED)

    bronze = {r["event_id"]: r for r in _table(spark, layout, "movie_ticket_sales_bronze").collect()}
    assert set(bronze) == {"ok1", "ok2", "ok3"}
    assert bronze["ok2"]["title"] == "Dune"
    assert str(bronze["ok2"]["ticket_total_value"]) == "7.50"
    assert bronze["ok2"]["customer_id"] == "c1"
    user = result.commits["bronze"][-1]["user"]
    assert user.pop("app_id").startswith("statetables/movie_ticket_sales_ingest/")
    assert user == {"batch_id": 0, "files": 1, "lines": len(lines), "accepted": 3,
                    "quarantined": len(MALFORMED), "duplicates": 0, "already_ingested": 0}


def test_redeliveries_count_once_and_conflicting_ids_are_quarantined(spark, layout, landing):
    conflict = GOOD.replace("12.50", "99.00")
    landing.write("movie_ticket_sales", "a.jsonl", [GOOD % "e1", GOOD % "e2", GOOD % "e1", conflict % "e2"])
    ingest_stream(spark, layout, MOVIE_TICKET_SALES)
    # second delivery: a re-delivery and a conflict of ids accepted in the first run, and one new id
    landing.write("movie_ticket_sales", "b.jsonl", [GOOD % "e1", conflict % "e1", GOOD % "e3"])
    result = ingest_stream(spark, layout, MOVIE_TICKET_SALES)

    bronze = _table(spark, layout, "movie_ticket_sales_bronze")
    assert sorted(r["event_id"] for r in bronze.collect()) == ["e1", "e2", "e3"]
    assert bronze.where("ticket_total_value != 12.50").count() == 0
    conflicts = _table(spark, layout, "movie_ticket_sales_quarantine").where(F.col("reason") == "conflicting_duplicate")
    assert sorted((r["record_id"], r["source_file"][-7:]) for r in conflicts.collect()) == [
        ("e1", "b.jsonl"), ("e2", "a.jsonl")]
    assert result.commits["bronze"][-1]["user"]["duplicates"] == 1


def test_payments_rules_amount_must_be_positive(spark, layout, landing):
    base = '{"payment_id":"%s","customer_id":"c1","amount":%s,"paid_at":"2026-11-01T10:00:00Z"}'
    landing.write("payments", "p.jsonl", [base % ("p1", "0"), base % ("p2", '"0.01"'), base % ("p3", "10")])
    ingest_stream(spark, layout, PAYMENTS)
    reasons = {r["record_id"]: r["reason"] for r in _table(spark, layout, "payments_quarantine").collect()}
    assert reasons == {"p1": "out_of_range"}
    assert _table(spark, layout, "payments_bronze").count() == 2


def test_replayed_ingest_batch_is_not_written_twice(spark, layout, landing):
    """A crash after the bronze commit but before the checkpoint commit replays the batch."""
    landing.write("movie_ticket_sales", "a.jsonl", [GOOD % "e1", "garbage", GOOD % "e2"])
    ingest_stream(spark, layout, MOVIE_TICKET_SALES)
    commit = layout.checkpoint(MOVIE_TICKET_SALES.ingest_query) / "commits" / "0"
    assert commit.exists()
    commit.unlink()  # as if the process died before Spark recorded the batch as done
    (commit.parent / ".0.crc").unlink(missing_ok=True)

    result = ingest_stream(spark, layout, MOVIE_TICKET_SALES)

    assert result.micro_batches == 1  # the batch really was replayed...
    assert _table(spark, layout, "movie_ticket_sales_bronze").count() == 2  # ...and wrote nothing twice
    assert _table(spark, layout, "movie_ticket_sales_quarantine").count() == 1
    assert result.versions["bronze"].before == result.versions["bronze"].after


def test_files_still_being_written_are_ignored(spark, layout, landing):
    folder = layout.landing("movie_ticket_sales")
    folder.mkdir(parents=True)
    (folder / "_partial.jsonl").write_text(GOOD % "hidden1" + "\n")
    (folder / ".partial.jsonl").write_text(GOOD % "hidden2" + "\n")
    landing.write("movie_ticket_sales", "done.jsonl", [GOOD % "visible"])
    ingest_stream(spark, layout, MOVIE_TICKET_SALES)
    assert [r["event_id"] for r in _table(spark, layout, "movie_ticket_sales_bronze").collect()] == ["visible"]
    shutil.move(folder / "_partial.jsonl", folder / "renamed.jsonl")
    ingest_stream(spark, layout, MOVIE_TICKET_SALES)
    assert _table(spark, layout, "movie_ticket_sales_bronze").count() == 2
