"""What a project declares, as `statetables check` prints it: read from the project file alone, no Spark started.

Each stream with its fields, id, event time, source and settings; each table with its kind, keys and aggregates,
the MERGE a state table's micro-batch runs, and the path of every table a run writes.
"""

from __future__ import annotations

from datetime import timedelta

from pipelines.declare.project import Project
from pipelines.declare.specs import FieldRule, StreamSpec
from pipelines.state.changelog import changelog_name
from pipelines.state.tables import merge_text
from pipelines.storage.layout import StorageLayout


def _rule(f: FieldRule) -> str:
    parts = [f.kind, "required" if f.required else "optional"]
    if f.trim:
        parts.append("trimmed")
    if f.max_length:
        parts.append(f"at most {f.max_length} characters")
    if f.min_value is not None:
        parts.append(f"{'>=' if f.min_inclusive else '>'} {f.min_value}")
    if f.max_value is not None:
        parts.append(f"{'<=' if f.max_inclusive else '<'} {f.max_value}")
    return ", ".join(parts)


def _days(delta: timedelta) -> str:
    days = delta / timedelta(days=1)
    return f"{days:g} day{'' if days == 1 else 's'}"


def _span(delta: timedelta) -> str:
    """A window size or gap as the SQL writes it: '1 hour', '30 minutes'."""
    seconds = int(delta.total_seconds())
    for unit, size in (("week", 604800), ("day", 86400), ("hour", 3600), ("minute", 60), ("second", 1)):
        if seconds % size == 0:
            count = seconds // size
            return f"{count} {unit}{'s' if count != 1 else ''}"
    return str(delta)


def describe_project(project: Project, layout: StorageLayout) -> dict:
    """The project as data (`check --json` prints it as is)."""
    streams = []
    for spec in project.streams.values():
        streams.append({
            "name": spec.name, "line": spec.line, "id": spec.id_field, "event_time": spec.event_time_field,
            "source": (f"Kafka topic {spec.topic.topic}" if spec.topic is not None
                       else f"landing files in {layout.landing(spec.name)}"),
            "fields": {f.name: _rule(f) for f in spec.fields},
            "settings": {"dedup_horizon": _days(spec.dedup_horizon), "event_time_max_ahead": _days(spec.max_ahead),
                         "watermark_delay_minutes": spec.watermark_delay / timedelta(minutes=1)},
            "tables": _stream_tables(spec, layout),
        })
    return {"project": str(project.path), "storage_root": str(layout.home), "streams": streams}


def _stream_tables(spec: StreamSpec, layout: StorageLayout) -> list[dict]:
    tables = [
        {"name": spec.bronze_table, "kind": "bronze", "path": str(layout.table(spec.bronze_table)),
         "what": f"accepted events, one row per distinct {spec.id_field}"},
        {"name": spec.quarantine_table, "kind": "quarantine", "path": str(layout.table(spec.quarantine_table)),
         "what": "every line not accepted, with its reason"},
    ]
    for table in spec.state_tables:
        tables.append({
            "name": table.name, "kind": "state", "line": table.line, "sql": table.sql,
            "keys": list(table.keys), "aggregates": [_aggregate(a) for a in table.aggregates],
            **({"where": table.where} if table.where else {}),
            **({"ttl": _days(table.ttl)} if table.ttl else {}),
            **({"changelog_topic": table.changelog_topic.topic} if table.changelog_topic else {}),
            "merge": merge_text(table, layout.table(table.name)),
            "path": str(layout.table(table.name)),
            "changelog_path": str(layout.table(changelog_name(table)))})
    for table in spec.event_time_tables:
        tables.append({
            "name": table.name, "kind": "windowed" if table.kind == "window" else "session", "line": table.line,
            "sql": table.sql, "keys": list(table.keys), "aggregates": [_aggregate(a) for a in table.aggregates],
            ("window" if table.kind == "window" else "gap"): _span(table.size),
            **({"where": table.where} if table.where else {}),
            **({"ttl": _days(table.ttl)} if table.ttl else {}),
            "path": str(layout.table(table.name)), "operator_state_path": str(layout.table(table.state_table)),
            "top_n": [{"name": top.name, "n": top.n, "line": top.line, "path": str(layout.table(top.name))}
                      for top in table.tops]})
    return tables


def _aggregate(a) -> str:
    argument = "*" if a.column is None else a.column + (f", {a.by}" if a.by else "") + (f", {a.n}" if a.n else "")
    return f"{a.function.upper()}({argument}) AS {a.name}"


def render(description: dict) -> str:
    """The description as text for a terminal."""
    lines = [f"storage root: {description['storage_root']}"]
    for stream in description["streams"]:
        lines += ["", f"stream {stream['name']} (line {stream['line']}): id {stream['id']}, event time "
                      f"{stream['event_time']}, from {stream['source']}"]
        lines += [f"  field {name}: {rule}" for name, rule in stream["fields"].items()]
        settings = stream["settings"]
        lines.append(f"  dedup horizon {settings['dedup_horizon']}, event time at most "
                     f"{settings['event_time_max_ahead']} ahead, watermark delay "
                     f"{settings['watermark_delay_minutes']:g} minutes")
        for table in stream["tables"]:
            head = f"  {table['kind']} table {table['name']}"
            if "line" in table:
                head += f" (line {table['line']})"
            lines.append(f"{head}: {table['path']}")
            if table["kind"] in ("bronze", "quarantine"):
                lines.append(f"    {table['what']}")
                continue
            lines.append(f"    keys {', '.join(table['keys'])}; {', '.join(table['aggregates'])}")
            for option in ("window", "gap", "where", "ttl", "changelog_topic"):
                if option in table:
                    lines.append(f"    {option.replace('_', ' ')}: {table[option]}")
            if "merge" in table:
                lines.append(f"    each micro-batch: {table['merge']}")
                lines.append(f"    change feed as a table (published daily): {table['changelog_path']}")
            if "operator_state_path" in table:
                lines.append(f"    operator state: {table['operator_state_path']}")
            for top in table.get("top_n", ()):
                lines.append(f"    top {top['n']} per window (line {top['line']}): {top['name']}, {top['path']}")
    return "\n".join(lines)
