"""One benchmark case per process, so every figure includes what a user pays: interpreter, JVM, session.

    python -m benchmarks.cases <case> --home H --landing L [--out O] [--increment DIR]

Each case prints one last line `RESULT {json}` with the time of its own work inside the process
(`work_s`); benchmarks/run.py measures the whole process around it (wall time, peak memory).
Cases (docs/performance.md):
  minimal    (e) the smallest Spark + Delta process: session with the project's jars and confs, one small read
  floor      (a) Spark's floor: batch read of the landing files with a schema, aggregate by key, write parquet
  recompute  (b) the periodic batch job: GROUP BY over all of bronze, overwrite a state table
  stateful   (c) Spark's stateful streaming aggregation (RocksDB, update mode), foreachBatch MERGE of absolutes
  polars     (d) Polars + delta-rs: aggregate the files, MERGE into a Delta table (it has no quarantine and
                 stops at the first malformed line, so it reads a copy of the files without them)
  paths      (g) the event-time steps (windows, sessions) against the all-time MERGE step on the same bronze
  floor_bulk the stack's floor of a bulk run: every table it writes, by plain delta-spark with the least work each
  floor_increment_warm  the floor of a warm increment: its append and MERGE, repeated in one warm engine process
  floor_increment_warm_every_table  the same for every table a warm increment writes, with the least work for each
  warm       (f) this project inside a warm process: one catch-up run, then `--repeat` runs that each add an
                 increment's files, timed one by one (the step cost without the process start)
  batch      a micro-batch of `--events` new payments in a warm process, without event time and with sessions, each
                 step's seconds, Spark jobs and Delta commits, beside its floor measured in turn in the same process:
                 plain delta-spark appending the same rows twice and MERGEing them by customer (Change Data Feed on)
"""

from __future__ import annotations

import argparse
import json
import os
import time
from functools import partial
from pathlib import Path

PAYMENT_SCHEMA = "payment_id string, customer_id string, amount decimal(18,2), paid_at timestamp"
# The shipped customer_activity's session gap and the payments stream's watermark delay (statetables.yaml), which the
# floors' session steps apply.
SESSION_GAP_US, WATERMARK_DELAY_US = 30 * 60 * 1_000_000, 10 * 60 * 1_000_000
DEDUP_HORIZON_US = 7 * 86_400_000_000  # the shipped project's dedup horizon


def _session():
    from pipelines.runtime.spark import build_spark_session
    return build_spark_session()


def _landing_files(folder: Path) -> list[str]:
    return sorted(str(p) for p in folder.rglob("*.jsonl"))


def minimal(args) -> dict:
    started = time.monotonic()
    spark = _session()
    session_s = time.monotonic() - started
    rows = spark.read.format("delta").load(args.out).count()
    read_s = time.monotonic() - started - session_s
    spark.stop()
    return {"work_s": time.monotonic() - started, "session_s": session_s, "first_read_s": read_s, "rows": rows}


def floor(args) -> dict:
    from pyspark.sql import functions as F
    spark = _session()
    started = time.monotonic()
    events = spark.read.schema(PAYMENT_SCHEMA).json(_landing_files(Path(args.landing)))
    (events.groupBy("customer_id").agg(F.count("amount").alias("payment_count"), F.sum("amount").alias("total_amount"))
     .write.mode("overwrite").parquet(args.out))
    return {"work_s": time.monotonic() - started}


def recompute(args) -> dict:
    from pyspark.sql import functions as F
    spark = _session()
    started = time.monotonic()
    bronze = spark.read.format("delta").load(str(Path(args.home) / "tables" / "payments_bronze"))
    (bronze.groupBy("customer_id").agg(F.count("amount").alias("payment_count"), F.sum("amount").alias("total_amount"),
                                       F.min("paid_at").alias("first_paid_at"), F.max("paid_at").alias("last_paid_at"))
     .write.format("delta").mode("overwrite").save(args.out))
    return {"work_s": time.monotonic() - started}


def stateful(args) -> dict:
    from delta.tables import DeltaTable
    from pyspark.sql import functions as F
    spark = _session()
    spark.conf.set("spark.sql.streaming.stateStore.providerClass",
                   "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider")
    out = args.out
    started = time.monotonic()
    if not DeltaTable.isDeltaTable(spark, out):
        spark.createDataFrame([], "customer_id string, payment_count bigint, total_amount decimal(28,2)") \
            .write.format("delta").save(out)

    def merge_absolutes(batch, batch_id):
        # update mode emits each changed key's absolute aggregate: upsert it as is
        DeltaTable.forPath(batch.sparkSession, out).alias("t").merge(batch.alias("s"), "t.customer_id = s.customer_id") \
            .whenMatchedUpdateAll().whenNotMatchedInsertAll().execute()

    aggregated = (spark.readStream.schema(PAYMENT_SCHEMA).json(args.landing)
                  .groupBy("customer_id").agg(F.count("amount").alias("payment_count"),
                                              F.sum("amount").cast("decimal(28,2)").alias("total_amount")))
    query = (aggregated.writeStream.outputMode("update").option("checkpointLocation", out + "_checkpoint")
             .trigger(availableNow=True).foreachBatch(merge_absolutes).start())
    query.awaitTermination()
    return {"work_s": time.monotonic() - started}


