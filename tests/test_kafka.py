"""Streams read from Kafka topics, and state tables published to compacted changelog topics, against a real broker
(Apache Kafka in KRaft mode, started here: statetables/servers.py), read back with independent readers
(confluent-kafka for the topics, `deltalake` for the tables) and the independent oracle.

Covers: both contract streams produced to topics (bad records, re-deliveries, conflicting ids; every record keyed by
its id), two runs, a re-delivery of the first run's records, a lost checkpoint that resumes from the offsets the
tables record: every key equal to the oracle, every bad record in quarantine with its partition and offset; the
changelog topics compacted, each publish one transaction, no (key, version) twice, a run with nothing new publishing
nothing; the status of a topic stream (records waiting); `statetables restore-topic` after the state table and its
checkpoint are deleted, equal to the table; a broker restart between runs; the chaos harness with a topic source:
kill -9 between a batch's commits, the broker restarted or killed after every round, then a clean run. Not covered:
freshness figures (`make bench-freshness`), a cluster of brokers, TLS. A broker that requires a SASL/PLAIN login:
the credentials from the environment, a wrong one refused.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from deltalake import DeltaTable as IndependentDeltaTable

from pipelines import faults
from pipelines.declare.project import SHIPPED, load_project
from pipelines.ingest.generate import generate
from pipelines.operate.status import stream_status
from pipelines.runtime.query import RECORD_BYTES
from pipelines.state.changelog_topic import COVERS_HEADER, VERSION_HEADER
from statetables.servers import kafka_broker
from pipelines.storage.layout import StorageLayout
from tests.chaos import run_chaos
from tests.contract_oracle import expected_from_topic
from tests.streams import advance, batch_lines, project_with_ttl, redeliver, with_kafka

pytestmark = pytest.mark.long

COMMAND = [sys.executable, "-m", "statetables.cli"]


@pytest.fixture
def broker(tmp_path):
    with kafka_broker(tmp_path / "kafka") as running:
        yield running


def kafka_project(bootstrap: str, folder: Path) -> Path:
    """The shipped project file with both streams read from topics and both state tables published to topics."""
    path = folder / "statetables.yaml"
    path.write_text(SHIPPED.read_text())
    return with_kafka(path, bootstrap)


def _consume(bootstrap: str, topic: str, options: dict | None = None) -> list:
    """Every committed record of a topic, with its headers (read_committed, as a restoring reader reads)."""
    from confluent_kafka import Consumer, KafkaError, TopicPartition
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "test", "enable.auto.commit": False,
                         "enable.partition.eof": True, "isolation.level": "read_committed", **(options or {})})
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


def test_topics_in_equal_the_oracle_and_a_table_restores_from_its_changelog_topic(spark, layout, broker, tmp_path):
    path = kafka_project(broker.bootstrap, tmp_path)
    specs = load_project(path.read_text(), path).streams
    # A batch is sized by the offsets its checkpoint plans: here a batch of 350 records or more is a large one.
    large = {"large_from_bytes": 350 * RECORD_BYTES}
    for spec in specs.values():
        generate(spec, spec.topic, events=700, malformed=0.03, duplicates=0.03, conflicts=0.01, seed=1,
                 events_per_file=350)
        with batch_lines() as lines:
            first = advance(spark, layout, spec, event_time=False, **large)
        assert first.micro_batches >= 2  # max_records_per_batch: 400
        assert [r.figures["small"] for r in lines] == [r.figures["lines"] < 350 for r in lines], lines
        assert {r.figures["small"] for r in lines} == {True, False}, lines  # 400 records, then the rest
        _assert_equal_to_oracle(layout, spec, broker.bootstrap)

    # The broker restarts; then a second delivery, with re-deliveries of the first run's records.
    broker.restart()
    for spec in specs.values():
        generate(spec, spec.topic, events=400, malformed=0.03, duplicates=0.03, conflicts=0.01, seed=2,
                 events_per_file=400)
        assert redeliver(broker.bootstrap, spec.topic.topic, spec.id_field, 40, random.Random(5)) == 40
    payments, sales = specs["payments"], specs["movie_ticket_sales"]
    # A topic's checkpoint is trusted by the next run (Spark's Kafka source writes its first file after a zero byte).
    assert advance(spark, layout, sales, event_time=False, **large).recovery is None
    assert not layout.set_aside_checkpoints.exists() or not any(layout.set_aside_checkpoints.iterdir())
    # payments' checkpoint is lost: the new query starts where bronze's newest commit says, nothing read twice.
    shutil.rmtree(layout.checkpoint(payments.name))
    with batch_lines() as lines:
        second = advance(spark, layout, payments, event_time=False, **large)
    assert second.rows_read == 440  # 400 new records, 40 re-delivered: none of the first run's read again
    # The new checkpoint's first batch is sized too, from the offsets the query started at (where bronze ends).
    assert [r.figures["small"] for r in lines] == [r.figures["lines"] < 350 for r in lines], lines
    for spec in specs.values():
        _assert_equal_to_oracle(layout, spec, broker.bootstrap)

    # `statetables status`: what the tables hold of the topic, and what waits.
    topic_status = stream_status(spark, layout, payments, None)["topic"]
    assert topic_status["pending"] == 0 and topic_status["offsets_in_tables"] == topic_status["end_offsets"]
    generate(payments, payments.topic, events=5, malformed=0, duplicates=0, conflicts=0, seed=3)
    assert stream_status(spark, layout, payments, None)["topic"]["pending"] == 5
    advance(spark, layout, payments, event_time=False, **large)

    # A run with nothing new publishes nothing.
    table = payments.state_tables[0]
    topic = table.changelog_topic.topic
    before = len(_consume(broker.bootstrap, topic))
    advance(spark, layout, payments, event_time=False, **large)
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


def test_chaos_with_a_topic_source_kills_between_commits_and_broker_restarts_then_one_clean_run(tmp_path, broker):
    """The chaos harness (tests/chaos.py) with payments read from its topic: `statetables run` killed with SIGKILL at
    named points between a batch's commits, the broker restarted after every round (every other time after its own
    kill -9); then one clean run: every key, closed session and expired row equal to the oracle, and the changelog
    topic holds no (key, version) twice."""
    # Between quarantine's and bronze's commits is where a topic differs from files (the records quarantine holds
    # beyond bronze's offsets are looked up); `make chaos-kafka` kills at every point and at random instants.
    plan = [(faults.INGEST_AFTER_QUARANTINE_COMMIT, {}), (faults.SESSIONS_BEFORE_CLOSING_COMMIT, {})]
    home = tmp_path / "home"
    report = run_chaos(home, kills=len(plan), seed=11, events=240, named_only=True, plan=plan, streams=["payments"],
                       kafka=broker)

    assert [r.kind for r in report.rounds if r.killed] == [point for point, _ in plan]
    assert all("broker" in r.note for r in report.rounds[:-1])
    assert report.keys_compared["payments_per_customer"] > 50 and report.keys_compared["customer_activity"] > 50
    assert report.differences == 0, (report.keys_differing, report.rows_differing)
    path = with_kafka(project_with_ttl({}, tmp_path / "p.yaml"), broker.bootstrap)
    table = load_project(path.read_text(), path).streams["payments"].state_tables[0]
    _assert_published_once(broker.bootstrap, table.changelog_topic.topic,
                           _table(StorageLayout.under(home).table(table.name)), table)


def test_the_landing_sensor_starts_a_run_when_records_arrive_on_a_topic(layout, broker, tmp_path, monkeypatch):
    """The sensor every deployment runs: for a stream read from a topic it compares the topic's end offsets with its
    cursor; a broker that does not answer is said on the tick, and the other streams go on."""
    import dagster as dg

    from assets.automation import landing_files_sensor
    from resources import StorageResource

    path = kafka_project(broker.bootstrap, tmp_path)
    monkeypatch.setenv("STATETABLES_PROJECT", str(path))
    payments = load_project(path.read_text(), path).streams["payments"]
    storage, instance = StorageResource(home=str(layout.home)), dg.DagsterInstance.ephemeral()
    generate(payments, payments.topic, events=20, seed=1)
    with dg.build_sensor_context(instance=instance, resources={"storage": storage}) as context:
        first = landing_files_sensor(context)
    assert [r.job_name for r in first.run_requests] == ["advance_payments"]  # sales' topic does not exist yet: said
    with dg.build_sensor_context(instance=instance, resources={"storage": storage}, cursor=first.cursor) as context:
        assert not landing_files_sensor(context).run_requests  # no record since the cursor
    generate(payments, payments.topic, events=5, seed=2)
    with dg.build_sensor_context(instance=instance, resources={"storage": storage}, cursor=first.cursor) as context:
        assert [r.job_name for r in landing_files_sensor(context).run_requests] == ["advance_payments"]
    broker.stop()
    with dg.build_sensor_context(instance=instance, resources={"storage": storage}, cursor=first.cursor) as context:
        down = landing_files_sensor(context)
    assert not down.run_requests and "did not answer" in down.skip_reason.skip_message


SASL_OPTIONS = ("  options:\n    security.protocol: SASL_PLAINTEXT\n    sasl.mechanism: PLAIN\n"
                "    sasl.username: ${KAFKA_USERNAME}\n    sasl.password: ${KAFKA_PASSWORD}\n")


def test_a_broker_that_requires_a_login_takes_credentials_from_the_environment(spark, layout, tmp_path, monkeypatch):
    """A managed Kafka requires a login: `kafka: options:` reach Spark's source and sink and confluent-kafka alike, the
    credentials read from the environment (never from the file); a wrong password is refused by name."""
    with kafka_broker(tmp_path / "kafka", sasl_users={"alice": "alice-secret"}) as secured:
        path = kafka_project(secured.bootstrap, tmp_path)
        path.write_text(path.read_text() + SASL_OPTIONS)
        monkeypatch.setenv("KAFKA_USERNAME", "alice")
        monkeypatch.setenv("KAFKA_PASSWORD", "wrong")
        spec = load_project(path.read_text(), path).streams["payments"]
        assert dict(spec.topic.options)["sasl.password"] == "${KAFKA_PASSWORD}"  # the file holds the name only
        with pytest.raises(Exception, match="refused this client's login"):
            from pipelines.ingest.kafka_source import topic_partitions
            topic_partitions(spec.topic, timeout_s=10)
        monkeypatch.setenv("KAFKA_PASSWORD", "alice-secret")
        generate(spec, spec.topic, events=300, malformed=0.03, duplicates=0.03, conflicts=0.01, seed=4,
                 events_per_file=300)  # confluent-kafka logs in
        advance(spark, layout, spec, event_time=False)  # Spark's Kafka source logs in; the changelog producer too
        expected = expected_from_topic(spec.name, secured.bootstrap, spec.topic.topic,
                                       consumer_options=spec.topic.client_options())
        table = spec.state_tables[0]
        state = {r[table.key]: r[table.count_column] for r in _table(layout.table(table.name))}
        assert state == dict(expected.counts) and state
        published = _consume(secured.bootstrap, table.changelog_topic.topic, spec.topic.client_options())
        assert {m.key().decode() for m in published} == set(state)


def test_credentials_written_in_the_project_file_are_refused(tmp_path):
    path = kafka_project("127.0.0.1:9092", tmp_path)
    text = path.read_text() + SASL_OPTIONS.replace("${KAFKA_PASSWORD}", "alice-secret")
    with pytest.raises(Exception, match="sasl.password is written in the file; credentials are read from the "
                                        "environment only"):
        load_project(text, path)
