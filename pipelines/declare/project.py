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
        watermark_delay_minutes: 10   # how far behind the newest event the windows and sessions close
    state_tables:
      - CREATE TABLE orders_per_key AS SELECT ... FROM orders GROUP BY ...
      - {sql: CREATE TABLE ..., ttl_days: 30}
      - CREATE TABLE orders_hourly AS SELECT ... FROM orders GROUP BY region, window(ordered_at, '1 hour')

The tables are SQL, parsed by pipelines/declare/sql.py (state, windowed and session tables, top N) and kept only
when every column can be kept incrementally; anything else fails the load naming the file's line and the fix,
before any data is touched.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from datetime import timedelta
from decimal import Decimal, InvalidOperation
from pathlib import Path

import yaml

from pipelines.declare.specs import (
    KAFKA_OPTIONS, KAFKA_SECRETS, LATE_EVENTS, EventTimeTableSpec, FieldRule, KafkaTopic, StateTableSpec, StreamSpec,
    TopSpec,
)
from pipelines.declare.sql import NAME, SQL_HELP, over_broken_source, parse_table
from pipelines.errors import ConfigurationError, did_you_mean

PROJECT_ENV = "STATETABLES_PROJECT"
PROJECT_FILE = "statetables.yaml"
SHIPPED = Path(__file__).resolve().parents[2] / PROJECT_FILE
KINDS = ("string", "decimal", "timestamp", "integer", "boolean")
RULES = {"type", "required", "trim", "max_length", "min", "max", "min_exclusive", "max_exclusive"}
STREAM_KEYS = {"id", "event_time", "fields", "dedup_horizon_days", "event_time_max_ahead_hours",
               "watermark_delay_minutes", "source"}
# Options of earlier project files, now declared by SQL: what to write instead.
REPLACED_KEYS = {
    "windows": "declare a windowed table under `state_tables:`, e.g. `CREATE TABLE t AS SELECT key, window.start AS "
               "window_start, window.end AS window_end, COUNT(*) AS n FROM stream GROUP BY key, window(event_time, "
               "'1 hour')`, and its top N as a table of its own; the watermark delay is the stream's "
               "`watermark_delay_minutes:`",
    "sessions": "declare a session table under `state_tables:`, e.g. `CREATE TABLE t AS SELECT key, MIN(event_time) "
                "AS session_start, MAX(event_time) AS session_end, COUNT(*) AS n FROM stream GROUP BY key, "
                "session_window(event_time, '30 minutes')` (`ttl_days:` beside its `sql:`); the watermark delay is "
                "the stream's `watermark_delay_minutes:`"}
TOPIC = re.compile(r"^[A-Za-z0-9._-]{1,249}$")  # Kafka's own rule for topic names
SECTIONS = {"streams", "state_tables", "kafka"}
TABLE_OPTIONS = {"sql", "ttl_days", "changelog_topic"}


@dataclass(frozen=True)
class _OverABrokenSource:
    """A table over a stream or table whose declaration failed: that problem is listed, not this table's."""

    name: str


@dataclass(frozen=True)
class Kafka:
    """The project file's `kafka:` section: the brokers and the clients' options."""

    servers: str | None = None
    options: tuple[tuple[str, str], ...] = ()


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

    def table(self, name: str) -> tuple[StreamSpec, StateTableSpec | EventTimeTableSpec]:
        """A state, windowed or session table by name (a top N: the windowed table it ranks, rebuilt with it)."""
        for spec in self.streams.values():
            for table in (*spec.state_tables, *spec.event_time_tables):
                if table.name == name or (isinstance(table, EventTimeTableSpec)
                                          and name in {top.name for top in table.tops}):
                    return spec, table
        known = ", ".join(t.name for s in self.streams.values() for t in (*s.state_tables, *s.event_time_tables))
        raise ConfigurationError(f"No table {name!r} in {self.path}. Fix: use one of {known}.")

    @property
    def state_tables(self) -> list[StateTableSpec]:
        return [t for s in self.streams.values() for t in s.state_tables]


