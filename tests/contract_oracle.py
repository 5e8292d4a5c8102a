"""An independent reading of ../shared/contract.md in plain Python (json, Decimal, datetime, re).

It shares no code with pipelines/: tests compare what Spark + Delta produced with what this
oracle expects from the same landing files, key by key, with exact decimals.

The validation rules it reads, in the order they are applied to a line:
- bytes that are not UTF-8 → invalid_utf8; not exactly one JSON value (syntax error, trailing
  content, NaN/Infinity, a key twice in one object) → not_json; a JSON value that is not an
  object → not_object;
- then the stream's fields in order (movie_ticket_sales: event_id, title, ticket_total_value,
  sale_ts, customer_id; payments: payment_id, customer_id, amount, paid_at); the first failing
  check wins. "Trimmed" always means without JSON whitespace (space, tab, LF, CR) at both ends;
- strings: missing_field, wrong_type, invalid_utf8 (an escaped lone surrogate, as "\\ud83c" alone), empty_field,
  too_long (title: > 500 code points, trimmed);
  the title is kept trimmed, the other strings as given;
- the value: missing_field; wrong_type (bool, object, array, or a string that is not a number);
  empty_field (blank string); out_of_range (< 0 for tickets, <= 0 for payments,
  > 9999999999999999.99); too_many_decimals; kept as DECIMAL(18,2). Every value is read exactly
  from its text, a JSON number literal as a numeric string, whatever its exponent or length;
- the event time: missing_field; wrong_type (not a string); invalid_timestamp (not
  `YYYY-MM-DDTHH:MM[:SS[.ffffff]](Z|±HH[:]MM)`, not a real date-time, offset beyond ±18:00);
  out_of_range (in UTC, before 1970-01-01T00:00:00Z or after ingestion time + 1 day).
Re-deliveries: an event is compared with the accepted events of its id whose event time lies within the
dedup horizon (default 7 days) of its own: same normalised content (every contract field as kept) counts
once; other content → conflicting_duplicate; none there → a new event (the id reused). First arrival wins;
arrival order is file modification time, then full path, then line number.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path
from typing import Iterable, NamedTuple

MAX = Decimal("9999999999999999.99")
CENT = Decimal("0.01")
DEFAULT_MAX_AHEAD = timedelta(days=1)
DEFAULT_HORIZON = timedelta(days=7)
EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
JSON_WHITESPACE = " \t\n\r"
TITLE_MAX = 500
NESTING_LIMIT = 20_000  # deeper lines are not judged (RecursionError → not_json): tests stay below
# Limits of Spark's JSON parser (Jackson's StreamReadConstraints), which the implementation inherits:
# a number literal longer than 1000 characters, or a line nested more than 999 levels deep (the implementation
# wraps each line in one array), is not readable JSON.
MAX_NUMBER_LENGTH = 1000
MAX_NESTING = 1000

# re.fullmatch, not `$`: Python's (and Java's) `$` also matches before a final "\n".
ISO = re.compile(r"([0-9]{4})-([0-9]{2})-([0-9]{2})T([0-9]{2}):([0-9]{2})(?::([0-9]{2})(?:\.([0-9]{1,6}))?)?"
                 r"(Z|([+-])([0-9]{2}):?([0-9]{2}))")
NUMERIC_STRING = re.compile(r"([+-]?)(?:([0-9]+)(?:\.([0-9]*))?|\.([0-9]+))(?:[eE]([+-]?[0-9]+))?")


@dataclass(frozen=True)
class StreamRules:
    id: str
    key: str
    value: str
    ts: str
    fields: tuple[str, ...]  # contract fields, in the order they are checked
    strings: dict[str, bool]  # string field → required
    positive: bool  # value must be > 0 (else >= 0)


STREAMS = {
    "movie_ticket_sales": StreamRules(
        id="event_id", key="title", value="ticket_total_value", ts="sale_ts",
        fields=("event_id", "title", "ticket_total_value", "sale_ts", "customer_id"),
        strings={"event_id": True, "title": True, "customer_id": False}, positive=False),
    "payments": StreamRules(
        id="payment_id", key="customer_id", value="amount", ts="paid_at",
        fields=("payment_id", "customer_id", "amount", "paid_at"),
        strings={"payment_id": True, "customer_id": True}, positive=True),
}


@dataclass(frozen=True)
class Number:
    """A JSON number as its literal text, so the oracle decides how exactly it is read."""

    text: str


class Verdict(NamedTuple):
    event: dict | None  # the normalised event when valid
    reason: str | None  # None when valid
    field: str | None  # the offending field, for field-level reasons


class _Invalid(Exception):
    def __init__(self, reason: str, field_name: str | None = None):
        super().__init__(reason)
        self.reason, self.field = reason, field_name


def trim(text: str) -> str:
    return text.strip(JSON_WHITESPACE)


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _object_without_duplicate_keys(pairs: list[tuple[str, object]]) -> dict:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError("duplicate key")
    return dict(pairs)


def parse_json(text: str):
    """The one JSON value of `text`; ValueError when it is not exactly one (strict) JSON value."""
    # Python's parser recurses once per nesting level; deep nesting is still JSON, so the limit is
    # raised for the parse (a line is at most a few MB: far below what the C stack holds).
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, NESTING_LIMIT))
    try:
        value = json.loads(text, parse_float=_number, parse_int=_number, parse_constant=_refuse_constant,
                           object_pairs_hook=_object_without_duplicate_keys)
    finally:
        sys.setrecursionlimit(limit)
    if _depth(value) + 1 > MAX_NESTING:
        raise ValueError("nested too deep for Spark's JSON parser")
    return value


def _number(literal: str) -> "Number":
    is_integer = not any(c in literal for c in ".eE")
    if len(literal.lstrip("-") if is_integer else literal) > MAX_NUMBER_LENGTH:
        raise ValueError("number literal longer than Spark's JSON parser reads")
    return Number(literal)


def _depth(value) -> int:
    """Nesting levels of arrays and objects (iterative: a deep line must not exhaust the stack)."""
    deepest, pending = 0, [(value, 1)]
    while pending:
        item, level = pending.pop()
        if isinstance(item, (list, dict)):
            deepest = max(deepest, level)
            pending.extend((child, level + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def _exact_decimal(sign: str, whole: str, fraction: str, exponent: str) -> Decimal | str:
    """The exact value of a numeric text, or "huge"/"tiny" when its exponent is beyond what
    Decimal can hold (a value that is surely > MAX, or nonzero and surely < 0.01)."""
    digits = (whole + fraction).lstrip("0")
    if not digits:
        return Decimal(0)
    exp_digits = exponent.lstrip("+-").lstrip("0") or "0"
    if len(exp_digits) > 18:  # |exponent| >= 1e18: no Decimal, and no int(): str→int has a digit limit
        huge = not exponent.startswith("-")
        return ("-" if sign == "-" else "") + ("huge" if huge else "tiny")
    exp = int(exp_digits) * (-1 if exponent.startswith("-") else 1)
    # value = 0.d1d2... × 10^(adjusted + 1), with d1 != 0
    adjusted = exp + len(whole) - 1 - (len(whole + fraction) - len((whole + fraction).lstrip("0")))
    if adjusted > 17:
        return ("-" if sign == "-" else "") + "huge"
    if adjusted < -3:
        return ("-" if sign == "-" else "") + "tiny"
    return Decimal(f"{sign}{whole or '0'}.{fraction or '0'}E{exp}")


def _value(raw, rules: StreamRules) -> Decimal:
    name = rules.value
    if raw is None:
        raise _Invalid("missing_field", name)
    if isinstance(raw, (str, Number)):
        text = trim(raw) if isinstance(raw, str) else raw.text
        if not text:
            raise _Invalid("empty_field", name)
        match = NUMERIC_STRING.fullmatch(text)
        if not match:
            raise _Invalid("wrong_type", name)
        sign, whole, fraction, only_fraction, exponent = match.groups()
        value = _exact_decimal(sign, whole or "", (fraction if whole is not None else only_fraction) or "",
                               exponent or "0")
    else:  # bool, object, array
        raise _Invalid("wrong_type", name)
    if isinstance(value, str):
        if value.startswith("-") or value == "huge":
            raise _Invalid("out_of_range", name)
        raise _Invalid("too_many_decimals", name)  # "tiny": nonzero, smaller than a cent
    if not value.is_finite() or value < 0 or (rules.positive and value == 0) or value > MAX:
        raise _Invalid("out_of_range", name)
    kept = value.quantize(CENT)
    if kept != value:
        raise _Invalid("too_many_decimals", name)
    return abs(kept)  # -0 is kept as 0.00


def _event_time(raw, name: str, ingested_at: datetime, max_ahead: timedelta) -> datetime:
    if raw is None:
        raise _Invalid("missing_field", name)
    if not isinstance(raw, str):
        raise _Invalid("wrong_type", name)
    match = ISO.fullmatch(raw)
    if not match:
        raise _Invalid("invalid_timestamp", name)
    year, month, day, hour, minute, second, fraction, zone, sign, off_h, off_m = match.groups()
    # ISO 8601's proleptic calendar has a year 0000 (1 BC, a leap year); Python's datetime starts at
    # year 1, so year 0 is read as year 400 (same calendar: 400 years repeat exactly) moved back.
    shift = timedelta(days=146097) if year == "0000" else timedelta(0)
    try:
        local = datetime(int(year) + (400 if shift else 0), int(month), int(day), int(hour), int(minute),
                         int(second or 0), int((fraction or "").ljust(6, "0")))
    except ValueError:
        raise _Invalid("invalid_timestamp", name) from None
    offset = timedelta(0)
    if zone != "Z":
        if int(off_m) > 59:
            raise _Invalid("invalid_timestamp", name)
        offset = timedelta(hours=int(off_h), minutes=int(off_m))
        if offset > timedelta(hours=18):
            raise _Invalid("invalid_timestamp", name)
        offset = -offset if sign == "-" else offset
    # Instant as a distance from the epoch: no datetime arithmetic that overflows at year 1 or 9999.
    since_epoch = (local - datetime(1970, 1, 1)) - shift - offset
    if since_epoch < timedelta(0) or since_epoch > ingested_at + max_ahead - EPOCH:
        raise _Invalid("out_of_range", name)
    return EPOCH + since_epoch


def judge_line(stream: str, raw: bytes, *, ingested_at: datetime | None = None,
               max_ahead: timedelta = DEFAULT_MAX_AHEAD) -> Verdict:
    """The verdict on one line: the normalised event, or the reason and field it is malformed."""
    rules = STREAMS[stream]
    ingested_at = _utc(ingested_at or datetime.now(timezone.utc))
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return Verdict(None, "invalid_utf8", None)
    try:
        doc = parse_json(text)
    except (ValueError, RecursionError):  # RecursionError: beyond NESTING_LIMIT, see parse_json
        return Verdict(None, "not_json", None)
    if not isinstance(doc, dict):
        return Verdict(None, "not_object", None)
    event: dict = {}
    try:
        for name in rules.fields:
            raw_value = doc.get(name)
            if name == rules.value:
                event[name] = _value(raw_value, rules)
            elif name == rules.ts:
                event[name] = _event_time(raw_value, name, ingested_at, max_ahead)
            else:
                event[name] = _string(raw_value, name, rules.strings[name])
    except _Invalid as invalid:
        return Verdict(None, invalid.reason, invalid.field)
    return Verdict(event, None, None)


def _string(raw, name: str, required: bool) -> str | None:
    if raw is None:
        if required:
            raise _Invalid("missing_field", name)
        return None
    if not isinstance(raw, str):
        raise _Invalid("wrong_type", name)
    try:
        raw.encode("utf-8")
    except UnicodeEncodeError:  # json.loads keeps an escaped lone surrogate, which no UTF-8 text can hold
        raise _Invalid("invalid_utf8", name) from None
    trimmed = trim(raw)
    if not trimmed:
        raise _Invalid("empty_field", name)
    if name == "title":
        if len(trimmed) > TITLE_MAX:
            raise _Invalid("too_long", name)
        return trimmed
    return raw


def check_line(stream: str, raw: bytes, ingested_at: datetime | None = None,
               max_ahead: timedelta = DEFAULT_MAX_AHEAD) -> tuple[dict | None, str | None]:
    """(normalised event, None) if valid, else (None, reason)."""
    verdict = judge_line(stream, raw, ingested_at=ingested_at, max_ahead=max_ahead)
    return verdict.event, verdict.reason


def content(stream: str, event: dict) -> tuple:
    """An event's normalised content: every contract field as kept (title trimmed, DECIMAL(18,2)
    value, UTC instant; a missing optional field is None, unlike any present value)."""
    return tuple(event[name] for name in STREAMS[stream].fields)


def _utc(moment: datetime) -> datetime:
    return moment.replace(tzinfo=timezone.utc) if moment.tzinfo is None else moment.astimezone(timezone.utc)


@dataclass
class Expected:
    counts: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    sums: dict[str, Decimal] = field(default_factory=lambda: defaultdict(Decimal))
    accepted: int = 0
    quarantined: int = 0
    duplicates: int = 0
    reasons: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    # id → accepted event (an id reused beyond the horizon: its newest); every accepted event's id, in arrival
    # order; (source, line number, reason) of every quarantined line
    events: dict[str, dict] = field(default_factory=dict)
    accepted_ids: list[str] = field(default_factory=list)
    quarantine: list[tuple[str, int, str]] = field(default_factory=list)
    lines: int = 0


class Oracle:
    """Takes deliveries in arrival order and keeps what the tables must hold after them.

    >>> oracle = Oracle("payments")
    >>> oracle.deliver("a.jsonl", [b'{"payment_id":"p1",...}'])
    >>> oracle.expected.counts
    """

    def __init__(self, stream: str, *, max_ahead: timedelta = DEFAULT_MAX_AHEAD, horizon: timedelta = DEFAULT_HORIZON):
        self.stream, self.max_ahead, self.horizon = stream, max_ahead, horizon
        self.expected = Expected()
        self._seen: dict[str, list[tuple[datetime, tuple]]] = defaultdict(list)  # id → (event time, content) accepted

    def deliver(self, source: str, lines: Iterable[bytes], *, first_line_number: int = 1,
                ingested_at: datetime | None = None) -> None:
        rules, out = STREAMS[self.stream], self.expected
        for number, raw in enumerate(lines, start=first_line_number):
            out.lines += 1
            verdict = judge_line(self.stream, raw, ingested_at=ingested_at, max_ahead=self.max_ahead)
            reason = verdict.reason
            if reason is None:
                event = verdict.event
                identity, at = content(self.stream, event), event[rules.ts]
                near = {c for t, c in self._seen[event[rules.id]] if abs(t - at) <= self.horizon}
                if not near:
                    self._seen[event[rules.id]].append((at, identity))
                    out.accepted += 1
                    out.events[event[rules.id]] = event  # an id reused beyond the horizon: its newest event
                    out.accepted_ids.append(event[rules.id])
                    out.counts[event[rules.key]] += 1
                    out.sums[event[rules.key]] += event[rules.value]
                    continue
                if identity in near:
                    out.duplicates += 1
                    continue
                reason = "conflicting_duplicate"
            out.quarantined += 1
            out.reasons[reason] += 1
            out.quarantine.append((source, number, reason))


def file_lines(path: Path) -> list[bytes]:
    """A landing file's lines as received (gunzipped for .gz); a final newline ends the last line."""
    data = path.read_bytes()
    if path.name.endswith(".gz"):
        data = gzip.decompress(data)
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    return lines


