"""A state table's changes as a compacted Kafka topic, and the state table rebuilt from that topic alone.

After a micro-batch's state-table MERGE, `ChangelogTopicStage` publishes the versions that table gained, from its
Change Data Feed: one record per key that changed, keyed by the state key, its value the key's row as of
the newest state-table version those changes reach, as JSON with that version in `_commit_version`; a key the
table deleted gets a tombstone (no value). Every record carries two headers: `statetables.version` (its row's
version) and `statetables.covers` (every state-table version up to this one is in the topic). The topic is
created with `cleanup.policy=compact`, so the broker keeps at least the newest record of every key: the table.

Exactly once with respect to the table, by a transactional producer. Each publish is one Kafka transaction, so a
reader in `read_committed` mode sees all of a publish or none of it; a run's producer fences any earlier one with
the same transactional id (a run killed mid-publish cannot commit later). A stage starts from the `covers` header
of the newest committed record, read from the tail of every partition: a batch replayed after a crash publishes
only the versions after it, nothing twice.

`restore_from_topic` rebuilds the table from the topic: per key the record with the highest version (then
offset); a tombstone means no row.
"""

from __future__ import annotations

import json
from pathlib import Path

from pyspark.sql import DataFrame, SparkSession, Window
from pyspark.sql import functions as F

from pipelines.declare.specs import KafkaTopic, StateTableSpec
from pipelines.errors import ChangelogError, ConfigurationError
from pipelines.ingest.kafka_source import client_config
from pipelines.state.tables import state_schema
from pipelines.storage.delta_log import rows_changed, table_version
from pipelines.storage.layout import StorageLayout

VERSION_HEADER = "statetables.version"
COVERS_HEADER = "statetables.covers"
# Microseconds, as the tables keep them (Spark's JSON default keeps milliseconds).
JSON_OPTIONS = {"timestampFormat": "yyyy-MM-dd'T'HH:mm:ss.SSSSSSXXX", "ignoreNullFields": "false"}
TOPIC_CONFIG = {"cleanup.policy": "compact"}
DEFAULT_PARTITIONS = 4
TAIL_RECORDS = 64  # first look this far back from each partition's end for the newest committed record

_producers: dict[tuple[str, str], object] = {}  # one transactional producer per process and table


def record_key(table: StateTableSpec) -> F.Column:
    """The record key: the key's value as text for a one-column key (a NULL key: empty, since a compacted topic
    refuses records without a key), a JSON array of them for several."""
    if len(table.keys) == 1:
        return F.coalesce(F.col(table.keys[0]).cast("string"), F.lit(""))
    return F.to_json(F.array(*[F.col(k).cast("string") for k in table.keys]))


def ensure_changelog_topic(topic: KafkaTopic, partitions: int = DEFAULT_PARTITIONS) -> None:
    """Create the compacted topic when it does not exist; refuse one whose records the broker would delete."""
    from confluent_kafka.admin import ConfigResource
    from pipelines.ingest.kafka_source import admin, ensure_topic
    ensure_topic(topic, partitions, TOPIC_CONFIG)
    client = admin(topic)
    resource = ConfigResource(ConfigResource.Type.TOPIC, topic.topic)
    policy = client.describe_configs([resource])[resource].result(30)["cleanup.policy"].value
    if "compact" not in policy:
        raise ConfigurationError(
            f"Changelog topic {topic.topic} has cleanup.policy={policy}: the broker would delete keys' only records "
            f"and the topic could no longer rebuild the table. Fix: set cleanup.policy=compact on it, or name a new "
            f"topic (statetables creates it compacted).")


def published_through(topic: KafkaTopic, timeout_s: float = 30.0) -> int:
    """The `covers` header of the topic's newest committed record: -1 for an empty topic."""
    from confluent_kafka import Consumer, TopicPartition
    consumer = Consumer(client_config(topic, **{"group.id": "statetables-tail", "enable.auto.commit": False,
                                                "isolation.level": "read_committed", "enable.partition.eof": True}))
    try:
        partitions = consumer.list_topics(topic.topic, timeout=timeout_s).topics[topic.topic].partitions
        covers = -1
        for partition in sorted(partitions):
            low, high = consumer.get_watermark_offsets(TopicPartition(topic.topic, partition), timeout=timeout_s)
            back = TAIL_RECORDS
            while high > low:
                start = max(low, high - back)
                found = _newest_covers(consumer, TopicPartition(topic.topic, partition, start), high, timeout_s)
                if found is not None or start == low:
                    covers = max(covers, found if found is not None else -1)
                    break
                back *= 8  # only transaction markers and aborted records there: look further back
        return covers
    finally:
        consumer.close()


def _newest_covers(consumer, start, high: int, timeout_s: float) -> int | None:
    from confluent_kafka import KafkaError
    consumer.assign([start])
    found = None
    while True:
        message = consumer.poll(timeout_s)
        if message is None:
            raise ChangelogError(f"no answer from the brokers while reading {start.topic} [{start.partition}]")
        if message.error():
            if message.error().code() == KafkaError._PARTITION_EOF:
                return found
            raise ChangelogError(f"reading {start.topic}: {message.error()}")
        headers = dict(message.headers() or [])
        if COVERS_HEADER in headers:
            found = int(headers[COVERS_HEADER])
        if message.offset() + 1 >= high:
            return found


def _producer(topic: KafkaTopic, table: StateTableSpec):
    from confluent_kafka import Producer
    key = (topic.servers, table.name)
    if key not in _producers:
        producer = Producer(client_config(topic, **{"transactional.id": f"statetables.{table.name}",
                                                    "enable.idempotence": True, "linger.ms": 5,
                                                    "compression.type": "lz4"}))
        producer.init_transactions(60)  # fences an earlier producer of this table (a killed run's)
        _producers[key] = producer
    return _producers[key]