def project_path() -> Path:
    """$STATETABLES_PROJECT (the CLI's --project sets it), else statetables.yaml in the working directory. Nothing
    else: a command never acts on another project than the one it names (in the product's own checkout, the
    shipped file is the working directory's)."""
    named = os.environ.get(PROJECT_ENV)
    if named:
        path = Path(named).expanduser()
        if not path.is_file():
            raise ConfigurationError(f"{PROJECT_ENV}={named}: no such file. Fix: point it at your project file "
                                     f"(a statetables.yaml), or unset it to use ./{PROJECT_FILE}.")
        return path.resolve()
    here = Path.cwd() / PROJECT_FILE
    if here.is_file():
        return here.resolve()
    near = sorted(p.name for p in Path.cwd().glob("statetables.*") if p.suffix in (".yml", ".yaml", ".json"))
    hint = (f" ({near[0]} is here: rename it to {PROJECT_FILE}, or pass --project {near[0]})" if near else "")
    raise ConfigurationError(f"No project file: {here} does not exist{hint}. Fix: `statetables init` writes one to "
                             f"start from, `--project FILE` names another, or run from your project's folder.")


_loaded: dict[tuple[Path, int], Project] = {}


def stream_spec(name: str) -> StreamSpec:
    """The declared stream by name (the project file); an unknown name fails with the list of known ones."""
    return project().stream(name)


def streams() -> dict[str, StreamSpec]:
    """Every declared stream, in the project file's order."""
    return project().streams


def project(path: Path | None = None) -> Project:
    """The project as its file says now (read again when the file changes)."""
    path = path or project_path()
    key = (path, path.stat().st_mtime_ns)
    if key not in _loaded:
        _loaded[key] = load_project(path.read_text(), path)
    return _loaded[key]


class _Where:
    """Error messages that name the file, line and column, and the problems of a load, every one of them."""

    def __init__(self, path: Path, text: str):
        self.path, self.text = path, text
        self.problems: list[ConfigurationError] = []

    def at(self, line: int, column: int) -> str:
        return f"{self.path}:{line}:{column}"

    def fail(self, node: yaml.Node | None, message: str, fix: str) -> ConfigurationError:
        place = self.at(node.start_mark.line + 1, node.start_mark.column + 1) if node is not None else str(self.path)
        return ConfigurationError(f"{place}: {message}. Fix: {fix}")

    def in_sql(self, node: yaml.Node, sql: str, offset: int | None, message: str, fix: str) -> ConfigurationError:
        """An error at character `offset` of the SQL text that `node` holds, placed in the file: the token found
        in the node's own text (a quoted, folded or block scalar writes the same tokens at other places)."""
        line, column = node.start_mark.line + 1, node.start_mark.column + 1
        if offset is not None and 0 <= offset < len(sql):
            raw = self.text[node.start_mark.index:node.end_mark.index]
            token = re.match(r"\w+|\S", sql[offset:]).group(0)
            nth = len(re.findall(rf"(?<!\w){re.escape(token)}", sql[:offset]))
            found = [m.start() for m in re.finditer(rf"(?<!\w){re.escape(token)}", raw)]
            if nth < len(found):
                before = self.text[:node.start_mark.index + found[nth]]
                line, column = before.count("\n") + 1, len(before) - (before.rfind("\n") + 1) + 1
        return ConfigurationError(f"{self.at(line, column)}: {message}. Fix: {fix}")

    def collect(self, parse, *args):
        """`parse(*args)`, or None with its problem kept: one bad stream or table does not hide the next."""
        try:
            return parse(*args)
        except ConfigurationError as problem:
            self.problems.append(problem)
            return None


