"""The JVM validator (pipelines/ingest/validate.py, jvm/) against the SQL validator it replaced (tests/reference_validator.py).

Both judge the same generated and hostile lines, over 2,400 in one Spark job per stream, newly drawn on every run:
event-shaped lines with every field drawn around its boundaries, lines broken at the byte level, any JSON value, raw
bytes, deep nesting (tests/pipelines/ingest/test_validation_properties.py's strategies). Every column must be equal:
reason, field, detail, record id, raw line, typed values, content hash. Two exceptions, where the JVM validator
follows the contract and the reference did not: a JSON number with an exponent or more than 38 digits, which the
reference read through a double, and a kept string holding an escaped lone surrogate, which the reference stored as
'?'. There the JVM validator must give the oracle's verdict (tests/contract_oracle.py), and the test counts them.
Integer and boolean fields and upper bounds, which no product stream has yet, are judged on a test stream, edge by
edge, against both the reference and a table of expected verdicts written out by hand.
"""

from __future__ import annotations

import dataclasses
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pyspark.sql import Row
from pyspark.sql import functions as F

from pipelines.declare.specs import FieldRule
from pipelines.errors import ConfigurationError
from pipelines.ingest.validate import line_rules
from pipelines.runtime.spark import JARS_ENV, delta_jars
from tests.streams import MOVIE_TICKET_SALES, PAYMENTS
from pipelines.ingest.validate import validate_lines
from tests.contract_oracle import judge_line
from tests.pipelines.ingest.test_validation_properties import (
    INGESTED_AT, LINE_SCHEMA, SEARCH, line_batch, mutate, odd_line,
)
from tests.reference_validator import validate_lines as reference_validate_lines

BATCHES_PER_STREAM = 8  # of 300 lines: 2,400 lines per stream, a new draw on every run
COLUMNS = ("reason", "reason_field", "detail", "record_id", "raw_line", "content_hash")
# Hand-picked lines where the two readings part or nearly part: exponents, long literals, the decimal boundary.
EDGES = [
    b'{"payment_id":"p1","customer_id":"c","amount":1e-400,"paid_at":"2026-11-22T11:00:00Z"}',
    b'{"payment_id":"p2","customer_id":"c","amount":1.0000000000000000001e0,"paid_at":"2026-11-22T11:00:00Z"}',
    b'{"payment_id":"p3","customer_id":"c","amount":12.5e1,"paid_at":"2026-11-22T11:00:00Z"}',
    b'{"payment_id":"p4","customer_id":"c","amount":"9999999999999999.995","paid_at":"2026-11-22T11:00:00Z"}',
    b'{"payment_id":"p5","customer_id":"c","amount":9999999999999999.99,"paid_at":"2026-11-22T11:00Z"}',
    b'{"payment_id":"p6","customer_id":"c","amount":1e999999999999,"paid_at":"2026-11-22T11:00:00+18:00"}',
    b'{"payment_id":7,"customer_id":"c","amount":true,"paid_at":"2026-11-22T11:00:00+0530"}',
    b'{"payment_id":{"a":[1]},"customer_id":"c","amount":1,"paid_at":"2026-02-30T11:00:00Z"}',
    b'{"payment_id":"p9","customer_id":"c","amount":1,"paid_at":"2026-11-22T24:00:00Z"}',
    b'{"payment_id":"\\ud83cWudfab","customer_id":"c","amount":1,"paid_at":"2026-11-22T11:00:00Z"}',
    b'{"payment_id":"p10","customer_id":"\\udfab","amount":1,"paid_at":"2026-11-22T11:00:00Z"}',
    b'{"payment_id":"p11","customer_id":"\\ud83c\\udfab","amount":1,"paid_at":"2026-11-22T11:00:00Z"}',
    b'[1,2]', b'"x"', b'{"a":1,"a":2}', b'{"a":{"b":1,"b":2}}', b'\xef\xbb\xbf{}', b'{} x', b'',
]


