"""The JVM validator (pipelines/validate.py, jvm/) against the SQL validator it replaced (tests/reference_validator.py).

Both judge the same generated and hostile lines, over 10,000 in one Spark job per stream: event-shaped lines with
every field drawn around its boundaries, lines broken at the byte level, any JSON value, raw bytes, deep nesting
(tests/pipelines/test_validation_properties.py's strategies). Every column must be equal: reason, field, detail,
record id, raw line, typed values, content hash. The one exception is where the JVM validator is exact and the
reference was not: a JSON number with an exponent or more than 38 digits, which the reference read through a
double. There the JVM validator must give the exact reading (tests/contract_oracle.py), and the test counts them.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st
from pyspark.sql import functions as F

from pipelines.session import JARS_ENV, delta_jars
from tests.streams import MOVIE_TICKET_SALES, PAYMENTS
from pipelines.validate import validate_lines
from tests.contract_oracle import judge_line
from tests.pipelines.test_validation_properties import (
    INGESTED_AT, LINE_SCHEMA, REPRODUCIBLE, line_batch, mutate, odd_line,
)
from tests.reference_validator import validate_lines as reference_validate_lines

BATCHES_PER_STREAM = 20  # of 300 lines: 6,000 lines per stream, 12,000 in all
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
    b'[1,2]', b'"x"', b'{"a":1,"a":2}', b'{"a":{"b":1,"b":2}}', b'\xef\xbb\xbf{}', b'{} x', b'',
]


def _judged(spark, validate, spec, lines: list[bytes]) -> list:
    frame = spark.createDataFrame([("/landing/f.jsonl", INGESTED_AT, n, raw) for n, raw in enumerate(lines, 1)],
                                  LINE_SCHEMA)
    judged = validate(frame, spec, ingested_at=INGESTED_AT)
    return judged.select("line_number", *COLUMNS, *[F.col(f).cast("string").alias(f) for f in spec.field_names]
                         ).orderBy("line_number").collect()


def _read_through_a_double(raw: bytes) -> bool:
    """Whether the reference read one of the line's JSON numbers through a double: an exponent, or > 38 digits."""
    text = raw.decode("utf-8", "replace")
    return any(c in text for c in "eE") or sum(c.isdigit() for c in text) > 38


@settings(max_examples=1, **REPRODUCIBLE)
@given(data=st.data())
def test_the_jvm_validator_judges_every_line_as_the_sql_reference(spark, data):
    rng = random.Random(7)
    for spec in (MOVIE_TICKET_SALES, PAYMENTS):
        lines = list(EDGES)
        for i in range(BATCHES_PER_STREAM):
            lines += data.draw(line_batch(spec, odd=i % 2 == 0))
        lines += [mutate(rng, line) for line in data.draw(st.lists(odd_line(), min_size=50, max_size=50))]
        assert len(lines) >= 5_000
        jvm = _judged(spark, validate_lines, spec, lines)
        reference = _judged(spark, reference_validate_lines, spec, lines)
        assert [r["line_number"] for r in jvm] == list(range(1, len(lines) + 1))
        differ, exact_only = [], 0
        for raw, mine, theirs in zip(lines, jvm, reference):
            if mine == theirs:
                continue
            oracle = judge_line(spec.name, raw, ingested_at=INGESTED_AT)
            if _read_through_a_double(raw) and (mine["reason"], mine["reason_field"]) == (oracle.reason, oracle.field):
                exact_only += 1
                continue
            changed = {c: (theirs[c], mine[c]) for c in mine.asDict() if mine[c] != theirs[c]}
            differ.append(f"{raw!r}\n    reference → jvm: {changed}")
        assert not differ, f"{spec.name}: {len(differ)} of {len(lines)} lines differ:\n" + "\n".join(differ[:40])
        # The edges above hold at least two lines that only an exact reading tells apart (1e-400, 1.000…1e0).
        assert exact_only >= 2 if spec is PAYMENTS else True


def test_an_engine_without_the_projects_jar_fails_naming_the_fix(tmp_path):
    """A JVM started with Delta's jars but not the project's: the validator's registration names `make jars`."""
    for jar in delta_jars():
        if jar.name != "statetables-jvm.jar":
            (tmp_path / jar.name).symlink_to(jar)
    script = ("from pipelines.session import build_spark_session\n"
              "from pipelines.validate import register_validator\n"
              "register_validator(build_spark_session())\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, JARS_ENV: str(tmp_path)}, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode != 0
    assert "ConfigurationError" in done.stderr and "statetables.jvm.ValidateLine" in done.stderr
    assert "Fix: run `make jars`" in done.stderr
