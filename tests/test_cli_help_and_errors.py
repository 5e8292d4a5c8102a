"""A new user's errors and help, by the real `statetables` command (no Spark starts: each is found before). Every
error names its place in the project file (FILE:LINE:COLUMN) and one fix; a project with several problems lists
every one; a command never falls back to another project than the one it names."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from statetables import cli


COMMAND = [sys.executable, "-m", "statetables.cli"]
STREAM = """\
streams:
  orders:
    id: order_id
    event_time: ordered_at
    fields:
      order_id: {type: string}
      region: {type: string}
      total: {type: decimal}
      ordered_at: {type: timestamp}
"""


def _statetables(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STATETABLES_PROJECT", "STATETABLES_HOME"))}
    return subprocess.run([*COMMAND, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def _help_page(command: str) -> str:
    """`statetables COMMAND --help` as the command prints it; the help exits with 0."""
    page = io.StringIO()
    with contextlib.redirect_stdout(page), pytest.raises(SystemExit) as exited:
        cli.main([command, "--help"])
    assert exited.value.code == 0, command
    return page.getvalue()


def _check(tmp_path: Path, text: str) -> str:
    (tmp_path / "statetables.yaml").write_text(text)
    done = _statetables(tmp_path, "check")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    return done.stderr


def test_a_placeholder_in_the_sql_says_what_it_is_where_it_is(tmp_path):
    stderr = _check(tmp_path, STREAM + "state_tables:\n  - sql: CREATE TABLE ...\n")
    assert f"{tmp_path / 'statetables.yaml'}:11:23: the SQL does not parse: `...` stands for the rest" in stderr
    assert "Token" not in stderr and "SENTINEL" not in stderr


def test_an_aggregate_that_cannot_be_kept_is_placed_at_its_token_with_one_fix(tmp_path):
    stderr = _check(tmp_path, STREAM + """state_tables:
  - sql: |
      CREATE TABLE t AS
      SELECT region,
             COUNT(*) AS n,
             MEDIAN(total) AS m
      FROM orders GROUP BY region
""")
    assert "statetables.yaml:15:14: table t: `MEDIAN(total)` is not an aggregate" in stderr  # line 15, not 12
    assert "use COUNT(*), COUNT(col), SUM, MIN, MAX, AVG, MIN_BY or MAX_BY" in stderr
    assert "README, 'Declare a stream'" not in stderr  # the general help only where there is no specific fix


def test_every_problem_is_listed_with_a_suggestion_for_a_typo(tmp_path):
    stderr = _check(tmp_path, STREAM.replace("    fields:", "    dedup_horizon_day: 3\n    fields:") + """\
  refunds:
    id: refund_id
    event_time: refunded_at
    fields:
      refund_id: {type: string, required: false}
      refunded_at: {type: timestamp}
state_tables:
  - CREATE TABLE a AS SELECT regoin, COUNT(*) AS n FROM orders GROUP BY regoin
  - CREATE TABLE b AS SELECT refund_id, COUNT(*) AS n FROM refunds GROUP BY refund_id
""")
    assert "the project file has 2 problems" in stderr
    assert "statetables.yaml:5:5: stream orders: unknown setting 'dedup_horizon_day' (did you mean " \
           "'dedup_horizon_days'?)" in stderr
    # The id is declared, but optional: the fix is to make it required, not to declare it.
    assert "statetables.yaml:12:9: stream refunds: `id: refund_id` names a field declared `required: false`" in stderr
    assert "Fix: remove `required: false` from refund_id" in stderr
    assert "table a:" not in stderr  # over a stream whose declaration failed: that stream's problem is the one


def test_an_unknown_column_suggests_the_field(tmp_path):
    stderr = _check(tmp_path, STREAM + "state_tables:\n"
                    "  - CREATE TABLE a AS SELECT region, SUM(totl) AS s FROM orders GROUP BY region\n")
    assert "statetables.yaml:11:42: table a: unknown column 'totl' (did you mean 'total'?)" in stderr
    assert "Fix: use one of orders's fields: order_id, region, total, ordered_at" in stderr


def test_yaml_errors_name_the_file_line_and_column(tmp_path):
    stderr = _check(tmp_path, "streams:\n  orders:\n    id: order_id\n   event_time: [\n")
    assert f"{tmp_path / 'statetables.yaml'}:4:4: not valid YAML" in stderr and "<unicode string>" not in stderr


def test_no_project_file_is_an_error_never_the_demo(tmp_path):
    (tmp_path / "statetables.yml").write_text(STREAM)
    done = _statetables(tmp_path, "status")
    assert done.returncode == 2 and "movie_ticket_sales" not in done.stdout + done.stderr
    assert "No project file" in done.stderr and "statetables.yml is here: rename it" in done.stderr
    assert "statetables init" in done.stderr


def test_project_after_the_command_and_a_missing_one_named_as_given(tmp_path):
    (tmp_path / "orders.yaml").write_text(STREAM)
    done = _statetables(tmp_path, "check", "--project", "orders.yaml")
    assert done.returncode == 0, done.stderr
    assert done.stderr.count(f"project: {tmp_path / 'orders.yaml'}") == 1 and "stream orders" in done.stdout
    missing = _statetables(tmp_path, "status", "--project", "nope.yaml")
    assert missing.returncode == 2 and "--project nope.yaml: no such file" in missing.stderr
    assert "STATETABLES_PROJECT" not in missing.stderr


def test_every_command_has_a_description_an_example_and_defaults(tmp_path):
    top = _statetables(tmp_path, "--help")
    assert top.returncode == 0 and "commands by what they are for:" in top.stdout
    assert "statetables init my_project" in top.stdout
    commands = [line.split()[0] for line in top.stdout.split("positional arguments:")[1].split("options:")[0]
                .splitlines()[2:] if line.startswith("    ") and not line.startswith("     ")]
    assert {"init", "check", "show", "quarantine", "explain", "run", "refresh"} <= set(commands)
    # Each command's page from the same parser in this process (a process each took ~0.3 s, ~30 of them).
    for command in commands:
        assert "example:\n  statetables " + command in _help_page(command), command
    generate = _help_page("generate")
    assert "(default: 10000)" in generate and "out of order" in generate
    assert _statetables(tmp_path, "--version").stdout.startswith("statetables ")
