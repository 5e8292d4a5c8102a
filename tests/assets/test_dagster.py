"""The Dagster code location: loads and validates, runs with real Spark + Delta (every asset of both streams
end to end: tests/test_engines.py), blocking checks fail the run, sensors request the right runs, bad
configuration fails fast.

Uses a real (ephemeral) Dagster instance and the session's SparkSession. Not covered here: the
daemon and webserver launching runs (the failure sensor is evaluated through Dagster's sensor
test context, against a real failed run; tests/assets/test_ui.py has the real daemon recover a run).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import dagster as dg
import pytest
from delta.tables import DeltaTable
from pyspark.sql import functions as F

from assets.continuous import ContinuousReport, QueryProgress
from assets.automation import (
    LANDING_SENSOR_ENV, landing_files_sensor, landing_sensor_interval, recover_failed_stream, spark_engine_health,
)
from assets.maintenance import changelogs
from assets.streams import build_stream_assets
from assets import automation
from resources.check_policy import DEEP_CHECK, blocking_check_names
from assets.keys import (
    CONTINUOUS_JOB, MAX_RECOVERY_ATTEMPTS, RECOVERY_ATTEMPT_TAG, RECOVERY_CHAIN_TAG, RECOVERY_OF_TAG, RECOVERY_REASON_TAG,
    STREAM_TAG,
)
from pipelines.errors import ConfigurationError, EngineUnavailableError
from pipelines.event_time.watermark import LATE
from pipelines.ingest.generate import generate
from pipelines.runtime.micro_batch import EVENT_TIME_ENV, event_time_streams, event_time_tables
from pipelines.runtime.query import Continuous
from pipelines.runtime.spark import delta_jars, engine_address, require_java, wait_for_engine
from pipelines.storage.delta_log import USER_METADATA, commit_confs, commit_metadata, history_rows, table_version
from pipelines.storage.layout import StorageLayout
from tests.streams import advance, project_with_ttl, PAYMENTS
from pipelines.declare.project import PROJECT_ENV, stream_spec
from resources import CheckPolicyResource, SparkSessionResource, StorageResource
from resources.spark import ENGINE_TAG
from statetables.definitions import defs
from statetables.servers import free_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def storage_root(layout, monkeypatch):
    """The code location's StorageResource reads $STATETABLES_HOME: point it at this test's root."""
    monkeypatch.setenv("STATETABLES_HOME", str(layout.home))


def _job(name: str):
    return defs.resolve_job_def(name)


def _materialized(result, node: str, asset: str):
    return next(m.metadata for m in result.asset_materializations_for_node(node) if m.asset_key.path == [asset])


@pytest.mark.parametrize("event_time", ["all", "movie_ticket_sales"])
def test_definitions_validate_with_the_dagster_cli(event_time):
    result = subprocess.run([Path(sys.executable).parent / "dagster", "definitions", "validate", "-w", "workspace.yaml"],
                            cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, EVENT_TIME_ENV: event_time})
    assert result.returncode == 0, result.stdout + result.stderr


def _config_fields(config_type, path: str):
    for name, field in (getattr(config_type, "fields", None) or {}).items():
        yield f"{path}.{name}", field
        yield from _config_fields(field.config_type, f"{path}.{name}")


def test_the_launchpad_documents_every_config_field_with_a_default():
    """What a person sees in the launchpad: every field of the assets', ops' and resources' config (batch size,
    lock timeout, engine, ...) has a description and a default, so a run can be changed there. What decides the
    rows (watermarks, dedup horizon, TTL) is not among them: it is in the project file, for every run."""
    seen = {}
    for job in defs.resolve_all_job_defs():
        schema = job.run_config_schema.config_type
        for section in ("ops", "resources"):
            for owner, field in schema.fields[section].config_type.fields.items():
                if owner == "io_manager":  # Dagster's own
                    continue
                config = getattr(field.config_type, "fields", {}).get("config")
                for path, leaf in _config_fields(config.config_type if config else None, f"{section}.{owner}"):
                    seen[path] = leaf
    assert {"ops.movie_ticket_sales.max_files_per_trigger", "ops.payments.lock_timeout_s", "resources.spark.remote",
            "ops.keep_streams_running.trigger_seconds"} <= set(seen)
    assert not [path for path in seen if any(word in path for word in ("ttl", "watermark", "horizon", "gap"))]
    undocumented = sorted(path for path, leaf in seen.items() if not leaf.description or leaf.is_required)
    assert not undocumented, f"config fields without a description or a default: {undocumented}"


@pytest.mark.long
def test_a_grown_landing_file_warns_and_a_ttl_set_in_the_project_file_expires_keys(spark, layout, tmp_path,
                                                                                   monkeypatch):
    """Every asset of both streams under Dagster: tests/test_engines.py. Long tier: the grown file (test_ingest.py)
    and the TTL (test_state_ttl.py) have their main tests in the fast loop."""
    generate(PAYMENTS, layout.landing("payments"), events=600, seed=3, events_per_file=300)
    with dg.DagsterInstance.ephemeral() as instance:
        assert _job("advance_payments").execute_in_process(instance=instance).success
        # A landing file appended to after ingestion: its new line is ingested, and the change is
        # reported as a warning naming the file, without failing the run.
        grown = sorted(layout.landing("payments").glob("*.jsonl"))[0]
        with open(grown, "a") as handle:
            handle.write('{"payment_id":"late-append","customer_id":"c1","amount":1,"paid_at":"2026-11-01T10:00:00Z"}\n')
        # ... in a run after the project file turned on a TTL for payments_per_customer (no reload of the code
        # location): customers idle for 0.1 day of event time are expired, and the per-run check still reconciles.
        project = tmp_path / "statetables.yaml"
        project = project_with_ttl({"payments_per_customer": 0.1}, tmp_path / "statetables.yaml")
        monkeypatch.setenv(PROJECT_ENV, str(project))
        again = _job("advance_payments").execute_in_process(instance=instance)
        assert again.success
        state = _materialized(again, "payments", "payments_per_customer")
        assert state["ttl_days"].value == "0.1" and state["keys_expired_this_run"].value > 0
        checked = [e.event_specific_data for e in again.all_events if e.event_type_value == "ASSET_CHECK_EVALUATION"
                   and e.event_specific_data.check_name == "totals_match_bronze"]
        assert checked[0].passed and checked[0].metadata["expired_events"].value > 0
        warned = [e.event_specific_data for e in again.all_events if e.event_type_value == "ASSET_CHECK_EVALUATION"
                  and e.event_specific_data.check_name == "landing_files_written_once"]
        assert len(warned) == 1 and not warned[0].passed and warned[0].severity == dg.AssetCheckSeverity.WARN
        assert [(r.data["file"], r.data["change"]) for r in warned[0].metadata["files"].records] == [
            (str(grown), "appended")]
        assert _materialized(again, "payments", "payments_bronze")["rows_accepted"].value == 1


def test_without_event_time_a_failing_blocking_check_fails_the_run_and_the_deep_check_names_the_key(
        spark, layout, monkeypatch):
    """$STATETABLES_EVENT_TIME=movie_ticket_sales: the code location gives payments no sessions, and its job
    materializes bronze, quarantine and the state table only, creating none of the sessions' tables nor the changelog,
    which its own job publishes.
    Then the state table is corrupted behind the pipeline's back: the per-run check fails the next run, the
    operator's `warn_only` lets one run pass with a warning, and the nightly deep check names the key."""
    assert event_time_streams("movie_ticket_sales") == {"movie_ticket_sales"}
    assert event_time_streams("none") == set() and event_time_streams("all") == {"movie_ticket_sales", "payments"}
    sessions_tables = set(event_time_tables(PAYMENTS)) - {LATE}
    assert {key.path[-1] for key in build_stream_assets(PAYMENTS)[0].keys} >= sessions_tables
    stream, *checks = build_stream_assets(PAYMENTS, keeps_event_time=False)
    assert not {key.path[-1] for key in stream.keys} & sessions_tables
    per_run = [c for c in checks if DEEP_CHECK not in {key.name for key in c.check_keys}]
    assert len(per_run) == len(checks) - 1

    def advance_payments(instance, check_policy=CheckPolicyResource()):
        return dg.materialize([stream, *per_run], instance=instance, raise_on_error=False, resources={
            "spark": SparkSessionResource(), "storage": StorageResource(), "check_policy": check_policy})

    generate(PAYMENTS, layout.landing("payments"), events=300, seed=4, events_per_file=300)
    with dg.DagsterInstance.ephemeral() as instance:
        first = advance_payments(instance)
        assert first.success
        assert {event.asset_key.path[-1] for event in first.get_asset_materialization_events()} == {
            "payments_bronze", "payments_quarantine", "payments_per_customer"}
        assert not any(layout.table(name).exists()
                       for name in sessions_tables | {LATE, "payments_per_customer_changelog"})
        # Published by its own job, the changelog's figures in the UI against its rows.
        published = dg.materialize([changelogs], instance=instance, resources={
            "spark": SparkSessionResource(), "storage": StorageResource()})
        changelog = next(e.step_materialization_data.materialization.metadata
                         for e in published.get_asset_materialization_events()
                         if e.asset_key.path[-1] == "payments_per_customer_changelog")
        versions = [r[0] for r in spark.read.format("delta").load(
            str(layout.table("payments_per_customer_changelog"))).select("_commit_version").collect()]
        assert changelog["change_rows_total"].value == len(versions) > 0
        assert changelog["state_table_version_covered"].value == max(versions) == table_version(
            spark, layout.table("payments_per_customer"))
        # corrupt the state table behind the pipeline's back: one customer counted twice
        table = DeltaTable.forPath(spark, str(layout.table("payments_per_customer")))
        key = table.toDF().first()["customer_id"]
        table.update(F.col("customer_id") == key, {"payment_count": F.col("payment_count") + 1})
        result = advance_payments(instance)
        # the operator's switch for a check they have shown wrong (docs/recovery.md): for one run it warns
        warned = advance_payments(instance, CheckPolicyResource(warn_only=["payments_per_customer:totals_match_bronze"]))
        # the code location's nightly job of deep checks compares every key with all of bronze and names the key
        deep = _job("reconcile_state_tables").execute_in_process(instance=instance, raise_on_error=False)
        # the continuous job's first report runs the same check: its queries stop and the run fails naming it
        continuous = _job(CONTINUOUS_JOB).execute_in_process(instance=instance, raise_on_error=False, run_config={
            "ops": {"keep_streams_running": {"config": {"report_every_seconds": 1.0, "event_time_steps": False}}}})
    assert not result.success
    failed = [e.event_specific_data for e in result.all_events
              if e.event_type_value == "ASSET_CHECK_EVALUATION" and not e.event_specific_data.passed]
    # the per-run check: totals against bronze's running totals, without reading bronze
    assert [c.check_name for c in failed] == ["totals_match_bronze"]
    assert failed[0].metadata["events_counted"].value == failed[0].metadata["bronze_events"].value + 1
    assert failed[0].severity == dg.AssetCheckSeverity.ERROR
    assert warned.success
    warning = [e.event_specific_data for e in warned.all_events if e.event_type_value == "ASSET_CHECK_EVALUATION"
               and not e.event_specific_data.passed]
    assert [(c.check_name, c.severity) for c in warning] == [("totals_match_bronze", dg.AssetCheckSeverity.WARN)]
    assert "check_policy.warn_only" in warning[0].metadata["blocking"].value
    assert not deep.success
    deep_failed = [e.event_specific_data for e in deep.all_events
                   if e.event_type_value == "ASSET_CHECK_EVALUATION" and not e.event_specific_data.passed]
    assert [c.check_name for c in deep_failed] == ["reconciles_with_bronze"]
    assert deep_failed[0].metadata["mismatched_keys"].value == 1
    assert not continuous.success
    stopped = continuous.failure_data_for_node("keep_streams_running").user_failure_data
    assert stopped.description.startswith("Blocking checks failed: payments_per_customer:totals_match_bronze."), (
        stopped.description)


