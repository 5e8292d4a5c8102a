"""Sample landing files for any declared stream, valid by its declaration, with the faults the contract describes.

The two streams of the shipped project file get the demo's data (titles, customers); any other stream gets
values drawn from its fields' types and rules.

Each file is written under a hidden name (`.name`) and renamed when complete, as the contract asks
of every producer. Deterministic for a given seed; file names carry a run tag so that repeated
calls add files instead of overwriting them.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path

from pipelines.declare.specs import FieldRule, KafkaTopic, StreamSpec
from pipelines.storage import files

DEMO_STREAMS = ("movie_ticket_sales", "payments")
TOPIC_PARTITIONS = 4  # a source topic the generator creates  # the shipped project file's, with the demo's own values

_ADJECTIVES = ["Silent", "Crimson", "Last", "Hidden", "Electric", "Broken", "Golden", "Midnight", "Lost", "Iron",
               "Wild", "Frozen", "Burning", "Distant", "Quiet", "Final", "Secret", "Endless", "Northern", "Paper"]
_NOUNS = ["River", "Empire", "Garden", "Signal", "Horizon", "Harbor", "Machine", "Orchard", "Kingdom", "Voyage",
          "Mirror", "Frontier", "Lantern", "Circuit", "Tide", "Citadel", "Meadow", "Engine", "Summit", "Archive"]
TITLES = [f"The {a} {n}" for a in _ADJECTIVES for n in _NOUNS]  # 400 titles
MALFORMED_KINDS = (
    "not_json", "not_object", "missing_field", "empty_field", "wrong_type_id", "wrong_type_value",
    "non_numeric_value", "negative_value", "too_many_decimals", "timestamp_without_offset",
    "impossible_date", "invalid_utf8", "null_required",
)


@dataclass
class GenerationSummary:
    stream: str
    files: list[str] = field(default_factory=list)
    valid: int = 0
    malformed: int = 0
    duplicates: int = 0
    conflicts: int = 0
    late: int = 0


def _number(rule: FieldRule, rng: random.Random, integer: bool) -> Decimal:
    """A value inside the field's bounds (exclusive ones kept out)."""
    step = Decimal(1) if integer else Decimal("0.01")
    low = Decimal(rule.min_value) if rule.min_value is not None else Decimal(0)
    high = Decimal(rule.max_value) if rule.max_value is not None else low + 500
    if rule.min_value is not None and not rule.min_inclusive:
        low += step
    if rule.max_value is not None and not rule.max_inclusive:
        high -= step
    low, high = low.quantize(step, rounding="ROUND_CEILING"), high.quantize(step, rounding="ROUND_FLOOR")
    steps = int((high - low) / step) if high > low else 0
    return low + step * rng.randrange(steps + 1)


def _declared_event(spec: StreamSpec, rng: random.Random, n: int, ts: str, tag: str, keys: int) -> dict:
    """An event of a stream the demo data does not know, from its fields' types: strings from a few dozen values
    per field (so that state tables have keys to aggregate), numbers inside their bounds."""
    event: dict = {}
    for rule in spec.fields:
        if not rule.required and rng.random() < 0.3:
            continue
        if rule.name == spec.id_field:
            value = f"{spec.name[:3]}-{tag}-{n}"
        elif rule.name == spec.event_time_field:
            value = ts
        elif rule.kind == "string":
            value = f"{rule.name}-{rng.randrange(keys)}"[:rule.max_length or None]
        elif rule.kind in ("decimal", "integer"):
            number = _number(rule, rng, rule.kind == "integer")
            value = int(number) if rule.kind == "integer" else (float(number) if n % 2 else str(number))
        elif rule.kind == "boolean":
            value = rng.random() < 0.5
        else:  # another timestamp: around the event time
            value = ts
        event[rule.name] = value
    return event


def _value_target(spec: StreamSpec) -> str:
    """The field the malformed and conflicting lines change: the summed value, else a required number, else a
    required field other than the id."""
    required = [f for f in spec.fields if f.required and f.name != spec.id_field]
    numbers = [f.name for f in required if f.kind in ("decimal", "integer")]
    return spec.value_field or (numbers[0] if numbers else required[0].name)


def _event(spec: StreamSpec, rng: random.Random, n: int, event_time: datetime, tag: str,
           customers: int = 2000) -> dict:
    ts = event_time.strftime("%Y-%m-%dT%H:%M:%S") + (f".{rng.randrange(1000):03d}" if n % 3 else "") + "Z"
    cents = rng.randrange(100, 50_000)
    if spec.name not in DEMO_STREAMS:
        return _declared_event(spec, rng, n, ts, tag, keys=min(customers, 50))
    if spec.name == "movie_ticket_sales":
        event = {"event_id": f"t-{tag}-{n}", "title": rng.choice(TITLES),
                 "ticket_total_value": float(Decimal(cents) / 100) if n % 2 else f"{Decimal(cents) / 100}",
                 "sale_ts": ts}
        if rng.random() < 0.7:
            event["customer_id"] = f"c-{rng.randrange(customers)}"
        if n % 10 == 0:
            event["channel"] = "web"  # an unknown extra field: allowed, ignored
        return event
    return {"payment_id": f"p-{tag}-{n}", "customer_id": f"c-{rng.randrange(customers)}",
            "amount": float(Decimal(cents) / 100) if n % 2 else f"{Decimal(cents) / 100}", "paid_at": ts}


