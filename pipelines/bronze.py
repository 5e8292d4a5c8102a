"""Landing files → bronze (accepted events, once each) and quarantine (everything else, with a reason).

Every input line ends in exactly one of: the bronze table, the quarantine table, or the count of
recognised duplicates recorded on the bronze commit (`userMetadata`). Both appends of a micro-batch
carry Delta transaction identifiers, so a batch replayed after a crash writes nothing twice; a line
read again under a new checkpoint is recognised by its file and line number.
"""

from __future__ import annotations

import json
import time
from datetime import datetime, timedelta
from functools import partial

from pyspark.sql import DataFrame, SparkSession, Window
from pyspark.sql import functions as F
from pyspark.sql.types import (
    BinaryType, DecimalType, LongType, StringType, StructField, StructType, TimestampType,
)

from pipelines.layout import StorageLayout
from pipelines.source import arrival_order, read_landing_files, split_lines
from pipelines.checkpoints import checkpoint_for_run, start_checkpoint
from pipelines.faults import INGEST_AFTER_BRONZE_COMMIT, INGEST_AFTER_QUARANTINE_COMMIT, INGEST_BATCH_END, fault_point
from pipelines.streaming import (
    StreamRunResult, TableVersions, commits_since, create_table_if_missing, require_writable, retry_on_conflict, run_available_now,
    storage_errors, table_version, writer_lock,
)
from pipelines.streams import StreamSpec
from pipelines.validate import validate_lines

DEFAULT_DEDUP_HORIZON = timedelta(days=7)
DEFAULT_MAX_FILES_PER_TRIGGER = 100
_SPARK_TYPES = {"string": StringType(), "decimal": DecimalType(18, 2), "timestamp": TimestampType()}

QUARANTINE_SCHEMA = StructType([
    StructField("raw_line", StringType()),  # the line as text (invalid UTF-8 bytes replaced)
    StructField("raw_bytes", BinaryType()),  # the line exactly as received
    StructField("source_file", StringType()),
    StructField("line_number", LongType()),
    StructField("reason", StringType()),
    StructField("reason_field", StringType()),
    StructField("detail", StringType()),
    StructField("record_id", StringType()),
    StructField("ingest_batch_id", LongType()),
    StructField("ingested_at", TimestampType()),
])


def bronze_schema(spec: StreamSpec) -> StructType:
    return StructType(
        [StructField(rule.name, _SPARK_TYPES[rule.kind], nullable=not rule.required) for rule in spec.fields]
        + [
            StructField("content_hash", StringType()),
            StructField("source_file", StringType()),
            StructField("line_number", LongType()),
            StructField("ingest_batch_id", LongType()),
            StructField("ingested_at", TimestampType()),
        ]
    )


def ensure_bronze_tables(spark: SparkSession, layout: StorageLayout, spec: StreamSpec) -> None:
    for name, schema in ((spec.bronze_table, bronze_schema(spec)), (spec.quarantine_table, QUARANTINE_SCHEMA)):
        create_table_if_missing(spark, layout.table(name), schema)


def _already_ingested(bronze: DataFrame, quarantine: DataFrame, spec: StreamSpec, files: list[str],
                      lo: datetime, hi: datetime) -> DataFrame:
    """(source_file, line_number) of the batch's lines that an earlier attempt already wrote.

    A line is identified by its file and line number (files are never modified). After a crash
    the same batch replays under the same app id and Delta skips its writes anyway; after a lost
    checkpoint the files are read again under a new app id, and this is what keeps every line in
    at most one table. Bronze is searched within the batch's event times (where its own lines
    are), quarantine by the batch's files.
    """
    ts_col = spec.event_time_field
    lines = ["source_file", "line_number"]
    in_bronze = (bronze.where(F.col(ts_col).between(F.lit(lo), F.lit(hi)))
                 .where(F.col("source_file").isin(files)).select(*lines))
    in_quarantine = quarantine.where(F.col("source_file").isin(files)).select(*lines)
    return in_bronze.unionByName(in_quarantine).distinct()


