"""Reading the tables without Spark: `statetables show`, `quarantine` and `explain`, through delta-rs.

delta-rs (`deltalake`) reads a Delta table on a local disk or in an S3 bucket and runs SQL over it with DataFusion,
in this process: no JVM starts, so a look at a table takes a second, not a Spark session's start. It only reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

from pipelines.declare.project import Project
from pipelines.declare.specs import LATE_EVENTS, EventTimeTableSpec, StateTableSpec, StreamSpec
from pipelines.errors import ConfigurationError, did_you_mean
from pipelines.state.changelog import changelog_name
from pipelines.storage.delta_rs import delta_table, file_batches
from pipelines.storage.layout import StorageLayout


def table_names(project: Project) -> list[str]:
    """Every table the project's runs write, in the project file's order."""
    names = []
    for spec in project.streams.values():
        names += [spec.bronze_table, spec.quarantine_table, spec.files_table]
        for table in spec.state_tables:
            names += [table.name, changelog_name(table)]
        for table in spec.event_time_tables:
            names += [table.name, table.state_table, *(top.name for top in table.tops)]
    if any(spec.event_time_tables for spec in project.streams.values()):
        names.append(LATE_EVENTS)
    return names


def open_table(layout: StorageLayout, project: Project, name: str):
    """The Delta table `name` under the storage root, through delta-rs; a name the project does not write, or a
    table no run has written yet, is refused with the fix."""
    known = table_names(project)
    if name not in known:
        raise ConfigurationError(f"No table {name!r} in {project.path}{did_you_mean(name, known)}. Fix: use one of "
                                 f"{', '.join(known)}.")
    path = layout.table(name)
    table = delta_table(path)
    if table is None:
        raise ConfigurationError(f"{name} has no data yet at {path}. Fix: `statetables run` writes it from the "
                                 f"landing files (`statetables status` shows what is waiting).")
    return table


def query(table, sql_where: str | None = None, *, order_by: list[str] | None = None, limit: int | None = None,
          columns: list[str] | None = None) -> pa.Table:
    """Rows of `table` (a delta-rs DeltaTable) by DataFusion SQL: `WHERE sql_where`, ordered, at most `limit`."""
    from deltalake import QueryBuilder

    selected = ", ".join(_quoted(c) for c in columns) if columns else "*"
    text = f"SELECT {selected} FROM t"
    if sql_where:
        text += f" WHERE {sql_where}"
    if order_by:
        text += " ORDER BY " + ", ".join(order_by)
    if limit is not None:
        text += f" LIMIT {int(limit)}"
    try:
        return _arrow(QueryBuilder().register("t", table).execute(text))
    except Exception as exc:  # DataFusion's planning errors name the column or the syntax
        raise ConfigurationError(f"the query `{text}` failed: {str(exc).splitlines()[0]}. Fix: write --where as a "
                                 f"SQL condition over the table's columns "
                                 f"({', '.join(f.name for f in table.schema().to_arrow())}), e.g. "
                                 f"\"region = 'north'\"") from None


def newest_rows(table, column: str, since_ms: int | None, limit: int, *, whole: bool = True) -> pa.Table | None:
    """The `limit` rows of `table` (a delta-rs DeltaTable) with the greatest `column`: first among the rows at
    `since_ms` or later, whose files the others' statistics let it skip; all of them when fewer are there (unless
    `whole` is False: then None). For the UI after each run: by Spark, a query of ~0.5 s on a warm +100k run."""
    order = [f"{_quoted(column)} DESC"]
    if since_ms is not None:
        rows = query(table, f"{_quoted(column)} >= to_timestamp_millis({int(since_ms)})", order_by=order, limit=limit)
        if rows.num_rows == limit:
            return rows
        if not whole:
            return None
    return query(table, order_by=order, limit=limit)


def newest_rows_streamed(table, column: str, since_ms: int | None, limit: int) -> pa.Table:
    """`newest_rows` read file by file and page by page (`file_batches`), the `limit` newest kept as it goes: for
    files too large for DataFusion, which decodes a file's row groups whole (the 1M sessions of a first load, two
    files, raised the run's Python process by 60-70 MB that way)."""
    import pyarrow.compute as pc
    import pyarrow.dataset as ds

    dataset = table.to_pyarrow_dataset()

    def newest(where) -> pa.Table | None:
        best = None
        for batch in file_batches(dataset, dataset.schema.names, where):
            rows = pa.Table.from_batches([batch])
            rows = rows if best is None else pa.concat_tables([best, rows])
            best = rows.take(pc.select_k_unstable(rows, limit, [(column, "descending")]))
        return best

    found = None
    if since_ms is not None:
        bound = pa.scalar(int(since_ms), pa.timestamp("ms", tz="UTC")).cast(dataset.schema.field(column).type)
        found = newest(ds.field(column) >= bound)
        if found is not None and found.num_rows < limit:
            found = None
    found = found if found is not None else newest(None)
    if found is None:
        return dataset.schema.empty_table()
    return found.sort_by([(column, "descending")])


