"""Table maintenance: the changelogs published, then OPTIMIZE (compact small files) and VACUUM (delete files no
version in the retention needs).

OPTIMIZE and VACUUM run per stream under the stream's writer lock, so no run of it is between two commits of a batch
meanwhile; publishing needs no lock (pipelines/state/changelog.py). What it never removes:
- a file of any version a savepoint records: the retention of a table is stretched past the commit time of the
  oldest version any savepoint keeps of it (a savepoint restore reads that version by time travel);
- a file of the last `retain` (at least 7 days, Delta's own safety floor, which stays on): what time travel and a
  step catching up on bronze's change feed read;
- a change row of a state table: its changelog is published first (`publish_changelogs`), so the change data
  VACUUM deletes is already in the changelog table, whose current rows VACUUM never deletes (it deletes only files
  no current or retained version references).
"""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

from pipelines.declare.specs import StreamSpec
from pipelines.errors import ConfigurationError
from pipelines.operate.savepoints import list_savepoints
from pipelines.runtime.locks import writer_lock
from pipelines.runtime.micro_batch import StreamSettings, stream_tables as all_tables
from pipelines.state.changelog import changelog_name, publish_changelog
from pipelines.storage import delta_sql
from pipelines.storage.delta_log import history_rows, new_app_id, table_version
from pipelines.storage.layout import StorageLayout

MIN_RETAIN = timedelta(days=7)  # Delta's retentionDurationCheck refuses less; it is not turned off here
SAVEPOINT_MARGIN = timedelta(hours=1)


def stream_tables(spec: StreamSpec) -> list[str]:
    """Every table of the stream: its ledger (a landing folder's), every table its runs write, its changelogs."""
    return [*((spec.files_table,) if spec.topic is None else ()), *all_tables(spec, StreamSettings()),
            *(changelog_name(table) for table in spec.state_tables)]


def _publish(spark, layout: StorageLayout, spec: StreamSpec) -> list[dict]:
    app_id = new_app_id(f"{spec.name}/changelog")
    return [publish_changelog(spark, layout, table, app_id) for table in spec.state_tables
            if table_version(spark, layout.table(table.name)) is not None]


def publish_changelogs(spark, layout: StorageLayout, spec: StreamSpec) -> list[dict]:
    """Bring every changelog of the stream up to its state table's newest version, beside its runs (a continuous one
    included): one dict of figures per changelog (`publish_changelog`)."""
    return _publish(spark, layout, spec)


def _retention(spark, path: Path, name: str, saved: dict[str, int], retain: timedelta) -> timedelta:
    """`retain`, stretched so that the oldest version a savepoint keeps of the table stays readable."""
    version = saved.get(name)
    if version is None:
        return retain
    when_ms = next((row["timestamp_ms"] for row in history_rows(spark, path) if row["version"] == version), None)
    if when_ms is None:
        return retain
    when = datetime.fromtimestamp(when_ms / 1000, timezone.utc)
    return max(retain, datetime.now(timezone.utc) - when + SAVEPOINT_MARGIN)


def maintain_stream(spark, layout: StorageLayout, spec: StreamSpec, *, retain: timedelta = MIN_RETAIN,
                    lock_timeout_s: float = 60.0) -> list[dict]:
    """Publish the stream's changelogs, then OPTIMIZE and VACUUM every table of the stream; one dict of figures per
    table."""
    if retain < MIN_RETAIN:
        raise ConfigurationError(f"A retention of {retain} is shorter than Delta's safety floor of {MIN_RETAIN.days} "
                                 f"days, below which a running reader or time travel could lose files. Fix: retain "
                                 f"at least {MIN_RETAIN.days * 24} hours.")
    saved: dict[str, int] = {}
    for manifest in list_savepoints(layout):
        for name, entry in manifest["tables"].items():
            saved[name] = min(saved.get(name, entry["version"]), entry["version"])
    figures = []
    with writer_lock(layout.locks, spec.name, lock_timeout_s):
        _publish(spark, layout, spec)  # before VACUUM deletes the change data it copies
        for name in stream_tables(spec):
            path = layout.table(name)
            if table_version(spark, path) is None:
                continue
            started = time.monotonic()
            optimized = delta_sql.optimize(spark, path)
            keep = _retention(spark, path, name, saved, retain)
            vacuumed = delta_sql.vacuum(spark, path, keep)
            figures.append({"table": name, "files_compacted": optimized.get("numFilesRemoved", 0),
                            "files_written": optimized.get("numFilesAdded", 0), "files_deleted": vacuumed,
                            "retained_hours": round(keep / timedelta(hours=1), 1),
                            "kept_for_savepoint": name in saved and keep > retain,
                            "seconds": round(time.monotonic() - started, 2)})
    return figures
