"""Streams read from Kafka topics, and state tables published to compacted changelog topics, against a real broker
(Apache Kafka in KRaft mode, started here: statetables/servers.py), read back with independent readers
(confluent-kafka for the topics, `deltalake` for the tables) and the independent oracle.

Covers: both contract streams produced to topics (bad records, re-deliveries, conflicting ids; every record keyed by
its id), two runs, a re-delivery of the first run's records, a lost checkpoint that resumes from the offsets the
tables record: every key equal to the oracle, every bad record in quarantine with its partition and offset; the
changelog topics compacted, each publish one transaction, no (key, version) twice; `statetables restore-topic`
after the state table and its checkpoint are deleted, equal to the table; a broker restart between runs; kill -9
between a batch's commits with a topic source, then a clean run. Not covered: freshness figures
(`make bench-freshness`), a cluster of brokers.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from deltalake import DeltaTable as IndependentDeltaTable

from pipelines import faults
from pipelines.changelog_topic import COVERS_HEADER, VERSION_HEADER
from pipelines.generate import generate
from pipelines.project import SHIPPED, load_project
from statetables.servers import kafka_broker
from tests.contract_oracle import expected_from_topic
from tests.streams import advance

pytestmark = pytest.mark.long

COMMAND = [sys.executable, "-m", "statetables.cli"]


@pytest.fixture
def broker(tmp_path):
    with kafka_broker(tmp_path / "kafka") as running:
        yield running


def kafka_project(bootstrap: str, folder: Path) -> Path:
    """The shipped project file with both streams read from topics and both state tables published to topics."""
    text = SHIPPED.read_text()
    for stream in ("movie_ticket_sales", "payments"):
        text = text.replace(f"  {stream}:\n", f"  {stream}:\n    source: {{topic: {stream}-events, max_records_per_batch: 400}}\n")
    for table in ("movie_tickets_sold", "payments_per_customer"):
        start = text.index(f"  - CREATE TABLE {table} AS")
        end = text.find("\n\n", start)
        end = len(text) if end == -1 else end
        body = text[start + 4:end].replace("\n    ", "\n      ")
        text = text[:start] + f"  - changelog_topic: {table}-changes\n    sql: {body}" + text[end:]
    path = folder / "statetables.yaml"
    path.write_text(text + f"\nkafka:\n  bootstrap_servers: {bootstrap}\n")
    return path


def _consume(bootstrap: str, topic: str) -> list:
    """Every committed record of a topic, with its headers (read_committed, as a restoring reader reads)."""
    from confluent_kafka import Consumer, KafkaError, TopicPartition
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "test", "enable.auto.commit": False,
                         "enable.partition.eof": True, "isolation.level": "read_committed"})
    out = []
    try:
        for partition in consumer.list_topics(topic, timeout=30).topics[topic].partitions:
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=30)
            if high <= low:
                continue
            consumer.assign([TopicPartition(topic, partition, low)])
            while (message := consumer.poll(30)) is not None:
                if message.error():
                    assert message.error().code() == KafkaError._PARTITION_EOF, message.error()
                    break
                out.append(message)
        return out
    finally:
        consumer.close()


def _redeliver(bootstrap: str, topic: str, spec, count: int) -> None:
    """Produce `count` of the topic's first valid records again, keyed as the generator keys them."""
    from confluent_kafka import Producer
    producer = Producer({"bootstrap.servers": bootstrap})
    sent = 0
    for message in _consume(bootstrap, topic):
        try:
            event = json.loads(message.value())
        except (TypeError, ValueError):
            continue
        if isinstance(event, dict) and isinstance(event.get(spec.id_field), str) and sent < count:
            producer.produce(topic, value=message.value(), key=event[spec.id_field].encode())
            sent += 1
    assert producer.flush(30) == 0 and sent == count
    del producer


def _table(path: Path) -> list[dict]:
    return IndependentDeltaTable(str(path)).to_pyarrow_table().to_pylist()


def _assert_equal_to_oracle(layout, spec, bootstrap: str) -> None:
    expected = expected_from_topic(spec.name, bootstrap, spec.topic.topic)
    table = spec.state_tables[0]
    state = {r[table.key]: (r[table.count_column], r[table.sum_column]) for r in _table(layout.table(table.name))}
    assert state == {k: (expected.counts[k], expected.sums[k]) for k in expected.counts}
    quarantine = _table(layout.table(spec.quarantine_table))
    assert sorted((r["source_file"], r["line_number"], r["reason"]) for r in quarantine) == sorted(expected.quarantine)
    for row in quarantine:  # the record's own coordinates, as Kafka gave them
        assert row["source_file"] == f"kafka:{row['kafka_topic']}/{row['kafka_partition']}"
        assert row["line_number"] == row["kafka_offset"] and row["kafka_timestamp"] is not None
    assert any(r["kafka_key"] is not None for r in quarantine)  # conflicting duplicates carry their id as key
    assert len(_table(layout.table(spec.bronze_table))) == expected.accepted


