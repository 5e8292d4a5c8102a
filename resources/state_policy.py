"""How long the all-time state tables keep a key, as a Dagster resource (pipelines/expiry.py)."""

from __future__ import annotations

from datetime import timedelta

import dagster as dg
from pydantic import Field

from pipelines.errors import ConfigurationError
from pipelines.streams import STREAMS


class StatePolicyResource(dg.ConfigurableResource):
    """Per state table, an optional TTL on event time. Off for every table by default: a key is kept
    for as long as the table lives."""

    ttl_days: dict[str, float] = Field(default_factory=dict, description=(
        "Delete a state table's key once the table's newest event time is this many days past the key's "
        'newest event, e.g. {"payments_per_customer": 30}. Tables not listed keep every key. Each expiry '
        "is a delete in the table's changelog, with the key's totals; a key with later events starts a new "
        "row. Checks and rebuilds account for expired rows (docs/recovery.md)."))

    def ttl(self, table: str) -> timedelta | None:
        known = sorted(spec.state_table.name for spec in STREAMS.values())
        unknown = sorted(set(self.ttl_days) - set(known))
        if unknown:
            raise ConfigurationError(f"ttl_days names no state table: {', '.join(unknown)}. "
                                     f"Fix: use one of {', '.join(known)}.")
        days = self.ttl_days.get(table)
        if days is None:
            return None
        if not days > 0:
            raise ConfigurationError(f"ttl_days[{table!r}] is {days}: a TTL must be a positive number of days. "
                                     f"Fix: set a number > 0, or remove {table!r} to keep every key.")
        return timedelta(days=days)