def arrival_key(path) -> tuple[int, str]:
    return (path.mtime_ns if isinstance(path, ObjectFile) else os.stat(path).st_mtime_ns), str(path)


def expected_state(stream: str, files: list[Path], ingested_at: datetime | None = None,
                   max_ahead: timedelta = DEFAULT_MAX_AHEAD) -> Expected:
    """Per-key counts and sums the state table must hold after ingesting `files` (any batching).

    Files are taken in arrival order (modification time, then full path); the first accepted
    content of an id wins, an identical re-delivery counts once, a different one is a conflict.
    """
    oracle = Oracle(stream, max_ahead=max_ahead)
    for path in sorted(files, key=arrival_key):
        oracle.deliver(str(path), file_lines(path), ingested_at=ingested_at)
    return oracle.expected


def is_landing_file(relative: Path) -> bool:
    """A landing file, by its path below landing/<stream>/: *.jsonl or *.jsonl.gz, and no part of
    the path (file or folder) starting with `_` or `.` (still being written)."""
    return (relative.name.endswith((".jsonl", ".jsonl.gz"))
            and not any(part.startswith(("_", ".")) for part in relative.parts))


def landing_files(folder) -> list:
    """Every landing file under `folder`, at any depth (names are never patterns). `folder` may be an object-store
    prefix (`s3a://bucket/key`, or the product's S3Path): then its objects, listed with boto3 (`ObjectFile`)."""
    if str(folder).startswith("s3a://"):
        return object_files(str(folder))
    found = []
    for root, dirs, names in os.walk(folder):
        for name in names:
            path = Path(root) / name
            if path.is_file() and is_landing_file(path.relative_to(folder)):
                found.append(path)
    return found


