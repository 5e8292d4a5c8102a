"""A state table against an independent oracle, read with an independent Delta reader (`deltalake`), through the
failures around its runs.

Covers, in one scenario on movie_tickets_sold: generated data (malformed lines, re-deliveries, conflicting ids, late
events) delivered in two runs; the table equals the seed query computed by tests/contract_oracle.py with exact
decimals; one writer per stream (a run that finds the stream busy writes nothing); damaged checkpoint files
detected; a table log that cannot be written fails the run with the fix, and the next run is exact: the batch's
MERGE is made before the query starts, and the batch, replayed after its commits but before the checkpoint commit,
writes nothing; Change Data Feed on, recording every upsert; runs write no changelog, which, published (by two
publishers at once and a stale one), holds that feed once and alone rebuilds the table as of every version; a state table that records no bronze version (deleted) is
rebuilt from bronze. The same for a table with a TTL, a crash and a lost checkpoint:
tests/pipelines/state/test_state_ttl.py. Not covered: Dagster (tests/assets).
"""

from __future__ import annotations

import shutil
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from decimal import Decimal

import pyarrow as pa
import pytest
from deltalake import DeltaTable as IndependentDeltaTable

from pipelines.errors import ChangelogError, StorageError, StreamBusyError
from pipelines.ingest.generate import generate
from pipelines.runtime.checkpoints import verify_checkpoint
from pipelines.operate.maintenance import publish_changelogs
from pipelines.runtime.locks import writer_lock
from pipelines.state.changelog import changelog_name, changelog_stage, restore_from_changelog
from pipelines.storage.delta_log import table_version
from tests.streams import MOVIE_TICKET_SALES
from tests.contract_oracle import Expected, expected_state, landing_files
from tests.streams import advance

SPEC, TABLE = MOVIE_TICKET_SALES, MOVIE_TICKET_SALES.state_tables[0]
CHECKPOINT_DAMAGE = {
    "truncated offsets file": lambda cp, n: (cp / "offsets" / n).write_bytes((cp / "offsets" / n).read_bytes()[:40]),
    "garbage commit file": lambda cp, n: (cp / "commits" / n).write_bytes(b"\x00\xff garbage"),
    "truncated commit file, checksum gone": lambda cp, n: (
        (cp / "commits" / n).write_text("v1\n"), (cp / "commits" / f".{n}.crc").unlink()),
    # The stream's query reads the landing ledger (a Delta source), which keeps no sources/ log.
    "empty query metadata": lambda cp, n: (cp / "metadata").write_bytes(b""),
    "offsets folder lost": lambda cp, n: shutil.rmtree(cp / "offsets"),
    "origin record lost": lambda cp, n: (cp / "statetables_checkpoint.json").unlink(),
}


def _deliver(layout, seed: int) -> None:
    """A landing file of 300 generated events: a few of every kind of line the oracle judges."""
    generate(SPEC, layout.landing(SPEC.name), events=300, malformed=0.05, duplicates=0.05, conflicts=0.02, late=0.05,
             seed=seed, events_per_file=300)


def _advance(spark, layout, **settings):
    return advance(spark, layout, SPEC, event_time=False, **settings)


def _expected(layout) -> Expected:
    return expected_state(SPEC.name, landing_files(layout.landing(SPEC.name)))


def _rows(expected: Expected) -> dict[str, tuple[int, Decimal]]:
    return {k: (expected.counts[k], expected.sums[k]) for k in expected.counts}


def _read_state(layout) -> dict[str, tuple[int, Decimal]]:
    rows = IndependentDeltaTable(str(layout.table(TABLE.name))).to_pyarrow_table().to_pylist()
    return {r[TABLE.key]: (r[TABLE.count_column], r[TABLE.sum_column]) for r in rows}


def _all_columns(path, version: int | None = None) -> list[tuple]:
    """Every row with every column but `updated_at` (when it was written)."""
    rows = IndependentDeltaTable(str(path), version=version).to_pyarrow_table().drop_columns("updated_at")
    return sorted(tuple(row.values()) for row in rows.to_pylist())


