"""A Kafka topic → raw lines with partition, offset and key: the lines a landing file gives (pipelines/ingest/landing.py).

A record is a line. Its `source_file` is `kafka:<topic>/<partition>` and its `line_number` its offset, so line
identity, arrival order (partition, then offset) and the replay lookup in bronze and quarantine work as they do for
files; the record's topic, partition, offset, key and timestamp travel with it into quarantine.

Spark's own Kafka source plans the offsets (spark-sql-kafka, `make jars-kafka`) and keeps them in the stream's
checkpoint. Each batch's quarantine and bronze commits also record the next offset of every partition
(`source_offsets`), so a query started without its checkpoint begins where bronze ends: nothing is read twice into
the tables, nothing is skipped. Records the quarantine commit of a batch holds but bronze's does not (a crash
between the two) are looked up before they are written again (`recheck_offsets`).
"""

from __future__ import annotations

import json

import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import BinaryType, IntegerType, LongType, StringType, StructField, StructType, TimestampType

from pipelines.declare.specs import KafkaTopic
from pipelines.errors import ConfigurationError
from pipelines.storage.delta_log import commit_metadata, history_rows

SOURCE_OFFSETS = "source_offsets"  # commit metadata: {"topic": name, "next": {partition: next offset}}
OFFSETS_SEARCHED = 50  # newest commits searched for the offsets (maintenance commits carry none)
# What quarantine keeps of a record besides its value (raw_bytes) and its identity (source_file, line_number).
KAFKA_FIELDS = (
    StructField("kafka_topic", StringType()),
    StructField("kafka_partition", IntegerType()),
    StructField("kafka_offset", LongType()),
    StructField("kafka_key", BinaryType()),
    StructField("kafka_timestamp", TimestampType()),
)
SPARK_KAFKA_CLASS = "org.apache.spark.sql.kafka010.KafkaSourceProvider"
FETCH_MAX_WAIT_MS = 10  # the stream's consumers: how long the broker may hold a fetch at the end of a partition


def source_id(topic: KafkaTopic) -> str:
    """What a stream's checkpoint records as its source: a checkpoint of another source is not trusted."""
    return f"kafka:{topic.topic}"


def client_config(topic: KafkaTopic, **settings) -> dict:
    """A confluent-kafka client's settings for the topic's brokers; librdkafka's informational lines (a client
    closing, purging its queues) are left out of the run's output, its warnings and errors are not."""
    return {"bootstrap.servers": topic.servers, "log_level": 4, **topic.client_options(), **settings}


def admin(topic: KafkaTopic, errors: list | None = None):
    """An admin client of the topic's brokers; the errors librdkafka reports on the side (a refused login is one:
    the failing call itself only says the transport failed) go into `errors` when given."""
    from confluent_kafka.admin import AdminClient
    settings = {"socket.timeout.ms": 10_000, **({"error_cb": errors.append} if errors is not None else {})}
    return AdminClient(client_config(topic, **settings))


def topic_partitions(topic: KafkaTopic, timeout_s: float = 15.0) -> list[int]:
    """The topic's partition numbers; a clear error when the brokers do not answer or the topic does not exist."""
    from confluent_kafka import KafkaError, KafkaException
    errors: list = []
    client = admin(topic, errors)
    try:
        metadata = client.list_topics(topic=topic.topic, timeout=timeout_s)
    except KafkaException as exc:
        client.poll(1)  # serves the error callbacks
        refused = next((e for e in errors if e.code() == KafkaError._AUTHENTICATION), None)
        if refused is not None:
            raise ConfigurationError(f"The Kafka brokers {topic.servers} refused this client's login ({refused.str()}). Fix: "
                                     f"check kafka: options in the project file and the variables its sasl.username "
                                     f"and sasl.password name.") from None
        raise ConfigurationError(f"The Kafka brokers {topic.servers} did not answer ({exc}). Fix: start them (`make "
                                 f"kafka-broker` for development) or correct kafka: bootstrap_servers.") from None
    found = metadata.topics.get(topic.topic)
    if found is None or found.error is not None or not found.partitions:
        raise ConfigurationError(f"Topic {topic.topic} does not exist on {topic.servers}. Fix: create it (`statetables "
                                 f"generate` creates a stream's topic), or name an existing one in the project file.")
    return sorted(found.partitions)


def end_offsets(topic: KafkaTopic, timeout_s: float = 10.0) -> dict[int, int]:
    """partition → the offset the next record will get: what a sensor compares to see that records arrived."""
    from confluent_kafka import Consumer, TopicPartition
    partitions = topic_partitions(topic, timeout_s)
    consumer = Consumer(client_config(topic, **{"group.id": "statetables-ends", "enable.auto.commit": False}))
    try:
        return {p: consumer.get_watermark_offsets(TopicPartition(topic.topic, p), timeout=timeout_s)[1]
                for p in partitions}
    finally:
        consumer.close()


def ensure_topic(topic: KafkaTopic, partitions: int, config: dict[str, str] | None = None) -> bool:
    """Create the topic unless it exists; whether this call created it."""
    from confluent_kafka.admin import NewTopic
    client = admin(topic)
    if topic.topic in client.list_topics(timeout=15).topics:
        return False
    future = client.create_topics([NewTopic(topic.topic, partitions, 1, config=config or {})])[topic.topic]
    try:
        future.result(30)
    except Exception as exc:  # noqa: BLE001 - created meanwhile by another process
        if "TOPIC_ALREADY_EXISTS" not in str(exc):
            raise
        return False
    return True


