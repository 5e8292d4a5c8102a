"""`statetables` command line: generate sample data, run the pipeline headless through Dagster,
print the state tables, refresh one, show where each stream stands, prepare the Dagster instance.

    statetables generate --stream payments --events 100000 --malformed 0.005 --duplicates 0.01 --late 0.02 --seed 1
    statetables run [--job advance_all] [--show] [--warn-only-check ASSET:CHECK] [--remote sc://127.0.0.1:15002 | --master spark://127.0.0.1:7077]
    statetables connect-server [--port 15002]     # Spark Connect with Delta on 127.0.0.1, until Ctrl-C
    statetables cluster [--port 7077]             # a standalone master + worker on 127.0.0.1, until Ctrl-C
    statetables s3-server --dir PATH [--port 9000] [--bucket NAME]   # a local S3 server (s3proxy), until Ctrl-C
    statetables kafka-broker --dir PATH [--port 9092]   # a single-node Kafka broker (KRaft) on 127.0.0.1, until Ctrl-C
    statetables savepoint create|list|restore [NAME]
    statetables restore-changelog --table movie_tickets_sold --version 12 [--into NAME]
    statetables restore-topic --table payments_per_customer --into NEW   # rebuild a table from its changelog topic
    statetables refresh TABLE       # rebuild a table from bronze after its declaration changed
    statetables status [--json]     # per stream: files waiting, the last batch, versions, what each step folded, ...
    statetables --project FILE ...  # another project file than ./statetables.yaml
    statetables dev [--port 3000] [--engine-port 15002 | --embedded]   # Dagster UI + daemon + a warm Spark Connect engine
    statetables serve [--port 3000] [--engine-port 15002 | --embedded] # the same, with the continuous job running
    statetables instance            # prints DAGSTER_HOME after writing its dagster.yaml
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from pipelines.declare.project import PROJECT_ENV, stream_spec, streams
from pipelines.errors import ConfigurationError, SavepointError, StorageError, StreamBusyError
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
              f"({summary.late} late), {summary.malformed} malformed, {summary.duplicates} re-deliveries, "
              f"{summary.conflicts} conflicting ids")
    return 0


def _print_state_tables(layout: StorageLayout, engine: dict) -> None:
    from pyspark.sql import functions as F

    from pipelines.runtime.spark import SparkSettings, build_spark_session, default_remote

    # The run's session, still alive in this process (getOrCreate), on the run's engine.
    spark = build_spark_session(SparkSettings(remote=engine.get("remote", default_remote()),
                                              master=engine.get("master", "local[2]")))
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
    import dagster as dg

    from statetables.definitions import defs

    job = defs.resolve_job_def(args.job)
    run_config: dict = {"loggers": {"console": {"config": {"log_level": args.log_level}}}, "resources": {}}
    if args.warn_only_check:
        from resources import CheckPolicyResource

        CheckPolicyResource(warn_only=args.warn_only_check).severity("", "")  # an unknown name fails here, not mid-run
        run_config["resources"]["check_policy"] = {"config": {"warn_only": args.warn_only_check}}
    # --master means that engine even where $STATETABLES_SPARK_REMOTE names a Connect server.
    engine = {"remote": args.remote} if args.remote else {"master": args.master, "remote": None} if args.master else {}
    if engine:
        run_config["resources"]["spark"] = {"config": engine}
    with dg.DagsterInstance.get() as instance:
        result = job.execute_in_process(instance=instance, raise_on_error=False, run_config=run_config)
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
    from pipelines.runtime.spark import build_spark_session

    layout = StorageLayout.under()
    if args.action == "list":
        for manifest in list_savepoints(layout):
            tables = ", ".join(f"{t} v{m['version']}" for t, m in manifest["tables"].items())
            print(f"{manifest['name']}\t{manifest['created_at']}\t{tables}")
        return 0
    if not args.name:
        raise ConfigurationError(f"`statetables savepoint {args.action}` needs a name. Fix: add one, e.g. before-deploy-42.")
    spark = build_spark_session()
    action = create_savepoint if args.action == "create" else restore_savepoint
    manifest = action(spark, layout, args.name)
    verb = "taken" if args.action == "create" else "restored; the next run resumes from it"
    print(f"savepoint {args.name} {verb}: " + ", ".join(f"{t} v{m['version']}" for t, m in manifest["tables"].items()))
    return 0


def _restore_changelog(args: argparse.Namespace) -> int:
    from pipelines.state.changelog import restore_from_changelog
    from pipelines.runtime.spark import build_spark_session

    from pipelines.declare.project import project

    _, table = project().state_table(args.table)
    into = args.into or f"{args.table}_restored_v{args.version}"
    target = restore_from_changelog(build_spark_session(), StorageLayout.under(), table, args.version, into)
    print(f"{args.table} as of version {args.version}, rebuilt from its changelog only: {target}")
    return 0


def _restore_topic(args: argparse.Namespace) -> int:
    from pipelines.state.changelog_topic import restore_from_topic
    from pipelines.declare.project import project
    from pipelines.runtime.spark import build_spark_session

    _, table = project().state_table(args.table)
    target, version = restore_from_topic(build_spark_session(), StorageLayout.under(), table, args.into)
    print(f"{args.table} as of version {version}, rebuilt from topic {table.changelog_topic.topic} only: {target}")
    return 0


def _refresh(args: argparse.Namespace) -> int:
    from pipelines.declare.project import project
    from pipelines.operate.refresh import refresh_event_time_table, refresh_state_table
    from pipelines.runtime.spark import build_spark_session
    from pipelines.declare.specs import StateTableSpec

    spec, table = project().table(args.table)
    refresh = refresh_state_table if isinstance(table, StateTableSpec) else refresh_event_time_table
    figures = refresh(build_spark_session(), StorageLayout.under(), spec, table)
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


def _dev(args: argparse.Namespace) -> int:
    """`dagster dev` on 127.0.0.1 beside a supervised Spark Connect server that every run uses; Ctrl-C stops both."""
    from statetables.servers import dagster_dev

    _stop_on_signals()
    layout = StorageLayout.under()
    engine = _engine_port(args)
    with dagster_dev(layout, port=args.port, engine_port=engine, log=layout.home / "logs" / "dagster-dev.log") as url:
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
                     log=layout.home / "logs" / "dagster-dev.log") as url:
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="statetables", description=__doc__.split("\n")[0])
    parser.add_argument("--project", metavar="FILE", help="the project file (default $STATETABLES_PROJECT, else "
                                                           "./statetables.yaml)")
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="write contract-conformant sample landing files")
    gen.add_argument("--stream", default="all", help="a stream the project file declares, or all (default)")
    gen.add_argument("--events", type=int, default=10_000)
    gen.add_argument("--malformed", type=float, default=0.005)
    gen.add_argument("--duplicates", type=float, default=0.01)
    gen.add_argument("--conflicts", type=float, default=0.001)
    gen.add_argument("--late", type=float, default=0.02)
    gen.add_argument("--seed", type=int, default=1)
    gen.add_argument("--events-per-file", type=int, default=20_000)
    gen.set_defaults(func=_generate)

    run = commands.add_parser("run", help="one headless Dagster pass over the landing folders")
    run.add_argument("--job", default="advance_all")
    run.add_argument("--show", action="store_true", help="print the state tables, each top N's latest closed window and the newest rows of the other windowed and session tables afterwards")
    run.add_argument("--log-level", default="INFO", help="Dagster console log level (DEBUG shows every event)")
    run.add_argument("--warn-only-check", action="append", metavar="ASSET:CHECK",
                     help="for this run, a failure of this blocking check warns instead of stopping the run "
                          "(resource check_policy; docs/recovery.md says when)")
    run.add_argument("--remote", metavar="sc://HOST:PORT", help="run on a Spark Connect server (`statetables connect-server`)")
    run.add_argument("--master", metavar="URL", help="spark.master: local[N] (default local[2]) or spark://HOST:PORT (`statetables cluster`)")
    run.set_defaults(func=_run)

    server = commands.add_parser("connect-server", help="serve Spark Connect with Delta on 127.0.0.1 until interrupted")
    server.add_argument("--port", type=int, default=15002)
    server.set_defaults(func=_connect_server)

    s3 = commands.add_parser("s3-server", help="a local S3 server (s3proxy) over a folder on 127.0.0.1 until "
                                               "interrupted, for an s3a:// storage root")
    s3.add_argument("--port", type=int, default=9000)
    s3.add_argument("--dir", required=True, metavar="PATH", help="where objects are stored: a folder per bucket")
    s3.add_argument("--bucket", help="create this bucket (a folder under --dir) if it does not exist")
    s3.add_argument("--prefix", default="statetables", help="the prefix under the bucket in the printed STATETABLES_HOME")
    s3.add_argument("--log", metavar="FILE", help="s3proxy's log (default: PATH.log beside --dir)")
    s3.add_argument("--log-requests", action="store_true", help="also log a line per request")
    s3.set_defaults(func=_s3_server)

    kafka = commands.add_parser("kafka-broker", help="a single-node Kafka broker (KRaft) over a folder on 127.0.0.1 "
                                                     "until interrupted; a restart on the same folder keeps the topics")
    kafka.add_argument("--port", type=int, default=9092)
    kafka.add_argument("--dir", required=True, metavar="PATH", help="the broker's topics, metadata, config and log")
    kafka.set_defaults(func=_kafka_broker)

    cluster = commands.add_parser("cluster", help="a Spark standalone master and worker on 127.0.0.1 until interrupted")
    cluster.add_argument("--port", type=int, default=7077)
    cluster.add_argument("--cores", type=int, default=2)
    cluster.add_argument("--memory", default="6g", help="the worker's memory for executors")
    cluster.set_defaults(func=_cluster)

    save = commands.add_parser("savepoint", help="take, list or restore a savepoint of every state table")
    save.add_argument("action", choices=["create", "list", "restore"])
    save.add_argument("name", nargs="?")
    save.set_defaults(func=_savepoint)

    restore = commands.add_parser("restore-changelog", help="rebuild a state table as of a version from its changelog")
    restore.add_argument("--table", required=True)
    restore.add_argument("--version", type=int, required=True)
    restore.add_argument("--into", help="table name under tables/ to write (default <table>_restored_v<version>)")
    restore.set_defaults(func=_restore_changelog)
    from_topic = commands.add_parser("restore-topic", help="rebuild a state table from its compacted changelog topic")
    from_topic.add_argument("--table", required=True)
    from_topic.add_argument("--into", required=True, help="table name under tables/ to write")
    from_topic.set_defaults(func=_restore_topic)

    refresh = commands.add_parser("refresh", help="rebuild a state, windowed or session table from bronze under the "
                                                  "project file's definition, replacing its content in one commit")
    refresh.add_argument("table")
    refresh.set_defaults(func=_refresh)

    status = commands.add_parser("status", help="where each stream stands: landing files not ingested yet, the last "
                                                "micro-batch, table versions, what each step has folded, quarantine "
                                                "reasons, late events, the writer lock, the engine")
    status.add_argument("--json", action="store_true", help="one JSON document (stable keys) instead of text")
    status.set_defaults(func=_status)

    dev = commands.add_parser("dev", help="Dagster UI + daemon on 127.0.0.1 beside a warm Spark Connect engine")
    serve = commands.add_parser("serve", help="as `dev`, with the continuous job running")
    for command in (dev, serve):
        command.add_argument("--port", type=int, default=3000)
        command.add_argument("--engine-port", type=int, default=15002, help="the Spark Connect server's port")
        command.add_argument("--embedded", action="store_true",
                             help="no engine: every run starts an embedded JVM of its own")
    dev.set_defaults(func=_dev)
    serve.add_argument("--trigger-seconds", type=float, default=2.0, help="processing-time trigger of the queries")
    serve.add_argument("--report-every-seconds", type=float, default=30.0, help="how often tables are reported")
    serve.set_defaults(func=_serve)

    inst = commands.add_parser("instance", help="prepare the Dagster instance under the storage root")
    inst.set_defaults(func=_instance)

    args = parser.parse_args(argv)
    if args.project:
        # The environment, so that what this command starts (Dagster's code server, runs) reads the same file.
        os.environ[PROJECT_ENV] = str(Path(args.project).resolve())
    try:
        return args.func(args)
    except (ConfigurationError, StreamBusyError, StorageError, SavepointError, ValueError) as error:
        print(f"statetables: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
