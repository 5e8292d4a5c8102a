"""`statetables status` (pipelines/operate/status.py) and the line each micro-batch logs (`statetables.progress`).

Covers, on real Spark + Delta: a sales stream run once, then one more landing file; the status names that file as
pending, gives the last batch's counts as written, the quarantine by reason, positive table versions, the state
table folded through bronze's version and its changelog not yet published, and the writer lock's last holder; it
creates no table.
The progress line of the batch carries its counts. The command's `--json` on an untouched storage root (a
subprocess: exit 0, valid JSON, nothing created, no JVM needed), and a held lock named by pid and host. Marked
long (two more cold micro-batches through the windows step): the last of two batches, the watermark, late events.
Not covered: Spark Connect health against a live server (tests/test_engines.py starts servers), Dagster's capture
of the line (it is the stderr a step's compute log captures).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pipelines.operate.status import render, storage_status
from pipelines.runtime.locks import lock_state, writer_lock
from pipelines.storage.delta_log import table_version
from pipelines.storage.layout import StorageLayout
from tests.conftest import Landing
from tests.streams import MOVIE_TICKET_SALES, advance, batch_lines

SALE = '{"event_id":"%s","title":"%s","ticket_total_value":%s,"sale_ts":"2026-11-01T%s:00Z"}'
FIRST = [SALE % ("s1", "Dune", "12.50", "12:05"), SALE % ("s2", "Heat", "10.00", "12:20"),
         SALE % ("s3", "Dune", "7.50", "12:40"), "not json",
         '{"title":"Dune","ticket_total_value":1,"sale_ts":"2026-11-01T12:00:00Z"}']  # missing event_id
SECOND = [SALE % ("s4", "Dune", "9.00", "13:30"),
          SALE % ("s5", "Heat", "8.00", "10:00"),  # behind the watermark the first batch left (12:30): late
          SALE % ("s1", "Dune", "12.50", "12:05"),  # re-delivered: a duplicate
          "{broken"]
SPECS = {MOVIE_TICKET_SALES.name: MOVIE_TICKET_SALES}


def _run(spark, layout: StorageLayout, **settings) -> list[logging.LogRecord]:
    """The sales stream run over FIRST and SECOND; the progress records of the run. Then a third file lands."""
    landing = Landing(layout)
    landing.write(MOVIE_TICKET_SALES.name, "2026/11/01/a.jsonl", FIRST)
    landing.write(MOVIE_TICKET_SALES.name, "2026/11/01/b.jsonl", SECOND)
    with batch_lines() as records:
        advance(spark, layout, MOVIE_TICKET_SALES, **settings)
    landing.write(MOVIE_TICKET_SALES.name, "2026/11/02/c.jsonl", [SALE % ("s6", "Dune", "1.00", "14:00")])
    return records


@pytest.fixture(scope="module")
def ran(spark, tmp_path_factory):
    """Both files in one micro-batch, without the windows step (each costs a cold JVM half a minute and more):
    (layout, progress records)."""
    layout = StorageLayout.under(tmp_path_factory.mktemp("status") / "home")
    return layout, _run(spark, layout, event_time=False)


def _read_only(spark, layout: StorageLayout):
    """Each table's version, to compare before and after a status."""
    return {p.name: table_version(spark, p) for p in sorted(layout.tables_root.iterdir())}


def test_each_micro_batch_logs_one_line_with_its_counts(ran):
    _, records = ran
    assert len(records) == 1
    figures = records[0].figures
    assert (figures["batch"], figures["lines"], figures["accepted"], figures["quarantined"],
            figures["duplicates"]) == (0, 9, 5, 3, 1)
    assert figures["elapsed_s"] > 0 and figures["rows_per_s"] > 0
    line = records[0].getMessage()
    assert line.startswith("stream=movie_ticket_sales batch=0 lines=9 accepted=5 quarantined=3 duplicates=1 "), line
    assert "rows_per_s=" in line and "elapsed_s=" in line
    # each step's seconds, which together are most of the batch
    steps = [figures[f"{step}_s"] for step in ("ingest", "state")]
    assert all(s > 0 for s in steps) and sum(steps) <= figures["elapsed_s"] + 0.01, figures
    assert "ingest_s=" in line and "state_s=" in line
    assert figures["small"] is True and " small=True " in line  # 9 lines: decided in the driver


