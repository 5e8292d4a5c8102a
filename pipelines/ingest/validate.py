"""Landing lines → typed events or a reason, by the JVM validator `statetables_validate` (jvm/, ValidateLine).

One pass per line in the JVM: the UTF-8 check, a Jackson streaming parse (the JSON Spark's parse_json accepts,
duplicate keys refused), exact JSON types, every rule of the stream's fields, decimals read exactly from their text
whatever the spelling, the event-time range. The stream's rules travel as data (`line_rules`), so one function
serves every stream, on every engine the project starts (.jars/ is on each one's classpath).

Reasons (column `reason`, with the offending field in `reason_field`), first failing rule first:
    invalid_utf8, not_json, not_object, then per field in the stream's order: missing_field, wrong_type,
    invalid_utf8 (a string whose escapes decode to a lone surrogate), empty_field, too_long, out_of_range,
    too_many_decimals, invalid_timestamp
and, decided later against bronze, conflicting_duplicate. An integer field is checked whole (too_many_decimals)
before its range: "12.0" and "1e3" are refused as written, so a range is only ever read from plain digits.
"""

from __future__ import annotations

import json
import re
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from functools import lru_cache

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import (
    ArrayType, BooleanType, DecimalType, LongType, StringType, StructField, StructType,
)

from pipelines.declare.specs import FieldRule, StreamSpec
from pipelines.errors import ConfigurationError
from pipelines.ingest.jvm import batch_constant, register_jvm_function

VALIDATOR = "statetables_validate"
VALIDATOR_CLASS = "statetables.jvm.ValidateLine"
VALUE_TYPE = DecimalType(18, 2)
# What the function returns: the first failing rule, or the typed values, each in the array of its kind in the
# order of the stream's fields. `type_of`: the field whose JSON type the detail names ("" the whole line), spelled
# here by schema_of_variant; `id_needs_variant`: an id that is not a JSON string, read here as Spark casts it.
VERDICT_TYPE = StructType([
    StructField("reason", StringType()),
    StructField("reason_field", StringType()),
    StructField("detail", StringType()),
    StructField("type_of", StringType()),
    StructField("record_id", StringType()),
    StructField("id_needs_variant", BooleanType()),
    StructField("strings", ArrayType(StringType())),
    StructField("decimals", ArrayType(VALUE_TYPE)),
    StructField("timestamps", ArrayType(LongType())),
    StructField("integers", ArrayType(LongType())),
    StructField("booleans", ArrayType(BooleanType())),
])
_ARRAY_OF_KIND = {"string": "strings", "decimal": "decimals", "timestamp": "timestamps", "integer": "integers",
                  "boolean": "booleans"}
# Contract: event time lies between the epoch and one day (configurable) after ingestion. An event from
# the far past or the future would push watermarks and dedup horizons away from every real event.
EARLIEST_EVENT_TIME = datetime(1970, 1, 1, tzinfo=timezone.utc)
DEFAULT_MAX_AHEAD = timedelta(days=1)
# What "trimmed" removes: JSON's own whitespace, both ends.
TRIMMED = " \t\n\r"
MAX_VALUE = "9999999999999999.99"
MAX_DECIMALS = 2
# What each numeric kind can store (DECIMAL(18,2), BIGINT): the range a field has where it declares no bound.
STORED_RANGE = {"decimal": (Decimal(f"-{MAX_VALUE}"), Decimal(MAX_VALUE)),
                "integer": (Decimal(-2**63), Decimal(2**63 - 1))}
# A declared bound: plain decimal text, which Python's Decimal and Java's BigDecimal read alike.
BOUND_TEXT = re.compile(r"-?[0-9]+(\.[0-9]+)?")


def _range_detail(rule: FieldRule) -> str:
    """`<name> must be <lower> and <upper>`: each declared bound as declared, the stored type's limit where none is
    declared ("amount must be > 0 and at most 9999999999999999.99", "quantity must be >= 1 and < 500")."""
    floor, ceiling = STORED_RANGE[rule.kind]
    lower = (f"{'>=' if rule.min_inclusive else '>'} {rule.min_value}" if rule.min_value is not None
             else f"at least {floor}")
    upper = (f"{'<=' if rule.max_inclusive else '<'} {rule.max_value}" if rule.max_value is not None
             else f"at most {ceiling}")
    return f"{rule.name} must be {lower} and {upper}"


