"""Running a stream in tests: `advance_stream` with its settings as keywords, and the shipped project's streams."""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Iterator

from pipelines.declare.project import SHIPPED, project
from pipelines.declare.specs import StreamSpec
from pipelines.runtime.micro_batch import StreamSettings, advance_stream
from pipelines.runtime.query import StreamRunResult
from pipelines.storage.layout import StorageLayout

# The two streams of the shipped project file (statetables.yaml), as the contract describes them.
_SHIPPED = project(SHIPPED).streams
MOVIE_TICKET_SALES, PAYMENTS = _SHIPPED["movie_ticket_sales"], _SHIPPED["payments"]
STREAMS = {MOVIE_TICKET_SALES.name: MOVIE_TICKET_SALES, PAYMENTS.name: PAYMENTS}
STATE_TABLES = {t.name for spec in STREAMS.values() for t in spec.state_tables}


def declared(spec: StreamSpec, *, dedup_horizon=None, max_ahead=None, ttl=None, watermark_delay=None,
             session_ttl=None) -> StreamSpec:
    """`spec` as a project file with these settings would declare it (None: as declared): `ttl` on its state
    tables, `session_ttl` on its session tables."""
    changes: dict = {}
    if dedup_horizon is not None:
        changes["dedup_horizon"] = dedup_horizon
    if max_ahead is not None:
        changes["max_ahead"] = max_ahead
    if ttl is not None:
        changes["state_tables"] = tuple(replace(t, ttl=ttl) for t in spec.state_tables)
    if watermark_delay is not None:
        changes["watermark_delay"] = watermark_delay
    if session_ttl is not None:
        changes["event_time_tables"] = tuple(replace(t, ttl=session_ttl) if t.kind == "session" else t
                                             for t in spec.event_time_tables)
    return replace(spec, **changes)


def advance(spark, layout: StorageLayout, spec: StreamSpec, *, dedup_horizon=None, max_ahead=None, ttl=None,
            watermark_delay=None, session_ttl=None, **settings) -> StreamRunResult:
    """One run of the stream's query (`event_time=False` leaves out the windowed and session tables, which tests
    of other steps do not need); declaration settings (TTL, horizons, watermarks) apply to this run's spec."""
    spec = declared(spec, dedup_horizon=dedup_horizon, max_ahead=max_ahead, ttl=ttl,
                    watermark_delay=watermark_delay, session_ttl=session_ttl)
    return advance_stream(spark, layout, spec, StreamSettings(**settings))


def project_with_ttl(ttl_days: dict[str, float], path) -> Path:
    """The shipped project file with `ttl_days` on the named state tables, written to `path`."""
    out, current = [], None
    for line in SHIPPED.read_text().splitlines():
        if line.startswith("  - CREATE TABLE "):
            name = line.split()[3]
            current = name if name in ttl_days and name in STATE_TABLES else None
            if current:
                out += [f"  - ttl_days: {ttl_days[name]}", "    sql: " + line[4:]]
                continue
        elif not line.startswith("    "):
            current = None
        out.append(("  " + line) if current else line)
    path.write_text("\n".join(out) + "\n")
    return path


def with_kafka(path: Path, bootstrap: str, *, max_records_per_batch: int = 400) -> Path:
    """Rewrite the project file at `path` (the shipped one, or one `project_with_ttl` wrote) so that both contract
    streams read topics `<stream>-events` and both state tables publish to `<table>-changes`, on `bootstrap`."""
    lines, out = path.read_text().splitlines(), []
    for line in lines:
        if line in ("  movie_ticket_sales:", "  payments:"):
            out += [line, f"    source: {{topic: {line.strip(' :')}-events, max_records_per_batch: "
                          f"{max_records_per_batch}}}"]
        elif line.startswith("  - CREATE TABLE ") and line.split()[3] in STATE_TABLES:
            # A plain state table: becomes a mapping with its topic.
            out += [f"  - changelog_topic: {line.split()[3]}-changes", "    sql: " + line[4:]]
        elif line.startswith("    sql: CREATE TABLE ") and line.split()[3] in STATE_TABLES:  # already a mapping
            out += [f"    changelog_topic: {line.split()[3]}-changes", line]
        else:
            out.append(line)
    # The continuation lines of a table that became a mapping are indented under its `sql:`.
    text, fixed, inside = "\n".join(out), [], False
    for line in text.splitlines():
        if line.startswith("  - changelog_topic: "):
            inside = True
        elif not line.startswith("    "):
            inside = False
        elif inside and not line.startswith("    sql: "):
            line = "  " + line
        fixed.append(line)
    path.write_text("\n".join(fixed) + f"\nkafka:\n  bootstrap_servers: {bootstrap}\n")
    return path


def redeliver(bootstrap: str, topic: str, id_field: str, count: int, rng) -> int:
    """Produce `count` of the topic's valid records again (chosen by `rng`), keyed by id as the generator keys them:
    a producer's retry, or a replay of its outbox. Returns how many it sent."""
    import json

    from confluent_kafka import Producer

    from tests.contract_oracle import topic_lines

    valid = []
    for records in topic_lines(bootstrap, topic).values():
        for _, value in records:
            try:
                event = json.loads(value)
            except ValueError:
                continue
            if isinstance(event, dict) and isinstance(event.get(id_field), str):
                valid.append((event[id_field], value))
    chosen = rng.sample(valid, min(count, len(valid)))
    producer = Producer({"bootstrap.servers": bootstrap, "log_level": 4})
    for key, value in chosen:
        producer.produce(topic, value=value, key=key.encode())
    assert producer.flush(30) == 0
    del producer
    return len(chosen)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextmanager
def batch_lines() -> Iterator[list[logging.LogRecord]]:
    """The micro-batch lines (`statetables.progress`) logged inside the block, each with its `figures`."""
    progress, handler = logging.getLogger("statetables.progress"), _Records()
    progress.addHandler(handler)
    try:
        yield handler.records
    finally:
        progress.removeHandler(handler)
