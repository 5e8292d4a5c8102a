"""The SQL of the project file's tables, parsed by sqlglot (Spark dialect) into specs, before any data is touched.

Three shapes, in Spark SQL's own spelling:

    CREATE TABLE t AS SELECT keys..., aggregates... FROM stream GROUP BY keys...           -- a state table
    CREATE TABLE t AS SELECT keys..., window.start AS window_start, window.end AS window_end, aggregates...
        FROM stream GROUP BY keys..., window(event_time, '1 hour')                          -- a windowed table
    CREATE TABLE t AS SELECT keys..., MIN(event_time) AS started, aggregates...
        FROM stream GROUP BY keys..., session_window(event_time, '30 minutes')              -- a session table

and a top N of a windowed table, `SELECT ... FROM (SELECT ..., ROW_NUMBER() OVER (PARTITION BY window_start ORDER
BY ...) AS rank FROM windowed) WHERE rank <= N`. Only what can be kept incrementally is accepted: every column
mergeable (COUNT, SUM, MIN, MAX, AVG, MIN_BY, MAX_BY), and for session tables the previous session's value of an
aggregate (`LAG(agg) OVER (PARTITION BY keys ORDER BY MIN(event_time))`) and an aggregate's running sum over the
key's sessions of the same UTC day (`SUM(agg) OVER (PARTITION BY keys, DATE(MAX(event_time)) ORDER BY
MIN(event_time))`), which per-key state carries from one micro-batch to the next. Anything else is refused with the
reason and the fix.
"""

from __future__ import annotations

import re
from dataclasses import replace
from datetime import timedelta
from typing import Callable

import sqlglot
from sqlglot import exp

from pipelines.declare.aggregates import KINDS
from pipelines.declare.specs import (
    Aggregate, EventTimeTableSpec, KafkaTopic, OutputColumn, StateTableSpec, StreamSpec, TopSpec,
)
from pipelines.errors import ConfigurationError, did_you_mean

NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,99}$")
SQL_HELP = ("write `CREATE TABLE name AS SELECT key, ..., COUNT(*) AS n, SUM(col) AS total, ... FROM stream "
            "GROUP BY key, ...` with aggregates COUNT(*), COUNT(col), SUM, MIN, MAX, AVG, MIN_BY, MAX_BY over the "
            "stream's fields; add `window(event_time, '1 hour')` or `session_window(event_time, '30 minutes')` to "
            "the GROUP BY for a windowed or session table (README, 'Declare a stream')")
# sqlglot's expression class → the aggregate it is, for those a MERGE can combine (pipelines/declare/aggregates.py).
_AGGREGATES = {getattr(exp, kind.sqlglot_class): function for function, kind in KINDS.items()}
NUMERIC = ("decimal", "integer")
_UNITS = {"second": 1, "minute": 60, "hour": 3600, "day": 86400, "week": 604800}
_DURATION = re.compile(r"^\s*(\d+)\s*(second|minute|hour|day|week)s?\s*$", re.IGNORECASE)
# Clauses a declared table refuses, and why.
_CLAUSES = (("joins", "a join cannot be kept incrementally"),
            ("having", "a HAVING cannot be kept incrementally (a key's row would come and go)"),
            ("order", "an ORDER BY has no meaning for a table"), ("limit", "a LIMIT cannot be kept incrementally"),
            ("distinct", "SELECT DISTINCT cannot be kept incrementally"), ("with", "a WITH is not supported"),
            ("qualify", "a QUALIFY cannot be kept incrementally"))

# fail(message, at=None, fix=None): the error, placed at character `at` of the SQL; `fix` when there is a specific
# one (else the caller's general help).
Fail = Callable[..., ConfigurationError]


def _offset(node: exp.Expression | None) -> int | None:
    """Where a parsed node starts in the SQL text: its own token's position, or its first token's."""
    if node is None:
        return None
    for found in node.walk():
        found = found[0] if isinstance(found, tuple) else found
        if found.meta.get("start") is not None:
            return found.meta["start"]
    return None