def close_producers() -> None:
    """Close this process's producers (a run's end): none lingers, reconnecting to brokers that may be gone."""
    while _producers:
        _, producer = _producers.popitem()
        producer.flush(10)
        del producer


def latest_changes(changes: DataFrame, table: StateTableSpec) -> DataFrame:
    """Per key, its newest change: the row (insert or update_postimage) or its deletion; within one version a row
    wins over a delete (a file-level rewrite deletes and inserts the same key, as in table_from_changelog)."""
    newest_first = Window.partitionBy(*table.keys).orderBy(
        F.col("_commit_version").desc(), (F.col("_change_type") == "delete").asc())
    return (changes.where(F.col("_change_type") != "update_preimage")
            .withColumn("_rank", F.row_number().over(newest_first)).where(F.col("_rank") == 1))


class ChangelogTopicStage:
    """Publishes the state table's change rows after those the topic covers, one transaction a micro-batch."""

    def __init__(self, layout: StorageLayout, table: StateTableSpec, published: int):
        self.layout, self.table, self.topic, self.published = layout, table, table.changelog_topic, published

    def advance(self, spark: SparkSession) -> int:
        """Publish every state-table version up to the newest; the records published."""
        through = table_version(spark, self.layout.table(self.table.name)) or 0
        if through <= self.published:
            return 0
        changes = rows_changed(spark, self.layout.table(self.table.name), self.published, through)
        columns = state_schema(self.table).fieldNames()
        rows = latest_changes(changes, self.table).select(
            record_key(self.table).alias("key"), F.col("_commit_version").alias("version"),
            F.when(F.col("_change_type") != "delete",
                   F.to_json(F.struct(*columns, "_commit_version"), JSON_OPTIONS)).alias("value")).collect()
        producer = _producer(self.topic, self.table)
        producer.begin_transaction()
        try:
            covers = str(through).encode()
            for row in rows:
                record = {"key": row["key"].encode(), "value": row["value"].encode() if row["value"] is not None
                          else None, "headers": [(VERSION_HEADER, str(row["version"]).encode()), (COVERS_HEADER, covers)]}
                while True:
                    try:
                        producer.produce(self.topic.topic, **record)
                        break
                    except BufferError:  # the local queue is full (a first publish of a large table): let it drain
                        producer.poll(0.1)
                producer.poll(0)
            producer.commit_transaction(120)
        except BaseException:
            producer.abort_transaction(60)
            raise
        self.published = through
        return len(rows)


def changelog_topic_stage(layout: StorageLayout, table: StateTableSpec, state_version: int | None) -> ChangelogTopicStage:
    ensure_changelog_topic(table.changelog_topic)
    # The producer first: its start fences a killed run's producer and aborts its open transaction, so the tail read
    # below is not held up by records that will never be committed.
    _producer(table.changelog_topic, table)
    published = published_through(table.changelog_topic)
    if published > (state_version or 0):
        raise ChangelogError(
            f"Topic {table.changelog_topic.topic} covers {table.name} up to version {published}, but the table is at "
            f"version {state_version}: it holds the changes of an earlier {table.name}. Fix: name a new "
            f"changelog_topic for the new table (keep the old topic: it is the old table's history).")
    return ChangelogTopicStage(layout, table, published)


def topic_table(spark: SparkSession, table: StateTableSpec) -> tuple[DataFrame, int]:
    """The table as the topic holds it, and the state-table version that is (-1: an empty topic)."""
    topic = table.changelog_topic
    records = (spark.read.format("kafka").option("kafka.bootstrap.servers", topic.servers)
               .option("subscribe", topic.topic).option("startingOffsets", "earliest").option("includeHeaders", "true")
               .option("kafka.isolation.level", "read_committed").options(**topic.spark_options()).load())

    def header(name: str) -> F.Column:
        return F.expr(f"cast(filter(headers, h -> h.key = '{name}')[0].value as string)").cast("bigint")

    versioned = records.select("key", "value", "partition", "offset", header(VERSION_HEADER).alias("_version"),
                               header(COVERS_HEADER).alias("_covers")).cache()
    covers = versioned.agg(F.max("_covers")).first()[0]
    newest = Window.partitionBy("key").orderBy(F.col("_version").desc(), F.col("offset").desc())
    schema = state_schema(table)
    rows = (versioned.withColumn("_rank", F.row_number().over(newest))
            .where((F.col("_rank") == 1) & F.col("value").isNotNull())
            .select(F.from_json(F.col("value").cast("string"), schema, JSON_OPTIONS).alias("r")).select("r.*"))
    return rows, -1 if covers is None else int(covers)


def restore_from_topic(spark: SparkSession, layout: StorageLayout, table: StateTableSpec, into: str) -> tuple[Path, int]:
    """Write the state table as its changelog topic holds it to tables/<into>; where, and the version it is."""
    if table.changelog_topic is None:
        raise ConfigurationError(f"{table.name} has no changelog_topic. Fix: declare `changelog_topic: name` with it in "
                                 f"the project file; its changes are published from the next run on.")
    target = layout.table(into)
    if target == layout.table(table.name):
        raise ConfigurationError(f"refusing to overwrite the live table {table.name}. Fix: choose another name with --into.")
    rows, version = topic_table(spark, table)
    (rows.write.format("delta").mode("overwrite").option("overwriteSchema", "true")
     .option("userMetadata", json.dumps({"restored_from_topic": table.changelog_topic.topic, "version": version}))
     .save(str(target)))
    return target, version