class ProjectError(ConfigurationError):
    """Every problem of a project file, one a line."""

    def __init__(self, problems: list[ConfigurationError]):
        self.problems = problems
        if len(problems) == 1:
            super().__init__(str(problems[0]))
        else:
            super().__init__(f"the project file has {len(problems)} problems:\n" + "\n".join(f"  {p}" for p in problems))


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
    """The project `text` (the file at `path`) declares; a ProjectError lists every problem found, each at its
    file:line:column (a problem in a stream hides the problems of the tables over it)."""
    where = _Where(path, text)
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        place = where.at(mark.line + 1, mark.column + 1) if mark is not None else str(path)
        problem = getattr(exc, "problem", None) or str(exc)
        context = f" ({exc.context})" if getattr(exc, "context", None) else ""
        raise ConfigurationError(f"{place}: not valid YAML: {problem}{context}. Fix: correct the file's syntax there "
                                 f"(a `key: value` a line, lists as `- item`, quote text holding `: ` or `#`)"
                                 ) from None
    if root is None:
        raise where.fail(None, "the project file is empty", "declare `streams:` and `state_tables:`")
    top = _mapping(where, root, "the project file")
    for unknown in sorted(set(top) - SECTIONS):
        where.problems.append(where.fail(top[unknown][0], f"unknown section {unknown!r}{did_you_mean(unknown, SECTIONS)}",
                                         "use `streams:`, `state_tables:` and `kafka:`"))
    if "streams" not in top:
        raise ProjectError([*where.problems, where.fail(root, "no `streams:` section",
                                                        "declare at least one stream under `streams:`")])
    kafka = (where.collect(_kafka, where, top["kafka"][1]) if "kafka" in top else None) or Kafka()
    declared = where.collect(_mapping, where, top["streams"][1], "streams") or {}
    streams = {name: stream for name, (key, node) in declared.items()
               if (stream := where.collect(_stream, where, name, key, node, kafka)) is not None}
    broken = frozenset(declared) - set(streams)
    tables: dict[str, list[StateTableSpec]] = {name: [] for name in streams}
    timed: dict[str, list[EventTimeTableSpec]] = {name: [] for name in streams}
    tops: dict[str, list[TopSpec]] = {}
    windowed: dict[str, EventTimeTableSpec] = {}
    items = top.get("state_tables", (None, yaml.SequenceNode("tag:yaml.org,2002:seq", [])))[1]
    if not isinstance(items, yaml.SequenceNode):
        where.problems.append(where.fail(items, "`state_tables:` must be a list",
                                         "write each table as `- CREATE TABLE ...`"))
        items = yaml.SequenceNode("tag:yaml.org,2002:seq", [])
    taken = {t for s in streams.values() for t in (s.bronze_table, s.quarantine_table, s.files_table)} | {LATE_EVENTS}
    for item in items.value:
        table = where.collect(_table, where, item, streams, windowed, kafka, broken)
        if isinstance(table, _OverABrokenSource):
            broken |= {table.name}  # and a top N over it
            continue
        if table is None:
            continue
        owned = (table.name, table.state_table) if isinstance(table, EventTimeTableSpec) else (table.name,)
        if clash := next((name for name in owned if name in taken), None):
            where.problems.append(where.fail(item, f"the table name {clash!r} is taken", "give the table another name"))
            continue
        taken.update(owned)
        if isinstance(table, TopSpec):
            tops.setdefault(table.source, []).append(table)
        elif isinstance(table, EventTimeTableSpec):
            timed[table.stream].append(table)
            if table.kind == "window":
                windowed[table.name] = table
        else:
            tables[table.stream].append(table)
    if where.problems:
        raise ProjectError(where.problems)
    specs = {name: replace(spec, state_tables=tuple(tables[name]), event_time_tables=tuple(
                 replace(t, tops=tuple(tops.get(t.name, ()))) for t in timed[name]))
             for name, spec in streams.items()}
    return Project(path, specs)


def _number(where: _Where, node: yaml.Node, what: str, *, positive: bool = True) -> float:
    value = _value(node)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (positive and not value > 0):
        raise where.fail(node, f"{what} is {value!r}", f"give {what} a number{' > 0' if positive else ''}")
    return float(value)