def test_a_continuous_runs_first_report_covers_every_table_as_found(spark, layout):
    """A continuous run's first report materializes every existing table with its figures and checks though
    nothing committed since the run started (a recovery run whose predecessor's queries, left running in a Connect
    server, committed after their last report); then only the tables that moved."""
    state = PAYMENTS.state_tables[0]
    generate(PAYMENTS, layout.landing("payments") / "a", events=80, seed=5, events_per_file=40)
    advance(spark, layout, PAYMENTS, event_time=False)
    report = ContinuousReport(spark, layout, QueryProgress(), frozenset(), CheckPolicyResource())

    first = list(report.events())
    found = {e.asset_key.to_user_string(): e for e in first if isinstance(e, dg.AssetMaterialization)}
    assert {PAYMENTS.bronze_table, state.name} <= set(found), sorted(found)
    assert not any(k.startswith("movie_ticket_sales") for k in found)  # its tables do not exist
    keys = spark.read.format("delta").load(str(layout.table(state.name))).count()
    as_found = found[state.name].metadata
    assert as_found["keys"].value == keys > 0
    assert found[state.name].description.endswith("as found when the run started")
    assert as_found["table_version"].value == as_found["table_version_before"].value
    checks = {(e.check_name, e.passed) for e in first if isinstance(e, dg.AssetCheckEvaluation)}
    assert {("unique_keys", True), ("nothing_negative", True), ("totals_match_bronze", True)} <= checks, checks
    assert list(report.events()) == []  # nothing moved

    generate(PAYMENTS, layout.landing("payments") / "b", events=40, seed=6, events_per_file=40)
    advance(spark, layout, PAYMENTS, event_time=False)
    moved = {e.asset_key.to_user_string(): e for e in report.events() if isinstance(e, dg.AssetMaterialization)}
    assert moved[state.name].metadata["table_version_before"].value == as_found["table_version"].value
    assert moved[state.name].description.endswith("committed since the last report")


