"""Landing lines → bronze / quarantine through the real streaming ingest (Spark + Delta, no Dagster).

Covers: every malformed kind of the contract with its reason, type coercion caught, unknown
fields accepted, re-deliveries counted once (same batch and across runs), conflicting ids
quarantined, a replayed ingest batch not written twice. Not covered here: state tables (test_state_tables).
"""

from __future__ import annotations

from decimal import Decimal

import shutil

from pyspark.sql import functions as F

from tests.streams import MOVIE_TICKET_SALES, PAYMENTS
from tests.streams import advance

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

    result = advance(spark, layout, MOVIE_TICKET_SALES, event_time=False)

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
    user = result.commits[MOVIE_TICKET_SALES.bronze_table][-1]["user"]
    assert user.pop("app_id").startswith("statetables/movie_ticket_sales/")
    # running totals of bronze after this commit (what the per-run state check compares with)
    expected_total = str(sum(Decimal(str(r["ticket_total_value"])) for r in bronze.values()))
    assert user == {"batch_id": 0, "files": 1, "lines": len(lines), "accepted": 3,
                    "quarantined": len(MALFORMED), "duplicates": 0, "already_ingested": 0, "unprocessable": 0,
                    "files_vanished": [], "accepted_total": 3, "accepted_value_total": expected_total}


def test_redeliveries_count_once_and_conflicting_ids_are_quarantined(spark, layout, landing):
    conflict = GOOD.replace("12.50", "99.00")
    landing.write("movie_ticket_sales", "a.jsonl", [GOOD % "e1", GOOD % "e2", GOOD % "e1", conflict % "e2"])
    advance(spark, layout, MOVIE_TICKET_SALES, event_time=False)
    # second delivery: a re-delivery and a conflict of ids accepted in the first run, and one new id
    landing.write("movie_ticket_sales", "b.jsonl", [GOOD % "e1", conflict % "e1", GOOD % "e3"])
    result = advance(spark, layout, MOVIE_TICKET_SALES, event_time=False)

    bronze = _table(spark, layout, "movie_ticket_sales_bronze")
    assert sorted(r["event_id"] for r in bronze.collect()) == ["e1", "e2", "e3"]
    assert bronze.where("ticket_total_value != 12.50").count() == 0
    conflicts = _table(spark, layout, "movie_ticket_sales_quarantine").where(F.col("reason") == "conflicting_duplicate")
    assert sorted((r["record_id"], r["source_file"][-7:]) for r in conflicts.collect()) == [
        ("e1", "b.jsonl"), ("e2", "a.jsonl")]
    assert result.commits[MOVIE_TICKET_SALES.bronze_table][-1]["user"]["duplicates"] == 1


def test_payments_rules_amount_must_be_positive(spark, layout, landing):
    base = '{"payment_id":"%s","customer_id":"c1","amount":%s,"paid_at":"2026-11-01T10:00:00Z"}'
    landing.write("payments", "p.jsonl", [base % ("p1", "0"), base % ("p2", '"0.01"'), base % ("p3", "10")])
    advance(spark, layout, PAYMENTS, event_time=False)
    reasons = {r["record_id"]: r["reason"] for r in _table(spark, layout, "payments_quarantine").collect()}
    assert reasons == {"p1": "out_of_range"}
    assert _table(spark, layout, "payments_bronze").count() == 2


def test_replayed_ingest_batch_is_not_written_twice(spark, layout, landing):
    """A crash after the bronze commit but before the checkpoint commit replays the batch."""
    landing.write("movie_ticket_sales", "a.jsonl", [GOOD % "e1", "garbage", GOOD % "e2"])
    advance(spark, layout, MOVIE_TICKET_SALES, event_time=False)
    commit = layout.checkpoint(MOVIE_TICKET_SALES.name) / "commits" / "0"
    assert commit.exists()
    commit.unlink()  # as if the process died before Spark recorded the batch as done
    (commit.parent / ".0.crc").unlink(missing_ok=True)

    result = advance(spark, layout, MOVIE_TICKET_SALES, event_time=False)

    assert result.micro_batches == 1  # the batch really was replayed...
    assert _table(spark, layout, "movie_ticket_sales_bronze").count() == 2  # ...and wrote nothing twice
    assert _table(spark, layout, "movie_ticket_sales_quarantine").count() == 1
    assert result.versions[MOVIE_TICKET_SALES.bronze_table].before == result.versions[MOVIE_TICKET_SALES.bronze_table].after