def _kafka(where: _Where, node: yaml.Node) -> Kafka:
    """`kafka: {bootstrap_servers: host:port, options: {security.protocol: SASL_SSL, ...}}`: the brokers, and the
    options every client of them takes (Spark's source and sink and confluent-kafka alike)."""
    settings = _mapping(where, node, "kafka")
    if unknown := sorted(set(settings) - {"bootstrap_servers", "options"}):
        raise where.fail(settings[unknown[0]][0], f"kafka: unknown setting {unknown[0]!r}"
                         f"{did_you_mean(unknown[0], ['bootstrap_servers', 'options'])}",
                         "write `kafka: {bootstrap_servers: host:port, options: {...}}`")
    servers = None
    if "bootstrap_servers" in settings:
        servers = _value(settings["bootstrap_servers"][1])
        if not isinstance(servers, str) or not servers.strip():
            raise where.fail(settings["bootstrap_servers"][1], f"kafka: bootstrap_servers {servers!r}",
                             "write host:port, several separated by commas")
        servers = servers.strip()
    options = []
    for name, (key, value_node) in (_mapping(where, settings["options"][1], "kafka: options").items()
                                    if "options" in settings else []):
        if name not in KAFKA_OPTIONS:
            raise where.fail(key, f"kafka: unknown option {name!r}{did_you_mean(name, KAFKA_OPTIONS)}",
                             f"use some of {', '.join(KAFKA_OPTIONS)}")
        value = str(_value(value_node))
        allowed = KAFKA_OPTIONS[name]
        if allowed is not None and value.upper() not in allowed:
            raise where.fail(value_node, f"kafka: {name} {value!r}{did_you_mean(value.upper(), allowed)}",
                             f"use one of {', '.join(allowed)}")
        if name in KAFKA_SECRETS and not re.fullmatch(r"\$\{[A-Za-z_][A-Za-z0-9_]*\}", value):
            raise where.fail(value_node, f"kafka: {name} is written in the file; credentials are read from the "
                             f"environment only", f"write `{name}: ${{KAFKA_{name.split('.')[1].upper()}}}` and "
                             f"export that variable where the runs run")
        options.append((name, value.upper() if allowed is not None else value))
    return Kafka(servers, tuple(options))


def _topic_name(where: _Where, node: yaml.Node, what: str) -> str:
    name = _value(node)
    if not isinstance(name, str) or not TOPIC.match(name) or name in (".", ".."):
        raise where.fail(node, f"{what} {name!r} is not a Kafka topic name",
                         "use up to 249 letters, digits, '.', '_' and '-'")
    return name


