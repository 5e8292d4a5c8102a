"""What a table's Delta log tells: its newest version, read without listing the whole log; what statetables
recorded in its commits' metadata, whatever else wrote there."""

from __future__ import annotations

import json
import shutil
from decimal import Decimal
from pathlib import Path

from deltalake import DeltaTable as IndependentDeltaTable

import pipelines.storage.delta_log as delta_log
from pipelines.storage.delta_log import table_version


def _append(spark, path: Path, commits: int) -> None:
    for _ in range(commits):
        spark.range(1).write.format("delta").mode("append").save(str(path))


def _described(path: Path) -> int:
    """The version another reader (delta-rs) finds."""
    return IndependentDeltaTable(str(path)).version()


def test_the_newest_version_comes_from_the_newest_part_of_the_log(spark, tmp_path, monkeypatch):
    path = tmp_path / "table"
    spark.sql(f"CREATE TABLE delta.`{path}` (id BIGINT) USING delta TBLPROPERTIES (delta.checkpointInterval = 2)")
    _append(spark, path, 5)  # versions 0-5; checkpoints at 2 and 4
    log = path / "_delta_log"
    assert json.loads((log / "_last_checkpoint").read_text())["version"] == 4

    listed = []
    real_iterdir = Path.iterdir
    monkeypatch.setattr(Path, "iterdir", lambda self: listed.append(self) or real_iterdir(self))

    delta_log._SEEN_VERSION.clear()  # a new process: it starts from the checkpoint
    assert table_version(spark, path) == _described(path) == 5
    _append(spark, path, 1)
    assert table_version(spark, path) == _described(path) == 6  # from the version seen last
    assert log not in listed

    # Deleted and created again with fewer versions than seen: the whole (new) log is listed.
    shutil.rmtree(path)
    _append(spark, path, 2)
    assert table_version(spark, path) == _described(path) == 1
    assert log in listed
    # ...and again with more: found from the version seen last.
    listed.clear()
    shutil.rmtree(path)
    _append(spark, path, 3)
    assert table_version(spark, path) == _described(path) == 2
    assert log not in listed

    shutil.rmtree(path)
    assert table_version(spark, path) is None


def test_a_commit_whose_metadata_another_writer_wrote_as_text_is_skipped_by_every_reader(spark, tmp_path):
    """A tool other than statetables may commit with userMetadata that is not a JSON object (a maintenance job's
    note, a JSON list): each reader of what statetables records in its commits looks past it, and none raises."""
    from pipelines.ingest.bronze import ACCEPTED_TOTAL, ACCEPTED_VALUE_TOTAL, accepted_totals
    from pipelines.runtime.checkpoints import table_batches
    from pipelines.state.tables import FOLDED_THROUGH, folded_through
    path = tmp_path / "table"
    recorded = {"app_id": "a", "batch_id": 4, ACCEPTED_TOTAL: 7, ACCEPTED_VALUE_TOTAL: "12.50", FOLDED_THROUGH: 3}
    (spark.range(1).write.format("delta").mode("append").option("userMetadata", json.dumps(recorded))
     .save(str(path)))
    for foreign in ("compacted by the ops team", "[1, 2]", "{not json"):
        spark.range(1).write.format("delta").mode("append").option("userMetadata", foreign).save(str(path))

    assert delta_log.commit_metadata({"userMetadata": "compacted by the ops team"}) == {}
    assert [c["user"] for c in delta_log.commits_since(spark, path, 0)] == [{}, {}, {}]
    assert delta_log.newest_commit_with(spark, path, "batch_id") == (0, recorded)
    assert delta_log.made_by_batch(spark, path, "a", 4)
    assert table_batches(spark, path, "a") == (4, 4)
    assert accepted_totals(spark, str(path), "id") == (7, Decimal("12.50"))
    assert folded_through(spark, path).through == 3