def _parse_error(sql: str, exc: sqlglot.errors.ParseError) -> tuple[str, int | None]:
    """sqlglot's first error in words (without its token internals) and its offset in the SQL."""
    error = exc.errors[0] if exc.errors else {}
    if "..." in sql:
        return "`...` stands for the rest of the statement in an example; write it whole", sql.index("...")
    if "TokenType.SENTINEL" in (error.get("description") or ""):
        return "the statement ends before it is complete", max(len(sql.rstrip()) - 1, 0)
    text = re.sub(r"<Token token_type: TokenType\.\w+, text: (.*?), line: \d+.*?>", r"`\1`",
                  error.get("description") or str(exc).splitlines()[0])
    line, col = error.get("line"), error.get("col")
    if not line or not col:
        return text, None
    lines = sql.split("\n")
    return text, sum(len(x) + 1 for x in lines[:line - 1]) + max(col - len(error.get("highlight") or "x"), 0)


def over_broken_source(sql: str, broken: frozenset[str]) -> str | None:
    """The name of the table `sql` declares when it reads FROM one of the `broken` streams or tables (their
    declarations failed, and say so), else None."""
    if not broken:
        return None
    try:
        create = sqlglot.parse_one(sql, read="spark")
    except sqlglot.errors.ParseError:
        return None
    select = create.expression if isinstance(create, exp.Create) else None
    source = select.args.get("from_") if isinstance(select, exp.Select) else None
    if source is not None and isinstance(source.this, exp.Subquery):  # a top N: FROM (SELECT ... FROM windowed)
        inner = source.this.this
        source = inner.args.get("from_") if isinstance(inner, exp.Select) else None
    if source is not None and isinstance(source.this, exp.Table) and source.this.name in broken:
        return create.this.name if isinstance(create.this, exp.Table) else ""
    return None


def parse_table(sql: str, fail: Fail, streams: dict[str, StreamSpec], windowed: dict[str, EventTimeTableSpec], *,
                line: int, ttl: timedelta | None = None, changelog_topic: KafkaTopic | None = None
                ) -> StateTableSpec | EventTimeTableSpec | TopSpec:
    """The spec `sql` declares; `fail(message)` makes the error (the caller adds the file and line); `windowed`:
    the windowed tables declared before it, which a top N may rank."""
    try:
        statements = [s for s in sqlglot.parse(sql, read="spark") if s is not None]
    except sqlglot.errors.ParseError as exc:
        text, at = _parse_error(sql, exc)
        raise fail(f"the SQL does not parse: {text}", at) from None
    if len(statements) != 1 or not isinstance(statements[0], exp.Create) or statements[0].kind != "TABLE":
        raise fail("a table is one `CREATE TABLE name AS SELECT ...` statement")
    create = statements[0]
    name = create.this.name if isinstance(create.this, exp.Table) else ""
    select = create.expression
    if not NAME.match(name or "") or not isinstance(select, exp.Select):
        raise fail("a table is `CREATE TABLE name AS SELECT ...` with a plain name")
    def where_of(message: str, at: exp.Expression | None = None, fix: str | None = None) -> ConfigurationError:
        return fail(f"table {name}: {message}", _offset(at), fix)

    text = " ".join(sql.split())
    source = select.args.get("from_") or select.args.get("from")
    if source is not None and isinstance(source.this, exp.Subquery):
        if ttl is not None or changelog_topic is not None:
            raise where_of("a top N takes no `ttl_days:` or `changelog_topic:`")
        return _top(name, select, source.this, windowed, where_of, text, line)
    for clause, why in _CLAUSES:
        if select.args.get(clause):
            raise where_of(why)
    if source is None or not isinstance(source.this, exp.Table) or source.this.args.get("db"):
        raise where_of("FROM must name one declared stream", at=source, fix=f"read FROM one of {', '.join(streams)}")
    stream_name = source.this.name
    if stream_name not in streams:
        raise where_of(f"FROM {stream_name}: no such stream{did_you_mean(stream_name, streams)}", at=source.this,
                       fix=f"read FROM one of {', '.join(streams)}, or declare {stream_name} under `streams:`")
    spec = streams[stream_name]
    group = select.args.get("group")
    if group is None or not group.expressions:
        raise where_of("no GROUP BY: a table has one row per key", at=select,
                       fix="add `GROUP BY key, ...` with the keys the SELECT lists")
    timed = [g for g in group.expressions if _function_name(g) in ("window", "session_window")]
    if len(timed) > 1:
        raise where_of("GROUP BY one window() or one session_window(), not several")
    parts = _Parts(name, spec, where_of)
    where = _filter(select.args.get("where"), parts) if select.args.get("where") else None
    keys = tuple(parts.field_of(g, "a GROUP BY item") for g in group.expressions if g not in timed)
    if not keys:
        raise where_of("no key: GROUP BY at least one field besides the window")
    if len(set(keys)) != len(keys):
        raise where_of("a key is grouped twice")
    if timed:
        if changelog_topic is not None:
            raise where_of("`changelog_topic:` is for state tables: a windowed or session table's rows are final "
                           "once written, read them from the table")
        return replace(_event_time_table(name, select, parts, keys, timed[0], ttl, text, line), where=where)
    return replace(_state_table(name, select, parts, keys, ttl, changelog_topic, text, line), where=where)


