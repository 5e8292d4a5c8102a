"""Freshness: the time from a landing file renamed into landing/ (or records produced to the stream's topic) to its
events visible in the state table, read with the independent `deltalake` reader, under the real `dagster dev`
(webserver + daemon).

- continuous: the `run_continuously` job, launched once through the webserver, keeps the queries running;
- orchestrated: the landing sensor (every 5 s) starts `advance_payments` runs.

Each mode runs on an embedded JVM per run, or through a warm Spark Connect server beside Dagster (`make dev`).

Each file (or each set of records, acknowledged by the broker) holds the payments of one new customer id, so it is
visible when that key appears in payments_per_customer. Files arrive at a steady rate. The throughput part raises the arrival rate step by
step and reports, per rate, how fast the lag grew over the step (a least-squares slope over the files).
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

from deltalake import DeltaTable

from pipelines.storage.layout import StorageLayout

STATE = "payments_per_customer"
# A rate is held when the lag grows by less than this many seconds per second of arrivals: a mode that
# batches sees its lag rise and fall by a batch's length, not climb with every file.
LAG_GROWTH_LIMIT = 0.15


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


class Arrivals:
    """Writes one file per customer id, as producers must (hidden name, then rename), and watches the
    state table for the ids with `deltalake`; latency = first seen - renamed."""

    def __init__(self, layout: StorageLayout, tag: str):
        self.layout, self.tag = layout, tag
        self.renamed: dict[str, float] = {}
        self.seen: dict[str, float] = {}
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self):
        self._watcher.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._watcher.join()

    def lines(self, index: int, events: int) -> tuple[str, list[str]]:
        customer = f"{self.tag}-{index:05d}"
        now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        return customer, [json.dumps({"payment_id": f"{customer}-{i}", "customer_id": customer, "amount": "12.50",
                                      "paid_at": now}) for i in range(events)]

    def write(self, index: int, events: int) -> None:
        customer, lines = self.lines(index, events)
        folder = self.layout.landing("payments") / self.tag
        folder.mkdir(parents=True, exist_ok=True)
        lines = "".join(line + "\n" for line in lines)
        hidden, final = folder / f".{customer}.jsonl", folder / f"{customer}.jsonl"
        hidden.write_text(lines)
        os.replace(hidden, final)
        self.renamed[customer] = time.monotonic()

    def _watch(self) -> None:
        path = str(self.layout.table(STATE))
        table = None
        while not self._stop.wait(0.2):
            try:
                if table is None:
                    table = DeltaTable(path)
                else:
                    table.update_incremental()
                keys = table.to_pyarrow_table(columns=["customer_id"]).column("customer_id").to_pylist()
            except Exception:  # not created yet, or a commit being written: look again
                table = None
                continue
            now = time.monotonic()
            for key in keys:
                if key in self.renamed and key not in self.seen:
                    self.seen[key] = now

    def close(self) -> None:
        pass

    def wait_all(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.seen) < len(self.renamed) and time.monotonic() < deadline:
            time.sleep(0.5)

    def latencies(self) -> list[float]:
        return [self.seen[k] - self.renamed[k] for k in sorted(self.renamed) if k in self.seen]


class TopicArrivals(Arrivals):
    """Produces each customer's payments to the stream's topic, keyed by payment id, and counts from the moment the
    broker acknowledged them all (`flush`)."""

    topic = None  # the KafkaTopic, set by run_mode

    def __init__(self, layout: StorageLayout, tag: str):
        from confluent_kafka import Producer
        super().__init__(layout, tag)
        self.producer = Producer({"bootstrap.servers": self.topic.servers, "linger.ms": 5, "enable.idempotence": True,
                                  "compression.type": "lz4"})

    def write(self, index: int, events: int) -> None:
        customer, lines = self.lines(index, events)
        for i, line in enumerate(lines):
            self.producer.produce(self.topic.topic, value=line.encode(), key=f"{customer}-{i}".encode())
            if i % 5000 == 4999:
                self.producer.poll(0)
        self.producer.flush(60)
        self.renamed[customer] = time.monotonic()

    def close(self) -> None:
        self.producer.flush(60)
        del self.producer


def steady(layout: StorageLayout, tag: str, files: int, every_s: float, events: int, timeout_s: float,
           kind: type[Arrivals] = Arrivals) -> dict:
    with kind(layout, tag) as arrivals:
        started = time.monotonic()
        for i in range(files):
            arrivals.write(i, events)
            time.sleep(max(0.0, started + (i + 1) * every_s - time.monotonic()))
        arrivals.wait_all(timeout_s)
        arrivals.close()
    lat = arrivals.latencies()
    result = {"files": files, "every_s": every_s, "events_per_file": events, "visible": len(lat)}
    if len(lat) > 1:
        fifth = max(1, len(lat) // 5)
        keys = [k for k in sorted(arrivals.renamed) if k in arrivals.seen]
        arrived = [arrivals.renamed[k] - arrivals.renamed[keys[0]] for k in keys]
        # Seconds of lag gained per second of arrivals (least squares): ~0 when the mode keeps up.
        growth = statistics.linear_regression(arrived, lat).slope
        # Done: the events that became visible after the first set, over the time between the first set's being seen
        # and the last's. From the first arrival instead, the last set's latency counted as time spent, and a
        # rate kept up with (the lag not growing) showed as less done than offered.
        seen = sorted(arrivals.seen[k] for k in keys)
        span = seen[-1] - seen[0]
        result.update({"p50_s": round(statistics.median(lat), 2), "p99_s": round(_percentile(lat, 0.99), 2),
                       "min_s": round(min(lat), 2), "max_s": round(max(lat), 2),
                       "first_fifth_s": round(statistics.mean(lat[:fifth]), 2),
                       "last_fifth_s": round(statistics.mean(lat[-fifth:]), 2),
                       "lag_growth_s_per_s": round(growth, 3),
                       "events_per_s_done": round((len(lat) - 1) * events / span, 1) if span > 0 else None,
                       "lag_grew": len(lat) < files or growth > LAG_GROWTH_LIMIT})
    print(f"freshness {tag}: {json.dumps(result)}", flush=True)
    return result


def rates(layout: StorageLayout, steps: list[int], seconds: float, kind: type[Arrivals] = Arrivals) -> list[dict]:
    """Arrival rates (events/s, one file per second), each held for `seconds`; stops at the first rate whose
    lag grew (LAG_GROWTH_LIMIT)."""
    out = []
    for rate in steps:
        result = steady(layout, f"rate{rate}", int(seconds), 1.0, rate, timeout_s=300, kind=kind)
        out.append({"events_per_s": rate, **result})
        if result.get("lag_grew", True):
            break
    return out


def run_mode(home: Path, mode: str, *, files: int, every_s: float, rate_steps: list[int], rate_seconds: float,
             engine: bool = False, kind: type[Arrivals] = Arrivals) -> dict:
    """One mode under a fresh `dagster dev` over `home` (which already holds a little history); with `engine`,
    beside a warm Spark Connect server that every run uses; `kind`: files (Arrivals) or records (TopicArrivals)."""
    from assets.keys import CONTINUOUS_JOB
    from pipelines.runtime.warm_up import WARM_UP_BATCHES
    from statetables.servers import dagster_dev, free_port, launch_run, terminate_run, wait_for_run_end

    layout = StorageLayout.under(home)
    result: dict = {}
    # The engine warmed as `statetables dev` and `serve` warm theirs.
    with dagster_dev(layout, port=free_port(), engine_port=free_port() if engine else None,
                     log=home / "logs" / f"dagster-{mode}.log", warm_up_batches=WARM_UP_BATCHES) as url:
        run_id = None
        if mode == "continuous":
            run_id = launch_run(url, CONTINUOUS_JOB, {"ops": {"keep_streams_running": {"config": {}}}})
        if mode == "continuous" or engine:
            # Warm, as a deployment is: the queries are running, or the engine has compiled its first runs' code,
            # once the first files are visible.
            result["warmup"] = steady(layout, "warmup", 3, 2.0, 5, timeout_s=300, kind=kind)
        result["steady"] = steady(layout, mode, files, every_s, 10, timeout_s=600, kind=kind)
        if rate_steps:
            result["rates"] = rates(layout, rate_steps, rate_seconds, kind=kind)
        if run_id:
            terminate_run(url, run_id)
            result["run_status"] = wait_for_run_end(url, run_id, timeout_s=300)
    return result
