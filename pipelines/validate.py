"""Raw lines → typed events, or a machine-readable reason why the line is malformed.

Spark's JSON reader coerces types silently (a number read into a string column, a string into a
number), so lines are parsed to VARIANT instead: `schema_of_variant` tells the JSON type of every
field exactly, and each contract rule is checked against it.

Reasons (column `reason`, with the offending field in `reason_field`):
    invalid_utf8, not_json, not_object, missing_field, wrong_type, empty_field, too_long,
    out_of_range, too_many_decimals, invalid_timestamp
and, decided later against bronze, conflicting_duplicate.
"""

from __future__ import annotations

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from pipelines.streams import FieldRule, StreamSpec

VALUE_TYPE = "decimal(18,2)"
# Wide enough to see a third decimal or a value beyond DECIMAL(18,2) before rounding hides it.
WIDE_DECIMAL = "decimal(38,18)"
MAX_VALUE = "9999999999999999.99"
NUMERIC_JSON_TYPES = ("BIGINT", "INT", "SMALLINT", "TINYINT", "DOUBLE", "FLOAT")
# ISO-8601 date-time with an explicit offset or Z; Spark's cast alone also accepts local times.
END_OF_LINE = "statetables:end-of-line"
ISO_TIMESTAMP = r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}(:\d{2}(\.\d{1,6})?)?(Z|[+-]\d{2}:?\d{2})$"


def _json_type(doc: Column, name: str) -> Column:
    return F.schema_of_variant(F.variant_get(doc, f"$.{name}", "variant"))


def _field_checks(doc: Column, rule: FieldRule) -> tuple[list[tuple[Column, str, Column]], Column]:
    """(condition, reason, detail) triples in the order they are tested, and the typed value."""
    path = f"$.{rule.name}"
    json_type = _json_type(doc, rule.name)
    missing = F.variant_get(doc, path, "variant").isNull() | (json_type == "VOID")
    as_string = F.try_variant_get(doc, path, "string")
    checks: list[tuple[Column, str, Column]] = []
    if rule.required:
        checks.append((missing, "missing_field", F.lit(f"{rule.name} is required")))
    present = ~missing

    if rule.kind == "string":
        value = F.trim(as_string) if rule.trim else as_string
        checks.append((present & (json_type != "STRING"),
                       "wrong_type", F.concat(F.lit(f"{rule.name} must be a JSON string, got "), json_type)))
        checks.append((present & (F.trim(as_string) == ""), "empty_field", F.lit(f"{rule.name} is empty")))
        if rule.max_length:
            checks.append((present & (F.char_length(value) > rule.max_length), "too_long",
                           F.lit(f"{rule.name} is longer than {rule.max_length} characters")))
        return checks, F.when(present, value)

    if rule.kind == "decimal":
        numeric_type = json_type.isin(*NUMERIC_JSON_TYPES) | json_type.startswith("DECIMAL")
        number = F.try_variant_get(doc, path, WIDE_DECIMAL)
        is_string = json_type == "STRING"
        checks.append((present & ~numeric_type & ~is_string, "wrong_type",
                       F.concat(F.lit(f"{rule.name} must be a JSON number or numeric string, got "), json_type)))
        checks.append((present & is_string & (F.trim(as_string) == ""), "empty_field", F.lit(f"{rule.name} is empty")))
        checks.append((present & is_string & number.isNull(), "wrong_type",
                       F.lit(f"{rule.name} is a string that is not a number")))
        below = number < F.lit(rule.min_value).cast(WIDE_DECIMAL) if rule.min_inclusive \
            else number <= F.lit(rule.min_value).cast(WIDE_DECIMAL)
        bound = ">=" if rule.min_inclusive else ">"
        checks.append((present & (below | (F.abs(number) > F.lit(MAX_VALUE).cast(WIDE_DECIMAL))),
                       "out_of_range", F.lit(f"{rule.name} must be {bound} {rule.min_value} and fit DECIMAL(18,2)")))
        checks.append((present & (number != F.round(number, 2)), "too_many_decimals",
                       F.lit(f"{rule.name} has more than 2 decimals")))
        return checks, F.when(present, number.cast(VALUE_TYPE))

    # timestamp
    parsed = as_string.try_cast("timestamp")
    checks.append((present & (json_type != "STRING"), "wrong_type",
                   F.concat(F.lit(f"{rule.name} must be an ISO-8601 string, got "), json_type)))
    checks.append((present & (~as_string.rlike(ISO_TIMESTAMP) | parsed.isNull()), "invalid_timestamp",
                   F.lit(f"{rule.name} is not an ISO-8601 timestamp with offset or Z")))
    return checks, F.when(present, parsed)