def test_files_still_being_written_are_ignored(spark, layout, landing):
    folder = layout.landing("movie_ticket_sales")
    folder.mkdir(parents=True)
    (folder / "_partial.jsonl").write_text(GOOD % "hidden1" + "\n")
    (folder / ".partial.jsonl").write_text(GOOD % "hidden2" + "\n")
    landing.write("movie_ticket_sales", "done.jsonl", [GOOD % "visible"])
    advance(spark, layout, MOVIE_TICKET_SALES, event_time=False)
    assert [r["event_id"] for r in _table(spark, layout, "movie_ticket_sales_bronze").collect()] == ["visible"]
    shutil.move(folder / "_partial.jsonl", folder / "renamed.jsonl")
    advance(spark, layout, MOVIE_TICKET_SALES, event_time=False)
    assert _table(spark, layout, "movie_ticket_sales_bronze").count() == 2


# --- hostile input (issue 7): values, names, folders, changes; each case failed on the old code ---

PAY = '{"payment_id":"%s","customer_id":"c1","amount":%s,"paid_at":"%s"}'
TS = "2026-01-01T00:00:00Z"


def test_poison_values_are_quarantined_and_the_stream_goes_on(spark, layout, landing):
    poison = [
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
    valid = [PAY % ("ok1", "9999999999999999.99", TS), PAY % ("ok2", "1.5e1", "1970-01-01T00:00:00Z"),
             PAY % ("ok3", '"0.10000"', TS)]
    landing.write("payments", "poison.jsonl", [line for line, _ in poison] + valid)

    advance(spark, layout, PAYMENTS, event_time=False)

    reasons = {r["record_id"]: r["reason"] for r in _table(spark, layout, "payments_quarantine").collect()}
    assert reasons == {line.split('"')[3]: reason for line, reason in poison}
    bronze = {r["payment_id"]: str(r["amount"]) for r in _table(spark, layout, "payments_bronze").collect()}
    assert bronze == {"ok1": "9999999999999999.99", "ok2": "15.00", "ok3": "0.10"}
    # the next file of the stream is ingested: nothing is stuck
    landing.write("payments", "next.jsonl", [PAY % ("after", "1", TS)])
    advance(spark, layout, PAYMENTS, event_time=False)
    assert _table(spark, layout, "payments_bronze").where("payment_id = 'after'").count() == 1


ODD_NAMES = ["2026-01-01T00:00:00.jsonl", "x [x].jsonl", "{a,b}.jsonl", "star*.jsonl", "what?.jsonl",
             "100%.jsonl", "sp ace.jsonl", "plus+sign.jsonl", "ünï.jsonl"]


def test_any_file_name_and_date_folders_and_gzip_are_read_once(spark, layout, landing):
    import gzip

    for n, name in enumerate(ODD_NAMES):
        landing.write("payments", name, [PAY % (f"odd{n}", "1", TS), "not json"])
    landing.write("payments", "plain.jsonl", [PAY % ("plain1", "1", TS), PAY % ("plain2", "1", TS)])
    landing.write("payments", "2026/11/22/deep.jsonl", [PAY % ("deep", "1", TS)])
    landing.write("payments", "a/b/c/d/e/deeper.jsonl", [PAY % ("deeper", "1", TS)])
    folder = layout.landing("payments")
    (folder / "zipped.jsonl.gz").write_bytes(gzip.compress((PAY % ("gz", "1", TS) + "\n").encode()))
    (folder / "_tmp").mkdir()
    (folder / "_tmp" / "inflight.jsonl").write_text(PAY % ("hidden", "1", TS) + "\n")
    (folder / "notes.txt").write_text(PAY % ("txt", "1", TS) + "\n")

    result = advance(spark, layout, PAYMENTS, event_time=False)

    bronze = _table(spark, layout, "payments_bronze").collect()
    ids = sorted(r["payment_id"] for r in bronze)
    assert ids == sorted([f"odd{n}" for n in range(len(ODD_NAMES))] + ["plain1", "plain2", "deep", "deeper", "gz"])
    assert {r["source_file"] for r in bronze} >= {str(folder / name) for name in ODD_NAMES}
    quarantine = _table(spark, layout, "payments_quarantine").collect()
    assert sorted((r["source_file"], r["line_number"]) for r in quarantine) == sorted(
        (str(folder / name), 2) for name in ODD_NAMES)
    user = result.commits[PAYMENTS.bronze_table][-1]["user"]
    assert (user["lines"], user["accepted"], user["quarantined"], user["duplicates"]) == (
        2 * len(ODD_NAMES) + 5, len(ODD_NAMES) + 5, len(ODD_NAMES), 0)


def test_appended_lines_are_ingested_and_a_rewritten_file_is_its_next_version(spark, layout, landing):
    appended = landing.write("payments", "grows.jsonl", [PAY % ("g1", "1", TS)])
    rewritten = landing.write("payments", "redo.jsonl", [PAY % ("r1", "1", TS), PAY % ("r2", "2", TS)])
    advance(spark, layout, PAYMENTS, event_time=False)

    with open(appended, "a") as handle:
        handle.write(PAY % ("g2", "1", TS) + "\nbroken\n")
    rewritten.unlink()
    rewritten.write_text("\n".join([PAY % ("r1", "1", TS), PAY % ("r2", "5", TS), PAY % ("r3", "3", TS)]) + "\n")
    result = advance(spark, layout, PAYMENTS, event_time=False)

    assert sorted((c["file"], c["change"], c["version"]) for c in result.changed_files) == [
        (str(appended), "appended", 1), (str(rewritten), "rewritten", 2)]
    bronze = {r["payment_id"]: (r["source_file"], r["line_number"]) for r in _table(spark, layout, "payments_bronze").collect()}
    assert bronze == {"g1": (str(appended), 1), "g2": (str(appended), 2), "r1": (str(rewritten), 1),
                      "r2": (str(rewritten), 2), "r3": (f"{rewritten}#v2", 3)}
    quarantine = sorted((r["source_file"], r["line_number"], r["reason"])
                        for r in _table(spark, layout, "payments_quarantine").collect())
    assert quarantine == [(str(appended), 3, "not_json"), (f"{rewritten}#v2", 2, "conflicting_duplicate")]
    user = result.commits[PAYMENTS.bronze_table][-1]["user"]
    assert (user["lines"], user["accepted"], user["quarantined"], user["duplicates"]) == (5, 2, 2, 1)
    # nothing changed since: nothing is read again
    assert advance(spark, layout, PAYMENTS, event_time=False).changed_files == []
    assert _table(spark, layout, "payments_bronze").count() == 5


def test_missing_optional_field_differs_from_a_nul_character(spark, layout, landing):
    base = '{"event_id":"e1","title":"Dune","ticket_total_value":1,"sale_ts":"2026-11-01T10:00:00Z"%s}'
    landing.write("movie_ticket_sales", "a.jsonl", [base % ""])
    landing.write("movie_ticket_sales", "b.jsonl", [base % ',"customer_id":"\\u0000"', base % ""])
    advance(spark, layout, MOVIE_TICKET_SALES, event_time=False)
    result = advance(spark, layout, MOVIE_TICKET_SALES, event_time=False)
    quarantine = _table(spark, layout, "movie_ticket_sales_quarantine").collect()
    assert [(r["source_file"][-7:], r["reason"]) for r in quarantine] == [("b.jsonl", "conflicting_duplicate")]
    assert _table(spark, layout, "movie_ticket_sales_bronze").count() == 1


def test_timestamps_are_written_as_int64_for_every_reader(spark, layout, landing):
    import deltalake
    import pyarrow.parquet as pq

    landing.write("payments", "a.jsonl", [PAY % ("p1", "1", "1970-01-01T00:00:00Z")])
    advance(spark, layout, PAYMENTS, event_time=False)
    path = layout.table("payments_bronze")
    for data_file in path.glob("*.parquet"):
        column = pq.ParquetFile(data_file).metadata.schema.column(
            pq.ParquetFile(data_file).schema_arrow.get_field_index("paid_at"))
        assert column.physical_type == "INT64"
    assert deltalake.DeltaTable(str(path)).to_pyarrow_table().column("paid_at").to_pylist()[0].year == 1970


def test_a_line_that_fails_the_engine_is_isolated_as_unprocessable(spark, layout, landing, tmp_path, monkeypatch):
    """Last resort: a line that makes Spark itself fail (injected: as an engine bug would) is found by
    bisection and quarantined with reason `unprocessable` and the error; the rest of the batch goes on."""
    from pipelines.faults import FAULTS_ENV, INGEST_POISON, arm

    faults = tmp_path / "faults"
    arm(faults, INGEST_POISON, "poison POISON-7")
    monkeypatch.setenv(FAULTS_ENV, str(faults))
    landing.write("payments", "a.jsonl", [PAY % (f"p{n}", "1", TS) for n in range(6)]
                  + ['{"payment_id":"POISON-7","customer_id":"c1","amount":1,"paid_at":"%s"}' % TS]
                  + [PAY % (f"q{n}", "1", TS) for n in range(3)])
    landing.write("payments", "b.jsonl", [PAY % ("b1", "1", TS)])

    result = advance(spark, layout, PAYMENTS, event_time=False)

    quarantine = _table(spark, layout, "payments_quarantine").collect()
    assert [(r["source_file"][-7:], r["line_number"], r["reason"]) for r in quarantine] == [
        ("a.jsonl", 7, "unprocessable")]
    assert "POISON-7" in quarantine[0]["detail"] and quarantine[0]["raw_bytes"].startswith(b'{"payment_id":"POISON-7"')
    assert _table(spark, layout, "payments_bronze").count() == 10
    user = result.commits[PAYMENTS.bronze_table][-1]["user"]
    assert (user["lines"], user["accepted"], user["quarantined"], user["unprocessable"]) == (11, 10, 1, 1)