# Functions whose value is not the row's alone: a replay or a rebuild would keep other rows.
_UNSTABLE = {"rand", "random", "randn", "uuid", "shuffle", "now", "current_timestamp", "current_date",
             "localtimestamp", "unix_timestamp", "monotonically_increasing_id", "spark_partition_id",
             "input_file_name"}


def _filter(where: exp.Where, parts: _Parts) -> str:
    """A WHERE over the stream's fields, kept incrementally because it decides each event alone: no aggregate, no
    window function, no subquery, nothing that changes between runs. As Spark SQL, for `F.expr`."""
    condition = where.this
    for node in condition.walk():
        node = node[0] if isinstance(node, tuple) else node
        if isinstance(node, (exp.AggFunc, exp.Window)):
            raise parts.where_of(f"WHERE `{condition.sql('spark')}`: an aggregate or window function decides rows "
                                 f"together; a WHERE keeps each event on its own (HAVING is not kept)", at=condition)
        if isinstance(node, (exp.Subquery, exp.Select)):
            raise parts.where_of(f"WHERE `{condition.sql('spark')}`: a subquery is not kept incrementally", at=condition)
        if isinstance(node, exp.Func):
            name = (node.name if isinstance(node, exp.Anonymous) else node.sql_name()).lower()
            if name in _UNSTABLE or type(node).__name__.lower() in _UNSTABLE:
                raise parts.where_of(f"WHERE `{condition.sql('spark')}`: {name} changes between runs, so a replay "
                                     f"would keep other events", at=condition)
        if isinstance(node, exp.Column):
            parts.field_of(node, "a column of the WHERE")
    return condition.sql("spark")


def _function_name(node: exp.Expression) -> str | None:
    return node.name.lower() if isinstance(node, exp.Anonymous) else None


class _Parts:
    """Reads a table's select items against its stream's fields."""

    def __init__(self, name: str, spec: StreamSpec, where_of: Fail):
        self.name, self.spec, self.where_of = name, spec, where_of
        self.fields = {f.name: f for f in spec.fields}

    def field_of(self, node: exp.Expression, role: str) -> str:
        if not isinstance(node, exp.Column) or node.table:
            raise self.where_of(f"{role} must be a plain column of {self.spec.name}, got `{node.sql('spark')}`", at=node)
        if node.name not in self.fields:
            raise self.where_of(f"unknown column {node.name!r}{did_you_mean(node.name, self.fields)}", at=node,
                                fix=f"use one of {self.spec.name}'s fields: {', '.join(self.fields)}")
        return node.name

    def aggregate(self, node: exp.Expression, name: str, *, lists: bool) -> Aggregate:
        function = _AGGREGATES.get(type(node))
        if function is None:
            raise self.where_of(f"`{node.sql('spark')}` is not an aggregate the table can merge incrementally", at=node,
                                fix="use COUNT(*), COUNT(col), SUM, MIN, MAX, AVG, MIN_BY or MAX_BY: each is kept from "
                                    "partial results batch by batch, which a median, a distinct count or a "
                                    "percentile cannot be")
        argument = node.this
        if isinstance(argument, exp.Distinct):
            raise self.where_of(f"`{node.sql('spark')}`: DISTINCT cannot be kept incrementally", at=node)
        takes = KINDS[function].argument
        if takes == "row or column" and isinstance(argument, exp.Star):
            return Aggregate(name, function)
        column = self.field_of(argument, f"the argument of {function.upper()}")
        kind = self.fields[column].kind
        if takes == "number" and kind not in NUMERIC:
            raise self.where_of(f"{function.upper()}({column}): {column} is a {kind}; {function.upper()} needs a "
                                f"decimal or integer")
        if takes == "value and ordering":
            by = node.args.get("expression")
            if by is None:
                raise self.where_of(f"{function.upper()} takes (value, ordering)")
            by_column = self.field_of(by, f"the ordering of {function.upper()}")
            if self.fields[by_column].kind == "boolean":
                raise self.where_of(f"{function.upper()} orders by {by_column}, a boolean: order by a time or a "
                                    f"number")
            n = None
            if node.args.get("count") is not None:
                if not lists:
                    raise self.where_of(f"`{node.sql('spark')}` keeps a list of values: a state table keeps one "
                                        f"value per column (lists are for windowed and session tables)", at=node)
                n = _whole_number(node.args["count"], f"the count of {function.upper()}", self.where_of)
            return Aggregate(name, function, column, by_column, n)
        if node.args.get("expressions"):
            raise self.where_of(f"`{node.sql('spark')}` takes one column", at=node)
        return Aggregate(name, function, column)


