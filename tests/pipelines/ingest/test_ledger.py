"""When a new query may read the landing ledger commit by commit from its first (pipelines/ingest/landing.py
`ledger_replayable`): only while that plans exactly the units the ledger's snapshot holds. A whole run on a compacted
ledger under a lost checkpoint: tests/pipelines/runtime/test_recovery.py."""

from __future__ import annotations

import pyarrow as pa
from deltalake import write_deltalake

from pipelines.ingest.landing import REPLAYABLE_LEDGER_COMMITS, ledger_replayable
from pipelines.storage import delta_sql


def test_a_ledger_is_read_from_its_first_commit_only_while_short_and_only_appended_to(spark, tmp_path):
    appended = tmp_path / "appended"
    assert not ledger_replayable(spark, appended)  # no table yet
    for unit in (0, 1):
        spark.range(unit, unit + 1).withColumnRenamed("id", "unit").write.format("delta").mode("append") \
            .save(str(appended))
    assert ledger_replayable(spark, appended)
    delta_sql.optimize(spark, appended)  # its compacted files may be vacuumed: the old commits' files with them
    assert not ledger_replayable(spark, appended)

    long = tmp_path / "long"  # delta-rs: no Spark job per commit
    for unit in range(REPLAYABLE_LEDGER_COMMITS + 1):  # versions 0 .. REPLAYABLE_LEDGER_COMMITS
        write_deltalake(long, pa.table({"unit": pa.array([unit], pa.int64())}), mode="append")
    assert ledger_replayable(spark, long)
    write_deltalake(long, pa.table({"unit": pa.array([99], pa.int64())}), mode="append")
    assert not ledger_replayable(spark, long)