def test_a_state_table_stays_exact_through_a_busy_stream_read_only_storage_a_replay_and_a_rebuild(spark, layout):
    _deliver(layout, seed=1)
    after_first = _rows(_expected(layout))

    # One writer per stream: a run that finds the stream busy writes nothing.
    holding, release = threading.Event(), threading.Event()

    def other_run():
        with writer_lock(layout.locks, SPEC.name, 5):
            holding.set()
            release.wait(60)

    thread = threading.Thread(target=other_run)
    thread.start()
    holding.wait(10)
    try:
        with pytest.raises(StreamBusyError, match="Another run is advancing movie_ticket_sales "):
            _advance(spark, layout, lock_timeout_s=1)
    finally:
        release.set()
        thread.join()
    assert table_version(spark, layout.table(SPEC.bronze_table)) is None  # nothing was created or written
    assert not layout.tables_root.exists() or not any(layout.tables_root.iterdir())
    started = datetime.now(timezone.utc)
    first = _advance(spark, layout).versions[TABLE.name].after
    # updated_at: the time of the batch that wrote the row, one instant for the whole batch (the MERGE's and the
    # append's `statetables_constant`, not a literal).
    stamps = set(IndependentDeltaTable(str(layout.table(TABLE.name))).to_pyarrow_table()["updated_at"].to_pylist())
    assert len(stamps) == 1 and started <= (first_stamp := stamps.pop()) <= datetime.now(timezone.utc)

    # Its checkpoint is trusted; each kind of damage to a copy of it is detected.
    checkpoint, bronze = layout.checkpoint(SPEC.name), [layout.table(SPEC.bronze_table)]
    assert verify_checkpoint(spark, checkpoint, bronze).problem is None
    for name, damage in CHECKPOINT_DAMAGE.items():
        copy = layout.home / "copies" / name.replace(" ", "_").replace(",", "")
        shutil.copytree(checkpoint, copy)
        damage(copy, "0")  # the last batch's files
        assert verify_checkpoint(spark, copy, bronze).problem, name

    # A table log that cannot be written fails the next run with the fix, at its batch's MERGE, after bronze's commit.
    _deliver(layout, seed=2)
    log = layout.table(TABLE.name) / "_delta_log"
    # As root, permissions do not stop writes; the immutable flag does (EPERM), like a read-only mount.
    subprocess.run(["chattr", "+i", str(log)], check=True)
    try:
        with pytest.raises(StorageError, match=r"Cannot write to .*_delta_log.*Fix: make the folder writable"):
            _advance(spark, layout)
    finally:
        subprocess.run(["chattr", "-i", str(log)], check=True)
    commits = layout.checkpoint(SPEC.name) / "commits"
    assert not (commits / "1").exists()

    # The run after it is exact: the batch's MERGE (a catch-up before the query starts), then the batch replayed,
    # which finds every commit made (Spark had not written its commit file) and writes nothing.
    started = datetime.now(timezone.utc)
    result = _advance(spark, layout)
    # The MERGE stamps the rows it changes with its batch's time; the others keep the first batch's.
    stamps = set(IndependentDeltaTable(str(layout.table(TABLE.name))).to_pyarrow_table()["updated_at"].to_pylist())
    merged = stamps - {first_stamp}
    assert len(merged) == 1 and started <= merged.pop() <= datetime.now(timezone.utc)
    assert result.micro_batches == 1 + 1 and (commits / "1").exists()
    history = IndependentDeltaTable(str(layout.table(TABLE.name))).history()
    # A fold per delivery, none replayed: the new table's first an append, then a MERGE.
    assert sorted((c["version"], c["operation"]) for c in history if c["operation"] in ("WRITE", "MERGE")) == [
        (first, "WRITE"), (result.versions[TABLE.name].after, "MERGE")]
    second = result.versions[TABLE.name].after
    expected = _expected(layout)
    assert expected.accepted > 450 and expected.duplicates > 10 and expected.quarantined > 20  # every kind of line
    after_second = _rows(expected)
    assert _read_state(layout) == after_second
    for name, rows in ((SPEC.bronze_table, expected.accepted), (SPEC.quarantine_table, expected.quarantined)):
        assert IndependentDeltaTable(str(layout.table(name))).to_pyarrow_table().num_rows == rows, name

    # The Change Data Feed: each MERGE's new keys inserted, every key it counted events for updated (both images).
    changes = (spark.read.format("delta").option("readChangeFeed", "true").option("startingVersion", 0)
               .load(str(layout.table(TABLE.name))).collect())
    found: dict[int, list] = {}
    for c in changes:
        found.setdefault(c["_commit_version"], []).append(
            (c["_change_type"], c[TABLE.key], c[TABLE.count_column], c[TABLE.sum_column]))
    updated = [key for key, row in after_second.items() if key in after_first and row != after_first[key]]
    assert updated
    assert {version: sorted(rows) for version, rows in found.items()} == {
        first: sorted(("insert", key, *row) for key, row in after_first.items()),
        second: sorted([("insert", key, *row) for key, row in after_second.items() if key not in after_first]
                       + [("update_preimage", key, *after_first[key]) for key in updated]
                       + [("update_postimage", key, *after_second[key]) for key in updated]),
    }

    # No run wrote the changelog; published, it holds that feed, each row once (published again: nothing added), and
    # from it alone the table is rebuilt as of every version. Publishers take no lock (a continuous run holds it for
    # its whole life): two at once, and one that read the coverage before them and writes after (stale), append each
    # change row once.
    assert table_version(spark, layout.table(changelog_name(TABLE))) is None
    stale = changelog_stage(spark, layout, TABLE)
    with writer_lock(layout.locks, SPEC.name, 5), ThreadPoolExecutor(2) as pool:
        at_once = [done.result() for done in [pool.submit(publish_changelogs, spark, layout, SPEC) for _ in range(2)]]
    assert [f["covers"] for figures in at_once for f in figures] == [second, second]
    stale.advance(spark, "stale publisher", 0)
    assert [f["change_rows_appended"] for f in publish_changelogs(spark, layout, SPEC)] == [0]
    published = IndependentDeltaTable(str(layout.table(changelog_name(TABLE)))).to_pyarrow_table().to_pylist()
    assert sorted((r["_commit_version"], r["_change_type"], r[TABLE.key], r[TABLE.count_column], r[TABLE.sum_column])
                  for r in published) == sorted((version, *row) for version, rows in found.items() for row in rows)
    # Every changelog file records the range of versions it holds, what its readers select by, and no other column's
    # statistics (they were almost half of an append).
    files = pa.table(IndependentDeltaTable(str(layout.table(changelog_name(TABLE)))).get_add_actions(flatten=True))
    assert sorted(c for c in files.column_names if c.startswith(("min.", "max."))) == [
        "max._commit_version", "min._commit_version"]
    assert {(f["min._commit_version"], f["max._commit_version"]) for f in files.to_pylist()} == {
        (first, first), (second, second)}
    for version in range(1, second + 1):
        rebuilt = restore_from_changelog(spark, layout, TABLE, version, f"rebuilt_v{version}")
        assert _all_columns(rebuilt) == _all_columns(layout.table(TABLE.name), version), version

    # Deleted, the table is built again from all of bronze, exactly, in one commit that records the bronze version;
    # its changelog refuses to follow it while it holds the old table's changes, and moved aside, starts again from
    # the new table's first version.
    shutil.rmtree(layout.table(TABLE.name))
    result = _advance(spark, layout)
    assert result.built_through[TABLE.name] == table_version(spark, layout.table(SPEC.bronze_table))
    assert _read_state(layout) == after_second
    with pytest.raises(ChangelogError, match="deleted and created again.*Fix: move"):
        publish_changelogs(spark, layout, SPEC)
    shutil.rmtree(layout.table(changelog_name(TABLE)))
    publish_changelogs(spark, layout, SPEC)
    rebuilt_changelog = IndependentDeltaTable(str(layout.table(changelog_name(TABLE)))).to_pyarrow_table()
    assert rebuilt_changelog.num_rows == len(after_second)  # the rebuild's inserts