def polars_merge(args) -> dict:
    import polars as pl
    from deltalake import DeltaTable, write_deltalake
    started = time.monotonic()
    schema = {"payment_id": pl.String, "customer_id": pl.String, "amount": pl.Decimal(18, 2), "paid_at": pl.String}
    # Polars stops at the first line that is not JSON: run.py gives it a copy without the malformed lines.
    batch = (pl.scan_ndjson(_landing_files(Path(args.landing)), schema=schema, ignore_errors=True)
             .group_by("customer_id").agg(pl.col("amount").count().alias("payment_count"),
                                          pl.col("amount").sum().alias("total_amount"))
             .collect())
    if not Path(args.out, "_delta_log").is_dir():
        write_deltalake(args.out, batch)
    else:
        (DeltaTable(args.out).merge(batch.to_arrow(), "t.customer_id = s.customer_id", source_alias="s",
                                    target_alias="t")
         .when_matched_update({"payment_count": "t.payment_count + s.payment_count",
                               "total_amount": "t.total_amount + s.total_amount"})
         .when_not_matched_insert_all().execute())
    return {"work_s": time.monotonic() - started, "keys": batch.height}


def jvm_thread_cpu(jvm) -> dict:
    """CPU seconds of a JVM process (`psutil.Process`): all of it, and its JIT compiler threads', its garbage
    collector's and its Spark task threads'. Threads are told apart by their names, which psutil does not give: read
    from /proc."""
    times = jvm.cpu_times()
    used = {"jvm": times.user + times.system, "jit": 0.0, "gc": 0.0, "tasks": 0.0}
    for thread in jvm.threads():
        try:
            name = Path(f"/proc/{jvm.pid}/task/{thread.id}/comm").read_text()
        except OSError:  # a thread that ended while read
            continue
        kind = ("jit" if "CompilerThre" in name else "gc" if name.startswith("GC Thread")
                else "tasks" if name.startswith("Executor task") else None)
        if kind:
            used[kind] += thread.user_time + thread.system_time
    return used


def cpu_s() -> dict:
    """CPU seconds used so far by this process and by its JVM (the embedded engine is a child process), split as
    `jvm_thread_cpu` does: a warm run is CPU-bound on this machine's 2 cores, and its CPU time varies less than its
    wall time between processes."""
    import psutil
    used = {"jvm": 0.0, "jit": 0.0, "gc": 0.0}
    for jvm in (p for p in psutil.Process().children() if p.name() == "java"):
        try:
            threads = jvm_thread_cpu(jvm)
        except psutil.Error:  # a JVM that ended while read
            continue
        for kind in used:
            used[kind] += threads[kind]
    own = os.times()
    return {**used, "python": own.user + own.system}


def warm(args) -> dict:
    """The project's job inside one warm process: a catch-up run and the warm-up an engine gets when it starts
    (`statetables warm-up`, as `make serve` and `make dev` run it), then one timed run per increment folder."""
    import dagster as dg
    from pyspark.sql import SparkSession
    from pipelines.declare.project import streams
    from pipelines.runtime.warm_up import warm_up_engine
    from statetables.definitions import defs
    job = defs.resolve_job_def("advance_payments")
    landing = Path(args.home) / "landing" / "payments"
    runs = []
    with dg.DagsterInstance.ephemeral() as instance:
        job.execute_in_process(instance=instance)  # catch up, and warm the JVM and the code paths
        warm_up_engine(SparkSession.builder.getOrCreate(), list(streams().values()))
        from benchmarks.run import counts, delta_commits, spark_jobs
        for increment in args.increment:
            for source in sorted(Path(increment).glob("*.jsonl")):
                os.link(source, landing / f"{Path(increment).name}-{source.name}")
            commits_before, jobs_before = delta_commits(Path(args.home)), spark_jobs(Path(args.home) / "event-log")
            started, cpu_before = time.monotonic(), cpu_s()
            result = job.execute_in_process(instance=instance)
            elapsed, cpu_after = time.monotonic() - started, cpu_s()
            counted = counts(Path(args.home), commits_before)
            counted["spark_jobs"] -= jobs_before
            counted["jobs_per_batch"] = round(counted["spark_jobs"] / max(counted["micro_batches"], 1), 1)
            # One step: the stream's query through every table.
            steps = {"payments": result.asset_materializations_for_node("payments")[0].metadata["duration_s"].value}
            runs.append({"run_s": elapsed, "steps_s": steps, "success": result.success,
                         "cpu_s": {k: round(cpu_after[k] - cpu_before[k], 2) for k in cpu_after}, **counted})
    return {"work_s": sum(r["run_s"] for r in runs), "runs": runs}


