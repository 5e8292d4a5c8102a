"""The two event streams of the contract (../shared/contract.md): fields, rules, state tables.

Everything stream-specific is data here, so validation, bronze and the MERGE are written once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pipelines.errors import ConfigurationError

FieldKind = Literal["string", "decimal", "timestamp", "integer", "boolean"]


@dataclass(frozen=True)
class FieldRule:
    """One contract field: its JSON type and the rule its value must keep."""

    name: str
    kind: FieldKind
    required: bool = True
    max_length: int | None = None  # strings: characters after trimming
    trim: bool = False  # strings: stored trimmed (titles)
    min_value: str | None = None  # decimals and integers: lower bound, as exact text
    min_inclusive: bool = True
    max_value: str | None = None  # decimals and integers: upper bound, as exact text
    max_inclusive: bool = True


@dataclass(frozen=True)
class StateTableSpec:
    """A keyed aggregate kept by MERGE: one row per `key`, a count, a sum, first/last event time."""

    name: str
    key: str
    count_column: str
    sum_column: str
    first_ts_column: str
    last_ts_column: str


@dataclass(frozen=True)
class StreamSpec:
    name: str
    id_field: str
    value_field: str
    event_time_field: str
    fields: tuple[FieldRule, ...]
    state_table: StateTableSpec

    @property
    def bronze_table(self) -> str:
        return f"{self.name}_bronze"

    @property
    def quarantine_table(self) -> str:
        return f"{self.name}_quarantine"

    @property
    def files_table(self) -> str:
        """The ledger of landing content (pipelines/source.py)."""
        return f"{self.name}_files"

    @property
    def field_names(self) -> list[str]:
        return [f.name for f in self.fields]


MOVIE_TICKET_SALES = StreamSpec(
    name="movie_ticket_sales",
    id_field="event_id",
    value_field="ticket_total_value",
    event_time_field="sale_ts",
    fields=(
        FieldRule("event_id", "string"),
        FieldRule("title", "string", max_length=500, trim=True),
        FieldRule("ticket_total_value", "decimal", min_value="0", min_inclusive=True),
        FieldRule("sale_ts", "timestamp"),
        FieldRule("customer_id", "string", required=False),
    ),
    state_table=StateTableSpec(
        name="movie_tickets_sold",
        key="title",
        count_column="tickets_sold",
        sum_column="total_ticket_value",
        first_ts_column="first_sale_ts",
        last_ts_column="last_sale_ts",
    ),
)

PAYMENTS = StreamSpec(
    name="payments",
    id_field="payment_id",
    value_field="amount",
    event_time_field="paid_at",
    fields=(
        FieldRule("payment_id", "string"),
        FieldRule("customer_id", "string"),
        FieldRule("amount", "decimal", min_value="0", min_inclusive=False),
        FieldRule("paid_at", "timestamp"),
    ),
    state_table=StateTableSpec(
        name="payments_per_customer",
        key="customer_id",
        count_column="payment_count",
        sum_column="total_amount",
        first_ts_column="first_paid_at",
        last_ts_column="last_paid_at",
    ),
)

STREAMS: dict[str, StreamSpec] = {s.name: s for s in (MOVIE_TICKET_SALES, PAYMENTS)}


def stream_spec(name: str) -> StreamSpec:
    """The spec of a stream by name; an unknown name fails with the list of known ones."""
    try:
        return STREAMS[name]
    except KeyError:
        raise ConfigurationError(
            f"Unknown stream {name!r}. Fix: use one of {', '.join(sorted(STREAMS))}."
        ) from None