def _check_bounds(rule: FieldRule) -> None:
    """A declared bound is plain decimal text inside what the field can store, and min <= max: the detail names the
    bounds as declared, so a bound the stored type overrides, or none that any value could meet, is refused here."""
    bounds = [b for b in (rule.min_value, rule.max_value) if b is not None]
    if not bounds:
        return
    floor, ceiling = STORED_RANGE.get(rule.kind, (None, None))
    fault = None
    if floor is None:
        fault = f"a {rule.kind} field has no min_value/max_value"
    elif not all(BOUND_TEXT.fullmatch(b) for b in bounds):
        fault = f"its bounds {bounds} are not plain decimal text (like 0, -5 or 499.99)"
    elif not all(floor <= Decimal(b) <= ceiling for b in bounds):
        fault = f"its bounds {bounds} lie outside what a {rule.kind} field stores, {floor} to {ceiling}"
    elif len(bounds) == 2 and Decimal(rule.min_value) > Decimal(rule.max_value):
        fault = f"its min_value {rule.min_value} is above its max_value {rule.max_value}"
    if fault:
        raise ConfigurationError(f"Field {rule.name!r}: {fault}. Fix: correct its FieldRule in pipelines/declare/specs.py.")


def _field_details(rule: FieldRule, max_ahead: timedelta) -> dict[str, str]:
    """The detail of each reason a field can have; a wrong_type's is completed with the JSON type found."""
    name = rule.name
    details = {"missing_field": f"{name} is required", "empty_field": f"{name} is empty"}
    if rule.kind == "string":
        details["wrong_type"] = f"{name} must be a JSON string, got "
        details["invalid_utf8"] = (f"{name} holds an escaped lone surrogate (a \\uD800-\\uDFFF escape not in a "
                                   "pair), which UTF-8 text cannot hold")
        if rule.max_length:
            details["too_long"] = f"{name} is longer than {rule.max_length} characters"
    elif rule.kind in ("decimal", "integer"):
        details.update({
            "wrong_type": f"{name} must be a JSON number or numeric string, got ",
            "not_a_number": f"{name} is a string that is not a number",
            "out_of_range": _range_detail(rule),
            "too_many_decimals": (f"{name} has more than {MAX_DECIMALS} decimals" if rule.kind == "decimal"
                                  else f"{name} must be a whole number"),
        })
    elif rule.kind == "boolean":
        details["wrong_type"] = f"{name} must be a JSON boolean (true or false), got "
    else:
        details.update({
            "wrong_type": f"{name} must be an ISO-8601 string, got ",
            "invalid_timestamp": f"{name} is not an ISO-8601 timestamp with offset or Z",
            "out_of_range": f"{name} must lie between 1970-01-01T00:00:00Z and "
                            f"{max_ahead.total_seconds() / 3600:g} h after ingestion",
        })
    return details


@lru_cache(maxsize=None)
def line_rules(spec: StreamSpec, max_ahead: timedelta = DEFAULT_MAX_AHEAD) -> str:
    """The stream's rules as the JVM validator reads them (jvm/src/statetables/jvm/LineRules.java)."""
    for rule in spec.fields:
        _check_bounds(rule)
    return json.dumps({
        "id": spec.id_field,
        "fields": [{"name": r.name, "kind": r.kind, "required": r.required, "trim": r.trim,
                    "max_length": r.max_length, "min": r.min_value, "min_inclusive": r.min_inclusive,
                    "max": r.max_value, "max_inclusive": r.max_inclusive,
                    "details": _field_details(r, max_ahead)} for r in spec.fields],
        "line_details": {"invalid_utf8": "line is not valid UTF-8", "not_json": "line is not a JSON document",
                         "not_object": "line is JSON but not an object: "},
    }, sort_keys=True)


