"""Always-on mode: every stream's streaming query kept running in one SparkSession, each in its own thread.

A step is a stream's `advance_stream` (pipelines/runtime/micro_batch.py), called with a `Continuous`: it takes the
stream's writer lock, verifies its checkpoint exactly as an orchestrated run does, then keeps its query
running with a processing-time trigger. Spark runs concurrent streaming queries side by side. Each step has a
session of its own (resources/spark.py, `session_of_its_own`), so the transaction confs of one stream's commits
(its catch-up before the query, and each micro-batch) never reach another's.

A stop (a cancel in Dagster arrives as an exception in the calling thread) lets each query finish its current
micro-batch, then stops it; whatever the stop interrupts is replayed by the next run from the checkpoint.

    >>> steps = [ContinuousStep("payments", lambda c: advance_stream(spark, layout, spec, continuous=c))]
    >>> for _ in run_steps_continuously(steps, Continuous(trigger_interval_s=2), tick_s=30):
    ...     print("report")
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator

from pyspark.sql import SparkSession

from pipelines.declare.project import streams
from pipelines.runtime.micro_batch import new_tables
from pipelines.runtime.query import Continuous, StreamRunResult
from pipelines.storage.delta_log import create_tables_if_missing
from pipelines.storage.layout import StorageLayout


@dataclass(frozen=True)
class ContinuousStep:
    name: str
    run: Callable[[Continuous], StreamRunResult]
    trigger_interval_s: float | None = None


def create_tables(spark: SparkSession, layout: StorageLayout) -> None:
    """Every table the streams write, created before they start: both write late_events, and would otherwise race
    to create it (Delta refuses the second creation, DELTA_PROTOCOL_CHANGED); and the run's first report then
    compares each table with its first version, not with nothing."""
    create_tables_if_missing(spark, [table for spec in streams().values() for table in new_tables(layout, spec)])


def run_steps_continuously(steps: list[ContinuousStep], continuous: Continuous, *, tick_s: float) -> Iterator[None]:
    """Run every step until `continuous.stop` is set, a step fails, or the consumer is interrupted; yields
    every `tick_s` seconds (the consumer reports between ticks) and once more after every query stopped.
    Raises the first step's error after that. Close the generator (`contextlib.closing`) to stop early."""

    def run(step: ContinuousStep) -> None:
        own = Continuous(trigger_interval_s=step.trigger_interval_s or continuous.trigger_interval_s,
                         stop=continuous.stop, on_progress=continuous.on_progress,
                         stop_timeout_s=continuous.stop_timeout_s)
        try:
            step.run(own)
        except BaseException as exc:  # noqa: BLE001 - raised in the consumer's thread below
            continuous.fail(exc)
        else:
            if not continuous.stop.is_set():
                continuous.fail(RuntimeError(f"{step.name} stopped while the run was still going; see the Spark log"))
        if own.error is not None:
            continuous.fail(own.error)

    threads = [threading.Thread(target=run, args=(step,), name=f"continuous-{step.name}", daemon=True)
               for step in steps]
    for thread in threads:
        thread.start()
    try:
        next_tick = time.monotonic() + tick_s
        while not continuous.stop.wait(min(1.0, max(0.0, next_tick - time.monotonic()))):
            if time.monotonic() >= next_tick:
                yield
                next_tick = time.monotonic() + tick_s
    finally:
        continuous.stop.set()
        for thread in threads:
            thread.join()
    yield
    if continuous.error is not None:
        raise continuous.error
