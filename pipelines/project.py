"""The project file: the streams and state tables a user declares, read once into `StreamSpec`s.

    statetables.yaml (or the file $STATETABLES_PROJECT names; the CLI's --project sets it)

    streams:
      orders:
        id: order_id                  # the dedup key
        event_time: ordered_at
        fields:
          order_id: {type: string}
          total:    {type: decimal, min: 0}
        dedup_horizon_days: 7         # optional settings, here and nowhere else, so every run uses them
    state_tables:
      - CREATE TABLE orders_per_key AS SELECT ... FROM orders GROUP BY ...
      - {sql: CREATE TABLE ..., ttl_days: 30}

State tables are the seeds' SQL, parsed by sqlglot (Spark dialect) and kept only when every column can be merged
incrementally; anything else fails the load naming the file's line and the fix, before any data is touched.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from datetime import timedelta
from decimal import Decimal, InvalidOperation
from pathlib import Path

import sqlglot
import yaml
from sqlglot import exp

from pipelines.errors import ConfigurationError
from pipelines.streams import (
    Aggregate, FieldRule, KafkaTopic, SessionOptions, StateTableSpec, StreamSpec, WindowOptions,
)

PROJECT_ENV = "STATETABLES_PROJECT"
PROJECT_FILE = "statetables.yaml"
SHIPPED = Path(__file__).resolve().parents[1] / PROJECT_FILE
NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,99}$")
KINDS = ("string", "decimal", "timestamp", "integer", "boolean")
RULES = {"type", "required", "trim", "max_length", "min", "max", "min_exclusive", "max_exclusive"}
STREAM_KEYS = {"id", "event_time", "fields", "dedup_horizon_days", "event_time_max_ahead_hours", "windows",
               "sessions", "source"}
TOPIC = re.compile(r"^[A-Za-z0-9._-]{1,249}$")  # Kafka's own rule for topic names
# The columns bronze adds to a stream's fields (pipelines/bronze.py): a state table may not aggregate them.
SQL_HELP = ("Fix: write `CREATE TABLE name AS SELECT key, ..., COUNT(*) AS n, SUM(col) AS total, ... FROM stream "
            "GROUP BY key, ...` with aggregates COUNT(*), COUNT(col), SUM, MIN, MAX, AVG, MIN_BY, MAX_BY over the "
            "stream's fields (README, 'Declare a stream').")


@dataclass(frozen=True)
class Project:
    path: Path
    streams: dict[str, StreamSpec]

    def stream(self, name: str) -> StreamSpec:
        try:
            return self.streams[name]
        except KeyError:
            raise ConfigurationError(f"Unknown stream {name!r}. Fix: use one of {', '.join(self.streams)} (declared "
                                     f"in {self.path}), or declare it there.") from None

    def state_table(self, name: str) -> tuple[StreamSpec, StateTableSpec]:
        for spec in self.streams.values():
            for table in spec.state_tables:
                if table.name == name:
                    return spec, table
        known = ", ".join(t.name for s in self.streams.values() for t in s.state_tables)
        raise ConfigurationError(f"No state table {name!r} in {self.path}. Fix: use one of {known}.")

    @property
    def state_tables(self) -> list[StateTableSpec]:
        return [t for s in self.streams.values() for t in s.state_tables]


def project_path() -> Path:
    """$STATETABLES_PROJECT, else statetables.yaml in the working directory, else the shipped one."""
    named = os.environ.get(PROJECT_ENV)
    if named:
        path = Path(named).expanduser()
        if not path.is_file():
            raise ConfigurationError(f"{PROJECT_ENV}={named}: no such file. Fix: point it at your project file "
                                     f"(a statetables.yaml), or unset it to use ./{PROJECT_FILE}.")
        return path.resolve()
    here = Path.cwd() / PROJECT_FILE
    return here.resolve() if here.is_file() else SHIPPED


_loaded: dict[tuple[Path, int], Project] = {}


def project(path: Path | None = None) -> Project:
    """The project as its file says now (read again when the file changes)."""
    path = path or project_path()
    key = (path, path.stat().st_mtime_ns)
    if key not in _loaded:
        _loaded[key] = load_project(path.read_text(), path)
    return _loaded[key]


class _Where:
    """Error messages that name the file and line."""

    def __init__(self, path: Path):
        self.path = path

    def fail(self, node: yaml.Node | None, message: str, fix: str) -> ConfigurationError:
        line = f":{node.start_mark.line + 1}" if node is not None else ""
        return ConfigurationError(f"{self.path}{line}: {message}. Fix: {fix}")


def _value(node: yaml.Node):
    return yaml.SafeLoader("").construct_object(node, deep=True)


def _mapping(where: _Where, node: yaml.Node, what: str) -> dict[str, tuple[yaml.Node, yaml.Node]]:
    if not isinstance(node, yaml.MappingNode):
        raise where.fail(node, f"{what} must be a mapping", f"write {what} as `name: value` lines")
    found: dict[str, tuple[yaml.Node, yaml.Node]] = {}
    for key, value in node.value:
        name = str(_value(key))
        if name in found:
            raise where.fail(key, f"{what} names {name!r} twice", "keep one")
        found[name] = (key, value)
    return found


def load_project(text: str, path: Path) -> Project:
    where = _Where(path)
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        raise ConfigurationError(f"{path}: not valid YAML: {exc}. Fix: correct the file's syntax.") from None
    if root is None:
        raise where.fail(None, "the project file is empty", "declare `streams:` and `state_tables:`")
    top = _mapping(where, root, "the project file")
    if unknown := sorted(set(top) - {"streams", "state_tables", "kafka"}):
        raise where.fail(top[unknown[0]][0], f"unknown section {unknown[0]!r}",
                         "use `streams:`, `state_tables:` and `kafka:`")
    if "streams" not in top:
        raise where.fail(root, "no `streams:` section", "declare at least one stream under `streams:`")
    servers = _kafka(where, top["kafka"][1]) if "kafka" in top else None
    streams = {name: _stream(where, name, key, node, servers) for name, (key, node) in
               _mapping(where, top["streams"][1], "streams").items()}
    tables: dict[str, list[StateTableSpec]] = {name: [] for name in streams}
    items = top.get("state_tables", (None, yaml.SequenceNode("tag:yaml.org,2002:seq", [])))[1]
    if not isinstance(items, yaml.SequenceNode):
        raise where.fail(items, "`state_tables:` must be a list", "write each table as `- CREATE TABLE ...`")
    taken = {t for s in streams.values() for t in (s.bronze_table, s.quarantine_table, s.files_table)}
    for item in items.value:
        table = _state_table(where, item, streams, servers)
        if table.name in taken or table.name in {t.name for ts in tables.values() for t in ts}:
            raise where.fail(item, f"the table name {table.name!r} is taken", "give the state table another name")
        taken.add(table.name)
        tables[table.stream].append(table)
    specs = {name: replace(spec, state_tables=tuple(tables[name])) for name, spec in streams.items()}
    for spec in specs.values():
        if (spec.windows or spec.sessions) and spec.value_field is None:
            raise where.fail(None, f"stream {spec.name} (line {spec.line}) declares `{'windows' if spec.windows else 'sessions'}:`, "
                             f"which total a value, but none of its state tables sums a required decimal field",
                             "add SUM(<decimal field>) to one of its state tables")
    for kind in ("windows", "sessions"):
        using = [s for s in specs.values() if getattr(s, kind) is not None]
        if len(using) > 1:
            raise where.fail(None, f"{', '.join(s.name for s in using)} all declare `{kind}:`; their output tables "
                             f"have one name each", f"declare `{kind}:` on one stream")
    return Project(path, specs)


def _number(where: _Where, node: yaml.Node, what: str, *, positive: bool = True) -> float:
    value = _value(node)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (positive and not value > 0):
        raise where.fail(node, f"{what} is {value!r}", f"give {what} a number{' > 0' if positive else ''}")
    return float(value)


def _kafka(where: _Where, node: yaml.Node) -> str | None:
    options = _mapping(where, node, "kafka")
    if unknown := sorted(set(options) - {"bootstrap_servers"}):
        raise where.fail(options[unknown[0]][0], f"kafka: unknown setting {unknown[0]!r}",
                         "write `kafka: {bootstrap_servers: host:port}`")
    if "bootstrap_servers" not in options:
        return None
    servers = _value(options["bootstrap_servers"][1])
    if not isinstance(servers, str) or not servers.strip():
        raise where.fail(options["bootstrap_servers"][1], f"kafka: bootstrap_servers {servers!r}",
                         "write host:port, several separated by commas")
    return servers.strip()


def _topic_name(where: _Where, node: yaml.Node, what: str) -> str:
    name = _value(node)
    if not isinstance(name, str) or not TOPIC.match(name) or name in (".", ".."):
        raise where.fail(node, f"{what} {name!r} is not a Kafka topic name",
                         "use up to 249 letters, digits, '.', '_' and '-'")
    return name


def _source(where: _Where, stream: str, node: yaml.Node, servers: str | None) -> KafkaTopic | None:
    options = _mapping(where, node, f"source of {stream}")
    allowed = {"landing", "topic", "max_records_per_batch"}
    if unknown := sorted(set(options) - allowed):
        raise where.fail(options[unknown[0]][0], f"source of {stream}: unknown setting {unknown[0]!r}",
                         "write `source: {topic: name}` (a Kafka topic) or `source: {landing: folder}` (the default)")
    if ("topic" in options) == ("landing" in options):
        raise where.fail(node, f"source of {stream} names {'both a topic and' if 'topic' in options else 'neither a topic nor'}"
                         f" the landing folder", "write `source: {topic: name}` or `source: {landing: folder}`")
    if "landing" in options:
        if _value(options["landing"][1]) != "folder":
            raise where.fail(options["landing"][1], f"source of {stream}: landing {_value(options['landing'][1])!r}",
                             "write `landing: folder`: landing files live under the storage root's landing/<stream>/")
        return None
    limit = None
    if "max_records_per_batch" in options:
        limit = _value(options["max_records_per_batch"][1])
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise where.fail(options["max_records_per_batch"][1], f"max_records_per_batch {limit!r}",
                             "give a whole number >= 1, or remove it")
    return KafkaTopic(_topic_name(where, options["topic"][1], f"source of {stream}: topic"), servers, limit)


def _stream(where: _Where, name: str, key: yaml.Node, node: yaml.Node, servers: str | None = None) -> StreamSpec:
    if not NAME.match(name):
        raise where.fail(key, f"stream name {name!r} is not allowed", "use letters, digits and '_'")
    entries = _mapping(where, node, f"stream {name}")
    if unknown := sorted(set(entries) - STREAM_KEYS):
        raise where.fail(entries[unknown[0]][0], f"stream {name}: unknown setting {unknown[0]!r}",
                         f"use some of {', '.join(sorted(STREAM_KEYS))}")
    for needed in ("id", "event_time", "fields"):
        if needed not in entries:
            raise where.fail(node, f"stream {name} has no `{needed}:`", f"add `{needed}:` to stream {name}")
    fields = tuple(_field(where, name, field, k, v) for field, (k, v) in
                   _mapping(where, entries["fields"][1], f"fields of {name}").items())
    kinds = {f.name: f for f in fields}
    id_field, event_time = str(_value(entries["id"][1])), str(_value(entries["event_time"][1]))
    for role, field, want in (("id", id_field, "string"), ("event_time", event_time, "timestamp")):
        rule = kinds.get(field)
        if rule is None or rule.kind != want or not rule.required:
            raise where.fail(entries[role][1], f"stream {name}: `{role}: {field}` must name a required {want} field",
                             f"declare `{field}: {{type: {want}}}` under fields, or name another field")
    spec = StreamSpec(name=name, id_field=id_field, event_time_field=event_time, fields=fields,
                      line=key.start_mark.line + 1)
    settings = {}
    if "dedup_horizon_days" in entries:
        settings["dedup_horizon"] = timedelta(days=_number(where, entries["dedup_horizon_days"][1], "dedup_horizon_days"))
    if "event_time_max_ahead_hours" in entries:
        settings["max_ahead"] = timedelta(hours=_number(where, entries["event_time_max_ahead_hours"][1],
                                                        "event_time_max_ahead_hours"))
    if "windows" in entries:
        settings["windows"] = _windows(where, spec, entries["windows"][1])
    if "sessions" in entries:
        settings["sessions"] = _sessions(where, spec, entries["sessions"][1])
    if "source" in entries:
        settings["topic"] = _source(where, name, entries["source"][1], servers)
    return replace(spec, **settings)


def _delay(where: _Where, options: dict, name: str, default: timedelta) -> timedelta:
    if name not in options:
        return default
    return timedelta(minutes=_number(where, options[name][1], name, positive=False))


# What the event-time operators read from a stream besides its id, event time and the summed value.
WINDOW_FIELDS = {"title": "string"}
SESSION_FIELDS = {"customer_id": "string"}


def _operator_fields(where: _Where, spec: StreamSpec, node: yaml.Node, kind: str, needs: dict[str, str]) -> None:
    kinds = {f.name: f for f in spec.fields}
    for field, want in needs.items():
        if field not in kinds or kinds[field].kind != want or not kinds[field].required:
            raise where.fail(node, f"stream {spec.name}: `{kind}:` keys on a required {want} field {field!r}",
                             f"declare `{field}: {{type: {want}}}` in the stream, or remove `{kind}:`")


def _windows(where: _Where, spec: StreamSpec, node: yaml.Node) -> WindowOptions:
    options = _mapping(where, node, f"windows of {spec.name}")
    allowed = {"watermark_delay_minutes", "size_minutes", "top"}
    if unknown := sorted(set(options) - allowed):
        raise where.fail(options[unknown[0]][0], f"windows: unknown option {unknown[0]!r}",
                         f"use some of {', '.join(sorted(allowed))}")
    # One-hour windows with a top 10 are what the windows keep today; other sizes are refused, not ignored.
    for option, fixed in (("size_minutes", 60), ("top", 10)):
        if option in options and _value(options[option][1]) != fixed:
            raise where.fail(options[option][1], f"windows: {option} {_value(options[option][1])!r} is not supported "
                             f"(only {fixed})", f"set {option}: {fixed} or remove it")
    _operator_fields(where, spec, node, "windows", WINDOW_FIELDS)
    return WindowOptions(watermark_delay=_delay(where, options, "watermark_delay_minutes",
                                                WindowOptions.watermark_delay))


def _sessions(where: _Where, spec: StreamSpec, node: yaml.Node) -> SessionOptions:
    options = _mapping(where, node, f"sessions of {spec.name}")
    allowed = {"watermark_delay_minutes", "gap_minutes", "state_ttl_days"}
    if unknown := sorted(set(options) - allowed):
        raise where.fail(options[unknown[0]][0], f"sessions: unknown option {unknown[0]!r}",
                         f"use some of {', '.join(sorted(allowed))}")
    _operator_fields(where, spec, node, "sessions", SESSION_FIELDS)
    defaults = SessionOptions()
    return SessionOptions(
        watermark_delay=_delay(where, options, "watermark_delay_minutes", defaults.watermark_delay),
        gap=timedelta(minutes=_number(where, options["gap_minutes"][1], "gap_minutes"))
        if "gap_minutes" in options else defaults.gap,
        state_ttl=timedelta(days=_number(where, options["state_ttl_days"][1], "state_ttl_days"))
        if "state_ttl_days" in options else defaults.state_ttl)


def _bound(where: _Where, node: yaml.Node, field: str, kind: str) -> str:
    value = _value(node)
    try:
        if isinstance(value, bool):
            raise InvalidOperation
        number = Decimal(str(value))
        if not number.is_finite() or (kind == "integer" and number != number.to_integral_value()):
            raise InvalidOperation
    except InvalidOperation:
        raise where.fail(node, f"field {field}: bound {value!r} is not a{'n integer' if kind == 'integer' else ' number'}",
                         "write a plain number, e.g. `min: 0`") from None
    return str(number)


def _field(where: _Where, stream: str, name: str, key: yaml.Node, node: yaml.Node) -> FieldRule:
    if not NAME.match(name):
        raise where.fail(key, f"field name {name!r} is not allowed", "use letters, digits and '_'")
    rules = _mapping(where, node, f"field {stream}.{name}")
    if unknown := sorted(set(rules) - RULES):
        raise where.fail(rules[unknown[0]][0], f"field {name}: unknown rule {unknown[0]!r}",
                         f"use some of {', '.join(sorted(RULES))}")
    kind = _value(rules["type"][1]) if "type" in rules else None
    if kind not in KINDS:
        raise where.fail(rules.get("type", (node, node))[1], f"field {name}: type {kind!r} is not one of "
                         f"{', '.join(KINDS)}", f"write `{name}: {{type: string}}` (or another of those types)")
    flag = lambda rule, default: _flag(where, rules, rule, default)  # noqa: E731
    args: dict = {"required": flag("required", True)}
    for rule, kinds in (("trim", ("string",)), ("max_length", ("string",)), ("min", ("decimal", "integer")),
                        ("max", ("decimal", "integer")), ("min_exclusive", ("decimal", "integer")),
                        ("max_exclusive", ("decimal", "integer"))):
        if rule in rules and kind not in kinds:
            raise where.fail(rules[rule][0], f"field {name}: `{rule}` does not apply to a {kind}",
                             f"remove it, or use it on a {' or '.join(kinds)} field")
    args["trim"] = flag("trim", False)
    if "max_length" in rules:
        length = _value(rules["max_length"][1])
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise where.fail(rules["max_length"][1], f"field {name}: max_length {length!r}", "give a whole number >= 1")
        args["max_length"] = length
    # `min: 0` is inclusive; `min_exclusive: 0` is the same bound, exclusive (payments' amount > 0).
    for end in ("min", "max"):
        given = [r for r in (end, f"{end}_exclusive") if r in rules]
        if len(given) == 2:
            raise where.fail(rules[given[1]][0], f"field {name}: both `{end}` and `{end}_exclusive`", "keep one")
        if given:
            args[f"{end}_value"] = _bound(where, rules[given[0]][1], name, kind)
            args[f"{end}_inclusive"] = given[0] == end
    return FieldRule(name=name, kind=kind, **args)


def _flag(where: _Where, rules: dict, rule: str, default: bool) -> bool:
    if rule not in rules:
        return default
    value = _value(rules[rule][1])
    if not isinstance(value, bool):
        raise where.fail(rules[rule][1], f"`{rule}: {value!r}` is not true or false", f"write `{rule}: true` or false")
    return value


# sqlglot's expression class → the aggregate it is, for those a MERGE can combine.
_AGGREGATES = {exp.Count: "count", exp.Sum: "sum", exp.Min: "min", exp.Max: "max", exp.Avg: "avg",
               exp.ArgMin: "min_by", exp.ArgMax: "max_by"}
NUMERIC = ("decimal", "integer")


def _state_table(where: _Where, item: yaml.Node, streams: dict[str, StreamSpec],
                 servers: str | None = None) -> StateTableSpec:
    ttl = changelog_topic = None
    if isinstance(item, yaml.MappingNode):
        options = _mapping(where, item, "a state table")
        if unknown := sorted(set(options) - {"sql", "ttl_days", "changelog_topic"}):
            raise where.fail(options[unknown[0]][0], f"state table: unknown option {unknown[0]!r}",
                             "write `- sql: CREATE TABLE ...` with an optional `ttl_days: N` and `changelog_topic: name`")
        if "sql" not in options:
            raise where.fail(item, "state table without `sql:`", "add `sql: CREATE TABLE name AS SELECT ...`")
        sql_node = options["sql"][1]
        if "ttl_days" in options:
            ttl = timedelta(days=_number(where, options["ttl_days"][1], "ttl_days"))
        if "changelog_topic" in options:
            changelog_topic = KafkaTopic(_topic_name(where, options["changelog_topic"][1], "changelog_topic"), servers)
    else:
        sql_node = item
    sql = _value(sql_node)
    if not isinstance(sql, str):
        raise where.fail(sql_node, "a state table must be SQL text", SQL_HELP.removeprefix("Fix: "))
    fail = lambda message: where.fail(sql_node, message, SQL_HELP.removeprefix("Fix: "))  # noqa: E731
    try:
        statements = [s for s in sqlglot.parse(sql, read="spark") if s is not None]
    except sqlglot.errors.ParseError as exc:
        raise fail(f"the SQL does not parse: {str(exc).splitlines()[0]}") from None
    if len(statements) != 1 or not isinstance(statements[0], exp.Create) or statements[0].kind != "TABLE":
        raise fail("a state table is one `CREATE TABLE name AS SELECT ...` statement")
    create = statements[0]
    name = create.this.name if isinstance(create.this, exp.Table) else ""
    select = create.expression
    if not NAME.match(name or "") or not isinstance(select, exp.Select):
        raise fail("a state table is `CREATE TABLE name AS SELECT ...` with a plain name")
    where_of = lambda message: fail(f"state table {name}: {message}")  # noqa: E731
    for clause, what in (("joins", "a join"), ("where", "a WHERE"), ("having", "a HAVING"), ("order", "an ORDER BY"),
                         ("limit", "a LIMIT"), ("distinct", "SELECT DISTINCT"), ("with", "a WITH"),
                         ("qualify", "a QUALIFY")):
        if select.args.get(clause):
            raise where_of(f"{what} cannot be kept incrementally")
    source = select.args.get("from_") or select.args.get("from")
    if source is None or not isinstance(source.this, exp.Table) or source.this.args.get("db"):
        raise where_of("FROM must name one declared stream")
    stream_name = source.this.name
    if stream_name not in streams:
        raise where_of(f"FROM {stream_name}: no such stream (declared: {', '.join(streams)})")
    spec = streams[stream_name]
    fields = {f.name: f for f in spec.fields}

    def field_of(node: exp.Expression, role: str) -> str:
        if not isinstance(node, exp.Column) or node.table:
            raise where_of(f"{role} must be a plain column of {stream_name}, got `{node.sql('spark')}`")
        if node.name not in fields:
            raise where_of(f"unknown column {node.name!r} (the fields of {stream_name}: {', '.join(fields)})")
        return node.name

    group = select.args.get("group")
    if group is None or not group.expressions:
        raise where_of("no GROUP BY: a state table has one row per key")
    keys = tuple(field_of(g, "a GROUP BY item") for g in group.expressions)
    if len(set(keys)) != len(keys):
        raise where_of("a key is grouped twice")
    selected_keys, aggregates, names = [], [], set()
    for item_sql in select.expressions:
        if isinstance(item_sql, exp.Column):
            column = field_of(item_sql, "a selected key")
            if column not in keys:
                raise where_of(f"`{column}` is neither grouped nor aggregated")
            selected_keys.append(column)
            out = column
        else:
            if not isinstance(item_sql, exp.Alias):
                raise where_of(f"`{item_sql.sql('spark')}` needs a column name: add `AS name`")
            out = item_sql.alias
            if isinstance(item_sql.this, exp.Column):  # `col AS name`: a renamed key, or a bare column
                column = field_of(item_sql.this, "a selected column")
                raise where_of(f"select the key `{column}` as is, without AS" if column in keys
                               else f"`{column}` is neither grouped nor aggregated")
            aggregates.append(_aggregate(item_sql.this, out, spec, field_of, where_of))
        if out in names:
            raise where_of(f"two columns are named {out!r}")
        names.add(out)
    if set(selected_keys) != set(keys) or len(selected_keys) != len(keys):
        raise where_of(f"select every GROUP BY key once, as is: {', '.join(keys)}")
    if not aggregates:
        raise where_of("no aggregate: add one, e.g. COUNT(*) AS events")
    if names & {"updated_at"} or any(n.startswith("_") for n in names):
        raise where_of("`updated_at` and names starting with `_` are the table's own columns")
    required = {f.name for f in spec.fields if f.required}
    counted = next((a.name for a in aggregates if a.function == "count" and (a.column is None or a.column in required)),
                   None)
    summed = next((a for a in aggregates if a.function == "sum" and a.column in required
                   and spec.field(a.column).kind == "decimal"), None)
    table = StateTableSpec(name=name, stream=stream_name, keys=tuple(selected_keys), aggregates=tuple(aggregates),
                           sql=" ".join(sql.split()), line=sql_node.start_mark.line + 1, ttl=ttl, fields=spec.fields,
                           count_column=counted, sum_column=summed.name if summed else None,
                           summed_field=summed.column if summed else None,
                           last_ts_column=next((a.name for a in aggregates if a.function == "max"
                                                and a.column == spec.event_time_field), None),
                           changelog_topic=changelog_topic)
    if ttl is not None:
        _check_ttl(table, spec, where_of)
    return table


def _aggregate(node: exp.Expression, name: str, spec: StreamSpec, field_of, where_of) -> Aggregate:
    function = _AGGREGATES.get(type(node))
    if function is None:
        raise where_of(f"`{node.sql('spark')}` is not an aggregate the table can merge incrementally")
    argument = node.this
    if isinstance(argument, exp.Distinct):
        raise where_of(f"`{node.sql('spark')}`: DISTINCT cannot be kept incrementally")
    if function == "count" and isinstance(argument, exp.Star):
        return Aggregate(name, "count")
    column = field_of(argument, f"the argument of {function.upper()}")
    kind = spec.field(column).kind
    if function in ("sum", "avg") and kind not in NUMERIC:
        raise where_of(f"{function.upper()}({column}): {column} is a {kind}; sum and average need a decimal or integer")
    if function in ("min_by", "max_by"):
        by = node.args.get("expression")
        if by is None:
            raise where_of(f"{function.upper()} takes (value, ordering)")
        by_column = field_of(by, f"the ordering of {function.upper()}")
        if spec.field(by_column).kind == "boolean":
            raise where_of(f"{function.upper()} orders by {by_column}, a boolean: order by a time or a number")
        return Aggregate(name, function, column, by_column)
    if node.args.get("expressions"):
        raise where_of(f"`{node.sql('spark')}` takes one column")
    return Aggregate(name, function, column)


def _check_ttl(table: StateTableSpec, spec: StreamSpec, where_of) -> None:
    """A TTL deletes keys by their newest event time and keeps running totals of what it deleted, so the table
    needs one key, a MAX of the event time and a count of every event."""
    if len(table.keys) != 1 or table.count_column is None or table.last_ts_column is None:
        raise where_of(f"ttl_days needs one key, COUNT(*) and MAX({spec.event_time_field}) in the table")