def register_validator(spark: SparkSession) -> None:
    """Make `statetables_validate` callable in `spark`'s SQL and DataFrames."""
    register_jvm_function(spark, VALIDATOR, VALIDATOR_CLASS, VERDICT_TYPE)


def content_identity(spec: StreamSpec) -> Column:
    """The identity of an event's content for duplicate detection: the contract fields, normalised
    (trimmed strings, DECIMAL(18,2), event time as UTC micros), so re-serialisation does not matter.

    JSON of a struct is unambiguous (quoting, and a missing field is absent rather than a marker
    value), so two contents share a hash only if they are equal. Computed from typed columns, it
    reads bronze rows written by any earlier version the same way.
    """
    parts = [(F.unix_micros(F.col(f)) if f == spec.event_time_field else F.col(f)).alias(f) for f in spec.field_names]
    return F.sha2(F.to_json(F.struct(*parts)), 256)


def _typed_values(spec: StreamSpec) -> dict[str, Column]:
    slots: dict[str, int] = {}
    values = {}
    for rule in spec.fields:
        array = _ARRAY_OF_KIND[rule.kind]
        value = F.col(f"_verdict.{array}")[slots.setdefault(array, 0)]
        slots[array] += 1
        values[rule.name] = F.timestamp_micros(value) if rule.kind == "timestamp" else value
    return values


def _detail(spec: StreamSpec, text: Column) -> Column:
    """The verdict's detail; for the rare wrong JSON type, completed with the type as schema_of_variant names it
    (the line is parsed to VARIANT for those lines only: a CASE branch is evaluated only where it is taken)."""
    doc = F.try_parse_json(text)
    type_of = F.col("_verdict.type_of")
    named = F.when(type_of == "", F.schema_of_variant(doc))
    for rule in spec.fields:
        named = named.when(type_of == rule.name, F.schema_of_variant(F.variant_get(doc, f"$.{rule.name}", "variant")))
    return F.when(type_of.isNull(), F.col("_verdict.detail")).otherwise(F.concat(F.col("_verdict.detail"), named))


def validate_lines(lines: DataFrame, spec: StreamSpec, *, ingested_at: datetime,
                   max_ahead: timedelta = DEFAULT_MAX_AHEAD) -> DataFrame:
    """Add the stream's typed fields, `reason`/`reason_field`/`detail` (NULL when valid),
    `raw_line` (the line as text), `record_id` (id when readable) and `content_hash`.

    `ingested_at` is the batch's ingestion time, fixed on the driver so that a recomputed
    partition classifies every line the same way.

    >>> validated = validate_lines(split_lines(files), MOVIE_TICKET_SALES, ingested_at=now)
    >>> accepted = validated.where("reason IS NULL")
    """
    register_validator(lines.sparkSession)
    latest = ingested_at + max_ahead
    latest_micros = (latest - EARLIEST_EVENT_TIME) // timedelta(microseconds=1)
    # The rules as BINARY: Spark hands a STRING argument to the function as a new String for every row.
    rules = F.lit(line_rules(spec, max_ahead).encode())
    judged = lines.withColumn("_verdict", F.call_function(VALIDATOR, F.col("raw_bytes"), rules,
                                                          batch_constant(lines.sparkSession, latest_micros)))
    text = F.col("raw_bytes").cast("string")
    typed = judged.select(
        *lines.columns,
        F.make_valid_utf8(text).alias("raw_line"),
        F.when(F.col("_verdict.id_needs_variant"),
               F.try_variant_get(F.try_parse_json(text), f"$.{spec.id_field}", "string"))
        .otherwise(F.col("_verdict.record_id")).alias("record_id"),
        *[value.alias(name) for name, value in _typed_values(spec).items()],
        F.col("_verdict.reason").alias("reason"),
        F.col("_verdict.reason_field").alias("reason_field"),
        _detail(spec, text).alias("detail"),
    )
    return typed.withColumn("content_hash", F.when(F.col("reason").isNull(), content_identity(spec)))