@dataclass(frozen=True)
class ObjectFile:
    """A landing file in a bucket, as the oracle reads it: its URI, its LastModified, its bytes on demand."""

    uri: str
    mtime_ns: int

    def __str__(self) -> str:
        return self.uri

    @property
    def name(self) -> str:
        return self.uri.rsplit("/", 1)[-1]

    def read_bytes(self) -> bytes:
        bucket, key = self.uri[len("s3a://"):].split("/", 1)
        return _s3().get_object(Bucket=bucket, Key=key)["Body"].read()


def independent_table(path):
    """The Delta table at `path` through `deltalake` (delta-rs), not Spark; an s3a:// table with the credentials and
    endpoint of the environment, over plain HTTP when the endpoint is."""
    from deltalake import DeltaTable

    if not str(path).startswith("s3a://"):
        return DeltaTable(str(path))
    endpoint = os.environ.get("AWS_ENDPOINT_URL", "")
    options = {"AWS_REGION": os.environ.get("AWS_REGION") or "us-east-1",
               "AWS_ACCESS_KEY_ID": os.environ.get("AWS_ACCESS_KEY_ID", ""),
               "AWS_SECRET_ACCESS_KEY": os.environ.get("AWS_SECRET_ACCESS_KEY", "")}
    if endpoint:
        options.update({"AWS_ENDPOINT_URL": endpoint, "AWS_ALLOW_HTTP": str(endpoint.startswith("http:")).lower(),
                        "AWS_VIRTUAL_HOSTED_STYLE_REQUEST": "false"})
    return DeltaTable(str(path), storage_options=options)