def rows_in_files(table, column: str, since_ms: int | None) -> tuple[int, int] | None:
    """(the rows of the files that may hold `column` at `since_ms` or later, every row) of `table` (a delta-rs
    DeltaTable), from its files' statistics: no data file is read. None when a file lacks its row count; a file
    without the column's statistics counts as one that may hold it."""
    import pyarrow.compute as pc

    files = pa.table(table.get_add_actions(flatten=True))
    rows = files["num_records"] if files.num_rows else pa.chunked_array([[]], pa.int64())
    if rows.null_count:
        return None
    total = pc.sum(rows).as_py() or 0
    newest = f"max.{column}"
    if since_ms is None or newest not in files.column_names:
        return total, total
    bound = pa.scalar(int(since_ms), pa.timestamp("ms", tz="UTC")).cast(files[newest].type)
    may_hold = pc.fill_null(pc.greater_equal(files[newest], bound), True)
    return pc.sum(pc.filter(rows, may_hold)).as_py() or 0, total


def _arrow(stream) -> pa.Table:
    """delta-rs answers in arro3's Arrow types: the same data as a pyarrow table (the Arrow C stream, no copy)."""
    return pa.RecordBatchReader.from_stream(stream).read_all()


def _quoted(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def sql_literal(value) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, (int, float)):
        return str(value)
    return "'" + str(value).replace("'", "''") + "'"


def key_condition(keys: tuple[str, ...], values: list) -> str:
    """`k1 = v1 AND k2 = v2`, NULL-safe (a NULL key is a key of its own)."""
    return " AND ".join(f"{_quoted(k)} IS NULL" if v is None else f"{_quoted(k)} = {sql_literal(v)}"
                        for k, v in zip(keys, values))


def parse_key(table: StateTableSpec | EventTimeTableSpec, text: str) -> list:
    """A key as the user types it: the key's value, or `k1=v1,k2=v2` for several keys (`NULL` for a NULL)."""
    kinds = {f.name: f.kind for f in table.fields}
    if len(table.keys) == 1 and "=" not in text:
        raw = {table.keys[0]: text}
    else:
        raw = {}
        for part in text.split(","):
            name, _, value = part.partition("=")
            raw[name.strip()] = value.strip()
        if set(raw) != set(table.keys):
            raise ConfigurationError(f"{table.name} is keyed by {', '.join(table.keys)}; got {text!r}. Fix: write "
                                     + ",".join(f"{k}=VALUE" for k in table.keys) + ".")
    values = []
    for key in table.keys:
        value = raw[key]
        if value.upper() == "NULL":
            values.append(None)
        elif kinds[key] in ("integer",):
            values.append(int(value))
        else:
            values.append(value)
    return values


@dataclass
class Provenance:
    """What `statetables explain TABLE KEY` shows: the row and what built it."""

    table: str
    key: dict
    row: list[dict]
    events: list[dict]  # accepted events that count in the row: id, event time, values, where each came from
    conflicting: list[dict]  # lines that re-used one of those ids with other content (quarantined)
    late: list[dict]  # of those events, the ones late for a windowed or session table
    changes: list[dict]  # every commit that changed the row: version, time, operation, the row after it
    duplicates_note: str


