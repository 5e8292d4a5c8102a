"""How a run's results are shown in the Dagster UI: rows as real tables, event times as timestamps, why a
recovery ran, and where the runbook is."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal
from pathlib import Path

import dagster as dg
from pyspark.sql import DataFrame

from assets.keys import RECOVERY_ATTEMPT_TAG, RECOVERY_OF_TAG, RECOVERY_REASON_TAG
from pipelines.operate.table_checks import TOP_ROWS
from pipelines.runtime.query import StreamRunResult

RUNBOOK = Path(__file__).resolve().parent.parent / "docs" / "recovery.md"
# In every asset's definition metadata (the asset page's Definition tab), and named in the descriptions.
RUNBOOK_METADATA = {"runbook": dg.MetadataValue.path(str(RUNBOOK))}
RUNBOOK_LINE = " When a check fails or a recovery runs, the runbook is docs/recovery.md (path in `runbook`)."


def _cell(value):
    """A Spark value as a table cell: TableRecord takes str, int, float, bool or None; DECIMAL stays exact as text."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, Decimal):
        return str(value)
    if isinstance(value, dt.datetime):  # as Spark returns it: naive, in the session's UTC
        if value.tzinfo is not None:
            value = value.astimezone(dt.timezone.utc).replace(tzinfo=None)
        return value.isoformat(sep=" ")
    if isinstance(value, (list, tuple)):
        return ", ".join(str(_cell(v)) for v in value)
    return str(value)


def frame_table(frame: DataFrame, limit: int = TOP_ROWS, *, rows_known: int | None = None) -> dg.MetadataValue:
    """Up to `limit` rows of `frame` as a Dagster table, typed by the frame's schema. A frame known to be empty
    (`rows_known=0`) costs no Spark job: a passing check or a run without quarantined lines reads nothing more."""
    schema = dg.TableSchema(columns=[dg.TableColumn(f.name, f.dataType.simpleString()) for f in frame.schema.fields])
    rows = [] if rows_known == 0 else frame.limit(limit).collect()
    return dg.MetadataValue.table(
        records=[dg.TableRecord({k: _cell(v) for k, v in row.asDict().items()}) for row in rows], schema=schema)


# How far behind the watermark the newest rows of a growing event-time table are looked for first (`newest_rows`).
RECENT = dt.timedelta(days=1)


def recent_since_ms(watermark_ms: int | None, slack: dt.timedelta = dt.timedelta(0)) -> int | None:
    """`watermark - RECENT - slack`: where the newest closed rows of an event-time table lie; None before there is
    a watermark."""
    if not watermark_ms:
        return None
    return watermark_ms - (RECENT + slack) // dt.timedelta(milliseconds=1)


def records_table(records: list[dict], columns: dict[str, str]) -> dg.MetadataValue:
    """Rows built in Python (not a DataFrame) as a Dagster table; `columns` maps each name to its type."""
    return dg.MetadataValue.table(
        records=[dg.TableRecord({name: _cell(r.get(name)) for name in columns}) for r in records],
        schema=dg.TableSchema(columns=[dg.TableColumn(name, kind) for name, kind in columns.items()]))


def event_time_metadata(value: dt.datetime | None) -> dg.MetadataValue:
    """An event time as Dagster shows a timestamp (Spark returns it naive, in the session's UTC)."""
    if value is None:
        return dg.MetadataValue.text("no event yet")
    return dg.MetadataValue.timestamp(value.replace(tzinfo=dt.timezone.utc))


def recovery_metadata(context: dg.AssetExecutionContext, result: StreamRunResult) -> dict:
    """Why this run recovered, shown on what it materialized: the failed run it recovers (a link in the UI) and
    the failure the run-failure sensor recorded (assets/automation.py); and a checkpoint that was not trusted,
    with what was done instead."""
    metadata = {}
    tags = context.run.tags
    if RECOVERY_OF_TAG in tags:
        metadata.update({"recovery_of_run": dg.MetadataValue.dagster_run(tags[RECOVERY_OF_TAG]),
                         "recovery_attempt": int(tags.get(RECOVERY_ATTEMPT_TAG, "1")),
                         "recovery_reason": dg.MetadataValue.text(tags.get(RECOVERY_REASON_TAG, ""))})
    if result.recovery:
        metadata["checkpoint_recovery"] = dg.MetadataValue.md(
            "\n".join(f"- **{k}**: {v}" for k, v in result.recovery.items() if v))
    return metadata
