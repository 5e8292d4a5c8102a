"""An independent reading of ../shared/contract.md in plain Python (json, Decimal, datetime).

It shares no code with pipelines/: tests compare what Spark + Delta produced with what this
oracle expects from the same landing files, key by key, with exact decimals.
"""

from __future__ import annotations

import json
import os
import re
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timezone
from decimal import Decimal, InvalidOperation
from pathlib import Path

ISO = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}(:\d{2}(\.\d{1,6})?)?(Z|[+-]\d{2}:?\d{2})$")
MAX = Decimal("9999999999999999.99")

STREAMS = {
    "movie_ticket_sales": {"id": "event_id", "key": "title", "value": "ticket_total_value", "ts": "sale_ts",
                           "strings": {"event_id": True, "title": True, "customer_id": False},
                           "positive": False},
    "payments": {"id": "payment_id", "key": "customer_id", "value": "amount", "ts": "paid_at",
                 "strings": {"payment_id": True, "customer_id": True}, "positive": True},
}


def _number(raw) -> Decimal | None:
    if isinstance(raw, bool):
        return None
    if isinstance(raw, (int, float)):
        return Decimal(str(raw))
    if isinstance(raw, str):
        try:
            return Decimal(raw.strip())
        except InvalidOperation:
            return None
    return None


def check_line(stream: str, raw: bytes) -> tuple[dict | None, str | None]:
    """(normalised event, None) if valid, else (None, reason)."""
    s = STREAMS[stream]
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None, "invalid_utf8"
    try:
        doc = json.loads(text)
    except ValueError:
        return None, "not_json"
    if not isinstance(doc, dict):
        return None, "not_object"
    event = {}
    for name, required in s["strings"].items():
        value = doc.get(name)
        if value is None:
            if required:
                return None, "missing_field"
            event[name] = None
            continue
        if not isinstance(value, str):
            return None, "wrong_type"
        if not value.strip():
            return None, "empty_field"
        if name == "title":
            value = value.strip()
            if len(value) > 500:
                return None, "too_long"
        event[name] = value
    raw_value = doc.get(s["value"])
    if raw_value is None:
        return None, "missing_field"
    amount = _number(raw_value)
    if amount is None or not amount.is_finite():
        return None, "wrong_type"
    if amount < 0 or (s["positive"] and amount == 0) or abs(amount) > MAX:
        return None, "out_of_range"
    if amount != amount.quantize(Decimal("0.01")):
        return None, "too_many_decimals"
    event[s["value"]] = amount.quantize(Decimal("0.01"))
    raw_ts = doc.get(s["ts"])
    if raw_ts is None:
        return None, "missing_field"
    if not isinstance(raw_ts, str):
        return None, "wrong_type"
    if not ISO.match(raw_ts):
        return None, "invalid_timestamp"
    try:
        event[s["ts"]] = datetime.fromisoformat(raw_ts.replace("Z", "+00:00")).astimezone(timezone.utc)
    except ValueError:
        return None, "invalid_timestamp"
    return event, None


@dataclass
class Expected:
    counts: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    sums: dict[str, Decimal] = field(default_factory=lambda: defaultdict(Decimal))
    accepted: int = 0
    quarantined: int = 0
    duplicates: int = 0
    reasons: dict[str, int] = field(default_factory=lambda: defaultdict(int))


def expected_state(stream: str, files: list[Path]) -> Expected:
    """Per-key counts and sums the state table must hold after ingesting `files` (any batching).

    Files are taken in arrival order (modification time, then name); the first accepted content of
    an id wins, an identical re-delivery counts once, a different one is a conflict.
    """
    s = STREAMS[stream]
    out = Expected()
    seen: dict[str, tuple] = {}
    for path in sorted(files, key=lambda p: (os.stat(p).st_mtime_ns, str(p))):
        data = path.read_bytes()
        lines = data.split(b"\n")
        if lines and lines[-1] == b"":
            lines.pop()
        for raw in lines:
            event, reason = check_line(stream, raw)
            if reason:
                out.quarantined += 1
                out.reasons[reason] += 1
                continue
            identity = tuple(sorted((k, str(v)) for k, v in event.items()))
            previous = seen.get(event[s["id"]])
            if previous is not None:
                if previous == identity:
                    out.duplicates += 1
                else:
                    out.quarantined += 1
                    out.reasons["conflicting_duplicate"] += 1
                continue
            seen[event[s["id"]]] = identity
            out.accepted += 1
            out.counts[event[s["key"]]] += 1
            out.sums[event[s["key"]]] += event[s["value"]]
    return out


def landing_files(folder: Path) -> list[Path]:
    return [p for p in folder.glob("*.jsonl") if not p.name.startswith(("_", "."))]
