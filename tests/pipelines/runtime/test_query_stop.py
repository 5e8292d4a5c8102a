"""How a continuous query stops (a cancelled run): after its running micro-batch commits, saying so while it waits;
and not at all when the stop came before it started. In the test session's embedded engine, on Spark's rate
source."""

from __future__ import annotations

import threading
import time

from pipelines.runtime import query as query_module
from pipelines.runtime.query import Continuous, run_query
from tests.streams import batch_lines


def test_a_stop_waits_for_the_running_batch_and_says_so_and_a_stop_before_the_start_starts_nothing(
        spark, tmp_path, monkeypatch):
    monkeypatch.setattr(query_module, "STOP_NOTE_S", 0.5)
    started, begun, finished = threading.Event(), [], []

    def on_batch(frame, batch_id: int) -> None:
        begun.append(batch_id)
        started.set()
        time.sleep(3)  # a batch still running when the stop arrives
        finished.append(batch_id)

    continuous = Continuous(trigger_interval_s=1)
    stream = spark.readStream.format("rate").option("rowsPerSecond", 5).load()
    returned = []
    with batch_lines() as lines:
        runner = threading.Thread(target=lambda: returned.append(run_query(
            stream, query_name="stopped_mid_batch", checkpoint_dir=tmp_path / "checkpoint", on_batch=on_batch,
            continuous=continuous)))
        runner.start()
        assert started.wait(120), "no micro-batch started"
        continuous.stop.set()
        runner.join(120)
    assert not runner.is_alive()
    # The batch running at the stop ran to its end. The rate source always has more: the next batch starts at once
    # and is stopped, not waited for (nor a pause between two batches that never comes).
    assert finished[:1] == [0] and begun in ([0], [0, 1]) and returned[0][0] >= 1, (begun, finished, returned)
    assert not [q for q in spark.streams.active if q.name == "stopped_mid_batch"]
    notes = [r.getMessage() for r in lines if "stopping once its micro-batch commits" in r.getMessage()]
    assert notes and notes[0].startswith("query stopped_mid_batch:"), [r.getMessage() for r in lines]

    # Told to stop before its start: it starts no query and folds nothing.
    called = []
    assert run_query(stream, query_name="never_started", checkpoint_dir=tmp_path / "never",
                     on_batch=lambda frame, batch_id: called.append(batch_id), continuous=continuous) == (0, 0)
    assert not called and not (tmp_path / "never").exists()
    assert not [q for q in spark.streams.active if q.name == "never_started"]
    # A stop that cannot end the query's thread fails instead of waiting forever.
    assert spark.conf.get("spark.sql.streaming.stopTimeout") == "60s"
