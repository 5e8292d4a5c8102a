"""Bronze → state tables: each micro-batch pre-aggregated by key and MERGEd, idempotently.

One MERGE routine (`upsert_batch`) serves every state table; the table's shape comes from its
`StateTableSpec`. Delta's txnAppId/txnVersion session confs make MERGE skip a micro-batch that
already committed, which is what happens when a run dies between the MERGE commit and the
checkpoint commit and the batch is replayed.
"""

from __future__ import annotations

import time
from functools import partial

from delta.tables import DeltaTable
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import DecimalType, LongType, StringType, StructField, StructType, TimestampType

from pipelines.layout import StorageLayout
from pipelines.streaming import (
    StreamRunResult, TableVersions, checkpoint_app_id, commits_since, run_available_now, table_version,
    writer_lock,
)
from pipelines.streams import StateTableSpec, StreamSpec

TXN_APP_ID = "spark.databricks.delta.write.txnAppId"
TXN_VERSION = "spark.databricks.delta.write.txnVersion"
TOTAL_TYPE = DecimalType(28, 2)  # what Spark's SUM of DECIMAL(18,2) yields


def state_schema(table: StateTableSpec) -> StructType:
    return StructType([
        StructField(table.key, StringType(), nullable=False),
        StructField(table.count_column, LongType(), nullable=False),
        StructField(table.sum_column, TOTAL_TYPE, nullable=False),
        StructField(table.first_ts_column, TimestampType()),
        StructField(table.last_ts_column, TimestampType()),
        StructField("updated_at", TimestampType()),
    ])


def ensure_state_table(spark: SparkSession, layout: StorageLayout, table: StateTableSpec) -> None:
    (
        DeltaTable.createIfNotExists(spark)
        .location(str(layout.table(table.name)))
        .addColumns(state_schema(table))
        .property("delta.enableChangeDataFeed", "true")
        .execute()
    )


def upsert_batch(events: DataFrame, batch_id: int, *, table_path: str, table: StateTableSpec,
                 value_column: str, event_time_column: str, app_id: str) -> None:
    """foreachBatch body: aggregate the batch's events by key and MERGE them into the state table.

    >>> upsert_batch(bronze_batch, 7, table_path="data/tables/movie_tickets_sold",
    ...              table=MOVIE_TICKET_SALES.state_table, value_column="ticket_total_value",
    ...              event_time_column="sale_ts", app_id="statetables/...")
    """
    spark = events.sparkSession
    if events.isEmpty():  # the Delta source can hand over a batch with no rows; no commit needed
        return
    batch = events.groupBy(table.key).agg(
        F.count(value_column).alias("batch_count"),
        F.sum(value_column).cast(TOTAL_TYPE).alias("batch_sum"),
        F.min(event_time_column).alias("batch_first"),
        F.max(event_time_column).alias("batch_last"),
    )
    # Over Spark Connect foreachBatch shares the client's session, so the confs are unset after use.
    spark.conf.set(TXN_APP_ID, app_id)
    spark.conf.set(TXN_VERSION, str(batch_id))
    try:
        (
            DeltaTable.forPath(spark, table_path).alias("t")
            .merge(batch.alias("s"), F.col(f"t.{table.key}") == F.col(f"s.{table.key}"))
            .whenMatchedUpdate(set={
                table.count_column: F.col(f"t.{table.count_column}") + F.col("s.batch_count"),
                table.sum_column: (F.col(f"t.{table.sum_column}") + F.col("s.batch_sum")).cast(TOTAL_TYPE),
                table.first_ts_column: F.least(F.col(f"t.{table.first_ts_column}"), F.col("s.batch_first")),
                table.last_ts_column: F.greatest(F.col(f"t.{table.last_ts_column}"), F.col("s.batch_last")),
                "updated_at": F.current_timestamp(),
            })
            .whenNotMatchedInsert(values={
                table.key: F.col(f"s.{table.key}"),
                table.count_column: F.col("s.batch_count"),
                table.sum_column: F.col("s.batch_sum"),
                table.first_ts_column: F.col("s.batch_first"),
                table.last_ts_column: F.col("s.batch_last"),
                "updated_at": F.current_timestamp(),
            })
            .execute()
        )
    finally:
        spark.conf.unset(TXN_APP_ID)
        spark.conf.unset(TXN_VERSION)


def update_state_table(spark: SparkSession, layout: StorageLayout, spec: StreamSpec, *,
                       lock_timeout_s: float = 60.0) -> StreamRunResult:
    """Fold every bronze event not yet counted into the stream's state table.

    >>> update_state_table(spark, StorageLayout.under("data"), MOVIE_TICKET_SALES).micro_batches
    """
    started = time.monotonic()
    table = spec.state_table
    table_path = layout.table(table.name)
    with writer_lock(layout.locks, spec.state_query, lock_timeout_s):
        ensure_state_table(spark, layout, table)
        before = table_version(spark, table_path)
        checkpoint = layout.checkpoint(spec.state_query)
        on_batch = partial(upsert_batch, table_path=str(table_path), table=table, value_column=spec.value_field,
                           event_time_column=spec.event_time_field,
                           app_id=checkpoint_app_id(checkpoint, spec.state_query))
        events = spark.readStream.format("delta").load(str(layout.table(spec.bronze_table)))
        batches, rows = run_available_now(events, query_name=spec.state_query, checkpoint_dir=checkpoint,
                                          on_batch=on_batch)
        return StreamRunResult(
            query_name=spec.state_query,
            micro_batches=batches,
            rows_read=rows,
            duration_s=time.monotonic() - started,
            versions={table.name: TableVersions(before, table_version(spark, table_path))},
            commits={table.name: commits_since(spark, table_path, before)},
        )