def _source(where: _Where, stream: str, node: yaml.Node, kafka: Kafka) -> KafkaTopic | None:
    options = _mapping(where, node, f"source of {stream}")
    allowed = {"landing", "topic", "max_records_per_batch"}
    if unknown := sorted(set(options) - allowed):
        raise where.fail(options[unknown[0]][0], f"source of {stream}: unknown setting {unknown[0]!r}"
                         f"{did_you_mean(unknown[0], allowed)}",
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
    return KafkaTopic(_topic_name(where, options["topic"][1], f"source of {stream}: topic"), kafka.servers, limit,
                      kafka.options)


def _stream(where: _Where, name: str, key: yaml.Node, node: yaml.Node, kafka: Kafka = None) -> StreamSpec:
    if not NAME.match(name):
        raise where.fail(key, f"stream name {name!r} is not allowed", "use letters, digits and '_'")
    entries = _mapping(where, node, f"stream {name}")
    if replaced := sorted(set(entries) & set(REPLACED_KEYS)):
        raise where.fail(entries[replaced[0]][0], f"stream {name}: `{replaced[0]}:` is no longer an option",
                         REPLACED_KEYS[replaced[0]])
    if unknown := sorted(set(entries) - STREAM_KEYS):
        raise where.fail(entries[unknown[0]][0], f"stream {name}: unknown setting {unknown[0]!r}"
                         f"{did_you_mean(unknown[0], STREAM_KEYS)}", f"use some of {', '.join(sorted(STREAM_KEYS))}")
    for needed in ("id", "event_time", "fields"):
        if needed not in entries:
            raise where.fail(node, f"stream {name} has no `{needed}:`", f"add `{needed}:` to stream {name}")
    fields = tuple(_field(where, name, field, k, v) for field, (k, v) in
                   _mapping(where, entries["fields"][1], f"fields of {name}").items())
    kinds = {f.name: f for f in fields}
    id_field, event_time = str(_value(entries["id"][1])), str(_value(entries["event_time"][1]))
    for role, field, want in (("id", id_field, "string"), ("event_time", event_time, "timestamp")):
        rule, at = kinds.get(field), entries[role][1]
        if rule is None:
            raise where.fail(at, f"stream {name}: `{role}: {field}` names no field of the stream"
                             f"{did_you_mean(field, kinds)}", f"declare `{field}: {{type: {want}}}` under fields, "
                             f"or name one of {', '.join(kinds)}")
        if rule.kind != want:
            raise where.fail(at, f"stream {name}: `{role}: {field}` names a {rule.kind} field; the {role} must be a "
                             f"{want}", f"declare `{field}: {{type: {want}}}`, or name a {want} field")
        if not rule.required:
            raise where.fail(at, f"stream {name}: `{role}: {field}` names a field declared `required: false`; every "
                             f"event needs its {role}", f"remove `required: false` from {field}")
    spec = StreamSpec(name=name, id_field=id_field, event_time_field=event_time, fields=fields,
                      line=key.start_mark.line + 1)
    settings = {}
    if "dedup_horizon_days" in entries:
        settings["dedup_horizon"] = timedelta(days=_number(where, entries["dedup_horizon_days"][1], "dedup_horizon_days"))
    if "event_time_max_ahead_hours" in entries:
        settings["max_ahead"] = timedelta(hours=_number(where, entries["event_time_max_ahead_hours"][1],
                                                        "event_time_max_ahead_hours"))
    if "watermark_delay_minutes" in entries:
        settings["watermark_delay"] = timedelta(minutes=_number(where, entries["watermark_delay_minutes"][1],
                                                                "watermark_delay_minutes", positive=False))
        if settings["watermark_delay"] < timedelta(0):
            raise where.fail(entries["watermark_delay_minutes"][1], "watermark_delay_minutes is negative",
                             "give 0 or more minutes")
    if "source" in entries:
        settings["topic"] = _source(where, name, entries["source"][1], kafka or Kafka())
    return replace(spec, **settings)


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
        raise where.fail(rules[unknown[0]][0], f"field {name}: unknown rule {unknown[0]!r}"
                         f"{did_you_mean(unknown[0], RULES)}", f"use some of {', '.join(sorted(RULES))}")
    kind = _value(rules["type"][1]) if "type" in rules else None
    if kind not in KINDS:
        raise where.fail(rules.get("type", (node, node))[1], f"field {name}: type {kind!r} is not one of "
                         f"{', '.join(KINDS)}{did_you_mean(kind, KINDS)}",
                         f"write `{name}: {{type: string}}` (or another of those types)")
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


def _table(where: _Where, item: yaml.Node, streams: dict[str, StreamSpec], windowed: dict[str, EventTimeTableSpec],
           kafka: Kafka | None = None, broken: frozenset[str] = frozenset()
           ) -> StateTableSpec | EventTimeTableSpec | TopSpec | _OverABrokenSource:
    """One item of `state_tables:`: SQL text, or `{sql: ..., ttl_days: N, changelog_topic: name}`."""
    ttl = changelog_topic = None
    if isinstance(item, yaml.MappingNode):
        options = _mapping(where, item, "a state table")
        if unknown := sorted(set(options) - TABLE_OPTIONS):
            raise where.fail(options[unknown[0]][0], f"state table: unknown option {unknown[0]!r}"
                             f"{did_you_mean(unknown[0], TABLE_OPTIONS)}",
                             "write `- sql: CREATE TABLE ...` with an optional `ttl_days: N` and `changelog_topic: name`")
        if "sql" not in options:
            raise where.fail(item, "state table without `sql:`", "add `sql: CREATE TABLE name AS SELECT ...`")
        sql_node = options["sql"][1]
        if "ttl_days" in options:
            ttl = timedelta(days=_number(where, options["ttl_days"][1], "ttl_days"))
        if "changelog_topic" in options:
            kafka = kafka or Kafka()
            changelog_topic = KafkaTopic(_topic_name(where, options["changelog_topic"][1], "changelog_topic"),
                                         kafka.servers, options=kafka.options)
    else:
        sql_node = item
    sql = _value(sql_node)
    if not isinstance(sql, str):
        raise where.fail(sql_node, "a state table must be SQL text", SQL_HELP)
    if (name := over_broken_source(sql, broken)) is not None:
        return _OverABrokenSource(name)

    def fail(message: str, at: int | None = None, fix: str | None = None) -> ConfigurationError:
        return where.in_sql(sql_node, sql, at, message, fix or SQL_HELP)

    return parse_table(sql, fail, streams, windowed, line=sql_node.start_mark.line + 1, ttl=ttl,
                       changelog_topic=changelog_topic)