def test_check_policy_knows_every_blocking_check():
    graph = defs.resolve_asset_graph()
    assert blocking_check_names() == sorted(f"{key.asset_key.to_user_string()}:{key.name}"
                                            for key in graph.asset_check_keys if graph.get_check_spec(key).blocking)
    with pytest.raises(ConfigurationError, match="warn_only names no blocking check: activity:sessions.*Fix: use "
                                                 "ASSET:CHECK, one of customer_activity:reconcile_with_bronze"):
        CheckPolicyResource(warn_only=["activity:sessions"]).severity("customer_activity", "unique_keys")


def test_landing_sensor_requests_one_run_per_stream_with_new_files(layout, landing, monkeypatch):
    storage = StorageResource(home=str(layout.home))
    instance = dg.DagsterInstance.ephemeral()
    with dg.build_sensor_context(instance=instance, resources={"storage": storage}) as context:
        assert not landing_files_sensor(context).run_requests
    landing.write("payments", "a.jsonl", ["{}"])
    landing.write("payments", "_in_flight.jsonl", ["{}"])
    with dg.build_sensor_context(instance=instance, resources={"storage": storage}) as context:
        first = landing_files_sensor(context)
        assert [r.job_name for r in first.run_requests] == ["advance_payments"]
        assert first.run_requests[0].tags[STREAM_TAG] == "payments"
    with dg.build_sensor_context(instance=instance, resources={"storage": storage}, cursor=first.cursor) as context:
        assert not landing_files_sensor(context).run_requests  # nothing new since the cursor
    landing.write("payments", "b.jsonl", ["{}"])
    landing.write("movie_ticket_sales", "c.jsonl", ["{}"])
    with dg.build_sensor_context(instance=instance, resources={"storage": storage}, cursor=first.cursor) as context:
        second = landing_files_sensor(context)
    assert sorted(r.job_name for r in second.run_requests) == ["advance_movie_ticket_sales", "advance_payments"]
    assert json.loads(second.cursor)["payments"][1] == str(layout.landing("payments") / "b.jsonl")
    landing.write("payments", "2026/11/22/deep.jsonl.gz", ["{}"])  # date folders and gzip count too
    with dg.build_sensor_context(instance=instance, resources={"storage": storage}, cursor=second.cursor) as context:
        assert [r.job_name for r in landing_files_sensor(context).run_requests] == ["advance_payments"]

    # While a continuous run is in progress it advances every stream: no run is requested, the cursor moves on.
    continuous = instance.create_run_for_job(_job(CONTINUOUS_JOB), status=dg.DagsterRunStatus.STARTED)
    landing.write("payments", "during.jsonl", ["{}"])
    with dg.build_sensor_context(instance=instance, resources={"storage": storage}, cursor=second.cursor) as context:
        during = landing_files_sensor(context)
    assert not during.run_requests and continuous.run_id in during.skip_reason.skip_message
    assert json.loads(during.cursor)["payments"][1] == str(layout.landing("payments") / "during.jsonl")
    # Failed, it is still in charge while its recovery is due: an orchestrated run would take the writer locks.
    instance.report_run_failed(continuous)
    landing.write("payments", "while_failed.jsonl", ["{}"])
    with dg.build_sensor_context(instance=instance, resources={"storage": storage}, cursor=during.cursor) as context:
        due = landing_files_sensor(context)
    assert not due.run_requests and "recover_failed_stream starts it again" in due.skip_reason.skip_message
    with monkeypatch.context() as patched:  # not recovered within RECOVERY_DUE_S: orchestrated runs resume
        patched.setattr(automation, "RECOVERY_DUE_S", 0)
        with dg.build_sensor_context(instance=instance, resources={"storage": storage}, cursor=during.cursor) as context:
            assert [r.job_name for r in landing_files_sensor(context).run_requests] == ["advance_payments"]
    # Nor once its recoveries are used up: the run-failure sensor gives up on it.
    given_up = instance.create_run_for_job(_job(CONTINUOUS_JOB), status=dg.DagsterRunStatus.STARTED, tags={
        RECOVERY_ATTEMPT_TAG: str(MAX_RECOVERY_ATTEMPTS), RECOVERY_OF_TAG: continuous.run_id,
        RECOVERY_CHAIN_TAG: continuous.run_id})
    instance.report_run_failed(given_up)
    landing.write("payments", "after.jsonl", ["{}"])
    with dg.build_sensor_context(instance=instance, resources={"storage": storage}, cursor=due.cursor) as context:
        after = landing_files_sensor(context)
    assert [r.job_name for r in after.run_requests] == ["advance_payments"]

    # While a run of a stream is queued or running, no other is requested for it; the cursor waits for its end.
    queued = instance.create_run_for_job(_job("advance_payments"), tags={STREAM_TAG: "payments"},
                                         status=dg.DagsterRunStatus.STARTED)
    landing.write("payments", "while_queued.jsonl", ["{}"])
    landing.write("movie_ticket_sales", "other_stream.jsonl", ["{}"])
    with dg.build_sensor_context(instance=instance, resources={"storage": storage}, cursor=after.cursor) as context:
        busy = landing_files_sensor(context)
    assert [r.job_name for r in busy.run_requests] == ["advance_movie_ticket_sales"]
    assert json.loads(busy.cursor)["payments"] == json.loads(after.cursor)["payments"]
    instance.report_run_failed(queued)
    with dg.build_sensor_context(instance=instance, resources={"storage": storage}, cursor=busy.cursor) as context:
        assert [r.job_name for r in landing_files_sensor(context).run_requests] == ["advance_payments"]