def _classify_duplicates(accepted: DataFrame, bronze: DataFrame, spec: StreamSpec, lo: datetime, hi: datetime,
                         horizon: timedelta) -> tuple[DataFrame, DataFrame, DataFrame]:
    """Split valid lines not yet ingested into (new events, recognised duplicates, conflicting duplicates).

    An id already in bronze keeps the content it was accepted with; otherwise the first arrival
    in the batch wins. Bronze is searched among events whose event time lies within `horizon` of
    the batch's event times.
    """
    id_col, ts_col = spec.id_field, spec.event_time_field
    by_arrival = Window.partitionBy(id_col).orderBy(*arrival_order())
    ranked = accepted.withColumns({
        "_rank": F.row_number().over(by_arrival),
        "_first_hash": F.first("content_hash").over(by_arrival),
    })
    prior = (
        bronze.where(F.col(ts_col).between(F.lit(lo - horizon), F.lit(hi + horizon)))
        .groupBy(F.col(id_col).alias("_prior_id"))
        .agg(F.collect_set("content_hash").alias("_prior_hashes"))
    )
    looked_up = ranked.join(prior, ranked[id_col] == prior["_prior_id"], "left")
    seen = F.col("_prior_id").isNotNull()
    known_content = F.when(seen, F.array_contains("_prior_hashes", F.col("content_hash"))).otherwise(
        F.col("content_hash") == F.col("_first_hash"))
    is_new = ~seen & (F.col("_rank") == 1)
    columns = accepted.columns
    return (
        looked_up.where(is_new).select(*columns),
        looked_up.where(~is_new & known_content).select(*columns),
        looked_up.where(~is_new & ~known_content).select(*columns),
    )


OUTCOMES = ("accepted", "quarantined", "duplicates", "already_ingested")


def ingest_batch(files: DataFrame, batch_id: int, *, spec: StreamSpec, bronze_path: str, quarantine_path: str,
                 app_id: str, horizon: timedelta) -> None:
    """foreachBatch body: validate, dedup, append to quarantine then bronze, both idempotently.

    Both appends happen even when empty: each commit records `{"app_id", "batch_id"}` in its
    userMetadata, which is how the next run checks the checkpoint against the tables.
    """
    spark = files.sparkSession
    stamped = validate_lines(split_lines(files), spec).withColumns(
        {"ingest_batch_id": F.lit(batch_id).cast("bigint"), "ingested_at": F.current_timestamp()}
    ).persist()
    classified = None
    try:
        bronze = spark.read.format("delta").load(bronze_path)
        quarantine = spark.read.format("delta").load(quarantine_path)
        ts_col = spec.event_time_field
        # One pass over the cached batch for everything later steps need to know about it.
        facts = stamped.agg(F.min(ts_col).alias("lo"), F.max(ts_col).alias("hi"), F.count("*").alias("lines"),
                            F.collect_set("source_file").alias("files")).first()
        lo = facts["lo"] or datetime(1970, 1, 1)
        hi = facts["hi"] or datetime(1970, 1, 1)
        done = _already_ingested(bronze, quarantine, spec, facts["files"], lo, hi).withColumn("_done", F.lit(True))
        marked = stamped.join(done, ["source_file", "line_number"], "left")
        fresh = marked.where(F.col("_done").isNull()).drop("_done")
        new, duplicates, conflicts = _classify_duplicates(
            fresh.where(F.col("reason").isNull()), bronze, spec, lo, hi, horizon)
        conflicts = conflicts.withColumns({
            "reason": F.lit("conflicting_duplicate"),
            "reason_field": F.lit(spec.id_field),
            "detail": F.concat(F.lit(f"{spec.id_field} "), F.col(spec.id_field),
                               F.lit(" was already accepted with different content")),
        })
        # Every line gets exactly one outcome; one cached frame feeds the counts and both writes.
        classified = (
            new.withColumn("outcome", F.lit("accepted"))
            .unionByName(duplicates.withColumn("outcome", F.lit("duplicates")))
            .unionByName(conflicts.withColumn("outcome", F.lit("quarantined")))
            .unionByName(fresh.where(F.col("reason").isNotNull()).withColumn("outcome", F.lit("quarantined")))
            .unionByName(marked.where(F.col("_done")).drop("_done").withColumn("outcome", F.lit("already_ingested")))
        ).persist()
        outcomes = {r["outcome"]: r["count"] for r in classified.groupBy("outcome").count().collect()}
        counts = {"app_id": app_id, "batch_id": batch_id, "files": len(facts["files"]), "lines": facts["lines"],
                  **{k: outcomes.get(k, 0) for k in OUTCOMES}}
        if counts["lines"] != sum(counts[k] for k in OUTCOMES):
            raise AssertionError(f"line accounting broken in batch {batch_id}: {counts}")
        writes = (
            (classified.where(F.col("outcome") == "quarantined").select(*QUARANTINE_SCHEMA.fieldNames()),
             quarantine_path, INGEST_AFTER_QUARANTINE_COMMIT),
            (classified.where(F.col("outcome") == "accepted").select(*bronze_schema(spec).fieldNames()), bronze_path,
             INGEST_AFTER_BRONZE_COMMIT),
        )
        for frame, path, fault in writes:
            retry_on_conflict(
                lambda: frame.write.format("delta").mode("append")
                .option("txnAppId", app_id).option("txnVersion", batch_id)
                .option("userMetadata", json.dumps(counts))
                .save(path),
                f"append of micro-batch {batch_id} to {path}")
            fault_point(fault)
    finally:
        if classified is not None:
            classified.unpersist()
        stamped.unpersist()
    fault_point(INGEST_BATCH_END)