def _s3():
    import boto3

    return boto3.client("s3", endpoint_url=os.environ.get("AWS_ENDPOINT_URL") or None,
                        region_name=os.environ.get("AWS_REGION") or "us-east-1")


def object_files(prefix_uri: str) -> list[ObjectFile]:
    bucket, _, prefix = prefix_uri[len("s3a://"):].partition("/")
    prefix = prefix.rstrip("/") + "/"
    found = []
    for page in _s3().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for item in page.get("Contents", []):
            if is_landing_file(Path(item["Key"][len(prefix):])):
                found.append(ObjectFile(f"s3a://{bucket}/{item['Key']}",
                                        int(item["LastModified"].timestamp() * 1_000_000) * 1000))
    return found


@dataclass
class WindowedExpected:
    """What the windowed outputs must hold (contract: "Windowed outputs")."""

    windows: dict[tuple[str, datetime], tuple[int, Decimal]]  # closed (title, window start) → tickets, value
    late: dict[str, tuple[datetime, datetime]]  # event id → (event time, watermark it missed)
    top: dict[datetime, list[tuple[int, str, int]]]  # window start → [(rank, title, tickets)]
    watermark: datetime | None


def expected_windows(batches: list[list[dict]], delay: timedelta, *, watermark_after_last: bool) -> WindowedExpected:
    """Sales in micro-batches, in order (each a list of accepted events with `title`, `sale_ts`,
    `ticket_total_value`, `event_id`). A batch's watermark is the newest event time of the earlier
    batches minus `delay`; a sale at or behind it is late; a one-hour window is written once the
    watermark reaches its end. `watermark_after_last`: the last batch's own sales advanced it too."""
    hour = timedelta(hours=1)
    open_windows: dict[tuple[str, datetime], list] = defaultdict(lambda: [0, Decimal(0)])
    late: dict[str, tuple[datetime, datetime]] = {}
    newest: datetime | None = None
    for batch in batches:
        watermark = newest - delay if newest is not None else None
        for sale in batch:
            moment = sale["sale_ts"]
            if watermark is not None and moment <= watermark:
                late[sale["event_id"]] = (moment, watermark)
                continue
            start = moment.replace(minute=0, second=0, microsecond=0)
            open_windows[(sale["title"], start)][0] += 1
            open_windows[(sale["title"], start)][1] += sale["ticket_total_value"]
        newest = max([newest] * (newest is not None) + [s["sale_ts"] for s in batch], default=None)
    if not watermark_after_last and batches:
        earlier = [s["sale_ts"] for batch in batches[:-1] for s in batch]
        newest = max(earlier, default=None)
    watermark = newest - delay if newest is not None else None
    windows = {key: (n, value) for key, (n, value) in open_windows.items()
               if watermark is not None and key[1] + hour <= watermark}
    top: dict[datetime, list[tuple[int, str, int]]] = {}
    for start in {s for _, s in windows}:
        titles = sorted(((n, value, title) for (title, s), (n, value) in windows.items() if s == start),
                        key=lambda t: (-t[0], -t[1], t[2]))[:10]
        top[start] = [(rank, title, n) for rank, (n, _, title) in enumerate(titles, start=1)]
    return WindowedExpected(windows, late, top, watermark)