def test_a_run_whose_engine_does_not_answer_fails_naming_the_fix_and_shows_its_engine(layout):
    """The `spark` resource configured for a Spark Connect server that is down: the run says which engine it used
    (a run tag, in the runs list), waits `engine_wait_seconds`, then fails naming the fix, having written nothing;
    the health sensor's tick fails the same way."""
    remote = f"sc://127.0.0.1:{free_port()}"
    generate(PAYMENTS, layout.landing("payments"), events=50, seed=3, events_per_file=50)
    with dg.DagsterInstance.ephemeral() as instance:
        result = _job("advance_payments").execute_in_process(instance=instance, raise_on_error=False, run_config={
            "resources": {"spark": {"config": {"remote": remote, "engine_wait_seconds": 1}}}})
        assert instance.get_run_by_id(result.run_id).tags[ENGINE_TAG] == remote
    assert not result.success
    failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
    error = failure.event_specific_data.error
    assert f"The Spark engine at {remote} does not answer (waited 1s); nothing was written. Fix: start it" in \
        error.cause.message
    assert not layout.tables_root.exists() or not any(layout.tables_root.iterdir())
    with pytest.raises(EngineUnavailableError, match="does not answer"):
        wait_for_engine(remote, 0.5)
    with dg.build_sensor_context(resources={"spark": SparkSessionResource(remote=remote)}) as context, \
            pytest.raises(EngineUnavailableError, match=f"{remote} does not answer.*Fix: `make dev`"):
        spark_engine_health(context)
    with dg.build_sensor_context(resources={"spark": SparkSessionResource()}) as context:
        assert "embedded JVM" in spark_engine_health(context).skip_message


