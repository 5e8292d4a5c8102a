"""An engine's warm-up: micro-batches of generated events through every step of the project's streams, on a scratch
root, before the engine serves runs.

A new engine JVM runs its first micro-batches interpreted, and compiles the hot code as it goes: in the continuous
job, the first twenty batches take twice as long as the later ones, and a record that waits for two of them sees
twice the freshness (docs/performance.md). Compiled code serves every table and stream, so batches of the same steps
on tables of their own warm the engine for the real ones.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import dataclass, replace
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # the command line reads WARM_UP_BATCHES for its help without loading Spark
    from pyspark.sql import SparkSession

    from pipelines.declare.specs import StreamSpec

WARM_UP_BATCHES = 10  # per stream; from about the tenth on, a batch takes what it will (docs/performance.md)
WARM_UP_EVENTS = 20  # per batch: a small batch, as the continuous job's are
# Then batches of this many events per stream, each run as a large batch (joins and kept frames instead of the
# driver's decisions): a file of 100k events is one, and without them an engine's first such batch ran that code cold.
WARM_UP_LARGE_EVENTS = 20_000
# Six: after one, the JIT still compiled the large path's driver code through the next real batches (~2.5 s of
# compiler CPU each, on 2 cores busy 1.8 of 2 already); the bench's warm +100k runs took 9% less after three than after
# one, and 9% less again after six than after three (docs/performance.md). Each costs an engine's start ~2 s a stream.
WARM_UP_LARGE_BATCHES = 6
# The most a generated event steps past the one before (pipelines/ingest/generate.py): each large batch's events
# start after the previous batch's last, so none of them is late.
EVENT_STEP_S = 30


@dataclass(frozen=True)
class WarmedStream:
    stream: str
    micro_batches: int
    seconds: float


def warm_up_engine(spark: SparkSession, specs: list[StreamSpec], *, batches: int = WARM_UP_BATCHES,
                   large_events: int = WARM_UP_LARGE_EVENTS, large_batches: int = WARM_UP_LARGE_BATCHES,
                   scratch: Path | None = None,
                   report: Callable[[WarmedStream], None] = lambda _: None) -> list[WarmedStream]:
    """Run `batches` micro-batches of each stream (one landing file each, a topic's stream from files too), then
    `large_batches` large batches of `large_events` each (none for 0), on a scratch root that is deleted after:
    nothing of the project's root is read or written. `report` is called as each stream is done."""
    from pipelines.ingest.generate import generate
    from pipelines.runtime.micro_batch import StreamSettings, advance_stream
    from pipelines.storage.layout import StorageLayout

    root = Path(tempfile.mkdtemp(prefix="statetables-warm-up-", dir=scratch))
    warmed = []
    try:
        layout = StorageLayout.under(root)
        for number, spec in enumerate(specs):
            started = time.monotonic()
            from_files = replace(spec, topic=None)
            # Some bad lines, as real batches have: quarantine's append is warmed too.
            generate(from_files, layout.landing(spec.name), events=batches * WARM_UP_EVENTS,
                     events_per_file=WARM_UP_EVENTS, malformed=0.05, seed=number + 1)
            result = advance_stream(spark, layout, from_files, StreamSettings(max_files_per_trigger=1))
            micro_batches = result.micro_batches
            # In the past (the contract quarantines events more than a day ahead), each batch's after the one before.
            first = datetime.now(timezone.utc) - timedelta(days=1, seconds=EVENT_STEP_S * large_events * large_batches)
            for round_ in range(large_batches if large_events > 0 else 0):
                generate(from_files, layout.landing(spec.name), events=large_events, events_per_file=large_events,
                         malformed=0.05, seed=100 * (number + 1) + round_, max_step_s=EVENT_STEP_S,
                         start=first + timedelta(seconds=EVENT_STEP_S * large_events * round_))
                micro_batches += advance_stream(spark, layout, from_files,
                                                StreamSettings(large_from_bytes=0, kept_on_disk_from_bytes=0)
                                                ).micro_batches
            warmed.append(WarmedStream(spec.name, micro_batches, time.monotonic() - started))
            report(warmed[-1])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return warmed