def _plain_delta_spark(spark, root: Path, path: Path) -> dict:
    """The floor of a micro-batch of the landing file `path`: plain delta-spark, the project's session confs, its
    rows appended to two tables (as bronze and quarantine are) and MERGEd by customer into a table with the change
    feed on (as the state table is); each step's seconds."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import StructType
    from pipelines.storage import delta_sql
    state = root / "state"
    delta_sql.create_table_if_missing(spark, state, StructType.fromDDL(
        "customer_id string, payment_count bigint, total_amount decimal(28,2), last_paid_at timestamp"),
        properties={"delta.enableChangeDataFeed": "true"})
    timings = {}
    rows = spark.read.schema(PAYMENT_SCHEMA).json(str(path))
    for step, table in (("append_s", "bronze"), ("second_append_s", "quarantine")):
        started = time.monotonic()
        rows.write.format("delta").mode("append").save(str(root / table))
        timings[step] = time.monotonic() - started
    by_key = rows.where(F.col("customer_id").isNotNull()).groupBy("customer_id").agg(
        F.count("*").alias("payment_count"), F.sum("amount").cast("decimal(28,2)").alias("total_amount"),
        F.max("paid_at").alias("last_paid_at"))
    started = time.monotonic()
    delta_sql.merge(spark, state, by_key, on="t.`customer_id` = s.`customer_id`", clauses=(
        "WHEN MATCHED THEN UPDATE SET t.payment_count = t.payment_count + s.payment_count, "
        "t.total_amount = t.total_amount + s.total_amount, "
        "t.last_paid_at = greatest(t.last_paid_at, s.last_paid_at) WHEN NOT MATCHED THEN INSERT *"))
    timings["merge_s"] = time.monotonic() - started
    return {**timings, "floor_s": sum(timings.values())}


def floor_batch(args) -> dict:
    """The floor of a process micro-batch: a new Python process and driver JVM (compiled as `statetables run`'s,
    C1 only) that commits one landing file (`--landing`) as `_plain_delta_spark` does, into `--out`."""
    from pipelines.runtime.spark import SparkSettings, build_spark_session
    spark = build_spark_session(SparkSettings(one_command=True))
    return {"work_s": _plain_delta_spark(spark, Path(args.out), Path(args.landing))["floor_s"]}


def _merge_by_customer(spark, rows, state: Path) -> None:
    """MERGE payment rows, aggregated by customer, into `state` (a copy of payments_per_customer), as the run's fold
    does: counts and sums added, first and last payment widened, `updated_at` set."""
    from pyspark.sql import functions as F
    from pipelines.storage import delta_sql
    by_key = rows.groupBy("customer_id").agg(
        F.count("*").alias("payment_count"), F.sum("amount").cast("decimal(28,2)").alias("total_amount"),
        F.min("paid_at").alias("first_paid_at"), F.max("paid_at").alias("last_paid_at"))
    delta_sql.merge(spark, state, by_key, on="t.`customer_id` = s.`customer_id`", clauses=(
        "WHEN MATCHED THEN UPDATE SET t.payment_count = t.payment_count + s.payment_count, "
        "t.total_amount = t.total_amount + s.total_amount, t.first_paid_at = least(t.first_paid_at, s.first_paid_at), "
        "t.last_paid_at = greatest(t.last_paid_at, s.last_paid_at), t.updated_at = current_timestamp() "
        "WHEN NOT MATCHED THEN INSERT (customer_id, payment_count, total_amount, first_paid_at, last_paid_at, "
        "updated_at) VALUES (s.customer_id, s.payment_count, s.total_amount, s.first_paid_at, s.last_paid_at, "
        "current_timestamp())"))


def _append_and_merge(spark, landing: Path, out: Path) -> dict:
    """The two commits exactly-once cannot do without for an increment, and nothing else: the increment's rows
    (`landing`) appended to a Delta table, as bronze, and MERGEd by customer into `out`/state (a copy of the history's
    payments_per_customer, change feed on). No validation, dedup, event time, changelog or checks. Each step's
    seconds."""
    from pyspark.sql import functions as F
    started = time.monotonic()
    rows = spark.read.schema(PAYMENT_SCHEMA).json(_landing_files(landing))
    rows.write.format("delta").mode("append").save(str(out / "bronze"))
    appended_s = time.monotonic() - started
    # The state table's NOT NULL columns: a malformed line would break the MERGE (the run quarantines it).
    complete = F.col("customer_id").isNotNull() & F.col("amount").isNotNull() & F.col("paid_at").isNotNull()
    _merge_by_customer(spark, rows.where(complete), out / "state")
    work_s = time.monotonic() - started
    return {"work_s": work_s, "append_s": appended_s, "merge_s": work_s - appended_s}


def _bad_payment_line():
    """The floors' quarantine rule: a line Spark's JSON reader cannot read, or without a required value or a positive
    amount (no contract-exact validation)."""
    from pyspark.sql import functions as F
    return (F.col("_corrupt_record").isNotNull() | F.col("payment_id").isNull() | F.col("customer_id").isNull()
            | F.col("paid_at").isNull() | F.col("amount").isNull() | (F.col("amount") <= 0))


def _quarantine_rows(bad_lines):
    """Quarantine rows of the bad lines: the raw line (as read, or as its parsed fields) and a reason."""
    from pyspark.sql import functions as F
    return bad_lines.select(F.coalesce("_corrupt_record", F.to_json(F.struct("payment_id", "customer_id", "amount",
                                                                             "paid_at"))).alias("raw_line"),
                            F.lit("invalid").alias("reason"))


def floor_bulk(args) -> dict:
    """The stack's floor of a bulk run: a new Python process and driver JVM (compiled as a large `statetables run`'s)
    that writes every table such a run of payments writes, with plain delta-spark and the least work for each: the
    ledger of the landing files; quarantine (lines Spark's JSON reader cannot read, or without a required value or a
    positive amount); bronze (the rest, one row per payment id); the state table by customer (change feed on) and
    its changelog (that table's change feed); the session table, its sessions cut by window functions with the
    declared LAG and day total, its closed sessions and, as its operator state, its open ones; an empty late_events. No
    contract-exact validation, horizon dedup, idempotent bookkeeping, checks or Dagster: what every table costs the
    stack, and no more. Each step's seconds."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F
    from pyspark.sql.types import StructType
    from pipelines.runtime.spark import SparkSettings, build_spark_session
    from pipelines.storage import delta_sql
    out, files = Path(args.out), _landing_files(Path(args.landing))
    # Compiled as a large run's JVM: 33-37 s against 40 s with the JVM's defaults (single runs, the same hour).
    spark = build_spark_session(SparkSettings(one_command=True, large_run=True))
    timings, started = {}, time.monotonic()

    def step(name: str) -> None:
        timings[f"{name}_s"] = round(time.monotonic() - started - sum(timings.values()), 3)

    spark.createDataFrame([(f, os.path.getsize(f)) for f in files], "path string, size bigint") \
        .write.format("delta").save(str(out / "ledger"))
    step("ledger")
    # Parsed twice, for quarantine then bronze: parsed once and kept (a local checkpoint), the case took the same
    # (36.4 s either way, single runs).
    lines = spark.read.schema(PAYMENT_SCHEMA + ", _corrupt_record string").json(files)
    bad = _bad_payment_line()
    _quarantine_rows(lines.where(bad)).write.format("delta").save(str(out / "quarantine"))
    step("quarantine")
    lines.where(~bad).drop("_corrupt_record").dropDuplicates(["payment_id"]) \
        .write.format("delta").save(str(out / "bronze"))
    step("bronze")
    bronze = spark.read.format("delta").load(str(out / "bronze"))
    delta_sql.create_table_if_missing(spark, out / "state", StructType.fromDDL(
        "customer_id string, payment_count bigint, total_amount decimal(28,2), first_paid_at timestamp, "
        "last_paid_at timestamp"), properties={"delta.enableChangeDataFeed": "true"})
    bronze.groupBy("customer_id").agg(
        F.count("amount").alias("payment_count"), F.sum("amount").cast("decimal(28,2)").alias("total_amount"),
        F.min("paid_at").alias("first_paid_at"), F.max("paid_at").alias("last_paid_at")) \
        .write.format("delta").mode("append").save(str(out / "state"))
    step("state")
    spark.read.format("delta").option("readChangeFeed", "true").option("startingVersion", 1).load(str(out / "state")) \
        .write.format("delta").save(str(out / "changelog"))
    step("changelog")
    # Sessions as gaps and islands, as the run cuts them: an event 30 minutes or more after its customer's previous
    # one starts a session. Spark's session_window also merges events exactly the gap apart (against the contract),
    # and was no cheaper: 12.4 s for this step against 11.5 s.
    at, gap_us = F.unix_micros("paid_at"), SESSION_GAP_US
    in_order = Window.partitionBy("customer_id").orderBy("paid_at")
    starts = F.coalesce((at - F.lag(at).over(in_order) >= gap_us).cast("int"), F.lit(1))
    sessions = (bronze.withColumn("_session", F.sum(starts).over(in_order))
                .groupBy("customer_id", "_session").agg(
                    F.min("paid_at").alias("session_start"), F.max("paid_at").alias("session_end"),
                    F.count("*").alias("payment_count"), F.sum("amount").alias("total_amount"),
                    F.slice(F.sort_array(F.collect_list(F.struct("paid_at", "payment_id")), asc=False), 1, 5)
                    .payment_id.alias("last_payment_ids")))
    by_key = Window.partitionBy("customer_id").orderBy("session_start")
    same_day = Window.partitionBy("customer_id", F.to_date("session_end")).orderBy("session_start")
    watermark = bronze.agg(F.max("paid_at")).first()[0]
    closes = F.unix_micros("session_end") + gap_us <= F.unix_micros(F.lit(watermark)) - WATERMARK_DELAY_US
    rows = sessions.select("*", F.lag("session_end").over(by_key).alias("previous_session_end"),
                           F.sum("total_amount").over(same_day).alias("day_amount"), closes.alias("closed")) \
        .localCheckpoint()
    rows.where("closed").drop("_session", "closed").write.format("delta").save(str(out / "customer_activity"))
    rows.where("NOT closed").drop("closed").write.format("delta").save(str(out / "customer_activity_state"))
    spark.createDataFrame([], "payment_id string, reason string").write.format("delta").save(str(out / "late_events"))
    step("sessions")
    return {"work_s": time.monotonic() - started, **timings}


def floor_increment(args) -> dict:
    """The floor of `statetables run` of an increment on a history: a new Python process and driver JVM (compiled as
    the run's, C1 only) that makes the increment's two commits (`_append_and_merge`) into `--out` (the harness copies
    the history's state table to `--out`/state)."""
    from pipelines.runtime.spark import SparkSettings, build_spark_session
    spark = build_spark_session(SparkSettings(one_command=True))
    return _append_and_merge(spark, Path(args.landing), Path(args.out))


def floor_increment_warm(args) -> dict:
    """The floor of a warm increment run: one engine process (the engine's JVM settings, as `warm` runs in) makes an
    increment's two commits (`_append_and_merge`) WARM_UP_ROUNDS times, then `--repeat` times timed, each round on a
    new copy of the history's state table (`--home`'s tables/payments_per_customer, copied untimed into `--out`), the
    increments of `--increment` in turn."""
    import shutil
    from pipelines.runtime.spark import build_spark_session
    spark = build_spark_session()
    state, out = Path(args.home) / "tables" / "payments_per_customer", Path(args.out)
    rounds = []
    for round_ in range(WARM_UP_ROUNDS + args.repeat):
        copy = out / f"round-{round_}"
        shutil.copytree(state, copy / "state")
        rounds.append(_append_and_merge(spark, Path(args.increment[round_ % len(args.increment)]), copy))
    return {"work_s": sum(r["work_s"] for r in rounds[WARM_UP_ROUNDS:]), "runs": rounds[WARM_UP_ROUNDS:],
            "warm_up": rounds[:WARM_UP_ROUNDS]}


WARM_UP_ROUNDS = 2


def _every_table_increment(spark, landing: Path, out: Path, watermark_us: int, history_bronze: Path) -> dict:
    """What a warm increment of payments writes to every table, by plain delta-spark with the least work for each,
    into `out` (which holds copies of the state table, `state`, and of the session table's operator state,
    `session_state`): the ledger of its files; the contract's dedup against history (each event against the events of
    its id within the horizon in `history_bronze`, by a join of the batch with bronze's events in the batch's range);
    quarantine (lines Spark's JSON reader cannot read, or without a required value or a positive amount, and the
    conflicting re-uses of an id); bronze (the rest, one row per payment id in the batch); the state table's
    MERGE by customer (change feed on) and its changelog (that commit's change feed); the session table: events at
    or behind the watermark (`watermark_us`) to late_events, the others cut into sessions with the open ones by window
    functions (an event 30 minutes or more after its customer's latest one starts one), the sessions the new watermark
    closes, with their LAG and day total carried on from the key's stored row, to the table, and the open ones and the
    keys' carried rows to its state (overwritten). The lines are parsed once and kept. No contract-exact validation,
    arrival order among an id's lines, idempotent bookkeeping, TTL, checks or Dagster. Each step's seconds."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F
    files = _landing_files(landing)
    timings, started = {}, time.monotonic()

    def step(name: str) -> None:
        timings[f"{name}_s"] = round(time.monotonic() - started - sum(timings.values()), 3)

    spark.createDataFrame([(f, os.path.getsize(f)) for f in files], "path string, size bigint") \
        .write.format("delta").mode("append").save(str(out / "ledger"))
    step("ledger")
    lines = spark.read.schema(PAYMENT_SCHEMA + ", _corrupt_record string").json(files).localCheckpoint()
    bad = _bad_payment_line()
    step("parse")
    # The contract's dedup against history: each event against bronze's events of its id within the horizon of its
    # own event time (bronze's files skipped by their event-time statistics, the bounds literals). None there: new;
    # the same content: a duplicate, dropped; other content: quarantined.
    at = F.unix_micros("paid_at")
    batch = lines.where(~bad).drop("_corrupt_record").dropDuplicates(["payment_id"])
    lo, hi = batch.agg(F.min(at), F.max(at)).first()
    content = F.xxhash64("customer_id", "amount", "paid_at")
    prior = (spark.read.format("delta").load(str(history_bronze))
             .where(F.col("paid_at").between(F.timestamp_micros(F.lit((lo or 0) - DEDUP_HORIZON_US)),
                                             F.timestamp_micros(F.lit((hi or 0) + DEDUP_HORIZON_US))))
             .select(F.col("payment_id").alias("_prior_id"), at.alias("_prior_at"), content.alias("_prior_content")))
    looked_up = batch.join(prior, (F.col("payment_id") == F.col("_prior_id"))
                           & (F.abs(at - F.col("_prior_at")) <= DEDUP_HORIZON_US), "left").localCheckpoint()
    conflicts = looked_up.where(F.col("_prior_id").isNotNull() & (F.col("_prior_content") != content))
    step("dedup")
    conflicting = _quarantine_rows(conflicts.withColumn("_corrupt_record", F.lit(None)))
    _quarantine_rows(lines.where(bad)).unionByName(conflicting) \
        .write.format("delta").mode("append").save(str(out / "quarantine"))
    step("quarantine")
    events = looked_up.where(F.col("_prior_id").isNull()).drop("_prior_id", "_prior_at", "_prior_content")
    events.write.format("delta").mode("append").save(str(out / "bronze"))
    step("bronze")
    _merge_by_customer(spark, events, out / "state")
    step("state_merge")
    version = spark.sql(f"DESCRIBE HISTORY delta.`{out / 'state'}` LIMIT 1").first()["version"]
    spark.read.format("delta").option("readChangeFeed", "true").option("startingVersion", version) \
        .load(str(out / "state")).write.format("delta").mode("append").save(str(out / "changelog"))
    step("changelog")
    gap_us, delay_us = SESSION_GAP_US, WATERMARK_DELAY_US
    late = at <= watermark_us
    events.where(late).select("payment_id", "paid_at", F.lit("behind the watermark").alias("reason")) \
        .write.format("delta").mode("append").save(str(out / "late_events"))
    step("late_events")
    # The operator state's rows: open sessions (their partial aggregates) and, per key, its newest closed session's
    # end and day total (what the next session's LAG and day total start from), as the run keeps them.
    state = spark.read.format("delta").load(str(out / "session_state"))
    by = F.struct(F.col("paid_at").alias("by"), F.col("payment_id").alias("value"))
    pieces = events.where(~late).select(
        "customer_id", F.col("paid_at").alias("_first"), F.col("paid_at").alias("_last"),
        F.lit(1).cast("bigint").alias("payment_count"), F.col("amount").cast("decimal(28,2)").alias("total_amount"),
        F.array(by).alias("_by_last_payment_ids")).unionByName(
        state.where("_open").select("customer_id", "_first", "_last", "payment_count", "total_amount",
                                    "_by_last_payment_ids"))
    in_order = Window.partitionBy("customer_id").orderBy("_first", "_last")
    latest_end = F.max(F.unix_micros("_last")).over(in_order.rowsBetween(Window.unboundedPreceding, -1))
    starts = F.when(latest_end.isNull() | (F.unix_micros("_first") - latest_end >= gap_us), 1).otherwise(0)
    sessions = (pieces.withColumn("_session", F.sum(starts).over(in_order.rowsBetween(Window.unboundedPreceding, 0)))
                .groupBy("customer_id", "_session").agg(
                    F.min("_first").alias("_first"), F.max("_last").alias("_last"),
                    F.sum("payment_count").alias("payment_count"), F.sum("total_amount").alias("total_amount"),
                    F.slice(F.sort_array(F.flatten(F.collect_list("_by_last_payment_ids")), asc=False), 1, 5)
                    .alias("_by_last_payment_ids")))
    newest_us = events.agg(F.max(at)).first()[0]
    watermark_after = max(watermark_us, (newest_us or 0) - delay_us)
    closes = F.unix_micros("_last") + gap_us <= watermark_after
    stored = state.where(~F.col("_open")).select(
        "customer_id", F.lit(None).cast("timestamp").alias("_first"), "_last", F.lit(True).alias("_stored"),
        "_carried_previous_session_end", "_carried_day_amount")
    # The key's stored row first (its _first is NULL), then its sessions by start: the closed ones are the oldest.
    rows = sessions.select("*", closes.alias("_closes"), F.lit(False).alias("_stored")).unionByName(
        stored, allowMissingColumns=True)
    by_start = Window.partitionBy("customer_id").orderBy(F.col("_first").asc_nulls_first())
    same_day = Window.partitionBy("customer_id", F.to_date("_last")).orderBy(F.col("_first").asc_nulls_first()) \
        .rowsBetween(Window.unboundedPreceding, 0)
    carrier = F.col("_stored") | F.col("_closes")
    valued = rows.select(
        "*", F.when(F.lag("_stored").over(by_start), F.lag("_carried_previous_session_end").over(by_start))
        .otherwise(F.lag("_last").over(by_start)).alias("previous_session_end"),
        F.sum(F.when(F.col("_stored"), F.col("_carried_day_amount")).otherwise(F.col("total_amount")))
        .over(same_day).alias("day_amount"),
        (carrier & ~F.coalesce(F.lead(carrier).over(by_start), F.lit(False))).alias("_carries")).localCheckpoint()
    valued.where(~F.col("_stored") & F.col("_closes")).select(
        "customer_id", F.col("_first").alias("session_start"), F.col("_last").alias("session_end"), "payment_count",
        "total_amount", F.col("_by_last_payment_ids.value").alias("last_payment_ids"), "previous_session_end",
        "day_amount").write.format("delta").mode("append").save(str(out / "customer_activity"))
    step("sessions_closed")
    open_rows = valued.where(~F.col("_stored") & ~F.col("_closes")).select(
        "customer_id", F.lit(True).alias("_open"), "_first", "_last", F.col("_first").alias("session_start"),
        F.col("_last").alias("session_end"), "payment_count", "total_amount",
        "_by_last_payment_ids", F.lit(None).cast("timestamp").alias("_carried_previous_session_end"),
        F.lit(None).cast("decimal(28,2)").alias("_carried_day_amount"))
    carried = valued.where("_carries").select(
        "customer_id", F.lit(False).alias("_open"), F.lit(None).cast("timestamp").alias("_first"), "_last",
        F.lit(None).cast("timestamp").alias("session_start"), F.lit(None).cast("timestamp").alias("session_end"),
        F.lit(None).cast("bigint").alias("payment_count"), F.lit(None).cast("decimal(28,2)").alias("total_amount"),
        F.lit(None).cast(state.schema["_by_last_payment_ids"].dataType).alias("_by_last_payment_ids"),
        F.when(F.col("_stored"), F.col("_carried_previous_session_end")).otherwise(F.col("_last"))
        .alias("_carried_previous_session_end"),
        F.when(F.col("_stored"), F.col("_carried_day_amount")).otherwise(F.col("day_amount"))
        .alias("_carried_day_amount"))
    open_rows.unionByName(carried).select(*(F.col(f.name).cast(f.dataType) for f in state.schema)) \
        .write.format("delta").mode("overwrite").save(str(out / "session_state"))
    step("session_state")
    return {"work_s": time.monotonic() - started, **timings}


def floor_increment_warm_every_table(args) -> dict:
    """The floor of a warm increment run's every table: one engine process (the engine's JVM settings, as `warm` runs
    in) writes what an increment writes to every table (`_every_table_increment`) WARM_UP_ROUNDS times, then
    `--repeat` times timed, each round on new copies of the history's state table and session state (`--home`'s,
    copied untimed into `--out`), the increments of `--increment` in turn."""
    import shutil
    from pyspark.sql import functions as F
    from pipelines.runtime.spark import build_spark_session
    spark = build_spark_session()
    tables, out = Path(args.home) / "tables", Path(args.out)
    # The watermark the runs start from: the history's newest payment less the stream's delay.
    newest_us = spark.read.format("delta").load(str(tables / "payments_bronze")).agg(
        F.max(F.unix_micros("paid_at"))).first()[0]
    rounds = []
    for round_ in range(WARM_UP_ROUNDS + args.repeat):
        copy = out / f"round-{round_}"
        shutil.copytree(tables / "payments_per_customer", copy / "state")
        shutil.copytree(tables / "customer_activity_state", copy / "session_state")
        cpu_before = cpu_s()
        timed = _every_table_increment(spark, Path(args.increment[round_ % len(args.increment)]), copy,
                                       newest_us - WATERMARK_DELAY_US, tables / "payments_bronze")
        cpu_after = cpu_s()
        rounds.append({**timed, "cpu_s": {k: round(cpu_after[k] - cpu_before[k], 2) for k in cpu_after}})
    return {"work_s": sum(r["work_s"] for r in rounds[WARM_UP_ROUNDS:]), "runs": rounds[WARM_UP_ROUNDS:],
            "warm_up": rounds[:WARM_UP_ROUNDS]}


def batch(args) -> dict:
    """`--repeat` rounds, after two of warm-up: the floor, then one micro-batch of each kind on its own storage root
    (a new landing file of `--events` payments each, so every batch adds to a stream that already has tables); the
    median of each figure. Spark jobs are read from the process's event log (benchmarks/run.py turns it on)."""
    import logging
    import shutil
    import statistics
    from dataclasses import replace
    from datetime import datetime, timedelta, timezone
    from pipelines.declare.project import stream_spec
    from pipelines.ingest.generate import generate
    from pipelines.runtime.micro_batch import StreamSettings, advance_stream
    from pipelines.storage.layout import StorageLayout
    from benchmarks.run import delta_commits, spark_jobs

    spark, spec, home = _session(), stream_spec("payments"), Path(args.home)
    events_log = home / "event-log"
    figures: list[dict] = []

    class Figures(logging.Handler):
        def emit(self, record):
            figures.append(getattr(record, "figures", {}))

    logging.getLogger("statetables.progress").addHandler(Figures())
    start = datetime.now(timezone.utc) - timedelta(days=2)

    def new_file(round_: int) -> Path:
        """`--events` payments of 100 customers over some minutes, each round later than the last (sessions close)."""
        folder = home / "generated" / str(round_)
        generate(spec, folder, events=args.events, seed=round_, customers=100, events_per_file=args.events,
                 start=start + timedelta(hours=round_), max_step_s=2)
        return next(folder.glob("*.jsonl"))

    floor_root = home / "floor"
    plain_delta_spark = partial(_plain_delta_spark, spark, floor_root)

    kinds = {"without_event_time": False, "with_sessions": True}
    roots = {kind: StorageLayout.under(home / kind) for kind in kinds}

    def micro_batch(kind: str, path: Path) -> dict:
        layout = roots[kind]
        layout.landing(spec.name).mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, layout.landing(spec.name) / f"{path.parent.name}-{path.name}")
        commits, jobs = sum(delta_commits(layout.home).values()), spark_jobs(events_log)
        figures.clear()
        started = time.monotonic()
        result = advance_stream(spark, layout, spec, replace(StreamSettings(), event_time=kinds[kind]))
        run_s = time.monotonic() - started
        assert result.micro_batches == 1 and len(figures) == 1, (result.micro_batches, figures)
        steps = {k: v for k, v in figures[0].items() if k.endswith("_s")}
        return {"run_s": run_s, "batch_s": steps.pop("elapsed_s"), **steps,
                "spark_jobs": spark_jobs(events_log) - jobs,
                "delta_commits": sum(delta_commits(layout.home).values()) - commits}

    warmup, rounds = 2, []
    for round_ in range(warmup + args.repeat):
        path = new_file(round_)
        measured = {"floor": plain_delta_spark(path), **{kind: micro_batch(kind, path) for kind in kinds}}
        print(f"round {round_}{' (warm-up)' if round_ < warmup else ''}: " + ", ".join(
            f"{k} {v.get('batch_s', v.get('floor_s')):.2f} s" for k, v in measured.items()), flush=True)
        if round_ >= warmup:
            rounds.append(measured)
    medians = {part: {key: round(statistics.median(r[part][key] for r in rounds), 3)
                      for key in sorted(set().union(*(r[part] for r in rounds)))} for part in rounds[0]}
    return {"work_s": sum(medians[kind]["run_s"] for kind in kinds), "events": args.events, "rounds": rounds,
            "medians": medians}