@dataclass
class SessionsExpected:
    """What customer_activity and the payments' late events must hold."""

    sessions: dict[tuple[str, datetime], tuple]  # (customer, start) → (end, payments, amount, last ids,
    #                                               previous session end, day amount)
    late: dict[str, tuple[datetime, datetime]]  # payment id → (event time, watermark it missed)


def expected_sessions(batches: list[list[dict]], delay: timedelta, gap: timedelta, ttl: timedelta) -> SessionsExpected:
    """Payments in runs, in order (each run one micro-batch of accepted payments, then the watermark moves
    to its newest payment minus `delay`). A payment at or behind the watermark of its run is late. A
    customer's payments less than `gap` apart are one session; it closes in the run whose watermark is
    at least its last payment + `gap`. Per customer, closed sessions carry the previous session's end and
    the customer's running total for the UTC day the session ended, unless the session started `ttl` or
    more after the previous one ended: the customer was forgotten, with every day total."""
    open_payments: dict[str, list[tuple[datetime, str, Decimal]]] = defaultdict(list)
    late: dict[str, tuple[datetime, datetime]] = {}
    sessions: dict[tuple[str, datetime], tuple] = {}
    previous: dict[str, datetime] = {}
    day_totals: dict[tuple[str, object], Decimal] = defaultdict(Decimal)
    newest: datetime | None = None
    for batch in batches:
        watermark = newest - delay if newest is not None else None
        for p in batch:
            if watermark is not None and p["paid_at"] <= watermark:
                late[p["payment_id"]] = (p["paid_at"], watermark)
            else:
                open_payments[p["customer_id"]].append((p["paid_at"], p["payment_id"], p["amount"]))
        newest = max([newest] * (newest is not None) + [p["paid_at"] for p in batch], default=None)
        if newest is None:
            continue
        watermark = newest - delay
        for customer, payments in open_payments.items():
            groups: list[list] = []
            for p in sorted(payments):
                if groups and p[0] - groups[-1][-1][0] < gap:
                    groups[-1].append(p)
                else:
                    groups.append([p])
            kept = []
            for group in groups:
                if group[-1][0] + gap > watermark:
                    kept.extend(group)
                    continue
                end, amount = group[-1][0], sum(p[2] for p in group)
                if customer in previous and group[0][0] - previous[customer] >= ttl:
                    del previous[customer]
                    for key in [k for k in day_totals if k[0] == customer]:
                        del day_totals[key]
                day_totals[(customer, end.date())] += amount
                sessions[(customer, group[0][0])] = (
                    end, len(group), amount, [p[1] for p in reversed(group[-5:])], previous.get(customer),
                    day_totals[(customer, end.date())])
                previous[customer] = end
            open_payments[customer] = kept
    return SessionsExpected(sessions, late)


