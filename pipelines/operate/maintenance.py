"""Table maintenance: OPTIMIZE (compact small files) and VACUUM (delete files no version in the retention needs).

Run per stream under the stream's writer lock, so no run of it is between two commits of a batch meanwhile. What it
never removes:
- a file of any version a savepoint records: the retention of a table is stretched past the commit time of the
  oldest version any savepoint keeps of it (a savepoint restore reads that version by time travel);
- a file of the last `retain` (at least 7 days, Delta's own safety floor, which stays on): what time travel and a
  step catching up on bronze's change feed read;
- a changelog row: `restore-changelog` reads the changelog table's current rows, which VACUUM never deletes
  (it deletes only files no current or retained version references).
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
from pipelines.storage import delta_sql
from pipelines.storage.delta_log import history_rows, table_version
from pipelines.storage.layout import StorageLayout

MIN_RETAIN = timedelta(days=7)  # Delta's retentionDurationCheck refuses less; it is not turned off here
SAVEPOINT_MARGIN = timedelta(hours=1)


def stream_tables(spec: StreamSpec) -> list[str]:
    """Every table of the stream: its ledger (a landing folder's) and every table its runs write."""
    return [*((spec.files_table,) if spec.topic is None else ()), *all_tables(spec, StreamSettings())]


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
    """OPTIMIZE then VACUUM every table of the stream; one dict of figures per table."""
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