def _assert_published_once(bootstrap: str, topic: str, live: list[dict], table) -> None:
    """The changelog topic: one record per (key, version), never two; its newest record per key is the table."""
    records = _consume(bootstrap, topic)
    versions = Counter((m.key(), dict(m.headers())[VERSION_HEADER]) for m in records)
    assert versions and max(versions.values()) == 1, [k for k, n in versions.items() if n > 1][:5]
    assert all(COVERS_HEADER in dict(m.headers()) for m in records)
    newest = {}
    for message in sorted(records, key=lambda m: int(dict(m.headers())[VERSION_HEADER])):
        newest[message.key().decode()] = message.value()
    assert {k for k, v in newest.items() if v is not None} == {r[table.key] for r in live}


def test_topics_in_equal_the_oracle_and_a_table_restores_from_its_changelog_topic(spark, layout, broker, tmp_path,
                                                                                    monkeypatch):
    path = kafka_project(broker.bootstrap, tmp_path)
    specs = load_project(path.read_text(), path).streams
    for spec in specs.values():
        generate(spec, spec.topic, events=900, malformed=0.03, duplicates=0.03, conflicts=0.01, seed=1,
                 events_per_file=300)
        first = advance(spark, layout, spec, event_time=False)
        assert first.micro_batches >= 2  # max_records_per_batch: 400
        _assert_equal_to_oracle(layout, spec, broker.bootstrap)

    # The broker restarts; then a second delivery, with re-deliveries of the first run's records.
    broker.restart()
    for spec in specs.values():
        generate(spec, spec.topic, events=600, malformed=0.03, duplicates=0.03, conflicts=0.01, seed=2,
                 events_per_file=300)
        _redeliver(broker.bootstrap, spec.topic.topic, spec, 40)
    payments, sales = specs["payments"], specs["movie_ticket_sales"]
    advance(spark, layout, sales, event_time=False)
    # payments' checkpoint is lost: the new query starts where bronze's newest commit says, nothing read twice.
    shutil.rmtree(layout.checkpoint(payments.name))
    second = advance(spark, layout, payments, event_time=False)
    assert second.rows_read == 640  # 600 new records, 40 re-delivered: none of the first run's read again
    for spec in specs.values():
        _assert_equal_to_oracle(layout, spec, broker.bootstrap)

    # A run with nothing new publishes nothing.
    table = payments.state_tables[0]
    topic = table.changelog_topic.topic
    before = len(_consume(broker.bootstrap, topic))
    advance(spark, layout, payments, event_time=False)
    assert len(_consume(broker.bootstrap, topic)) == before
    live = _table(layout.table(table.name))
    _assert_published_once(broker.bootstrap, topic, live, table)

    # The table and its checkpoint are destroyed; the topic alone rebuilds it, as a user runs it.
    shutil.rmtree(layout.table(table.name))
    shutil.rmtree(layout.checkpoint(payments.name))
    env = {**os.environ, "STATETABLES_HOME": str(layout.home), "STATETABLES_PROJECT": str(path)}
    done = subprocess.run([*COMMAND, "restore-topic", "--table", table.name, "--into", "ppc_from_topic"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rebuilt from topic" in done.stdout
    restored = _table(layout.table("ppc_from_topic"))
    columns = [f for f in live[0] if not f.startswith("_")]
    key = lambda r: r[table.key]  # noqa: E731
    assert sorted(({c: r[c] for c in columns} for r in restored), key=key) == \
        sorted(({c: r[c] for c in columns} for r in live), key=key)


def _run(env: dict, log: Path) -> int:
    """`statetables run` of payments' job in a new process group (a fault kills the group), as the chaos harness
    runs it."""
    with open(log, "ab") as out:
        proc = subprocess.Popen([*COMMAND, "run", "--job", "advance_payments", "--log-level", "WARNING"], env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        return proc.wait(timeout=900)


def test_kill_9_between_commits_with_a_topic_source_and_broker_restarts_then_a_clean_run(layout, broker, tmp_path):
    """`statetables run` killed at each named point between a batch's commits, the broker restarted after every
    kill; then one clean run: every key equal to the oracle, no changelog record twice."""
    path = kafka_project(broker.bootstrap, tmp_path)
    payments = load_project(path.read_text(), path).streams["payments"]
    fault_dir, log = tmp_path / "faults", tmp_path / "runs.log"
    env = {**os.environ, "STATETABLES_HOME": str(layout.home), "STATETABLES_PROJECT": str(path),
           "DAGSTER_HOME": str(tmp_path / "dagster"), faults.FAULTS_ENV: str(fault_dir), "PYTHONUNBUFFERED": "1"}
    points = (faults.INGEST_AFTER_QUARANTINE_COMMIT, faults.INGEST_AFTER_BRONZE_COMMIT,
              faults.STATE_AFTER_MERGE_COMMIT, faults.SESSIONS_AFTER_OPEN_SESSIONS_COMMIT, faults.STREAM_BATCH_END)
    for round_, point in enumerate(points, start=1):
        generate(payments, payments.topic, events=500, malformed=0.03, duplicates=0.03, conflicts=0.01,
                 seed=round_, events_per_file=250)
        faults.arm(fault_dir, point)
        code = _run(env, log)
        assert code == -9 and not (fault_dir / point).exists(), (point, code, log.read_text()[-3000:])
        broker.restart()
    code = _run(env, log)
    assert code == 0, log.read_text()[-3000:]
    _assert_equal_to_oracle(layout, payments, broker.bootstrap)
    table = payments.state_tables[0]
    _assert_published_once(broker.bootstrap, table.changelog_topic.topic, _table(layout.table(table.name)), table)