def _failed_run(instance, layout, tags=None):
    """A real failed run of advance_payments: the landing folder is a file, so the ingest step fails."""
    layout.landing_root.mkdir(parents=True, exist_ok=True)
    layout.landing("payments").write_text("not a folder")
    result = _job("advance_payments").execute_in_process(instance=instance, raise_on_error=False, tags=tags)
    assert not result.success
    run = instance.get_run_by_id(result.run_id)
    failure = instance.all_logs(result.run_id, of_type=dg.DagsterEventType.RUN_FAILURE)[0].dagster_event
    return run, failure


def test_failure_sensor_requests_a_bounded_recovery_run(spark, layout):
    with dg.DagsterInstance.ephemeral() as instance:
        run, failure = _failed_run(instance, layout)
        context = dg.build_run_status_sensor_context(
            sensor_name="recover_failed_stream", dagster_event=failure, dagster_instance=instance,
            dagster_run=run).for_run_failure()
        requests = recover_failed_stream(context)
        assert [r.job_name for r in requests] == ["advance_payments"]
        assert requests[0].tags[RECOVERY_OF_TAG] == requests[0].tags[RECOVERY_CHAIN_TAG] == run.run_id
        assert requests[0].tags[RECOVERY_ATTEMPT_TAG] == "1"
        assert requests[0].tags[RECOVERY_REASON_TAG].startswith(f"run {run.run_id} failed: payments: ")

        # A recovery that failed: the next one names it, and the chain's first run, and counts on.
        second = instance.create_run_for_job(_job("advance_payments"), status=dg.DagsterRunStatus.STARTED, tags={
            STREAM_TAG: "payments", **requests[0].tags})
        instance.report_run_failed(second)
        again = recover_failed_stream(dg.build_run_status_sensor_context(
            sensor_name="recover_failed_stream", dagster_instance=instance, dagster_run=instance.get_run_by_id(
                second.run_id), dagster_event=instance.all_logs(second.run_id, of_type=dg.DagsterEventType.RUN_FAILURE)[
                0].dagster_event).for_run_failure())
        assert [(r.job_name, r.tags[RECOVERY_OF_TAG], r.tags[RECOVERY_CHAIN_TAG], r.tags[RECOVERY_ATTEMPT_TAG])
                for r in again] == [("advance_payments", second.run_id, run.run_id, "2")]

        last, last_failure = _failed_run(instance, layout, tags={RECOVERY_ATTEMPT_TAG: "3", RECOVERY_OF_TAG: "x"})
        context = dg.build_run_status_sensor_context(
            sensor_name="recover_failed_stream", dagster_event=last_failure, dagster_instance=instance,
            dagster_run=last).for_run_failure()
        gave_up = recover_failed_stream(context)
        assert isinstance(gave_up, dg.SkipReason) and "recovery attempt 3" in gave_up.skip_message

        # A failed stream run while a continuous run advances the same checkpoints: left to that run.
        continuous = instance.create_run_for_job(_job(CONTINUOUS_JOB), status=dg.DagsterRunStatus.STARTED)
        left = recover_failed_stream(dg.build_run_status_sensor_context(
            sensor_name="recover_failed_stream", dagster_event=failure, dagster_instance=instance,
            dagster_run=run).for_run_failure())
        assert isinstance(left, dg.SkipReason) and continuous.run_id in left.skip_message
        # A failed continuous run is started again with its own config, tagged with why.
        config = {"ops": {"keep_streams_running": {"config": {"trigger_seconds": 3.0}}}}
        failed = instance.create_run_for_job(_job(CONTINUOUS_JOB), run_config=config, status=dg.DagsterRunStatus.STARTED)
        instance.report_run_failed(failed)
        instance.report_run_failed(continuous)
        event = instance.all_logs(failed.run_id, of_type=dg.DagsterEventType.RUN_FAILURE)[0].dagster_event
        again = recover_failed_stream(dg.build_run_status_sensor_context(
            sensor_name="recover_failed_stream", dagster_event=event, dagster_instance=instance,
            dagster_run=instance.get_run_by_id(failed.run_id)).for_run_failure())
    assert [r.job_name for r in again] == [CONTINUOUS_JOB] and again[0].run_config == config
    assert again[0].tags[RECOVERY_OF_TAG] == again[0].tags[RECOVERY_CHAIN_TAG] == failed.run_id
    assert again[0].tags[RECOVERY_ATTEMPT_TAG] == "1"


