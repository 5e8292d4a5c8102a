"""Savepoints: a named, consistent snapshot of every state table's version with its checkpoint.

    savepoints/<name>/manifest.json            written last: a savepoint without it is incomplete
    savepoints/<name>/checkpoints/<query>/     copy of each state query's checkpoint

Taken under each state query's writer lock, so table version and checkpoint belong together.
Restoring puts each table's content back as of its savepoint version with a MERGE (a normal
commit: readers and the Change Data Feed see only the rows that change; not Delta RESTORE, whose
kept transaction ids would make the resumed query skip batches, delta-io/delta#1813) and installs
the checkpoint copy under a new app id. The next run resumes from the savepoint's bronze offset and
folds in everything after it again, exactly once.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

from pyspark.sql import SparkSession

from pipelines.checkpoints import (
    copy_checkpoint, new_app_id, read_origin, set_aside, start_checkpoint, verify_checkpoint,
)
from pipelines.errors import ConfigurationError, SavepointError
from pipelines.expiry import EXPIRED, expired_totals, ttl_property
from pipelines.layout import StorageLayout
from pipelines.state import set_table_content
from pipelines.streaming import table_version, writer_lock
from pipelines.streams import STREAMS

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
        os.replace(folder, folder.with_name(f".{name}.incomplete-{time.time_ns()}"))
    manifest = {"name": name, "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "tables": {}}
    for spec in STREAMS.values():
        table, query = spec.state_table, spec.state_query
        checkpoint = layout.checkpoint(query)
        with writer_lock(layout.locks, query, lock_timeout_s):
            verdict = verify_checkpoint(spark, checkpoint, [layout.table(table.name)])
            offsets = [int(p.name) for p in (checkpoint / "offsets").glob("[0-9]*")]
            if verdict.origin is None or (offsets and max(offsets) != verdict.last_commit):
                raise SavepointError(
                    f"{query} is not at a clean point ({verdict.problem or 'a micro-batch is unfinished'}). "
                    f"Fix: run the pipeline once (`statetables run`), then take the savepoint.")
            copy_checkpoint(checkpoint, folder / "checkpoints" / query)
            manifest["tables"][table.name] = {
                "query": query, "version": table_version(spark, layout.table(table.name)),
                "last_batch": verdict.last_commit,
                "bronze_version": table_version(spark, layout.table(spec.bronze_table)),
            }
    tmp = folder / f".{MANIFEST}"
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(tmp, folder / MANIFEST)
    return manifest


def list_savepoints(layout: StorageLayout) -> list[dict]:
    found = []
    for manifest in sorted(layout.savepoints.glob(f"*/{MANIFEST}")) if layout.savepoints.exists() else []:
        found.append(json.loads(manifest.read_text()))
    return sorted(found, key=lambda m: m["created_at"])


def restore_savepoint(spark: SparkSession, layout: StorageLayout, name: str, *, lock_timeout_s: float = 60.0) -> dict:
    """Put every state table and its checkpoint back as they were at the savepoint.

    Per table, under its writer lock: (1) set the current checkpoint aside, (2) MERGE the table back
    to its savepoint content, recorded as the last batch of a new app id, (3) install the checkpoint
    copy under that app id. A crash between the steps leaves no checkpoint, so the next run rebuilds
    from bronze (consistent, but not the savepoint): run the restore again.
    """
    folder = _folder(layout, name)
    if not (folder / MANIFEST).exists():
        known = ", ".join(m["name"] for m in list_savepoints(layout)) or "none"
        raise SavepointError(f"No savepoint {name!r} (known: {known}). Fix: `statetables savepoint list`.")
    manifest = json.loads((folder / MANIFEST).read_text())
    for spec in STREAMS.values():
        table = spec.state_table
        saved = manifest["tables"][table.name]
        query, path = saved["query"], str(layout.table(table.name))
        with writer_lock(layout.locks, query, lock_timeout_s):
            checkpoint = layout.checkpoint(query)
            set_aside(checkpoint, layout.set_aside_checkpoints)
            copy = folder / "checkpoints" / query
            saved_origin = read_origin(copy)
            last_batch = saved["last_batch"] if saved["last_batch"] is not None else -1
            app_id = new_app_id(query)
            snapshot = spark.read.format("delta").option("versionAsOf", saved["version"]).load(path)
            metadata = {"app_id": app_id, "batch_id": last_batch, "restored_savepoint": name,
                        "restored_version": saved["version"]}
            if ttl_property(spark, path) is not None:  # the expiries after the savepoint are undone too
                metadata[EXPIRED] = expired_totals(spark, path, as_of=saved["version"]).as_metadata()
            set_table_content(spark, path, table, snapshot, metadata)
            tmp = checkpoint.with_name(f".{query}.restoring")
            shutil.rmtree(tmp, ignore_errors=True)  # left by a restore that died here
            copy_checkpoint(copy, tmp)
            # The start version matters only to a checkpoint without offsets (Spark ignores it otherwise).
            start_checkpoint(tmp, query, f"restored savepoint {name}", app_id=app_id, first_batch=last_batch + 1,
                             source_start_version=saved_origin.source_start_version if saved_origin else None,
                             source_table_id=saved_origin.source_table_id if saved_origin else None)
            os.replace(tmp, checkpoint)
    return manifest