def validate_lines(lines: DataFrame, spec: StreamSpec) -> DataFrame:
    """Add the stream's typed fields, `reason`/`reason_field`/`detail` (NULL when valid),
    `raw_line` (the line as text), `record_id` (id when readable) and `content_hash`.

    >>> validated = validate_lines(split_lines(files), MOVIE_TICKET_SALES)
    >>> accepted = validated.where("reason IS NULL")
    """
    text = F.col("raw_bytes").cast("string")
    utf8 = F.is_valid_utf8(text)
    # parse_json stops after the first complete value and ignores what follows (`{...} trailing`).
    # Parsing `[<line>,"<sentinel>"]` instead makes trailing content either a syntax error or an
    # array that is not exactly [value, sentinel], so only a line holding one JSON value passes.
    wrapped = F.try_parse_json(F.concat(F.lit("["), text, F.lit(f',"{END_OF_LINE}"]')))
    single_value = (F.try_variant_get(wrapped, "$[1]", "string") == END_OF_LINE) & F.variant_get(
        wrapped, "$[2]", "variant").isNull()
    doc = F.when(utf8 & single_value, F.variant_get(wrapped, "$[0]", "variant"))
    is_object = F.schema_of_variant(doc).startswith("OBJECT")

    ordered: list[tuple[Column, str, str | None, Column]] = [
        (~utf8, "invalid_utf8", None, F.lit("line is not valid UTF-8")),
        (doc.isNull(), "not_json", None, F.lit("line is not a JSON document")),
        (~is_object, "not_object", None, F.concat(F.lit("line is JSON but not an object: "), F.schema_of_variant(doc))),
    ]
    typed: dict[str, Column] = {}
    for rule in spec.fields:
        checks, value = _field_checks(F.col("_doc"), rule)
        ordered.extend((cond, reason, rule.name, detail) for cond, reason, detail in checks)
        typed[rule.name] = value

    verdict = None
    for cond, reason, field, detail in ordered:
        outcome = F.struct(F.lit(reason).alias("reason"), F.lit(field).cast("string").alias("reason_field"),
                           detail.alias("detail"))
        verdict = F.when(cond, outcome) if verdict is None else verdict.when(cond, outcome)

    with_doc = lines.withColumn("_doc", doc)
    checked = with_doc.select(
        "*",
        *[value.alias(name) for name, value in typed.items()],
        verdict.alias("_verdict"),
    )
    id_col = spec.id_field
    ts_col = spec.event_time_field
    # Identity of an event's content for duplicate detection: the contract fields, normalised
    # (trimmed strings, DECIMAL(18,2), event time in UTC micros), so re-serialisation does not matter.
    hash_parts = [F.coalesce(F.col(f).cast("string"), F.lit("\u0000")) for f in spec.field_names if f != ts_col]
    hash_parts.append(F.coalesce(F.unix_micros(F.col(ts_col)).cast("string"), F.lit("\u0000")))
    return checked.select(
        *lines.columns,
        F.make_valid_utf8(text).alias("raw_line"),
        F.try_variant_get(F.col("_doc"), f"$.{id_col}", "string").alias("record_id"),
        *spec.field_names,
        F.col("_verdict.reason").alias("reason"),
        F.col("_verdict.reason_field").alias("reason_field"),
        F.col("_verdict.detail").alias("detail"),
        F.sha2(F.concat_ws("\u0001", *hash_parts), 256).alias("content_hash"),
    )