def _rendered(node: exp.Expression) -> str:
    """An expression's SQL as sqlglot writes it, lower case: how two spellings of one aggregate are matched. Spark's
    writer has no 3-argument MAX_BY (ours keeps a list), hence no warning about it."""
    return node.sql("spark", unsupported_level=sqlglot.ErrorLevel.IGNORE).lower()


def _whole_number(node: exp.Expression, what: str, where_of: Fail) -> int:
    if not isinstance(node, exp.Literal) or node.is_string or not re.fullmatch(r"[0-9]+", node.this) \
            or int(node.this) < 1:
        raise where_of(f"{what} must be a whole number >= 1, got `{node.sql('spark')}`", at=node)
    return int(node.this)


def _check_names(names: list[str], where_of: Fail) -> None:
    if len(set(names)) != len(names):
        raise where_of(f"two columns are named {next(n for n in names if names.count(n) > 1)!r}")
    if "updated_at" in names or any(n.startswith("_") for n in names):
        raise where_of("`updated_at` and names starting with `_` are the table's own columns")


def _state_table(name: str, select: exp.Select, parts: _Parts, keys: tuple[str, ...], ttl: timedelta | None,
                 changelog_topic: KafkaTopic | None, sql: str, line: int) -> StateTableSpec:
    where_of, spec = parts.where_of, parts.spec
    selected_keys, aggregates, names = [], [], []
    for item in select.expressions:
        if isinstance(item, exp.Column):
            column = parts.field_of(item, "a selected key")
            if column not in keys:
                raise where_of(f"`{column}` is neither grouped nor aggregated")
            selected_keys.append(column)
            names.append(column)
            continue
        if not isinstance(item, exp.Alias):
            raise where_of(f"`{item.sql('spark')}` needs a column name: add `AS name`", at=item)
        if isinstance(item.this, exp.Column):  # `col AS name`: a renamed key, or a bare column
            column = parts.field_of(item.this, "a selected column")
            raise where_of(f"select the key `{column}` as is, without AS" if column in keys
                           else f"`{column}` is neither grouped nor aggregated")
        aggregates.append(parts.aggregate(item.this, item.alias, lists=False))
        names.append(item.alias)
    _check_names(names, where_of)
    if set(selected_keys) != set(keys) or len(selected_keys) != len(keys):
        raise where_of(f"select every GROUP BY key once, as is: {', '.join(keys)}")
    if not aggregates:
        raise where_of("no aggregate: add one, e.g. COUNT(*) AS events")
    required = {f.name for f in spec.fields if f.required}
    counted = next((a.name for a in aggregates if a.function == "count" and (a.column is None or a.column in required)),
                   None)
    summed = next((a for a in aggregates if a.function == "sum" and a.column in required
                   and spec.field(a.column).kind == "decimal"), None)
    table = StateTableSpec(name=name, stream=spec.name, keys=tuple(selected_keys), aggregates=tuple(aggregates),
                           sql=sql, line=line, ttl=ttl, fields=spec.fields,
                           count_column=counted, sum_column=summed.name if summed else None,
                           summed_field=summed.column if summed else None,
                           last_ts_column=next((a.name for a in aggregates if a.function == "max"
                                                and a.column == spec.event_time_field), None),
                           changelog_topic=changelog_topic)
    if ttl is not None and (len(table.keys) != 1 or table.count_column is None or table.last_ts_column is None):
        # A TTL deletes keys by their newest event time and keeps running totals of what it deleted.
        raise where_of(f"ttl_days needs one key, COUNT(*) and MAX({spec.event_time_field}) in the table")
    return table