def paths(args) -> dict:
    """(g) The event-time steps against the all-time step, on the same bronze, in one process: run each stream
    without its windowed and session tables, then time, each over all of bronze in one go, a fresh state table's
    MERGE and each windowed or session table's step, with its operator state's size."""
    import shutil
    from dataclasses import replace
    from pipelines.event_time.watermark import state_table_figures
    from pipelines.storage.layout import StorageLayout
    from pipelines.event_time.sessions import sessions_stage
    from pipelines.state.tables import StateTableStage, ensure_state_table
    from pipelines.runtime.micro_batch import StreamSettings, advance_stream
    from pipelines.storage.delta_log import BronzeRows, table_version
    from pipelines.declare.project import streams
    from pipelines.event_time.windows import windows_stage
    spark = _session()
    layout = StorageLayout.under(args.home)
    out = {}
    for name, spec in streams().items():
        if not layout.landing(name).is_dir() or not spec.event_time_tables:
            continue
        started = time.monotonic()
        advance_stream(spark, layout, spec, replace(StreamSettings(), event_time=False))
        ingest_s = time.monotonic() - started
        bronze_path = layout.table(spec.bronze_table)
        bronze = BronzeRows(spark, bronze_path, table_version(spark, bronze_path), None)
        rows = spark.read.format("delta").load(str(bronze_path)).count()
        table = spec.state_tables[0]
        shutil.rmtree(layout.table(table.name))
        ensure_state_table(spark, layout, table)
        started = time.monotonic()
        StateTableStage(layout, spec, table, 0).advance(spark, bronze, "bench/all-time", 0)
        all_time_s = time.monotonic() - started
        steps = {}
        for declared in spec.event_time_tables:
            stage = (windows_stage if declared.kind == "window" else sessions_stage)(spark, layout, spec, declared)
            started = time.monotonic()
            stage.advance(spark, bronze, "bench/event-time", 0)
            steps[declared.name] = {"seconds": round(time.monotonic() - started, 2),
                                    **state_table_figures(spark, layout.table(declared.state_table))}
        event_time_s = sum(step["seconds"] for step in steps.values())
        out[name] = {"bronze_rows": rows, "ingest_s": round(ingest_s, 2), "all_time_s": round(all_time_s, 2),
                     "event_time_s": round(event_time_s, 2), "event_time_micro_batches": 1,
                     "all_time_events_per_s": round(rows / all_time_s), "event_time_events_per_s": round(rows / event_time_s),
                     "operator_state_rows": sum(step["rows"] for step in steps.values()),
                     "operator_state_bytes": sum(step["bytes"] for step in steps.values()), "event_time_tables": steps}
    return {"work_s": sum(v["all_time_s"] + v["event_time_s"] for v in out.values()), **out}