def _malformed(spec: StreamSpec, rng: random.Random, event: dict) -> bytes:
    kind = rng.choice(MALFORMED_KINDS)
    bad = dict(event)
    value = _value_target(spec)
    if kind == "not_json":
        return b'{"' + spec.id_field.encode() + b'": "truncated'
    if kind == "not_object":
        return json.dumps([event]).encode()
    if kind == "missing_field":
        bad.pop(value)
    elif kind == "empty_field":
        bad[spec.id_field] = "  "
    elif kind == "wrong_type_id":
        bad[spec.id_field] = rng.randrange(10**6)
    elif kind == "wrong_type_value":
        bad[value] = True
    elif kind == "non_numeric_value":
        bad[value] = "twelve"
    elif kind == "negative_value":
        bad[value] = -5.25
    elif kind == "too_many_decimals":
        bad[value] = 3.14159
    elif kind == "timestamp_without_offset":
        bad[spec.event_time_field] = bad[spec.event_time_field].rstrip("Z")
    elif kind == "impossible_date":
        bad[spec.event_time_field] = "2026-02-30T10:00:00Z"
    elif kind == "null_required":
        bad[spec.event_time_field] = None
    elif kind == "invalid_utf8":
        return json.dumps(bad).encode()[:-2] + b'\xff\xfe"}'
    return json.dumps(bad).encode()


class _TopicWriter:
    """Produces lines to a topic, each keyed by its event's id when it has one: every re-delivery of an id goes to
    the id's partition, after the first, so the topic keeps their order (dedup's first arrival)."""

    def __init__(self, spec: StreamSpec, topic: KafkaTopic):
        from confluent_kafka import Producer

        from pipelines.ingest.kafka_source import client_config
        self.spec, self.topic = spec, topic
        self.producer = Producer(client_config(topic, **{"enable.idempotence": True, "linger.ms": 20,
                                                         "batch.num.messages": 10_000, "compression.type": "lz4"}))

    def key(self, line: bytes) -> bytes | None:
        try:
            value = json.loads(line).get(self.spec.id_field)
        except (ValueError, AttributeError):
            return None
        return value.encode() if isinstance(value, str) else None

    def write(self, lines: list[bytes]) -> None:
        for line in lines:
            while True:
                try:
                    self.producer.produce(self.topic.topic, value=line, key=self.key(line))
                    break
                except BufferError:  # the local queue is full: let it drain
                    self.producer.poll(0.1)
            self.producer.poll(0)
        if self.producer.flush(60):
            raise RuntimeError(f"records to {self.topic.topic} not delivered within 60 s")

    def close(self) -> None:
        self.producer.flush(60)
        del self.producer  # librdkafka's handle closes with its last reference


def generate(spec: StreamSpec, landing_dir: Path | KafkaTopic, *, events: int, malformed: float = 0.005,
             duplicates: float = 0.01, conflicts: float = 0.001, late: float = 0.02, seed: int = 1,
             events_per_file: int = 20_000, start: datetime | None = None, customers: int = 2000,
             max_step_s: int = 30) -> GenerationSummary:
    """Write `events` lines for `spec` into `landing_dir`, or produce them to a topic (`events_per_file` lines a
    flush).

    >>> generate(stream_spec("payments"), Path("data/landing/payments"), events=100_000, seed=1).valid
    """
    rng = random.Random(seed)
    topic = _TopicWriter(spec, landing_dir) if isinstance(landing_dir, KafkaTopic) else None
    if topic is not None:
        from pipelines.ingest.kafka_source import ensure_topic
        ensure_topic(landing_dir, TOPIC_PARTITIONS)
    if topic is None:
        landing_dir.mkdir(parents=True, exist_ok=True)
    # Events advance up to 30 s each; they must all lie in the past (the contract quarantines events
    # more than a day after ingestion), so a large run starts early enough.
    clock = start or min(datetime(2026, 11, 1, tzinfo=timezone.utc),
                         datetime.now(timezone.utc) - timedelta(seconds=max_step_s * events, days=1))
    tag = f"{seed}-{time.time_ns()}"
    summary = GenerationSummary(stream=spec.name)
    accepted: list[bytes] = []
    accepted_events: list[dict] = []
    lines: list[bytes] = []

    def flush() -> None:
        if not lines:
            return
        if topic is not None:
            topic.write(lines)
            summary.files.append(f"kafka:{topic.topic.topic}")
            lines.clear()
            return
        name = f"{spec.name}-{tag}-{len(summary.files):05d}.jsonl"
        files.write_atomic(landing_dir / name, b"\n".join(lines) + b"\n")  # visible only once complete
        summary.files.append(name)
        lines.clear()

    for n in range(events):
        clock += timedelta(seconds=rng.randrange(1, max_step_s))
        roll = rng.random()
        if roll < duplicates and accepted:
            lines.append(rng.choice(accepted))
            summary.duplicates += 1
        elif roll < duplicates + conflicts and accepted_events:
            original = rng.choice(accepted_events)
            target = _value_target(spec)
            changed = dict(original, **{target: (not original[target]) if isinstance(original.get(target), bool)
                                        else 999 if isinstance(original.get(target), int) else "999.99"
                                        if spec.field(target).kind == "decimal" else f"{original.get(target)}-changed"})
            lines.append(json.dumps(changed).encode())
            summary.conflicts += 1
        elif roll < duplicates + conflicts + malformed:
            lines.append(_malformed(spec, rng, _event(spec, rng, n, clock, tag, customers)))
            summary.malformed += 1
        else:
            is_late = rng.random() < late
            event_time = clock - timedelta(hours=rng.randrange(2, 48)) if is_late else clock
            event = _event(spec, rng, n, event_time, tag, customers)
            line = json.dumps(event).encode()
            lines.append(line)
            accepted.append(line)
            accepted_events.append(event)
            summary.valid += 1
            summary.late += is_late
        if len(lines) >= events_per_file:
            flush()
    flush()
    if topic is not None:
        topic.close()
    return summary