def duration(node: exp.Expression, what: str, where_of: Fail) -> timedelta:
    """A window size or gap as Spark writes it: '1 hour', '30 minutes', '10 seconds', '1 day'."""
    text = node.this if isinstance(node, exp.Literal) and node.is_string else None
    match = _DURATION.match(text or "")
    if match is None or int(match.group(1)) < 1:
        raise where_of(f"{what} `{node.sql('spark')}`: write a whole number of seconds, minutes, hours, days or "
                       f"weeks as a string, e.g. '1 hour' or '30 minutes'", at=node)
    return timedelta(seconds=int(match.group(1)) * _UNITS[match.group(2).lower()])


def _event_time_table(name: str, select: exp.Select, parts: _Parts, keys: tuple[str, ...], timed: exp.Anonymous,
                      ttl: timedelta | None, sql: str, line: int) -> EventTimeTableSpec:
    where_of, spec = parts.where_of, parts.spec
    kind = "window" if _function_name(timed) == "window" else "session"
    function = _function_name(timed)
    arguments = timed.expressions
    if len(arguments) < 2:
        raise where_of(f"{function}() takes (event time, '{'1 hour' if kind == 'window' else '30 minutes'}')")
    at = parts.field_of(arguments[0], f"the time of {function}()")
    if at != spec.event_time_field:
        raise where_of(f"{function}({at}, ...): the watermark follows {spec.name}'s event time; use "
                       f"{function}({spec.event_time_field}, ...)")
    size = duration(arguments[1], f"the {'size' if kind == 'window' else 'gap'} of {function}()", where_of)
    if kind == "window" and len(arguments) > 2:
        slide = duration(arguments[2], "the slide of window()", where_of)
        if slide != size or len(arguments) > 3:
            raise where_of("hopping windows (a slide other than the size, or a start offset) are not kept: each "
                           "event would count in several open windows at once. Declare a tumbling window, "
                           "window(event_time, size)")
    elif len(arguments) > 2:
        raise where_of("session_window() takes (event time, gap): a dynamic gap is not kept")
    if ttl is not None and kind == "window":
        raise where_of("`ttl_days:` is for session tables (a key's previous session is forgotten after it); a "
                       "window's rows are final once written")
    columns, aggregates, selected_keys = [], [], []
    rendered: dict[str, str] = {}  # an aggregate's SQL → its column, for LAG and SUM OVER
    window_items = []
    for item in select.expressions:
        if isinstance(item, exp.Column) and not item.table:
            column = parts.field_of(item, "a selected key")
            if column not in keys:
                raise where_of(f"`{column}` is neither grouped nor aggregated")
            selected_keys.append(column)
            columns.append(OutputColumn(column, "key"))
            continue
        if not isinstance(item, exp.Alias):
            raise where_of(f"`{item.sql('spark')}` needs a column name: add `AS name`", at=item)
        value, out = item.this, item.alias
        if isinstance(value, exp.Column) and value.table:
            if value.table.lower() != function or value.name.lower() not in ("start", "end"):
                raise where_of(f"`{value.sql('spark')}`: select {function}.start or {function}.end", at=value)
            columns.append(OutputColumn(out, value.name.lower()))
        elif isinstance(value, exp.Column):
            column = parts.field_of(value, "a selected column")
            raise where_of(f"select the key `{column}` as is, without AS" if column in keys
                           else f"`{column}` is neither grouped nor aggregated")
        elif isinstance(value, exp.Window):
            if kind != "session":
                raise where_of(f"`{value.sql('spark')}`: a window function is not kept in a windowed table (a top N "
                               f"is a table of its own, ranking this one)", at=value)
            window_items.append((out, value))
            columns.append(OutputColumn(out, "previous"))  # its role is settled below
        else:
            aggregate = parts.aggregate(value, out, lists=True)
            aggregates.append(aggregate)
            rendered[_rendered(value)] = out
            columns.append(OutputColumn(out, "aggregate", out))
    names = [c.name for c in columns]
    _check_names(names, where_of)
    if set(selected_keys) != set(keys) or len(selected_keys) != len(keys):
        raise where_of(f"select every GROUP BY key once, as is: {', '.join(keys)}")
    if not aggregates:
        raise where_of("no aggregate: add one, e.g. COUNT(*) AS events")
    if kind == "window" and not any(c.role == "start" for c in columns):
        raise where_of("select window.start (e.g. `window.start AS window_start`): without it, rows of different "
                       "windows cannot be told apart")
    first = next((a.name for a in aggregates if a.function == "min" and a.column == at), None)
    last = next((a.name for a in aggregates if a.function == "max" and a.column == at), None)
    if kind == "session" and first is None and not any(c.role == "start" for c in columns):
        raise where_of(f"select the session's start, session_window.start or MIN({at}): without it, sessions of a "
                       f"key cannot be told apart")
    roles = {}
    for out, window in window_items:
        roles[out] = _session_function(window, keys, rendered, first, last, at, aggregates, where_of)
    columns = [OutputColumn(c.name, *roles[c.name]) if c.name in roles else c for c in columns]
    return EventTimeTableSpec(name=name, stream=spec.name, kind=kind, keys=keys, aggregates=tuple(aggregates),
                              size=size, columns=tuple(columns), event_time_field=at, fields=spec.fields, sql=sql,
                              line=line, ttl=ttl)