@dataclass
class TtlExpected:
    """A state table with a TTL: its rows, and every row it expired (in order)."""

    rows: dict[str, tuple[int, Decimal]]  # key → count, sum
    expired: list[tuple[str, int, Decimal]]  # (key, count, sum) of each expired row


def expected_with_ttl(stream: str, batches: list[list[Path]], ttl: timedelta) -> TtlExpected:
    """Files in micro-batches, in order. Each batch's newly accepted events are added to their key's
    row; then every row whose newest event is more than `ttl` older than the newest event accepted so
    far is expired. A key with events after its expiry starts a new row."""
    rules, oracle = STREAMS[stream], Oracle(stream)
    rows: dict[str, list] = {}  # key → [count, sum, newest event time]
    expired: list[tuple[str, int, Decimal]] = []
    clock = None
    for batch in batches:
        before = set(oracle.expected.events)
        for path in sorted(batch, key=arrival_key):
            oracle.deliver(str(path), file_lines(path))
        new = [e for i, e in oracle.expected.events.items() if i not in before]
        if not new:
            continue
        for event in new:
            row = rows.setdefault(event[rules.key], [0, Decimal(0), event[rules.ts]])
            row[0], row[1], row[2] = row[0] + 1, row[1] + event[rules.value], max(row[2], event[rules.ts])
            clock = max(clock or event[rules.ts], event[rules.ts])
        for key in sorted(k for k, r in rows.items() if r[2] < clock - ttl):
            expired.append((key, rows[key][0], rows[key][1]))
            del rows[key]
    return TtlExpected({k: (r[0], r[1]) for k, r in rows.items()}, expired)


