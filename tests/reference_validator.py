"""The SQL line validator that the product used before the JVM one (pipelines/ingest/validate.py): kept as the reference
the JVM validator is compared with (tests/pipelines/ingest/test_jvm_validator.py). Both must give every line the same
outcome, except where the JVM one is exact and this one is not (docs/recovery.md, "Decimals"): a JSON number with
an exponent or more than 38 digits is read here through a double. Integer fields (BIGINT, whole digits only) and
boolean fields (JSON true/false) are judged here too; an integer's JSON number is only seen through VARIANT, which
keeps a fraction without its trailing zeros (12.0 as DECIMAL(2,0)), so a fraction of zeros beyond BIGINT
(9223372036854775808.0) reads here as whole. A bound other than 0 is compared at 22 decimals.

Spark's JSON reader coerces types silently (a number read into a string column, a string into a
number), so lines are parsed to VARIANT instead: `schema_of_variant` tells the JSON type of every
field exactly, and each contract rule is checked against it.

Reasons (column `reason`, with the offending field in `reason_field`):
    invalid_utf8, not_json, not_object, missing_field, wrong_type, empty_field, too_long,
    out_of_range, too_many_decimals, invalid_timestamp
and, decided later against bronze, conflicting_duplicate.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from decimal import Decimal

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from pipelines.declare.specs import FieldRule, StreamSpec
from pipelines.ingest.validate import DEFAULT_MAX_AHEAD, EARLIEST_EVENT_TIME, TRIMMED, content_identity

VALUE_TYPE = "decimal(18,2)"
NUMERIC_JSON_TYPES = ("BIGINT", "INT", "SMALLINT", "TINYINT", "DOUBLE", "FLOAT")
# A numeric string: sign, digits with an optional point, optional exponent. ASCII digits only.
NUMBER_TEXT = r"^([+-]?)([0-9]*)(?:\.([0-9]*))?(?:[eE]([+-]?[0-9]+))?\z"  # \z: `$` would allow a final newline
# At most 16 integer digits and 1-2 decimals, unsigned: in range and exact as DECIMAL(18,2), no more to check.
PLAIN_NUMBER = r"^[0-9]{1,16}(\.[0-9]{1,2})?\z"
MAX_INTEGER_DIGITS = 16  # DECIMAL(18,2): |value| <= 9999999999999999.99
MAX_DECIMALS = 2
END_OF_LINE = "statetables:end-of-line"
# ISO-8601 date-time with an explicit offset or Z; Spark's cast alone also accepts local times.
ISO_TIMESTAMP = r"^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}(:[0-9]{2}(\.[0-9]{1,6})?)?(Z|[+-][0-9]{2}:?[0-9]{2})\z"
MAX_VALUE = "9999999999999999.99"
# What each numeric kind stores where a field declares no bound: DECIMAL(18,2), BIGINT.
STORED_RANGE = {"decimal": (f"-{MAX_VALUE}", MAX_VALUE), "integer": (str(-2**63), str(2**63 - 1))}
INTEGER_JSON_TYPES = ("BIGINT", "INT", "SMALLINT", "TINYINT")
# A numeric string as a number field reads it: at least one digit, in the whole part or the fraction.
A_NUMBER = r"^[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?\z"
WHOLE_NUMBER = r"^[+-]?[0-9]+\z"


def trimmed(text: Column) -> Column:
    return F.trim(text, F.lit(TRIMMED))


def _decimal_text_facts(col) -> list[dict[str, Column]]:
    """Stages of columns `_is_number`, `_negative`, `_too_big`, `_too_precise`, `_is_zero` for the trimmed
    numeric text in column `_text` (`col(name)` reads one of the field's columns).

    Decided on the digits of the text, exactly, with no cast that could overflow: a value
    d1..dn x 10^k (trailing zeros folded into k) has n + k integer digits and max(0, -k) decimals.
    """
    text = col("_text")
    # Nearly every value is plain (`12`, `12.5`, `"12.50"`): decided by one regex. The exact analysis
    # below runs for the others only.
    plain = {"_plain": text.rlike(PLAIN_NUMBER)}
    slow = ~col("_plain")
    parts = {f"_p{i}": F.when(slow, F.regexp_extract(text, NUMBER_TEXT, i)) for i in (1, 2, 3, 4)}
    parts["_matches"] = F.when(slow, text.rlike(NUMBER_TEXT))
    p1, p2, p3, exponent_text = (col(f"_p{i}") for i in (1, 2, 3, 4))
    digits = {"_digits": F.concat(p2, p3)}
    # trim, not a regex: `0+$` backtracks quadratically on a long run of zeros (a hostile line)
    trailing = {"_without_trailing": F.rtrim(col("_digits"), F.lit("0"))}
    # Up to 9 exponent digits fit a BIGINT sum below; longer exponents are "enormous" either way.
    exponent = F.when(exponent_text == "", F.lit(0)).otherwise(
        F.when(F.length(F.regexp_replace(exponent_text, "^[+-]?0*", "")) <= 9, exponent_text.try_cast("bigint")))
    shape = {
        "_is_number": col("_matches") & ((F.length(p2) + F.length(p3)) > 0),
        "_significant": F.length(F.ltrim(col("_without_trailing"), F.lit("0"))),
        "_k": exponent - F.length(p3) + (F.length(col("_digits")) - F.length(col("_without_trailing"))),
    }
    is_zero, k = col("_significant") == 0, col("_k")
    enormous = k.isNull()
    integer_digits = col("_significant") + k
    # 16 integer digits can still exceed 9999999999999999.99 in the decimals (…99.994): compared exactly
    # at 22 decimals, which DECIMAL(38,22) holds for 16 integer digits.
    fast = col("_plain")
    facts = {
        "_is_number": fast | col("_is_number"),
        "_is_zero": F.when(fast, F.trim(text, F.lit("0.")) == "").otherwise(is_zero),
        "_negative": ~fast & ~is_zero & (p1 == "-"),
        "_too_big": ~fast & ~is_zero & F.when(enormous, ~exponent_text.startswith("-")).otherwise(
            (integer_digits > MAX_INTEGER_DIGITS) | ((integer_digits == MAX_INTEGER_DIGITS)
                                                     & (text.try_cast("decimal(38,22)")
                                                        > F.lit(MAX_VALUE).cast("decimal(38,22)")))),
        "_too_precise": ~fast & ~is_zero & F.when(enormous, exponent_text.startswith("-")).otherwise(-k > MAX_DECIMALS),
    }
    return [plain, parts, digits, trailing, shape, facts]


def _field_stages(rule: FieldRule, col) -> list[dict[str, Column]]:
    """Columns computed once per line for `rule`, stage by stage, from the field's variant `_v`
    (`col(name)` reads one of the field's columns; names are prefixed with the field by `_prefixed`).

    Each value used by several checks is its own column: a column expression written inline is
    evaluated again wherever it appears, while Spark's optimizer keeps a projection whose non-trivial
    columns are used more than once.
    """
    v = col("_v")
    stages = [{"_json_type": F.schema_of_variant(v), "_as_string": F.try_variant_get(v, "$", "string")}]
    if rule.kind == "decimal":
        stages.append({"_text": trimmed(col("_as_string"))})
        stages.extend(_decimal_text_facts(col))
        if _compared_exactly(rule):
            stages.append({"_exact": F.when(col("_is_zero"), F.lit(0)).otherwise(
                col("_text").try_cast("decimal(38,22)"))})
    elif rule.kind == "integer":
        stages.append({"_text": trimmed(col("_as_string"))})
        json_type, text = col("_json_type"), col("_text")
        # VARIANT keeps an integer literal as BIGINT where it fits, as DECIMAL(p,0) beyond; a fraction as DECIMAL
        # with its trailing zeros dropped (12.0: DECIMAL(2,0) holding 12), an exponent as DOUBLE.
        whole_json_number = json_type.isin(*INTEGER_JSON_TYPES) | (
            json_type.startswith("DECIMAL(") & json_type.endswith(",0)") & text.try_cast("bigint").isNull())
        stages.append({"_is_number": text.rlike(A_NUMBER),
                       "_whole": F.when(json_type == "STRING", text.rlike(WHOLE_NUMBER)).otherwise(whole_json_number)})
        stages.append({"_value": F.when(col("_whole"), text.try_cast("bigint"))})
    elif rule.kind == "timestamp":
        with_seconds = F.regexp_replace(col("_as_string"), r"^([0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2})(Z|[+-])",
                                        "$1:00$2")
        stages.append({"_parsed": with_seconds.try_cast("timestamp"), "_iso": col("_as_string").rlike(ISO_TIMESTAMP)})
    elif rule.trim:
        stages.append({"_trimmed": trimmed(col("_as_string"))})
    return stages


def _compared_exactly(rule: FieldRule) -> bool:
    """Whether a decimal field has a bound its sign alone cannot decide (an upper one, or a lower one other than 0)."""
    return rule.max_value is not None or (rule.min_value is not None and Decimal(rule.min_value) != 0)


def _range_text(rule: FieldRule) -> str:
    floor, ceiling = STORED_RANGE[rule.kind]
    lower = (f"{'>=' if rule.min_inclusive else '>'} {rule.min_value}" if rule.min_value is not None
             else f"at least {floor}")
    upper = (f"{'<=' if rule.max_inclusive else '<'} {rule.max_value}" if rule.max_value is not None
             else f"at most {ceiling}")
    return f"{rule.name} must be {lower} and {upper}"


def _beyond_bounds(rule: FieldRule, value: Column) -> Column:
    """`value` below the declared min or above the declared max (False where none is declared)."""
    beyond = F.lit(False)
    if rule.min_value is not None:
        low = F.lit(Decimal(rule.min_value))
        beyond = beyond | (value < low if rule.min_inclusive else value <= low)
    if rule.max_value is not None:
        high = F.lit(Decimal(rule.max_value))
        beyond = beyond | (value > high if rule.max_inclusive else value >= high)
    return F.coalesce(beyond, F.lit(False))  # no exact value (not a number, too big): other checks decide


def _prefixed(rule: FieldRule, name: str) -> str:
    return f"_{rule.name}{name}"


def _field_column(rule: FieldRule):
    return lambda name: F.col(_prefixed(rule, name))


def _field_checks(col, rule: FieldRule, ingested_at: Column,
                  max_ahead: timedelta) -> tuple[list[tuple[Column, str, Column]], Column]:
    """(condition, reason, detail) triples in the order they are tested, and the typed value, over the
    columns of `_field_stages` (`col(name)` reads this field's column `name`).

    Nothing here may throw on any input (a throw would stop the stream on every run): only try_*
    casts and text arithmetic; the typed value is produced only where every check passed.
    """
    json_type, as_string = col("_json_type"), col("_as_string")
    missing = col("_v").isNull() | (json_type == "VOID")
    checks: list[tuple[Column, str, Column]] = []
    if rule.required:
        checks.append((missing, "missing_field", F.lit(f"{rule.name} is required")))
    present = ~missing

    if rule.kind == "string":
        stripped = col("_trimmed") if rule.trim else trimmed(as_string)
        value = stripped if rule.trim else as_string
        checks.append((present & (json_type != "STRING"),
                       "wrong_type", F.concat(F.lit(f"{rule.name} must be a JSON string, got "), json_type)))
        checks.append((present & (stripped == ""), "empty_field", F.lit(f"{rule.name} is empty")))
        if rule.max_length:
            checks.append((present & (F.char_length(value) > rule.max_length), "too_long",
                           F.lit(f"{rule.name} is longer than {rule.max_length} characters")))
        return checks, F.when(present, value)

    if rule.kind == "decimal":
        # A JSON number's text as Spark's parser kept it: exact for plain literals of up to 38 digits,
        # an IEEE double (e.g. "1.0E30", "Infinity") for exponents and longer literals.
        is_string = json_type == "STRING"
        numeric_type = json_type.isin(*NUMERIC_JSON_TYPES) | json_type.startswith("DECIMAL")
        text = col("_text")
        is_number, negative, is_zero = col("_is_number"), col("_negative"), col("_is_zero")
        too_big, too_precise = col("_too_big"), col("_too_precise")
        checks.append((present & ~numeric_type & ~is_string, "wrong_type",
                       F.concat(F.lit(f"{rule.name} must be a JSON number or numeric string, got "), json_type)))
        checks.append((present & is_string & (text == ""), "empty_field", F.lit(f"{rule.name} is empty")))
        checks.append((present & is_string & ~is_number, "wrong_type",
                       F.lit(f"{rule.name} is a string that is not a number")))
        if _compared_exactly(rule):
            beyond = _beyond_bounds(rule, col("_exact"))
        elif rule.min_value is not None:  # a lower bound of 0: decided on the sign
            beyond = negative if rule.min_inclusive else (negative | is_zero)
        else:
            beyond = F.lit(False)
        checks.append((present & (~is_number | beyond | too_big), "out_of_range", F.lit(_range_text(rule))))
        checks.append((present & too_precise, "too_many_decimals",
                       F.lit(f"{rule.name} has more than {MAX_DECIMALS} decimals")))
        valid = is_number & ~beyond & ~too_big & ~too_precise
        # A zero with an enormous exponent ("0e999999999999") is 0, which no cast would say.
        return checks, F.when(present & valid, F.when(is_zero, F.lit(0).cast(VALUE_TYPE))
                              .otherwise(text.try_cast(VALUE_TYPE)))

    if rule.kind == "integer":
        is_string = json_type == "STRING"
        numeric_type = json_type.isin(*NUMERIC_JSON_TYPES) | json_type.startswith("DECIMAL")
        value = col("_value")
        checks.append((present & ~numeric_type & ~is_string, "wrong_type",
                       F.concat(F.lit(f"{rule.name} must be a JSON number or numeric string, got "), json_type)))
        checks.append((present & is_string & (col("_text") == ""), "empty_field", F.lit(f"{rule.name} is empty")))
        checks.append((present & is_string & ~col("_is_number"), "wrong_type",
                       F.lit(f"{rule.name} is a string that is not a number")))
        checks.append((present & ~col("_whole"), "too_many_decimals", F.lit(f"{rule.name} must be a whole number")))
        out_of_range = value.isNull() | _beyond_bounds(rule, value)
        checks.append((present & out_of_range, "out_of_range", F.lit(_range_text(rule))))
        return checks, F.when(present & ~out_of_range, value)

    if rule.kind == "boolean":
        checks.append((present & (json_type != "BOOLEAN"), "wrong_type",
                       F.concat(F.lit(f"{rule.name} must be a JSON boolean (true or false), got "), json_type)))
        return checks, F.when(present & (json_type == "BOOLEAN"), F.variant_get(col("_v"), "$", "boolean"))

    # timestamp; ISO-8601 allows leaving out the seconds, Spark's cast does not: they were added.
    parsed = col("_parsed")
    checks.append((present & (json_type != "STRING"), "wrong_type",
                   F.concat(F.lit(f"{rule.name} must be an ISO-8601 string, got "), json_type)))
    checks.append((present & (~col("_iso") | parsed.isNull()), "invalid_timestamp",
                   F.lit(f"{rule.name} is not an ISO-8601 timestamp with offset or Z")))
    latest = ingested_at + F.make_dt_interval(secs=F.lit(max_ahead.total_seconds()))
    checks.append((present & ((parsed < F.lit(EARLIEST_EVENT_TIME)) | (parsed > latest)), "out_of_range",
                   F.lit(f"{rule.name} must lie between 1970-01-01T00:00:00Z and "
                         f"{max_ahead.total_seconds() / 3600:g} h after ingestion")))
    return checks, F.when(present, parsed)


def validate_lines(lines: DataFrame, spec: StreamSpec, *, ingested_at: datetime,
                   max_ahead: timedelta = DEFAULT_MAX_AHEAD) -> DataFrame:
    """The columns of pipelines.ingest.validate.validate_lines, computed by SQL expressions over a VARIANT parse."""
    text = F.col("raw_bytes").cast("string")
    # parse_json stops after the first complete value and ignores what follows (`{...} trailing`).
    # Parsing `[<line>,"<sentinel>"]` instead makes trailing content either a syntax error or an
    # array that is not exactly [value, sentinel], so only a line holding one JSON value passes.
    # Each stage below is its own projection: every value several checks use is computed once per line.
    frame = lines.withColumns({
        "_utf8": F.is_valid_utf8(text),
        "_wrapped": F.try_parse_json(F.concat(F.lit("["), text, F.lit(f',"{END_OF_LINE}"]'))),
    })
    wrapped = F.col("_wrapped")
    single_value = (F.try_variant_get(wrapped, "$[1]", "string") == END_OF_LINE) & F.variant_get(
        wrapped, "$[2]", "variant").isNull()
    frame = frame.withColumn("_doc", F.when(F.col("_utf8") & single_value, F.variant_get(wrapped, "$[0]", "variant")))
    doc = F.col("_doc")
    # A single JSON value whose text starts with `{` is an object; only other lines need the (costly,
    # whole-document) schema_of_variant to say what they are.
    starts_as_object = F.ltrim(text, F.lit(TRIMMED)).startswith("{")
    frame = frame.withColumns({"_is_object": starts_as_object | F.schema_of_variant(doc).startswith("OBJECT"), **{
        _prefixed(rule, "_v"): F.variant_get(doc, f"$.{rule.name}", "variant") for rule in spec.fields}})
    # Every field's stages run side by side: stage i of all fields is one projection.
    field_stages = {rule.name: _field_stages(rule, _field_column(rule)) for rule in spec.fields}
    for depth in range(max(len(stages) for stages in field_stages.values())):
        frame = frame.withColumns({
            _prefixed(rule, name): column
            for rule in spec.fields if depth < len(field_stages[rule.name])
            for name, column in field_stages[rule.name][depth].items()})

    ordered: list[tuple[Column, str, str | None, Column]] = [
        (~F.col("_utf8"), "invalid_utf8", None, F.lit("line is not valid UTF-8")),
        (doc.isNull(), "not_json", None, F.lit("line is not a JSON document")),
        (~F.col("_is_object"), "not_object", None,
         F.concat(F.lit("line is JSON but not an object: "), F.schema_of_variant(doc))),
    ]
    typed: dict[str, Column] = {}
    for rule in spec.fields:
        checks, value = _field_checks(_field_column(rule), rule, F.lit(ingested_at), max_ahead)
        ordered.extend((cond, reason, rule.name, detail) for cond, reason, detail in checks)
        typed[rule.name] = value

    verdict = None
    for cond, reason, field, detail in ordered:
        outcome = F.struct(F.lit(reason).alias("reason"), F.lit(field).cast("string").alias("reason_field"),
                           detail.alias("detail"))
        verdict = F.when(cond, outcome) if verdict is None else verdict.when(cond, outcome)

    checked = frame.select(
        "*",
        *[value.alias(name) for name, value in typed.items()],
        verdict.alias("_verdict"),
    )
    id_col = spec.id_field
    typed_only = F.col("_verdict").isNull()
    return checked.select(
        *lines.columns,
        F.make_valid_utf8(text).alias("raw_line"),
        F.try_variant_get(F.col("_doc"), f"$.{id_col}", "string").alias("record_id"),
        *[F.when(typed_only, F.col(name)).alias(name) for name in spec.field_names],
        F.col("_verdict.reason").alias("reason"),
        F.col("_verdict.reason_field").alias("reason_field"),
        F.col("_verdict.detail").alias("detail"),
        F.when(typed_only, content_identity(spec)).alias("content_hash"),
    )