def _session_function(window: exp.Window, keys: tuple[str, ...], rendered: dict[str, str], first: str | None,
                      last: str | None, at: str, aggregates: list[Aggregate], where_of: Fail) -> tuple[str, str]:
    """(role, aggregate) of a window function over a session table's rows: LAG(agg) or SUM(agg) by day."""
    shown = window.sql("spark")
    order = window.args.get("order")
    ordered = order.expressions if order is not None else []
    start_sql = {f"min({at})", "session_window.start"}
    if len(ordered) != 1 or ordered[0].args.get("desc") or ordered[0].this.sql("spark").lower() not in start_sql:
        raise where_of(f"`{shown}`: order a key's sessions by their start, `ORDER BY MIN({at})`")
    if window.args.get("spec") is not None:
        raise where_of(f"`{shown}`: a frame clause is not kept; leave the default (the sessions up to this one)")
    partition = [p.sql("spark").lower() for p in window.args.get("partition_by") or []]
    function = window.this
    inner = _rendered(function.this) if function.this is not None else ""
    of = rendered.get(inner)
    if of is None:
        raise where_of(f"`{shown}`: its argument must be an aggregate the table also selects, e.g. "
                       f"LAG(MAX({at})) with `MAX({at}) AS ...` among the columns")
    if isinstance(function, exp.Lag):
        if function.args.get("offset") is not None or function.args.get("default") is not None:
            raise where_of(f"`{shown}`: LAG takes one argument here (the previous session)")
        if partition != [k.lower() for k in keys]:
            raise where_of(f"`{shown}`: partition by the table's keys, `PARTITION BY {', '.join(keys)}`")
        return "previous", of
    if isinstance(function, exp.Sum):
        summed = next(a for a in aggregates if a.name == of)
        if summed.function not in ("sum", "count"):
            raise where_of(f"`{shown}`: a running total adds up a SUM or COUNT of the table")
        day = {f"cast(max({at}) as date)", f"to_date(max({at}))", f"date(max({at}))"}
        if last is None or partition[:-1] != [k.lower() for k in keys] or not partition or partition[-1] not in day:
            raise where_of(f"`{shown}`: a running total per day partitions by the keys and the day the session "
                           f"ends, `PARTITION BY {', '.join(keys)}, DATE(MAX({at}))`, with `MAX({at}) AS ...` "
                           f"among the columns")
        return "day_total", of
    raise where_of(f"`{shown}`: a session table keeps LAG(agg) and SUM(agg) per day; other window functions are "
                   f"not kept")