def test_status_names_what_is_pending_and_what_each_step_folded(spark, ran):
    layout, _ = ran
    before = _read_only(spark, layout)

    report = storage_status(layout, SPECS, lambda: spark)

    stream = report["streams"][MOVIE_TICKET_SALES.name]
    assert report["nothing_run_yet"] is False and stream["ran"] is True
    assert stream["landing"]["pending"] == 1
    assert [Path(f["path"]).name for f in stream["landing"]["pending_files"]] == ["c.jsonl"]
    assert stream["landing"]["recorded_not_read"] is False
    batch = stream["last_batch"]
    assert (batch["batch_id"], batch["lines"], batch["accepted"], batch["quarantined"], batch["duplicates"],
            batch["files"]) == (0, 9, 5, 3, 1, 2)
    assert batch["committed_at"].startswith("20") and batch["committed_at"].endswith("Z")
    assert stream["quarantine_by_reason"] == {"not_json": 2, "missing_field": 1}
    tables = stream["tables"]
    written = ["movie_ticket_sales_files", "movie_ticket_sales_quarantine", "movie_ticket_sales_bronze",
               "movie_tickets_sold"]
    assert all(tables[name] > 0 for name in written), tables
    assert {tables[name] for name in set(tables) - set(written)} == {None}  # no windows step in this run
    bronze = tables[MOVIE_TICKET_SALES.bronze_table]
    assert batch["bronze_version"] == bronze
    folded = stream["folded"]
    assert folded["state_tables"] == {"movie_tickets_sold": {"bronze_version": bronze, "restored_to": None}}
    assert folded["changelogs"] == {"movie_tickets_sold_changelog": {
        "state_table": "movie_tickets_sold", "state_version": None}}  # published off the runs
    assert folded["event_time"]["tickets_per_title_hourly"]["bronze_version"] is None
    assert stream["late_events"] is None
    lock = stream["writer_lock"]
    assert (lock["held"], lock["pid"], lock["host"]) == (False, os.getpid(), socket.gethostname())
    json.dumps(report)  # one JSON document

    text = render(report)
    assert "1 landing file(s) not ingested yet" in text and "c.jsonl" in text
    assert "lines, 5 accepted, 3 quarantined" in text and "not_json 2, missing_field 1 (all time)" in text
    assert "BEHIND" not in text and "free (last held by pid" in text

    assert _read_only(spark, layout) == before  # no table created, none written


@pytest.mark.long
def test_status_gives_the_event_time_step_its_watermark_and_late_events(spark, layout):
    """Two micro-batches with the windows step: the last batch is the second, one sale was late."""
    records = _run(spark, layout, max_files_per_trigger=1)
    assert [r.figures["batch"] for r in records] == [0, 1]
    assert records[1].getMessage().startswith("stream=movie_ticket_sales batch=1 lines=4 accepted=2 quarantined=1 ")

    report = storage_status(layout, SPECS, lambda: spark)

    stream = report["streams"][MOVIE_TICKET_SALES.name]
    assert stream["landing"]["pending"] == 1
    batch = stream["last_batch"]
    assert (batch["batch_id"], batch["lines"], batch["accepted"], batch["quarantined"]) == (1, 4, 2, 1)
    assert stream["late_events"] == 1
    tables = stream["tables"]
    assert tables.pop("movie_tickets_sold_changelog") is None  # published off the runs
    assert all(version > 0 for version in tables.values()), tables
    assert stream["folded"]["event_time"] == {"tickets_per_title_hourly": {
        "problem": None, "bronze_version": batch["bronze_version"], "watermark": "2026-11-01T13:20:00Z"}}
    assert "watermark 2026-11-01T13:20:00Z" in render(report) and "BEHIND" not in render(report)


def test_a_held_writer_lock_is_named_by_pid_and_host(layout):
    assert lock_state(layout.locks, "payments")["held"] is False
    assert not layout.locks.exists()  # asking creates nothing
    with writer_lock(layout.locks, "payments", 5):
        held = lock_state(layout.locks, "payments")
        assert (held["held"], held["pid"], held["host"]) == (True, os.getpid(), socket.gethostname())
        assert held["since"].endswith("Z")
    assert lock_state(layout.locks, "payments")["held"] is False


def test_status_json_on_an_untouched_root_says_nothing_ran_and_creates_nothing(tmp_path):
    home = tmp_path / "home"
    env = {**os.environ, "STATETABLES_HOME": str(home)}
    env.pop("STATETABLES_SPARK_REMOTE", None)
    command = [sys.executable, "-m", "statetables.cli", "status"]
    done = subprocess.run([*command, "--json"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["nothing_run_yet"] is True and report["engine"]["engine"] == "embedded"
    assert set(report["streams"]) >= {"movie_ticket_sales", "payments"}
    sales = report["streams"]["movie_ticket_sales"]
    assert sales["last_batch"] is None and sales["landing"]["pending"] == 0
    assert set(sales["tables"].values()) == {None}
    text = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert text.returncode == 0 and "nothing run yet" in text.stdout, text.stderr
    assert not home.exists()
