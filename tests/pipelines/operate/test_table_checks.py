"""The per-run checks of a state table find what they look for: a key held twice, a negative count.
Their figures come from one scan per table version, shared by the run's materialization and its checks; a new
version is scanned again, so a table changed behind the pipeline's back is seen by the next check. A table of up to
SCANNED_IN_PROCESS_ROWS rows is scanned by delta-rs in the driver's process, a larger one by Spark: both give the same
figures. So do the newest rows of an event-time table shown after a run, read in the run's process by DataFusion
or page by page."""

from __future__ import annotations

import datetime as dt

from pipelines.ingest.generate import generate
from pipelines.operate import table_checks
from pipelines.storage.delta_sql import table_ref
from tests.streams import PAYMENTS, advance

TABLE = PAYMENTS.state_tables[0]


def test_per_run_checks_find_duplicated_and_negative_rows(spark, layout, monkeypatch):
    generate(PAYMENTS, layout.landing(PAYMENTS.name), events=200, seed=7, customers=20)
    advance(spark, layout, PAYMENTS, event_time=False)
    clean = table_checks.state_totals(spark, layout, PAYMENTS, TABLE)
    assert clean["keys"] == 20 and clean["events_counted"] > 0
    assert table_checks.duplicated_or_null_keys(spark, layout, PAYMENTS, TABLE)[0] == 0
    assert table_checks.negative_rows(spark, layout, PAYMENTS, TABLE)[0] == 0

    # Behind the pipeline's back: a key's row copied, a count made negative.
    ref = table_ref(layout.table(TABLE.name))
    keys = [r["customer_id"] for r in spark.read.format("delta").load(str(layout.table(TABLE.name)))
            .orderBy("customer_id").collect()]
    key = keys[0]
    spark.sql(f"INSERT INTO {ref} SELECT * FROM {ref} WHERE customer_id = '{key}'")
    spark.sql(f"UPDATE {ref} SET payment_count = -1 WHERE customer_id = '{keys[-1]}'")

    duplicated, which = table_checks.duplicated_or_null_keys(spark, layout, PAYMENTS, TABLE)
    assert duplicated == 1 and [r["customer_id"] for r in which.collect()] == [key]
    negative, rows = table_checks.negative_rows(spark, layout, PAYMENTS, TABLE)
    assert negative == 1 and rows.count() == 1
    assert table_checks.state_totals(spark, layout, PAYMENTS, TABLE)["keys"] == 21

    # The same figures, top rows included, from Spark's scan of the table (too many rows for delta-rs).
    in_process = table_checks.state_totals(spark, layout, PAYMENTS, TABLE)
    table_checks._SCANS.clear()
    monkeypatch.setattr(table_checks, "SCANNED_IN_PROCESS_ROWS", 0)
    assert table_checks.state_totals(spark, layout, PAYMENTS, TABLE) == in_process
    assert table_checks.duplicated_or_null_keys(spark, layout, PAYMENTS, TABLE)[0] == 1
    assert table_checks.negative_rows(spark, layout, PAYMENTS, TABLE)[0] == 1
    # The largest counts first, then by key: the copied key's two rows side by side, the -1 row not among them.
    rows = spark.read.format("delta").load(str(layout.table(TABLE.name))).collect()
    def shown(r):
        return -r["payment_count"], r["customer_id"], r["total_amount"]
    assert [shown(r) for r in in_process["top_rows"]] == sorted(map(shown, rows))[:table_checks.TOP_ROWS]


def test_newest_rows_of_a_session_table_read_by_datafusion_or_page_by_page(spark, layout, monkeypatch):
    """The newest rows shown after a run, read in the run's process: by DataFusion for a table whose candidate files
    hold few rows, page by page for more (NEWEST_IN_PROCESS_ROWS): the same rows, newest first, with or without a
    recent bound."""
    generate(PAYMENTS, layout.landing(PAYMENTS.name), events=600, seed=11, customers=40, events_per_file=200)
    advance(spark, layout, PAYMENTS, max_files_per_trigger=1)
    sessions = PAYMENTS.event_time_tables[0]
    path, order = layout.table(sessions.name), "session_start"
    every = sorted((r.asDict() for r in spark.read.format("delta").load(str(path)).collect()),
                   key=lambda r: r[order], reverse=True)
    assert len(every) > 2 * table_checks.TOP_ROWS
    middle = int(every[table_checks.TOP_ROWS + 3][order].replace(tzinfo=dt.timezone.utc).timestamp() * 1000)
    newest = int(every[2][order].replace(tzinfo=dt.timezone.utc).timestamp() * 1000)

    def read(since):
        rows = [{k: table_checks._naive_utc(v) for k, v in r.items()}
                for r in table_checks.newest_rows(path, order, since)]
        assert [r[order] for r in rows] == sorted((r[order] for r in rows), reverse=True)
        return rows

    # A bound that leaves fewer rows than asked for reads them all; none at all, too.
    in_process = {since: read(since) for since in (None, middle, newest)}
    assert all(rows == every[:table_checks.TOP_ROWS] for rows in in_process.values())
    monkeypatch.setattr(table_checks, "NEWEST_IN_PROCESS_ROWS", 0)
    assert {since: read(since) for since in in_process} == in_process