def _judged(spark, spec, lines: list[bytes]) -> tuple[list, list]:
    """The JVM validator's and the reference's verdicts on `lines`, each in line order, from one Spark job."""
    frame = spark.createDataFrame([("/landing/f.jsonl", INGESTED_AT, n, raw) for n, raw in enumerate(lines, 1)],
                                  LINE_SCHEMA)

    def verdicts(validate, by: str):
        judged = validate(frame, spec, ingested_at=INGESTED_AT)
        return judged.select(F.lit(by).alias("_by"), "line_number", *COLUMNS,
                             *[F.col(f).cast("string").alias(f) for f in spec.field_names])

    rows = (verdicts(validate_lines, "jvm").unionByName(verdicts(reference_validate_lines, "reference"))
            .orderBy("_by", "line_number").collect())
    by: dict[str, list] = {"jvm": [], "reference": []}
    for row in rows:
        values = row.asDict()
        by[values.pop("_by")].append(Row(**values))
    return by["jvm"], by["reference"]


def _read_through_a_double(raw: bytes) -> bool:
    """Whether the reference read one of the line's JSON numbers through a double: an exponent, or > 38 digits."""
    text = raw.decode("utf-8", "replace")
    return any(c in text for c in "eE") or sum(c.isdigit() for c in text) > 38


@settings(max_examples=1, **SEARCH)
@given(data=st.data())
def test_the_jvm_validator_judges_every_line_as_the_sql_reference(spark, data):
    rng = random.Random(data.draw(st.integers(0, 2**32 - 1), label="mutation seed"))
    for spec in (MOVIE_TICKET_SALES, PAYMENTS):
        lines = list(EDGES)
        for i in range(BATCHES_PER_STREAM):
            lines += data.draw(line_batch(spec, odd=i % 2 == 0))
        lines += [mutate(rng, line) for line in data.draw(st.lists(odd_line(), min_size=50, max_size=50))]
        assert len(lines) >= 2_000
        jvm, reference = _judged(spark, spec, lines)
        assert [r["line_number"] for r in jvm] == list(range(1, len(lines) + 1))
        differ, exact_only, lone_surrogates = [], 0, 0
        for raw, mine, theirs in zip(lines, jvm, reference):
            if mine == theirs:
                continue
            oracle = judge_line(spec.name, raw, ingested_at=INGESTED_AT)
            as_oracle = (mine["reason"], mine["reason_field"]) == (oracle.reason, oracle.field)
            if as_oracle and oracle.reason == "invalid_utf8" and oracle.field:
                lone_surrogates += 1
                continue
            if as_oracle and _read_through_a_double(raw):
                exact_only += 1
                continue
            changed = {c: (theirs[c], mine[c]) for c in mine.asDict() if mine[c] != theirs[c]}
            differ.append(f"{raw!r}\n    reference → jvm: {changed}")
        assert not differ, f"{spec.name}: {len(differ)} of {len(lines)} lines differ:\n" + "\n".join(differ[:40])
        # The edges above hold at least two lines that only an exact reading tells apart (1e-400, 1.000…1e0), and two
        # escaped lone surrogates.
        assert (exact_only >= 2 and lone_surrogates >= 2) if spec is PAYMENTS else True