def validation(args) -> dict:
    """The line validator alone: the landing files' lines, held in memory, judged by the JVM validator and by the
    SQL one it replaced (tests/reference_validator.py), in turn, twice each; the second time of each counts."""
    from datetime import datetime, timezone
    from pyspark.sql import functions as F
    from pipelines.declare.project import stream_spec
    from pipelines.ingest.validate import validate_lines
    from tests.reference_validator import validate_lines as sql_validate_lines
    spark = _session()
    lines = (spark.read.text(_landing_files(Path(args.landing)))
             .select(F.lit("f").alias("source_file"), F.current_timestamp().alias("file_modified_at"),
                     F.monotonically_increasing_id().alias("line_number"), F.col("value").cast("binary").alias("raw_bytes"))
             .repartition(2).cache())
    count = lines.count()
    now, times = datetime.now(timezone.utc), {}
    for name, validate in [("jvm", validate_lines), ("sql", sql_validate_lines)] * 2:
        started = time.monotonic()
        validate(lines, stream_spec("payments"), ingested_at=now).write.format("noop").mode("overwrite").save()
        times[name] = time.monotonic() - started
    return {"work_s": times["jvm"], "lines": count, "jvm_s": times["jvm"], "sql_s": times["sql"],
            "jvm_us_per_line": 1e6 * times["jvm"] / count, "sql_us_per_line": 1e6 * times["sql"] / count}


CASES = {"validation": validation, "paths": paths, "minimal": minimal, "floor": floor, "recompute": recompute, "stateful": stateful, "polars": polars_merge,
         "warm": warm, "batch": batch, "floor_batch": floor_batch,
         "floor_increment": floor_increment, "floor_bulk": floor_bulk,
         "floor_increment_warm": floor_increment_warm,
         "floor_increment_warm_every_table": floor_increment_warm_every_table}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("case", choices=sorted(CASES))
    parser.add_argument("--home")
    parser.add_argument("--landing")
    parser.add_argument("--out")
    parser.add_argument("--increment", action="append", default=[])
    parser.add_argument("--events", type=int, default=300)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    if args.home:
        os.environ["STATETABLES_HOME"] = args.home
    result = CASES[args.case](args)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