def topic_lines(bootstrap: str, topic: str, timeout_s: float = 30.0, consumer_options: dict | None = None
                ) -> dict[int, list[tuple[int, bytes]]]:
    """Every record of a topic as (offset, value) per partition, read with confluent-kafka (not Spark); a record
    without a value is an empty line."""
    from confluent_kafka import Consumer, KafkaError, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "oracle", "enable.auto.commit": False,
                         "enable.partition.eof": True, "auto.offset.reset": "earliest", **(consumer_options or {})})
    try:
        partitions = sorted(consumer.list_topics(topic, timeout=timeout_s).topics[topic].partitions)
        out: dict[int, list[tuple[int, bytes]]] = {}
        for partition in partitions:
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=timeout_s)
            out[partition] = []
            if high <= low:
                continue
            consumer.assign([TopicPartition(topic, partition, low)])
            while True:
                message = consumer.poll(timeout_s)
                assert message is not None, f"no answer reading {topic} [{partition}]"
                if message.error():
                    assert message.error().code() == KafkaError._PARTITION_EOF, message.error()
                    break
                out[partition].append((message.offset(), message.value() or b""))
                if message.offset() + 1 >= high:
                    break
        return out
    finally:
        consumer.close()


def expected_from_topic(stream: str, bootstrap: str, topic: str, consumer_options: dict | None = None) -> Expected:
    """`expected_state` of a topic's records: each partition in offset order, a record's source
    `kafka:<topic>/<partition>` and its line number its offset. The generator keys every record by its event's id,
    so all deliveries of an id share a partition and their order there is their arrival order."""
    oracle = Oracle(stream)
    for partition, records in topic_lines(bootstrap, topic, consumer_options=consumer_options).items():
        for offset, value in records:
            oracle.deliver(f"kafka:{topic}/{partition}", [value], first_line_number=offset)
    return oracle.expected


def accepted_per_file(stream: str, folder) -> list[list[dict]]:
    """Each landing file's accepted events under `folder` (judged by this oracle, not by the pipeline), in arrival
    order: what each micro-batch holds when every file is one micro-batch (a run with one file per trigger)."""
    oracle, batches = Oracle(stream), []
    for path in sorted(landing_files(folder), key=arrival_key):
        before = set(oracle.expected.events)
        oracle.deliver(str(path), file_lines(path))
        batches.append([e for i, e in oracle.expected.events.items() if i not in before])
    return batches