def test_an_engine_without_the_projects_jar_fails_naming_the_fix(tmp_path):
    """A JVM started with Delta's jars but not the project's: the validator's registration names `make jars`."""
    for jar in delta_jars():
        if jar.name != "statetables-jvm.jar":
            (tmp_path / jar.name).symlink_to(jar)
    script = ("from pipelines.runtime.spark import build_spark_session\n"
              "from pipelines.ingest.validate import register_validator\n"
              "register_validator(build_spark_session())\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, JARS_ENV: str(tmp_path)}, cwd=Path(__file__).resolve().parents[3])
    assert done.returncode != 0
    assert "ConfigurationError" in done.stderr and "statetables.jvm.ValidateLine" in done.stderr
    assert "Fix: run `make jars`" in done.stderr


# A stream with every field kind and bound, built from PAYMENTS so that only what validation reads is spelled out.
ORDERS = dataclasses.replace(PAYMENTS, name="orders_test", id_field="order_id", event_time_field="ordered_at", fields=(
    FieldRule("order_id", "string"),
    FieldRule("quantity", "integer", min_value="1", max_value="100"),
    FieldRule("amount", "decimal", min_value="0", min_inclusive=False, max_value="500", max_inclusive=False),
    FieldRule("gift", "boolean"),
    FieldRule("ordered_at", "timestamp"),
    FieldRule("loyalty_points", "integer", required=False),
))
ORDER = {"order_id": '"o1"', "quantity": "5", "amount": "12.50", "gift": "true", "ordered_at": '"2026-11-22T11:00:00Z"'}
ABSENT = None  # the field left out of the line
QUANTITY_RANGE = "quantity must be >= 1 and <= 100"
AMOUNT_RANGE = "amount must be > 0 and < 500"
POINTS_RANGE = "loyalty_points must be at least -9223372036854775808 and at most 9223372036854775807"
WHOLE = "quantity must be a whole number"
NOT_A_GIFT = "gift must be a JSON boolean (true or false), got "
# (field, its JSON text in an otherwise valid order, reason, detail, the field's typed value as text), by hand.
ORDER_EDGES = [
    ("quantity", "1", None, None, "1"),
    ("quantity", "100", None, None, "100"),
    ("quantity", "0", "out_of_range", QUANTITY_RANGE, None),
    ("quantity", "101", "out_of_range", QUANTITY_RANGE, None),
    ("quantity", "-0", "out_of_range", QUANTITY_RANGE, None),
    ("quantity", "9223372036854775807", "out_of_range", QUANTITY_RANGE, None),
    ("quantity", "9223372036854775808", "out_of_range", QUANTITY_RANGE, None),
    ("quantity", '"12"', None, None, "12"),
    ("quantity", '" 12\\t"', None, None, "12"),
    ("quantity", '"+12"', None, None, "12"),
    ("quantity", '"012"', None, None, "12"),
    ("quantity", "12.5", "too_many_decimals", WHOLE, None),
    ("quantity", "12.0", "too_many_decimals", WHOLE, None),
    ("quantity", "1e3", "too_many_decimals", WHOLE, None),
    ("quantity", "1E1", "too_many_decimals", WHOLE, None),
    ("quantity", "500.5", "too_many_decimals", WHOLE, None),  # whole first, then the range
    ("quantity", '"12.5"', "too_many_decimals", WHOLE, None),
    ("quantity", '"12a"', "wrong_type", "quantity is a string that is not a number", None),
    ("quantity", '" "', "empty_field", "quantity is empty", None),
    ("quantity", "true", "wrong_type", "quantity must be a JSON number or numeric string, got BOOLEAN", None),
    ("quantity", "[1]", "wrong_type", "quantity must be a JSON number or numeric string, got ARRAY<BIGINT>", None),
    ("quantity", "null", "missing_field", "quantity is required", None),
    ("quantity", ABSENT, "missing_field", "quantity is required", None),
    ("loyalty_points", "9223372036854775807", None, None, "9223372036854775807"),
    ("loyalty_points", "-9223372036854775808", None, None, "-9223372036854775808"),
    ("loyalty_points", "9223372036854775808", "out_of_range", POINTS_RANGE, None),
    ("loyalty_points", "-9223372036854775809", "out_of_range", POINTS_RANGE, None),
    ("loyalty_points", '"9223372036854775808"', "out_of_range", POINTS_RANGE, None),
    ("loyalty_points", "-0", None, None, "0"),
    ("loyalty_points", "null", None, None, None),
    ("loyalty_points", ABSENT, None, None, None),
    ("loyalty_points", "1.5", "too_many_decimals", "loyalty_points must be a whole number", None),
    ("amount", "0.01", None, None, "0.01"),
    ("amount", "499.99", None, None, "499.99"),
    ("amount", "0", "out_of_range", AMOUNT_RANGE, None),
    ("amount", "500", "out_of_range", AMOUNT_RANGE, None),
    ("amount", "500.00", "out_of_range", AMOUNT_RANGE, None),
    ("amount", '"500"', "out_of_range", AMOUNT_RANGE, None),
    ("amount", "5e2", "out_of_range", AMOUNT_RANGE, None),
    ("amount", "500.001", "out_of_range", AMOUNT_RANGE, None),  # for decimals, the range first
    ("amount", "499.999", "too_many_decimals", "amount has more than 2 decimals", None),
    ("gift", "true", None, None, "true"),
    ("gift", "false", None, None, "false"),
    ("gift", '"true"', "wrong_type", NOT_A_GIFT + "STRING", None),
    ("gift", "1", "wrong_type", NOT_A_GIFT + "BIGINT", None),
    ("gift", "{}", "wrong_type", NOT_A_GIFT + "OBJECT<>", None),
    ("gift", "null", "missing_field", "gift is required", None),
    ("gift", ABSENT, "missing_field", "gift is required", None),
]


def _order(field: str, text: str | None) -> bytes:
    members = {**ORDER, field: text}
    return ("{" + ",".join(f'"{k}":{v}' for k, v in members.items() if v is not ABSENT) + "}").encode()


def test_integer_boolean_and_upper_bounds_edge_by_edge(spark):
    """Each edge in an otherwise valid order: the expected verdict, and the reference's on every column; then the
    same lines broken at the byte level, against the reference."""
    lines = [_order(field, text) for field, text, *_ in ORDER_EDGES]
    rng = random.Random(11)
    broken = [mutate(rng, line) for line in lines for _ in range(4)]
    jvm_all, reference_all = _judged(spark, ORDERS, lines + broken)  # the edges and the broken lines in one job
    jvm, reference = jvm_all[:len(lines)], reference_all[:len(lines)]
    wrong = []
    for (field, text, reason, detail, value), raw, mine, theirs in zip(ORDER_EDGES, lines, jvm, reference):
        expected = (reason, field if reason else None, detail, value)
        got = (mine["reason"], mine["reason_field"], mine["detail"], mine[field])
        if got != expected or mine != theirs:
            wrong.append(f"{raw!r}\n    expected {expected}, got {got}\n    reference {theirs}")
    assert not wrong, f"{len(wrong)} of {len(lines)} edges:\n" + "\n".join(wrong)
    # Content identity reads the typed values: the same number however written, a boolean's value, null = absent.
    hashes = {(field, text): row["content_hash"] for (field, text, *_), row in zip(ORDER_EDGES, jvm)}
    assert hashes["quantity", '"12"'] == hashes["quantity", '" 12\\t"'] == hashes["quantity", '"+12"']
    assert hashes["loyalty_points", "null"] == hashes["loyalty_points", ABSENT] != hashes["loyalty_points", "-0"]
    assert hashes["gift", "true"] != hashes["gift", "false"]

    differ = [f"{raw!r}\n    jvm {mine}\n    reference {theirs}" for raw, mine, theirs in
              zip(broken, jvm_all[len(lines):], reference_all[len(lines):]) if mine != theirs]
    assert not differ, f"{len(differ)} of {len(broken)} broken lines differ:\n" + "\n".join(differ[:20])


@pytest.mark.parametrize("rule", [
    FieldRule("n", "integer", max_value="9223372036854775808"),  # beyond BIGINT: the detail would name it
    FieldRule("n", "decimal", max_value="1e3"),  # not plain decimal text
    FieldRule("n", "decimal", min_value="5", max_value="4"),  # no value could pass
    FieldRule("n", "boolean", min_value="0"),  # a bound that nothing would check
])
def test_a_bound_the_validator_cannot_keep_as_declared_is_refused(rule):
    spec = dataclasses.replace(ORDERS, fields=(FieldRule("order_id", "string"), rule))
    with pytest.raises(ConfigurationError, match="Fix: correct its FieldRule"):
        line_rules(spec)