def explain(layout: StorageLayout, project: Project, name: str, key_text: str, limit: int = 50) -> Provenance:
    """One key's row of a state table and its provenance: the accepted events that built it (file and line, or
    topic, partition and offset), conflicting re-uses of their ids, which were late for a windowed or session table,
    and every commit that changed the row with the row after it (the table's change feed)."""
    spec, table = project.table(name)
    if not isinstance(table, StateTableSpec):
        raise ConfigurationError(f"{name} is a {'windowed' if table.kind == 'window' else 'session'} table: explain "
                                 f"follows a state table's key. Fix: `statetables show {name} --where ...` shows its "
                                 f"rows; explain a state table of {spec.name}: "
                                 f"{', '.join(t.name for t in spec.state_tables) or '(none declared)'}.")
    values = parse_key(table, key_text)
    condition = key_condition(table.keys, values)
    state = open_table(layout, project, table.name)
    row = query(state, condition, columns=[f.name for f in state.schema().to_arrow() if not f.name.startswith("_")])
    bronze = open_table(layout, project, spec.bronze_table)
    wanted = condition + (f" AND ({_datafusion(table.where)})" if table.where else "")
    shown = [spec.id_field, spec.event_time_field, *(f.name for f in spec.fields
                                                      if f.name not in (spec.id_field, spec.event_time_field)),
             "source_file", "line_number", "ingested_at"]
    available = {f.name for f in bronze.schema().to_arrow()}
    shown += [c for c in ("kafka_topic", "kafka_partition", "kafka_offset") if c in available]
    events = query(bronze, wanted, order_by=[_quoted(spec.event_time_field), _quoted(spec.id_field)],
                   columns=[c for c in shown if c in available]).to_pylist()
    ids = [e[spec.id_field] for e in events]
    conflicting, late = [], []
    if ids:
        within = f"IN ({', '.join(sql_literal(i) for i in ids)})"
        quarantine = open_table(layout, project, spec.quarantine_table)
        conflicting = query(quarantine, f"record_id {within} AND reason = 'conflicting_duplicate'",
                            columns=["record_id", "source_file", "line_number", "detail", "raw_line"]).to_pylist()
        if spec.event_time_tables:
            try:
                late_table = open_table(layout, project, LATE_EVENTS)
            except ConfigurationError:
                late_table = None
            if late_table is not None:
                late = query(late_table, f"stream = {sql_literal(spec.name)} AND event_id {within}",
                             columns=["event_id", "table_name", "event_time", "watermark", "late_by_ms"]).to_pylist()
    changes = []
    # The change feed of this key only (delta-rs filters it), its post-images.
    for change in _arrow(state.load_cdf(starting_version=0, predicate=condition)).to_pylist():
        if change["_change_type"] in ("insert", "update_postimage", "delete"):
            changes.append(change)
    history = {h["version"]: h for h in state.history()}
    rows = [{"version": c["_commit_version"], "operation": history.get(c["_commit_version"], {}).get("operation"),
             "change": c["_change_type"].replace("update_postimage", "update"),
             **{k: v for k, v in c.items() if not k.startswith("_") and k not in table.keys}}
            for c in sorted(changes, key=lambda c: c["_commit_version"])]
    return Provenance(table=table.name, key=dict(zip(table.keys, values)), row=row.to_pylist(), events=events[:limit],
                      conflicting=conflicting, late=late, changes=rows[-limit:],
                      duplicates_note=f"{len(events)} accepted events"
                                      + (f" (the first {limit} shown)" if len(events) > limit else "")
                                      + "; exact re-deliveries of them are counted per micro-batch in "
                                        f"{spec.bronze_table}'s commits, not kept line by line")


def _datafusion(spark_sql: str) -> str:
    """A declared WHERE (Spark SQL) as DataFusion reads it: the same for comparisons, AND/OR, IN and literals."""
    import sqlglot

    return sqlglot.transpile(spark_sql, read="spark", write="postgres")[0]


def quarantine_summary(layout: StorageLayout, project: Project, spec: StreamSpec) -> pa.Table:
    """The stream's quarantine counted by reason."""
    table = open_table(layout, project, spec.quarantine_table)
    from deltalake import QueryBuilder

    return _arrow(QueryBuilder().register("t", table).execute(
        "SELECT reason, COUNT(*) AS lines FROM t GROUP BY reason ORDER BY lines DESC, reason"))
