"""Savepoints: a named, consistent snapshot of every state table's version.

    savepoints/<name>/manifest.json            written last: a savepoint without it is incomplete

Taken under each stream's writer lock. A state table's commits record the bronze version it has folded
through (pipelines/state/tables.py), so its version is all a savepoint needs. Restoring puts each table's content
back as of its savepoint version with a MERGE (a normal commit: readers and the Change Data Feed see only
the rows that change; not Delta RESTORE, which leaves the commits it undoes in the log, where a replayed batch
would find its own and skip its write) that records the savepoint's bronze version. The next run folds in everything
after it again, exactly once, before its query starts.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

from pyspark.sql import SparkSession

from pipelines.declare.project import project, streams
from pipelines.errors import ConfigurationError, SavepointError
from pipelines.runtime.locks import writer_lock
from pipelines.state.expiry import EXPIRED, expired_totals, ttl_property
from pipelines.state.tables import FOLDED_THROUGH, folded_through, set_table_content
from pipelines.storage import files
from pipelines.storage.delta_log import new_app_id
from pipelines.storage.layout import StorageLayout

MANIFEST = "manifest.json"
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")


def _folder(layout: StorageLayout, name: str) -> Path:
    if not NAME.match(name):
        raise ConfigurationError(f"Savepoint name {name!r} is not allowed. Fix: use letters, digits, '_', '.', '-'.")
    return layout.savepoints / name


def create_savepoint(spark: SparkSession, layout: StorageLayout, name: str, *, lock_timeout_s: float = 60.0) -> dict:
    folder = _folder(layout, name)
    if (folder / MANIFEST).exists():
        raise SavepointError(f"Savepoint {name} already exists ({folder}). Fix: choose another name.")
    if folder.exists():  # an earlier attempt died before its manifest: start it again
        files.replace(folder, folder.with_name(f".{name}.incomplete-{time.time_ns()}"))
    manifest = {"name": name, "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "tables": {}}
    for spec in streams().values():
        with writer_lock(layout.locks, spec.name, lock_timeout_s):
            for table in spec.state_tables:
                found = folded_through(spark, layout.table(table.name))
                if found is None:
                    raise SavepointError(f"{table.name} does not record which bronze version it has folded (no run "
                                         f"yet). Fix: run the pipeline once (`statetables run`), then take the "
                                         f"savepoint.")
                manifest["tables"][table.name] = {"stream": spec.name, "version": found.version,
                                                  "bronze_version": found.through}
    files.write_atomic(folder / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())
    return manifest


def list_savepoints(layout: StorageLayout) -> list[dict]:
    found = []
    for manifest in sorted(layout.savepoints.glob(f"*/{MANIFEST}")) if layout.savepoints.exists() else []:
        found.append(json.loads(manifest.read_text()))
    return sorted(found, key=lambda m: m["created_at"])


def restore_savepoint(spark: SparkSession, layout: StorageLayout, name: str, *, lock_timeout_s: float = 60.0) -> dict:
    """Put every state table back as it was at the savepoint, in one MERGE each, recording the savepoint's bronze
    version: the next run of each stream folds bronze after it again. Repeating a restore is safe."""
    folder = _folder(layout, name)
    if not (folder / MANIFEST).exists():
        known = ", ".join(m["name"] for m in list_savepoints(layout)) or "none"
        raise SavepointError(f"No savepoint {name!r} (known: {known}). Fix: `statetables savepoint list`.")
    manifest = json.loads((folder / MANIFEST).read_text())
    for name, saved in manifest["tables"].items():
        spec, table = project().state_table(name)
        path = str(layout.table(table.name))
        through = saved["bronze_version"]
        with writer_lock(layout.locks, spec.name, lock_timeout_s):
            snapshot = spark.read.format("delta").option("versionAsOf", saved["version"]).load(path)
            metadata = {"app_id": new_app_id(f"{spec.name}/savepoint"), "batch_id": -1, "restored_savepoint": name,
                        "restored_version": saved["version"], FOLDED_THROUGH: through}
            if ttl_property(spark, path) is not None:  # the expiries after the savepoint are undone too
                metadata[EXPIRED] = expired_totals(spark, path, as_of=saved["version"]).as_metadata()
            set_table_content(spark, path, table, snapshot, metadata)
    return manifest