def ingest_stream(spark: SparkSession, layout: StorageLayout, spec: StreamSpec, *,
                  max_files_per_trigger: int = DEFAULT_MAX_FILES_PER_TRIGGER,
                  dedup_horizon: timedelta = DEFAULT_DEDUP_HORIZON,
                  lock_timeout_s: float = 60.0) -> StreamRunResult:
    """Ingest every landing file not yet ingested into the stream's bronze and quarantine tables.

    >>> result = ingest_stream(spark, StorageLayout.under("data"), MOVIE_TICKET_SALES)
    >>> result.commits["bronze"][-1]["user"]["accepted"]
    """
    started = time.monotonic()
    bronze_path, quarantine_path = layout.table(spec.bronze_table), layout.table(spec.quarantine_table)
    checkpoint = layout.checkpoint(spec.ingest_query)
    require_writable([layout.locks, bronze_path / "_delta_log", quarantine_path / "_delta_log",
                      layout.checkpoints_root])
    with writer_lock(layout.locks, spec.ingest_query, lock_timeout_s), storage_errors():
        ensure_bronze_tables(spark, layout, spec)
        before = {"bronze": table_version(spark, bronze_path), "quarantine": table_version(spark, quarantine_path)}
        verdict, moved = checkpoint_for_run(spark, checkpoint, layout.set_aside_checkpoints,
                                            [quarantine_path, bronze_path])
        origin, recovery = verdict.origin, None
        if origin is None:
            reason = verdict.problem or "no checkpoint yet"
            origin = start_checkpoint(checkpoint, spec.ingest_query, reason)
            if verdict.problem or moved:
                recovery = {"problem": reason, "set_aside": str(moved) if moved else None,
                            "action": "new checkpoint: every landing file is read again; lines already in "
                                      "bronze or quarantine are recognised by file and line number and skipped"}
        on_batch = partial(ingest_batch, spec=spec, bronze_path=str(bronze_path), quarantine_path=str(quarantine_path),
                           app_id=origin.app_id, horizon=dedup_horizon)
        batches, rows = run_available_now(
            read_landing_files(spark, layout.landing(spec.name), max_files_per_trigger),
            query_name=spec.ingest_query, checkpoint_dir=checkpoint, on_batch=on_batch)
        return StreamRunResult(
            query_name=spec.ingest_query,
            micro_batches=batches,
            rows_read=rows,
            duration_s=time.monotonic() - started,
            versions={
                "bronze": TableVersions(before["bronze"], table_version(spark, bronze_path)),
                "quarantine": TableVersions(before["quarantine"], table_version(spark, quarantine_path)),
            },
            # The bronze commit's userMetadata carries the batch's line accounting for both tables.
            commits={"bronze": commits_since(spark, bronze_path, before["bronze"])},
            recovery=recovery,
        )