def recorded_offsets(spark: SparkSession, table_path, topic: KafkaTopic) -> dict[int, int]:
    """The next offset of every partition after the records the table's newest ingest commit covers; {} when no
    commit records any (a new table)."""
    # The newest commit is an ingest commit but after maintenance: its few commits first, each a file read (a GET on
    # a bucket), then further back.
    for limit in (3, OFFSETS_SEARCHED):
        for row in history_rows(spark, table_path, limit) or []:
            offsets = commit_metadata(row).get(SOURCE_OFFSETS)
            if offsets is None:
                continue
            if offsets.get("topic") != topic.topic:
                raise ConfigurationError(
                    f"{table_path} holds records of topic {offsets.get('topic')}, not {topic.topic}. Fix: a stream's "
                    f"tables follow one topic; declare a new stream for the other topic, or move the tables aside.")
            return {int(p): int(n) for p, n in offsets["next"].items()}
    return {}


def planned_records(topic: KafkaTopic, planned: tuple[dict, dict] | None) -> int | None:
    """How many records a batch reads between the offsets its checkpoint plans (`checkpoints.batch_source_offsets`):
    at most that many, a transaction's markers take offsets too. None when a partition's start or end is unknown."""
    start, end = ((planned[0].get(topic.topic), planned[1].get(topic.topic)) if planned is not None
                  else (None, None))
    if not start or not end or any(p not in start for p in end):
        return None
    return sum(max(0, int(offset) - int(start[p])) for p, offset in end.items())


def starting_offsets(topic: KafkaTopic, recorded: dict[int, int]) -> str:
    """Spark's `startingOffsets` for a query without a checkpoint: where the tables end, and the earliest record
    of partitions they hold none of (Spark wants every partition named once offsets are given)."""
    if not recorded:
        return "earliest"
    partitions = topic_partitions(topic)
    return json.dumps({topic.topic: {str(p): recorded.get(p, -2) for p in partitions}})  # -2: earliest


def topic_records(spark: SparkSession, topic: KafkaTopic, starting: str) -> DataFrame:
    """The stream's records as Spark's Kafka source reads them (key, value, topic, partition, offset, timestamp).
    Data lost to retention fails the query (`failOnDataLoss`): records are never skipped without a word."""
    reader = (spark.readStream.format("kafka").option("kafka.bootstrap.servers", topic.servers)
              .option("subscribe", topic.topic).option("startingOffsets", starting)
              # A transactional producer's aborted records are never read (Spark's default reads them).
              .option("kafka.isolation.level", "read_committed")
              # A task's consumer reads its range up to the log's end, where the broker holds a fetch for up to this
              # long before answering: at Kafka's default (500 ms), a warm batch read of 10 records from 2 partitions
              # took 0.57-0.61 s, at 10 ms 0.08 s (medians of 12 reads, blocks before and after it).
              .option("kafka.fetch.max.wait.ms", str(FETCH_MAX_WAIT_MS))
              .option("failOnDataLoss", "true")
              .options(**topic.spark_options()))
    if topic.max_records_per_batch is not None:
        reader = reader.option("maxOffsetsPerTrigger", str(topic.max_records_per_batch))
    return reader.load()


# The columns of `record_lines`.
RECORD_LINES_SCHEMA = StructType([
    StructField("unit", LongType()), StructField("source_file", StringType()), StructField("line_number", LongType()),
    StructField("raw_bytes", BinaryType()), *KAFKA_FIELDS,
])


def record_lines(records: DataFrame) -> DataFrame:
    """One line per record: unit (the partition), source_file, line_number (the offset), raw_bytes (the value;
    a NULL value, a tombstone, is an empty line and is quarantined as not JSON), and the record's KAFKA_FIELDS."""
    return records.select(
        F.col("partition").cast("bigint").alias("unit"),
        F.concat(F.lit("kafka:"), F.col("topic"), F.lit("/"), F.col("partition").cast("string")).alias("source_file"),
        F.col("offset").alias("line_number"),
        F.coalesce(F.col("value"), F.lit(b"").cast("binary")).alias("raw_bytes"),
        F.col("topic").alias("kafka_topic"),
        F.col("partition").alias("kafka_partition"),
        F.col("offset").alias("kafka_offset"),
        F.col("key").alias("kafka_key"),
        F.col("timestamp").alias("kafka_timestamp"),
    )


def batch_ranges(lines: DataFrame | pa.Table) -> dict[int, tuple[int, int]]:
    """partition → (first offset, last offset) of a batch's lines (a frame, or the lines the driver holds)."""
    if isinstance(lines, pa.Table):
        ranges = lines.group_by("unit").aggregate([("line_number", "min"), ("line_number", "max")]).to_pylist()
        return {int(r["unit"]): (int(r["line_number_min"]), int(r["line_number_max"])) for r in ranges}
    rows = lines.groupBy("unit").agg(F.min("line_number").alias("first"), F.max("line_number").alias("last")).collect()
    return {int(r["unit"]): (int(r["first"]), int(r["last"])) for r in rows}


def offsets_record(topic: KafkaTopic, before: dict[int, int], ranges: dict[int, tuple[int, int]]) -> dict:
    """The `source_offsets` a batch's commits carry: every partition's next offset after this batch."""
    after = dict(before)
    for partition, (_, last) in ranges.items():
        after[partition] = max(after.get(partition, 0), last + 1)
    return {"topic": topic.topic, "next": {str(p): n for p, n in sorted(after.items())}}