def _top(name: str, select: exp.Select, subquery: exp.Subquery, windowed: dict[str, EventTimeTableSpec],
         where_of: Fail, sql: str, line: int) -> TopSpec:
    pattern = ("SELECT ... FROM (SELECT ..., ROW_NUMBER() OVER (PARTITION BY window_start ORDER BY ...) AS rank "
               "FROM windowed_table) WHERE rank <= N")
    inner = subquery.this
    if not isinstance(inner, exp.Select):
        raise where_of(f"a top N is `{pattern}`")
    for clause, why in _CLAUSES:
        if select.args.get(clause) or inner.args.get(clause):
            raise where_of(f"{why}; a top N is `{pattern}`")
    if inner.args.get("where") or inner.args.get("group"):
        raise where_of(f"a top N ranks every row of its windowed table: `{pattern}`")
    source = inner.args.get("from_") or inner.args.get("from")
    if source is None or not isinstance(source.this, exp.Table):
        raise where_of(f"a top N ranks a windowed table: `{pattern}`")
    table = windowed.get(source.this.name)
    if table is None:
        raise where_of(f"FROM {source.this.name}: not a windowed table declared above this one"
                       + (f" (windowed tables: {', '.join(windowed)})" if windowed else ""))
    available = [c.name for c in table.columns]
    ranks = [item for item in inner.expressions if isinstance(item, exp.Alias) and isinstance(item.this, exp.Window)]
    if len(ranks) != 1:
        raise where_of(f"a top N has one ROW_NUMBER() OVER (...) AS rank: `{pattern}`")
    rank, window = ranks[0].alias, ranks[0].this
    if not isinstance(window.this, exp.RowNumber):
        raise where_of(f"`{window.sql('spark')}`: rank with ROW_NUMBER(): RANK and DENSE_RANK give ties the same "
                       f"rank, so a top N could hold more than N rows", at=window)
    inner_columns = []
    for item in inner.expressions:
        if item is ranks[0]:
            continue
        if isinstance(item, exp.Star):
            inner_columns += available
        elif isinstance(item, exp.Column) and not item.table and item.name in available:
            inner_columns.append(item.name)
        else:
            raise where_of(f"`{item.sql('spark')}`: select columns of {table.name} as they are "
                           f"({', '.join(available)})", at=item)
    start = table.column("start")
    partition = [p.sql("spark") for p in window.args.get("partition_by") or []]
    if partition != [start]:
        raise where_of(f"`{window.sql('spark')}`: rank within each window, `PARTITION BY {start}`", at=window)
    order = []
    for ordered in (window.args.get("order").expressions if window.args.get("order") else []):
        column = ordered.this
        if not isinstance(column, exp.Column) or column.table or column.name not in available:
            raise where_of(f"ORDER BY `{ordered.sql('spark')}`: order by columns of {table.name} "
                           f"({', '.join(available)})", at=ordered)
        descending = bool(ordered.args.get("desc"))
        nulls_first = ordered.args.get("nulls_first")
        order.append((column.name, descending, bool(nulls_first) if nulls_first is not None else not descending))
    if not set(table.keys) <= {c for c, _, _ in order}:
        missing = [k for k in table.keys if k not in {c for c, _, _ in order}]
        raise where_of(f"ORDER BY {', '.join(c for c, _, _ in order) or '(nothing)'} can tie: two rows of one window "
                       f"with equal values would be ranked by chance, and a replay could rank them otherwise. End it "
                       f"with {table.name}'s keys ({', '.join(missing)}), which no two rows of a window share")
    condition = select.args.get("where")
    bound = condition.this if condition is not None else None
    if not isinstance(bound, (exp.LTE, exp.LT)) or not isinstance(bound.this, exp.Column) or bound.this.name != rank:
        raise where_of(f"a top N keeps `WHERE {rank} <= N`")
    n = _whole_number(bound.expression, f"the N of `WHERE {rank} <= N`", where_of)
    n = n if isinstance(bound, exp.LTE) else n - 1
    if n < 1:
        raise where_of(f"`{condition.sql('spark')}` keeps no row", at=condition)
    columns = []
    for item in select.expressions:
        if isinstance(item, exp.Star):
            columns += [*inner_columns, rank]
        elif isinstance(item, exp.Column) and not item.table and item.name in (*inner_columns, rank):
            columns.append(item.name)
        else:
            raise where_of(f"`{item.sql('spark')}`: select columns of the ranking as they are "
                           f"({', '.join([*inner_columns, rank])})", at=item)
    _check_names(columns, where_of)
    return TopSpec(name=name, source=table.name, n=n, order=tuple(order), rank_column=rank, columns=tuple(columns),
                   sql=sql, line=line)


SOURCE = "__statetables_source__"


def query_over(sql: str, drop: set[str] = frozenset()) -> str:
    """The declared table's SELECT as Spark SQL text over a DataFrame argument `{source}` (`spark.sql(text,
    source=frame)`), in place of the stream or table it names; the columns in `drop` left out (a list MAX_BY, which
    Spark's own aggregate does not take). What the checks recompute: the user's query, run by Spark itself."""
    select = sqlglot.parse_one(sql, read="spark").expression.copy()
    for table in list(select.find_all(exp.Table)):
        table.replace(exp.to_table(SOURCE))
    if drop:
        select.set("expressions", [e for e in select.expressions if e.alias_or_name not in drop])
    text = select.sql("spark").replace("{", "{{").replace("}", "}}")
    return text.replace(SOURCE, "{source}")