def test_bad_configuration_fails_fast_with_the_fix(tmp_path, monkeypatch):
    with pytest.raises(ConfigurationError, match="Unknown stream 'refunds'.*movie_ticket_sales, payments"):
        stream_spec("refunds")
    with pytest.raises(ConfigurationError, match="outside the storage root"):
        StorageLayout.under(tmp_path, tables="../elsewhere")
    with pytest.raises(ConfigurationError, match="make jars"):
        delta_jars(tmp_path / "no-jars")
    with pytest.raises(ConfigurationError, match="'http://127.0.0.1:15002' is not sc://HOST:PORT. Fix: e.g. sc://"):
        engine_address("http://127.0.0.1:15002")
    monkeypatch.setenv(LANDING_SENSOR_ENV, "0")
    with pytest.raises(ConfigurationError, match="STATETABLES_LANDING_SENSOR_SECONDS='0'.*Fix: e.g."):
        landing_sensor_interval()
    with pytest.raises(ConfigurationError, match="trigger interval 0s.*Fix"):
        Continuous(trigger_interval_s=0)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("JAVA_HOME", raising=False)
    with pytest.raises(ConfigurationError, match="Java was not found"):
        require_java()
    with pytest.raises(ConfigurationError, match="names no stream refunds.*Fix: set it to all, none, or some of"):
        event_time_streams("payments, refunds")


