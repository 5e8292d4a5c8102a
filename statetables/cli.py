"""`statetables`: streaming state tables on Spark + Delta Lake, run by Dagster, declared in a project file.

Start here:
    statetables init my_project         # a project file, a sample landing file, and what to type next
    statetables check                   # the project as read: streams, tables, the MERGE each runs (no Spark)
    statetables run                     # one pass: landing files -> bronze, quarantine, every table
    statetables show orders_per_region  # a table's rows (no Spark)

`statetables COMMAND --help` shows a command's options and an example.
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
from pathlib import Path

from pipelines.declare.project import PROJECT_ENV, stream_spec, streams
from pipelines.errors import ConfigurationError, SavepointError, StorageError, StreamBusyError
from pipelines.runtime.warm_up import WARM_UP_BATCHES, WARM_UP_LARGE_BATCHES, WARM_UP_LARGE_EVENTS
from pipelines.storage.layout import StorageLayout
from statetables.servers import prepare_instance

def _generate(args: argparse.Namespace) -> int:
    from pipelines.ingest.generate import generate

    layout = StorageLayout.under()
    names = list(streams()) if args.stream == "all" else [args.stream]
    for name in names:
        spec = stream_spec(name)
        target = spec.topic or layout.landing(name)  # a stream read from a topic: produced to the topic
        summary = generate(spec, target, events=args.events, malformed=args.malformed,
                           duplicates=args.duplicates, conflicts=args.conflicts, late=args.late, seed=args.seed,
                           events_per_file=args.events_per_file)
        where = (f"records to topic {spec.topic.topic}" if spec.topic is not None
                 else f"{len(summary.files)} files in {layout.landing(name)}")
        print(f"{name}: {where}: {summary.valid} valid "
              f"({summary.late} delivered out of order), {summary.malformed} malformed, {summary.duplicates} "
              f"re-deliveries, {summary.conflicts} conflicting ids")
    return 0


def _print_state_tables(layout: StorageLayout, engine: dict) -> None:
    from pyspark.sql import functions as F

    from pipelines.runtime.spark import SparkSettings, build_spark_session

    # The run's session, still alive in this process (getOrCreate), on the run's engine (`spark_config`).
    spark = build_spark_session(SparkSettings(remote=engine["remote"], master=engine.get("master", "local[2]"),
                                              one_command=engine["one_command"]))
    for table in [t for spec in streams().values() for t in spec.state_tables]:
        frame = spark.read.format("delta").load(str(layout.table(table.name)))
        print(f"\n== {table.name}: {frame.count()} keys")
        order = [F.desc(table.count_column)] if table.count_column else []
        frame.orderBy(*order, *table.keys).select(*table.keys, *(a.name for a in table.aggregates)).show(
            10, truncate=False)
    for table in [t for spec in streams().values() for t in spec.event_time_tables]:
        rows = spark.read.format("delta").load(str(layout.table(table.name)))
        start = table.column("start")
        for top in table.tops:
            # The seeds' dashboard: the top N of the newest window the watermark has closed.
            ranked = spark.read.format("delta").load(str(layout.table(top.name)))
            newest = ranked.agg(F.max(start)).first()[0] if start in top.columns else None
            print(f"\n== {top.name}: top {top.n} of the latest closed window ({newest:%Y-%m-%d %H:%M} UTC)"
                  if newest else f"\n== {top.name}: no window closed yet")
            if newest:
                ranked.where(F.col(start) == newest).orderBy(top.rank_column).show(top.n, truncate=False)
        if not table.tops:
            order = start or next((a.name for a in table.aggregates if a.function == "max"
                                   and a.column == table.event_time_field), table.aggregates[0].name)
            print(f"\n== {table.name}: {rows.count()} rows; the newest")
            rows.orderBy(F.desc(order), *table.keys).show(5, truncate=False)


def spark_config(remote: str | None, master: str | None, job: str, layout: StorageLayout | None = None) -> dict:
    """The `spark` resource's config of a `statetables run`: the engine it names, else the code location's
    ($STATETABLES_SPARK_REMOTE, or an embedded JVM). Whole, since run config replaces the resource's configured values.
    An embedded JVM ends with this process, unless the job runs until it is stopped; one that has a large batch ahead
    (the job's streams have LARGE_RUN_BYTES of landing files waiting under `layout`) compiles for speed."""
    from assets.keys import CONTINUOUS_JOB, streams_of_job
    from pipelines.ingest.landing import waiting_bytes
    from pipelines.runtime.spark import LARGE_RUN_BYTES, default_remote

    # --master means that engine even where $STATETABLES_SPARK_REMOTE names a Connect server.
    engine = ({"remote": remote} if remote else {"master": master, "remote": None} if master
              else {"remote": default_remote()})
    one_command = job != CONTINUOUS_JOB
    large = (one_command and engine["remote"] is None and layout is not None
             and sum(waiting_bytes(layout.landing(spec.name), layout.table(spec.files_table))
                     for spec in streams_of_job(job) if spec.topic is None) >= LARGE_RUN_BYTES)
    return {**engine, "one_command": one_command, "large_run": large}


def _execute(args: argparse.Namespace, engine: dict):
    """The run's job through Dagster, in this process, with the `spark` resource's config `engine`."""
    import dagster as dg

    from statetables.definitions import defs

    job = defs.resolve_job_def(args.job)
    run_config: dict = {"loggers": {"console": {"config": {"log_level": args.log_level}}}, "resources": {}}
    if args.warn_only_check:
        from resources import CheckPolicyResource

        CheckPolicyResource(warn_only=args.warn_only_check).severity("", "")  # an unknown name fails here, not mid-run
        run_config["resources"]["check_policy"] = {"config": {"warn_only": args.warn_only_check}}
    run_config["resources"]["spark"] = {"config": engine}
    with dg.DagsterInstance.get() as instance:
        return job.execute_in_process(instance=instance, raise_on_error=False, run_config=run_config)


def _run(args: argparse.Namespace) -> int:
    from assets.keys import job_names

    if args.job not in job_names():  # before anything is created under the storage root
        raise ConfigurationError(f"Unknown job {args.job!r}. Fix: use one of {', '.join(job_names())}.")
    layout = StorageLayout.under()
    if layout.on_object_store:  # before a JVM starts: a missing bucket, key, server or connector names its fix
        from pipelines.runtime.spark import REMOTE_ENV, object_store_jars
        from pipelines.storage.files import require_bucket

        require_bucket(layout.home)
        if not (args.remote or os.environ.get(REMOTE_ENV)):
            object_store_jars()
    prepare_instance(layout)
    engine = spark_config(args.remote, args.master, args.job, layout)
    if engine["remote"] is None:
        from pipelines.runtime.spark import SparkSettings, start_session_early

        # The JVM starts on one core while Dagster loads on the other: the resource's settings, as the run gives them.
        start_session_early(SparkSettings(**{k: v for k, v in engine.items() if v is not None}))
    try:
        result = _execute(args, engine)
    finally:
        from pipelines.runtime.spark import take_early_session

        take_early_session()  # a run that never reached Spark leaves it to no later run of this process
    print(f"\nrun {result.run_id}: {'SUCCESS' if result.success else 'FAILURE'} (job {args.job}, "
          f"STATETABLES_HOME={layout.home})")
    for event in result.all_events:
        if event.event_type_value == "ASSET_MATERIALIZATION":
            mat = event.step_materialization_data.materialization
            # Figures only: tables (top rows, reasons) are for the UI.
            shown = {k: v.value for k, v in mat.metadata.items()
                     if isinstance(v.value, (int, float)) or (isinstance(v.value, str) and len(v.value) < 80)}
            print(f"  materialized {mat.asset_key.to_user_string()}: {shown}")
        elif event.event_type_value == "ASSET_CHECK_EVALUATION":
            check = event.event_specific_data
            status = "passed" if check.passed else f"FAILED ({check.severity.value})"
            print(f"  check {check.asset_key.to_user_string()}:{check.check_name} {status}")
        elif event.event_type_value == "STEP_FAILURE":
            print(f"  step {event.step_key} FAILED: {event.event_specific_data.error.message.strip()}")
    if args.show and result.success:
        _print_state_tables(layout, engine)
    return 0 if result.success else 1


def _savepoint(args: argparse.Namespace) -> int:
    from pipelines.operate.savepoints import create_savepoint, list_savepoints, restore_savepoint
    from pipelines.runtime.spark import SparkSettings, build_spark_session

    layout = StorageLayout.under()
    if args.action == "list":
        for manifest in list_savepoints(layout):
            tables = ", ".join(f"{t} v{m['version']}" for t, m in manifest["tables"].items())
            print(f"{manifest['name']}\t{manifest['created_at']}\t{tables}")
        return 0
    if not args.name:
        raise ConfigurationError(f"`statetables savepoint {args.action}` needs a name. Fix: add one, e.g. before-deploy-42.")
    spark = build_spark_session(SparkSettings(one_command=True))
    action = create_savepoint if args.action == "create" else restore_savepoint
    manifest = action(spark, layout, args.name)
    verb = "taken" if args.action == "create" else "restored; the next run resumes from it"
    print(f"savepoint {args.name} {verb}: " + ", ".join(f"{t} v{m['version']}" for t, m in manifest["tables"].items()))
    return 0


def _restore_changelog(args: argparse.Namespace) -> int:
    from pipelines.declare.project import project
    from pipelines.operate.maintenance import publish_changelogs
    from pipelines.runtime.spark import SparkSettings, build_spark_session
    from pipelines.state.changelog import restore_from_changelog

    name = _table_name(args)
    spec, table = project().state_table(name)
    into = args.into or f"{name}_restored_v{args.version}"
    spark, layout = build_spark_session(SparkSettings(one_command=True)), StorageLayout.under()
    # The changelog first takes in the state table's versions since it was last published.
    covers = next((f["covers"] for f in publish_changelogs(spark, layout, spec) if f["state_table"] == name), -1)
    if args.version > covers:
        raise ConfigurationError(f"{name} has no version {args.version} yet: its newest is {covers}. Fix: choose a "
                                 f"version from 0 to {covers}.")
    target = restore_from_changelog(spark, layout, table, args.version, into)
    print(f"{name} as of version {args.version}, rebuilt from its changelog only: {target}")
    return 0


def _restore_topic(args: argparse.Namespace) -> int:
    from pipelines.state.changelog_topic import restore_from_topic
    from pipelines.declare.project import project
    from pipelines.runtime.spark import SparkSettings, build_spark_session

    name = _table_name(args)
    _, table = project().state_table(name)
    target, version = restore_from_topic(build_spark_session(SparkSettings(one_command=True)), StorageLayout.under(), table,
                                         args.into or f"{name}_from_topic")
    print(f"{name} as of version {version}, rebuilt from topic {table.changelog_topic.topic} only: {target}")
    return 0


def _refresh(args: argparse.Namespace) -> int:
    from pipelines.declare.project import project
    from pipelines.operate.refresh import refresh_event_time_table, refresh_state_table
    from pipelines.runtime.spark import SparkSettings, build_spark_session
    from pipelines.declare.specs import StateTableSpec

    spec, table = project().table(_table_name(args))
    refresh = refresh_state_table if isinstance(table, StateTableSpec) else refresh_event_time_table
    figures = refresh(build_spark_session(SparkSettings(one_command=True)), StorageLayout.under(), spec, table)
    print(f"{table.name} rebuilt from {spec.bronze_table} version {figures['bronze_version']} under its current "
          f"definition: {figures['keys']} rows, table version {figures['table_version']} (one commit)")
    return 0


def _status(args: argparse.Namespace) -> int:
    import json

    from pipelines.operate.status import render, storage_status

    report = storage_status(StorageLayout.under())
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0


def _serve_until_interrupted(what: str, url: str) -> int:
    import time

    print(f"{what} ready: {url}  (Ctrl-C stops it)", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 0


def _connect_server(args: argparse.Namespace) -> int:
    from statetables.servers import spark_connect_server

    _stop_on_signals()
    layout = StorageLayout.under()
    with spark_connect_server(port=args.port, log=layout.home / "logs" / "spark-connect.log", supervise=True) as url:
        return _serve_until_interrupted("Spark Connect server (Delta)", f"{url}   e.g. statetables run --remote {url}")


def _s3_server(args: argparse.Namespace) -> int:
    """s3proxy on 127.0.0.1 over a local folder until Ctrl-C; prints the environment that points the product at it."""
    from statetables.servers import S3_DEV_ACCESS_KEY, S3_DEV_SECRET_KEY, _stop, s3_server

    _stop_on_signals()
    data_dir = Path(args.dir).resolve()
    log = Path(args.log).resolve() if args.log else data_dir.with_name(data_dir.name + ".log")
    proc = s3_server(port=args.port, data_dir=data_dir, log=log, access_key=S3_DEV_ACCESS_KEY,
                     secret_key=S3_DEV_SECRET_KEY, bucket=args.bucket, log_requests=args.log_requests)
    try:
        endpoint = f"http://127.0.0.1:{args.port}"
        home = f"s3a://{args.bucket or 'BUCKET'}/{args.prefix}"
        print(f"S3 server (s3proxy) over {data_dir}, log {log}; request counts: {endpoint}/metrics\n"
              f"Point statetables at it (a shell that runs the product):\n"
              f"  export AWS_ENDPOINT_URL={endpoint} AWS_ACCESS_KEY_ID={S3_DEV_ACCESS_KEY} "
              f"AWS_SECRET_ACCESS_KEY={S3_DEV_SECRET_KEY} AWS_REGION=us-east-1 STATETABLES_HOME={home}", flush=True)
        return _serve_until_interrupted("S3 server", endpoint)
    finally:
        _stop(proc)


def _kafka_broker(args: argparse.Namespace) -> int:
    """A single-node Kafka broker on 127.0.0.1 over a local folder until Ctrl-C; prints its bootstrap address."""
    from pipelines.declare.specs import KAFKA_BOOTSTRAP_ENV
    from statetables.servers import kafka_broker

    _stop_on_signals()
    with kafka_broker(Path(args.dir), args.port) as broker:
        print(f"Kafka broker (KRaft, one node) over {broker.data_dir}, log {broker.log}; topics are created "
              f"explicitly (auto-creation is off)\n"
              f"Point statetables at it (a shell that runs the product; overrides the project file's "
              f"kafka: bootstrap_servers):\n"
              f"  export {KAFKA_BOOTSTRAP_ENV}={broker.bootstrap}", flush=True)
        return _serve_until_interrupted("Kafka broker", broker.bootstrap)


def _cluster(args: argparse.Namespace) -> int:
    from statetables.servers import spark_standalone

    _stop_on_signals()
    layout = StorageLayout.under()
    with spark_standalone(port=args.port, log_dir=layout.home / "logs" / "spark-standalone", worker_cores=args.cores,
                          worker_memory=args.memory) as url:
        return _serve_until_interrupted("Spark standalone master + worker", f"{url}   e.g. statetables run --master {url}")


def _stop_on_signals() -> None:
    """Ctrl-C and `kill` (SIGTERM) end the command through its `finally` blocks, which stop every server it started;
    a shell that starts it in the background leaves SIGINT ignored, so the handlers are set here, not inherited."""
    import signal

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)


def _engine_port(args: argparse.Namespace) -> int | None:
    return None if args.embedded else args.engine_port


def _warm_up(args: argparse.Namespace) -> int:
    """Micro-batches of generated events through every stream of the project, on a scratch root, in the engine at
    --remote: its first real batches then run compiled code."""
    import time

    from pipelines.runtime.spark import SparkSettings, build_spark_session, default_remote
    from pipelines.runtime.warm_up import warm_up_engine

    remote = args.remote or default_remote()
    if not remote:
        raise ConfigurationError("statetables warm-up warms a Spark Connect engine, and none was named (an embedded "
                                 "JVM ends with this command). Fix: --remote sc://127.0.0.1:15002, or set "
                                 "$STATETABLES_SPARK_REMOTE.")
    specs = list(streams().values())
    started = time.monotonic()
    large = (f", then {args.large_batches} large batch{'es' if args.large_batches > 1 else ''} of "
             f"{args.large_events:,} events," if args.large_events > 0 and args.large_batches > 0 else "")
    print(f"warming the engine {remote}: {args.batches} micro-batches of each of {len(specs)} streams{large} on a "
          f"scratch root ...", flush=True)
    warm_up_engine(build_spark_session(SparkSettings(remote=remote)), specs, batches=args.batches,
                   large_events=args.large_events, large_batches=args.large_batches,
                   report=lambda w: print(f"  {w.stream}: {w.micro_batches} micro-batches in {w.seconds:.1f} s",
                                          flush=True))
    print(f"engine warmed in {time.monotonic() - started:.1f} s", flush=True)
    return 0


def _dev(args: argparse.Namespace) -> int:
    """`dagster dev` on 127.0.0.1 beside a supervised Spark Connect server that every run uses; Ctrl-C stops both."""
    from statetables.servers import dagster_dev

    _stop_on_signals()
    layout = StorageLayout.under()
    engine = _engine_port(args)
    with dagster_dev(layout, port=args.port, engine_port=engine, log=layout.home / "logs" / "dagster-dev.log",
                     warm_up_batches=args.warm_up_batches) as url:
        where = f"the Spark Connect engine sc://127.0.0.1:{engine}" if engine else "an embedded JVM per run"
        return _serve_until_interrupted(f"Dagster (runs use {where}; logs in {layout.home / 'logs'})", url)


def _serve(args: argparse.Namespace) -> int:
    """`dagster dev` on 127.0.0.1, and the continuous job launched in it; Ctrl-C cancels the job (the current
    micro-batches commit first), then stops Dagster."""
    import time

    from assets.keys import CONTINUOUS_JOB
    from statetables.servers import RUN_ENDED, dagster_dev, launch_run, list_runs, terminate_run, wait_for_run_end

    _stop_on_signals()  # Ctrl-C, and `kill` too, cancel the run cleanly
    layout = StorageLayout.under()
    config = {"trigger_seconds": args.trigger_seconds, "report_every_seconds": args.report_every_seconds}
    with dagster_dev(layout, port=args.port, engine_port=_engine_port(args),
                     log=layout.home / "logs" / "dagster-dev.log", warm_up_batches=args.warm_up_batches) as url:
        run_id = launch_run(url, CONTINUOUS_JOB, {"ops": {"keep_streams_running": {"config": config}}})
        print(f"Dagster UI: {url}   {CONTINUOUS_JOB} run {run_id}: {url}/runs/{run_id}\n"
              f"Drop *.jsonl files into {layout.landing('<stream>')}/ and follow the tables in the UI. "
              f"Ctrl-C cancels the run (the current micro-batches commit first), then stops Dagster.", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
        # The run launched above, or the recovery run that replaced it after a failure.
        for run in list_runs(url):
            if run["jobName"] == CONTINUOUS_JOB and run["status"] not in RUN_ENDED:
                print(f"cancelling {run['runId']} ...", flush=True)
                terminate_run(url, run["runId"])
                print(f"run {run['runId']}: {wait_for_run_end(url, run['runId'], timeout_s=300)}")
    return 0


def _instance(args: argparse.Namespace) -> int:
    print(prepare_instance(StorageLayout.under()))
    return 0



INIT_PROJECT = """\
# A statetables project: the streams you send and the tables kept from them (README, "Your first stream").
streams:
  orders:
    id: order_id                     # an order delivered twice counts once
    event_time: ordered_at           # the order's own time, with its UTC offset
    fields:
      order_id:    {type: string}
      customer_id: {type: string}
      region:      {type: string}
      total:       {type: decimal, min: 0}
      ordered_at:  {type: timestamp}

state_tables:
  - CREATE TABLE orders_per_region AS
    SELECT region, COUNT(*) AS orders, SUM(total) AS revenue, MAX(ordered_at) AS last_order_at
    FROM orders GROUP BY region
"""
INIT_LINES = [
    '{"order_id":"o-1","customer_id":"c-1","region":"north","total":"25.00","ordered_at":"2026-11-01T09:00:00Z"}',
    '{"order_id":"o-2","customer_id":"c-2","region":"south","total":"12.50","ordered_at":"2026-11-01T09:05:00Z"}',
    '{"order_id":"o-3","customer_id":"c-1","region":"north","total":"7.25","ordered_at":"2026-11-01T09:20:00+01:00"}',
    '{"order_id":"o-2","customer_id":"c-2","region":"south","total":"12.50","ordered_at":"2026-11-01T09:05:00Z"}',
    '{"order_id":"o-4","customer_id":"c-3","region":"north","total":"-3.00","ordered_at":"2026-11-01T09:30:00Z"}',
    '{"order_id":"o-5","customer_id":"c-3","region":"south","total":"40.00","ordered_at":"2026-11-01T10:10:00Z"}',
]


def _init(args: argparse.Namespace) -> int:
    """A project to start from: the project file, a landing file already dropped, and the next commands."""
    folder = Path(args.dir).resolve()
    project_file = folder / "statetables.yaml"
    if project_file.exists():
        raise ConfigurationError(f"{project_file} exists already; init writes a new project only. Fix: "
                                 f"`statetables init NEW_FOLDER`, or edit that file.")
    landing = folder / "data" / "landing" / "orders"
    landing.mkdir(parents=True, exist_ok=True)
    project_file.write_text(INIT_PROJECT)
    # Written under a dot name, then renamed: a run never reads a landing file half-written.
    sample = landing / "orders-0001.jsonl"
    hidden = landing / ".orders-0001.jsonl"
    hidden.write_text("\n".join(INIT_LINES) + "\n")
    hidden.rename(sample)
    shown = os.path.relpath(folder) if folder != Path.cwd() else "."
    print(f"project: {project_file}", file=sys.stderr)
    print(f"wrote {project_file.name} (stream orders, state table orders_per_region) and "
          f"{sample.relative_to(folder)} ({len(INIT_LINES)} lines: one delivered twice, one with a negative total)\n"
          f"next:\n"
          + (f"  cd {shown}\n" if shown != "." else "")
          + "  statetables check                     # the project as read, and the MERGE it runs\n"
            "  statetables run                       # bronze, quarantine and orders_per_region from the file\n"
            "  statetables show orders_per_region    # the table; then `statetables quarantine orders`")
    return 0


def _check(args: argparse.Namespace) -> int:
    import json

    from pipelines.declare.project import ProjectError, project, project_path
    from pipelines.operate.describe import describe_project, render

    path = project_path()
    try:
        description = describe_project(project(path), StorageLayout.under())
    except ProjectError as error:
        if args.json:
            print(json.dumps({"project": str(path), "problems": [str(p) for p in error.problems]}, indent=2))
        else:
            print(f"statetables: {error}", file=sys.stderr)
        return 2
    print(json.dumps(description, indent=2) if args.json else render(description))
    return 0


def _table_name(args: argparse.Namespace) -> str:
    name = args.table_option or args.table
    if not name:
        raise ConfigurationError(f"`statetables {args.command}` needs a table. Fix: name one, e.g. "
                                 f"`statetables {args.command} orders_per_region` (`statetables check` lists them).")
    return name


def _printed(table, limit: int | None = None) -> str:
    """A pyarrow table as aligned text (every row and column, nothing cut)."""
    import pandas as pd

    frame = table.to_pandas()
    if frame.empty:
        return "(no rows)"
    with pd.option_context("display.max_columns", None, "display.width", 10_000, "display.max_colwidth", 80):
        return frame.to_string(index=False)


def _show(args: argparse.Namespace) -> int:
    from pipelines.declare.project import project
    from pipelines.operate.inspect import open_table, query

    name = _table_name(args)
    table = open_table(StorageLayout.under(), project(), name)
    rows = query(table, args.where, limit=args.limit)
    print(f"{name} (version {table.version()}, {table.count()} rows{' in all' if args.where else ''}; "
          f"showing {rows.num_rows}{' where ' + args.where if args.where else ''}):")
    print(_printed(rows))
    return 0


def _quarantine(args: argparse.Namespace) -> int:
    from pipelines.declare.project import project
    from pipelines.operate.inspect import sql_literal, open_table, quarantine_summary, query

    current = project()
    spec = current.stream(args.stream)
    layout = StorageLayout.under()
    print(f"{spec.quarantine_table}: lines not accepted, by reason")
    print(_printed(quarantine_summary(layout, current, spec)))
    table = open_table(layout, current, spec.quarantine_table)
    rows = query(table, f"reason = {sql_literal(args.reason)}" if args.reason else None,
                 order_by=["ingested_at DESC", "source_file", "line_number"], limit=args.limit,
                 columns=["source_file", "line_number", "reason", "reason_field", "detail", "raw_line"])
    print(f"\nthe newest {rows.num_rows}{' of reason ' + args.reason if args.reason else ''}:")
    print(_printed(rows))
    return 0


def _explain(args: argparse.Namespace) -> int:
    from pipelines.declare.project import project
    from pipelines.operate.inspect import explain

    import pyarrow as pa

    found = explain(StorageLayout.under(), project(), _table_name(args), args.key, limit=args.limit)
    key = ", ".join(f"{k}={v}" for k, v in found.key.items())
    sections = [
        (f"{found.table} where {key}, now", found.row),
        (f"the accepted events that built it: {found.duplicates_note}", found.events),
        ("lines that re-used one of their ids with other content (quarantined as conflicting_duplicate)",
         found.conflicting),
        ("of those events, the ones late for a windowed or session table (they count here all the same)", found.late),
        ("every commit that changed the row, and the row after it", found.changes),
    ]
    for title, rows in sections:
        print(f"\n== {title}")
        print(_printed(pa.Table.from_pylist(rows)) if rows else "(none)")
    return 0


class _Help(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written (their examples keep their lines), and every option's default shown (where it
    has one: not a flag's False nor an optional value's None)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default not in (None, False, argparse.SUPPRESS) and "%(default)" not in text \
                and not isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            text += " (default: %(default)s)"
        return text


GROUPS = (("start", ("init", "check")),
          ("pipeline", ("generate", "run", "refresh", "dev", "serve")),
          ("inspect", ("status", "show", "quarantine", "explain")),
          ("recovery", ("savepoint", "restore-changelog", "restore-topic")),
          ("local servers", ("connect-server", "warm-up", "cluster", "s3-server", "kafka-broker", "instance")))
NO_PROJECT = {"init", "connect-server", "cluster", "s3-server", "kafka-broker", "instance"}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("statetables")
    except PackageNotFoundError:
        return "unknown (not installed)"


def _parser() -> argparse.ArgumentParser:
    project_option = argparse.ArgumentParser(add_help=False)
    project_option.add_argument("--project", metavar="FILE", default=argparse.SUPPRESS,
                                help="the project file (else $STATETABLES_PROJECT, else ./statetables.yaml)")
    listing = "\n".join(f"  {group + ':':15}{', '.join(names)}" for group, names in GROUPS)
    parser = argparse.ArgumentParser(
        prog="statetables", formatter_class=_Help, description=__doc__,
        epilog=f"commands by what they are for:\n{listing}\n\nThe storage root is $STATETABLES_HOME (default ./data).")
    parser.add_argument("--project", metavar="FILE", default=None,
                        help="the project file (else $STATETABLES_PROJECT, else ./statetables.yaml)")
    parser.add_argument("--version", action="version", version=f"statetables {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, summary: str, example: str, func, description: str = "") -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=summary, formatter_class=_Help, parents=[project_option],
                                  description=textwrap.fill(f"{summary}. {description}".strip(), 100),
                                  epilog=f"example:\n  {example}")
        sub.set_defaults(func=func)
        return sub

    def table_argument(sub: argparse.ArgumentParser, what: str) -> None:
        sub.add_argument("table", nargs="?", metavar="TABLE", help=f"{what} (`statetables check` lists them)")
        sub.add_argument("--table", dest="table_option", metavar="TABLE", help="the same as TABLE")

    init = command("init", "write a project to start from into DIR", "statetables init my_project", _init,
                   "A project file with one stream (orders) and one state table, a landing file already in "
                   "place, and the next commands to type.")
    init.add_argument("dir", nargs="?", default=".", metavar="DIR", help="the project's folder (created if missing)")

    check = command("check", "read the project file and show what it declares, without starting Spark",
                    "statetables check --json", _check,
                    "Each stream with its fields, id and event time; each table with its keys, aggregates, the MERGE "
                    "its micro-batches run, and its path. A project with problems lists every one, each at "
                    "FILE:LINE:COLUMN, and exits 2.")
    check.add_argument("--json", action="store_true", help="one JSON document instead of text")

    gen = command("generate", "write contract-conformant sample landing files, with faults on purpose",
                  "statetables generate --stream payments --events 100000 --seed 1", _generate,
                  "Valid events, some delivered twice, some with a conflicting re-used id, some malformed, and some "
                  "delivered out of order (`--late`): whether those end behind a watermark depends on the runs.")
    gen.add_argument("--stream", default="all", help="a stream the project file declares, or all")
    gen.add_argument("--events", type=int, default=10_000, help="valid events per stream")
    gen.add_argument("--malformed", type=float, default=0.005, help="share of malformed lines")
    gen.add_argument("--duplicates", type=float, default=0.01, help="share of events delivered again, same content")
    gen.add_argument("--conflicts", type=float, default=0.001, help="share of ids re-used with other content")
    gen.add_argument("--late", type=float, default=0.02,
                     help="share of events delivered out of order, hours after their event time")
    gen.add_argument("--seed", type=int, default=1, help="the random seed: the same seed writes the same files")
    gen.add_argument("--events-per-file", type=int, default=20_000, help="lines per landing file")

    run = command("run", "one headless Dagster run: landing files (or topics) into bronze, quarantine and every "
                  "table, with the checks", "statetables run --show", _run)
    run.add_argument("--job", default="advance_all",
                     help="advance_all, advance_<stream>, reconcile_state_tables (the deep checks), "
                          "refresh_state_table, maintain_tables or run_continuously")
    run.add_argument("--show", action="store_true", help="print the state tables, each top N's latest closed "
                     "window and the newest rows of the other windowed and session tables afterwards")
    run.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                     help="Dagster console log level (DEBUG shows every event)")
    run.add_argument("--warn-only-check", action="append", metavar="ASSET:CHECK",
                     help="for this run, a failure of this blocking check warns instead of stopping the run "
                          "(resource check_policy; docs/recovery.md says when)")
    run.add_argument("--remote", metavar="sc://HOST:PORT",
                     help="run on a Spark Connect server (`statetables connect-server`)")
    run.add_argument("--master", metavar="URL",
                     help="spark.master: local[N] (local[2] when neither this nor --remote) or spark://HOST:PORT "
                          "(`statetables cluster`)")

    refresh = command("refresh", "rebuild a state, windowed or session table from bronze under the project file's "
                      "definition, replacing its content in one commit", "statetables refresh orders_per_region",
                      _refresh)
    table_argument(refresh, "the table to rebuild")

    status = command("status", "where each stream stands: landing files not ingested yet, the last micro-batch, "
                     "table versions, what each step has folded, quarantine reasons, late events, the writer lock, "
                     "the engine", "statetables status --json", _status)
    status.add_argument("--json", action="store_true", help="one JSON document (stable keys) instead of text")

    show = command("show", "print a table's rows, read with delta-rs (no Spark)",
                   "statetables show orders_per_region --where \"region = 'north'\" --limit 5", _show)
    table_argument(show, "any table a run writes: a state, windowed, session or top N table, bronze, quarantine, "
                         "late_events")
    show.add_argument("--where", metavar="SQL", help="a SQL condition over the table's columns")
    show.add_argument("--limit", type=int, default=20, help="rows to print at most")

    quarantine = command("quarantine", "a stream's quarantine: lines not accepted, counted by reason, and the newest",
                         "statetables quarantine orders --reason out_of_range", _quarantine)
    quarantine.add_argument("stream", metavar="STREAM", help="a stream the project file declares")
    quarantine.add_argument("--reason", help="only lines of this reason")
    quarantine.add_argument("--limit", type=int, default=20, help="lines to print at most")

    explain = command("explain", "why a state table's row holds what it holds: the events that built it, with their "
                      "file and line (or topic, partition and offset), conflicting re-uses of their ids, late "
                      "events, and every commit that changed the row", "statetables explain orders_per_region north",
                      _explain)
    table_argument(explain, "a state table")
    explain.add_argument("key", metavar="KEY", help="the key's value, or k1=v1,k2=v2 for a table of several keys")
    explain.add_argument("--limit", type=int, default=50, help="events and commits to print at most")

    save = command("savepoint", "take, list or restore a savepoint of every state table",
                   "statetables savepoint create before-deploy-42", _savepoint)
    save.add_argument("action", choices=["create", "list", "restore"], help="what to do")
    save.add_argument("name", nargs="?", help="the savepoint's name (create and restore)")

    restore = command("restore-changelog", "rebuild a state table as of a version from its changelog table alone",
                      "statetables restore-changelog orders_per_region --version 12", _restore_changelog)
    table_argument(restore, "the state table")
    restore.add_argument("--version", type=int, required=True, help="the state table's version to rebuild")
    restore.add_argument("--into", help="table name under tables/ to write (default <table>_restored_v<version>)")

    from_topic = command("restore-topic", "rebuild a state table from its compacted changelog topic alone",
                         "statetables restore-topic payments_per_customer", _restore_topic)
    table_argument(from_topic, "the state table")
    from_topic.add_argument("--into", help="table name under tables/ to write (default <table>_from_topic)")

    dev = command("dev", "Dagster UI + daemon on 127.0.0.1 beside a warm Spark Connect engine", "statetables dev",
                  _dev, "Runs use the engine; Ctrl-C stops both.")
    serve = command("serve", "as `dev`, with the continuous job running", "statetables serve --trigger-seconds 2",
                    _serve, "Ctrl-C cancels the job (the current micro-batches commit first), then stops Dagster.")
    for sub in (dev, serve):
        sub.add_argument("--port", type=int, default=3000, help="the Dagster UI's port")
        sub.add_argument("--engine-port", type=int, default=15002, help="the Spark Connect server's port")
        sub.add_argument("--embedded", action="store_true", help="no engine: every run starts an embedded JVM")
        sub.add_argument("--warm-up-batches", type=int, default=WARM_UP_BATCHES, metavar="N",
                         help="micro-batches of each stream the engine runs on a scratch root before Dagster starts "
                              "(`statetables warm-up`); 0: none")
    serve.add_argument("--trigger-seconds", type=float, default=1.0, help="processing-time trigger of the queries")
    serve.add_argument("--report-every-seconds", type=float, default=30.0, help="how often tables are reported")

    warm = command("warm-up", "run micro-batches of generated events through every stream on a scratch root, in "
                   "a Spark Connect engine, so that its first real ones run compiled code",
                   "statetables warm-up --remote sc://127.0.0.1:15002", _warm_up,
                   "`dev` and `serve` run it against their engine before Dagster starts. Nothing under the storage "
                   "root is read or written.")
    warm.add_argument("--remote", help="the engine (default $STATETABLES_SPARK_REMOTE)")
    warm.add_argument("--batches", type=int, default=WARM_UP_BATCHES, help="micro-batches of each stream")
    warm.add_argument("--large-events", type=int, default=WARM_UP_LARGE_EVENTS, metavar="N",
                      help="then --large-batches batches of N events of each stream, each run as a large batch (as a "
                           "file of 100k events is); 0: none")
    warm.add_argument("--large-batches", type=int, default=WARM_UP_LARGE_BATCHES, metavar="N",
                      help="how many large batches of each stream; 0: none")
    server = command("connect-server", "serve Spark Connect with Delta on 127.0.0.1 until interrupted",
                     "statetables connect-server --port 15002", _connect_server)
    server.add_argument("--port", type=int, default=15002, help="the port to listen on")
    cluster = command("cluster", "a Spark standalone master and worker on 127.0.0.1 until interrupted",
                      "statetables cluster --cores 2 --memory 6g", _cluster)
    cluster.add_argument("--port", type=int, default=7077, help="the master's port")
    cluster.add_argument("--cores", type=int, default=2, help="the worker's cores")
    cluster.add_argument("--memory", default="6g", help="the worker's memory for executors")
    s3 = command("s3-server", "a local S3 server (s3proxy) over a folder on 127.0.0.1 until interrupted, for an "
                 "s3a:// storage root", "statetables s3-server --dir /tmp/s3 --bucket lake", _s3_server)
    s3.add_argument("--port", type=int, default=9000, help="the port to listen on")
    s3.add_argument("--dir", required=True, metavar="PATH", help="where objects are stored: a folder per bucket")
    s3.add_argument("--bucket", help="create this bucket (a folder under --dir) if it does not exist")
    s3.add_argument("--prefix", default="statetables", help="the prefix under the bucket in the printed "
                                                            "STATETABLES_HOME")
    s3.add_argument("--log", metavar="FILE", help="s3proxy's log (PATH.log beside --dir when not given)")
    s3.add_argument("--log-requests", action="store_true", help="also log a line per request")
    kafka = command("kafka-broker", "a single-node Kafka broker (KRaft) over a folder on 127.0.0.1 until "
                    "interrupted; a restart on the same folder keeps the topics",
                    "statetables kafka-broker --dir /tmp/kafka", _kafka_broker)
    kafka.add_argument("--port", type=int, default=9092, help="the port to listen on")
    kafka.add_argument("--dir", required=True, metavar="PATH", help="the broker's topics, metadata, config and log")
    command("instance", "prepare the Dagster instance under the storage root and print DAGSTER_HOME",
            "statetables instance", _instance)
    return parser


def _use_project(option: str | None) -> None:
    """The project every part of this command reads, named in the environment so that what the command starts
    (Dagster's code server, runs) reads the same file; printed once."""
    from pipelines.declare.project import project_path

    if option:
        path = Path(option).expanduser()
        if not path.is_file():
            raise ConfigurationError(f"--project {option}: no such file. Fix: name your project file (a "
                                     f"statetables.yaml), or leave --project out to use ./statetables.yaml.")
        os.environ[PROJECT_ENV] = str(path.resolve())
    os.environ[PROJECT_ENV] = str(project_path())


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command not in NO_PROJECT:
            _use_project(args.project)
            # On stderr: a terminal shows it, and what a script reads on stdout (JSON, a list) stays as it was.
            print(f"project: {os.environ[PROJECT_ENV]}", file=sys.stderr, flush=True)
        return args.func(args)
    except (ConfigurationError, StreamBusyError, StorageError, SavepointError, ValueError) as error:
        print(f"statetables: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