def test_cli_refuses_an_unknown_stream_before_touching_data(tmp_path):
    env = {**os.environ, "STATETABLES_HOME": str(tmp_path)}
    result = subprocess.run([Path(sys.executable).parent / "statetables", "generate", "--stream", "refunds"],
                            env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "Unknown stream 'refunds'. Fix: use one of movie_ticket_sales, payments" in result.stderr
    assert not any(tmp_path.iterdir())


def test_spark_resource_reuses_the_one_session(spark):
    assert SparkSessionResource().spark_session is spark


def test_streams_advanced_side_by_side_commit_under_their_own_metadata(spark, tmp_path):
    """The continuous job advances each stream in a thread of its own, on `session_of_its_own`. A commit's metadata
    (app id, bronze version folded) is a session conf set for the commit (`commit_confs`): set in one stream's
    session, it must not reach the other stream's commit made at the same moment."""
    resource, errors = SparkSessionResource(), []
    together = threading.Barrier(2, timeout=120)

    def stream(name: str) -> None:
        session = resource.session_of_its_own()
        try:
            with commit_confs(session, {USER_METADATA: json.dumps({"app_id": name})}):
                together.wait()  # both streams' metadata set before either commits
                session.range(1).write.format("delta").save(str(tmp_path / name))
                together.wait()  # neither unset before both committed
        except Exception as exc:  # surfaced by the assertion below
            errors.append(exc)
            together.abort()

    threads = [threading.Thread(target=stream, args=(name,)) for name in ("payments", "movie_ticket_sales")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(180)
    assert not errors, errors
    assert {name: commit_metadata(history_rows(spark, tmp_path / name, 1)[0])["app_id"]
            for name in ("payments", "movie_ticket_sales")} == {"payments": "payments",
                                                                "movie_ticket_sales": "movie_ticket_sales"}
