"""`statetables run` on ordinary payment data with every check on (issue 26): generated payments at second
resolution, plus customers whose payments are exactly 30:00 and 29:59.999 apart, the edge where the old
sessions check disagreed with the operator and failed every run. The run must succeed with every check
passed, and the sessions at the edge must be cut by the contract's rule. In process, through the CLI's own
entry point, so the worker's SparkSession is the run's."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from deltalake import DeltaTable as IndependentDeltaTable

from pipelines.errors import ConfigurationError
from pipelines.ingest.generate import generate
from tests.streams import PAYMENTS
from statetables import cli

START = datetime(2026, 11, 10, tzinfo=timezone.utc)


def _payment(payment_id: str, customer: str, at: datetime) -> str:
    return (f'{{"payment_id":"{payment_id}","customer_id":"{customer}","amount":"2.00",'
            f'"paid_at":"{at.isoformat(timespec="milliseconds").replace("+00:00", "Z")}"}}')


def test_run_passes_every_check_on_second_resolution_payments(spark, layout, landing, monkeypatch, capsys):
    monkeypatch.setenv("STATETABLES_HOME", str(layout.home))
    monkeypatch.setenv("DAGSTER_HOME", str(layout.home / "dagster"))
    # 1,000 payments of 100 customers over ~2 hours, most at whole seconds (pipelines/ingest/generate.py): what
    # failed the old check was the resolution, not the volume.
    generate(PAYMENTS, layout.landing(PAYMENTS.name), events=1_000, seed=26, customers=100, start=START)
    edge = START + timedelta(hours=2)
    landing.write(PAYMENTS.name, "edge.jsonl", [
        _payment("x1", "edge-exact", edge), _payment("x2", "edge-exact", edge + timedelta(minutes=30)),
        _payment("y1", "edge-less", edge), _payment("y2", "edge-less", edge + timedelta(minutes=30, milliseconds=-1))])

    assert cli.main(["run", "--job", "advance_payments"]) == 0
    printed = capsys.readouterr().out
    assert "SUCCESS" in printed and "FAILED" not in printed
    assert "check customer_activity:reconcile_with_bronze passed" in printed
    assert "check payments_per_customer:totals_match_bronze passed" in printed
    sessions = sorted((r["customer_id"], r["payment_count"])
                      for r in IndependentDeltaTable(str(layout.table(PAYMENTS.event_time_tables[0].name))).to_pyarrow_table().to_pylist()
                      if r["customer_id"].startswith("edge-"))
    assert sessions == [("edge-exact", 1), ("edge-exact", 1), ("edge-less", 2)]


def test_the_session_a_run_starts_before_dagster_loads_is_the_one_its_resource_takes(spark):
    """`statetables run` starts its embedded JVM while Dagster loads; the `spark` resource takes that session, once,
    and refuses one started with other settings (its JVM's options could no longer change)."""
    from pipelines.runtime.spark import SparkSettings, start_session_early, take_early_session
    from resources.spark import SparkSessionResource

    settings = SparkSettings(one_command=True)
    start_session_early(settings)
    assert take_early_session() == settings and take_early_session() is None
    start_session_early(settings)
    with pytest.raises(ConfigurationError, match="differs from the run's"):
        SparkSessionResource(one_command=False)._init_session()
    assert take_early_session() is None


def test_a_run_keeps_the_code_locations_engine_and_only_an_embedded_jvm_that_ends_with_it_compiles_quickly(monkeypatch):
    """The `spark` resource's run config is whole (it replaces what the code location configured): without --remote
    or --master a run still goes to $STATETABLES_SPARK_REMOTE's server."""
    monkeypatch.setenv("STATETABLES_SPARK_REMOTE", "sc://127.0.0.1:15002")
    assert cli.spark_config(None, None, "advance_all") == {"remote": "sc://127.0.0.1:15002", "one_command": True, "large_run": False}
    assert cli.spark_config(None, "local[2]", "advance_all") == {"master": "local[2]", "remote": None,
                                                                "one_command": True, "large_run": False}
    assert cli.spark_config("sc://h:1", None, "run_continuously") == {"remote": "sc://h:1", "one_command": False, "large_run": False}
    monkeypatch.delenv("STATETABLES_SPARK_REMOTE")
    assert cli.spark_config(None, None, "advance_all") == {"remote": None, "one_command": True, "large_run": False}


def test_an_embedded_run_with_a_large_batch_ahead_keeps_both_compilers(tmp_path, monkeypatch):
    """`large_run` comes from the landing bytes the job's own streams have waiting (no JVM is asked): a stream's
    files count for its job and advance_all, not for another stream's job; a Connect server's JVM is not the run's."""
    from pipelines.runtime import spark as runtime_spark
    from pipelines.storage.layout import StorageLayout

    monkeypatch.delenv("STATETABLES_SPARK_REMOTE", raising=False)
    monkeypatch.setattr(runtime_spark, "LARGE_RUN_BYTES", 1_000)
    layout = StorageLayout.under(tmp_path)
    landing = layout.landing(PAYMENTS.name)
    landing.mkdir(parents=True)
    (landing / "small.jsonl").write_text(_payment("p-1", "c-1", START) + "\n")
    assert cli.spark_config(None, None, "advance_payments", layout)["large_run"] is False
    (landing / "large.jsonl").write_text("".join(_payment(f"p-{i}", "c-1", START) + "\n" for i in range(20)))
    assert cli.spark_config(None, None, "advance_payments", layout)["large_run"] is True
    assert cli.spark_config(None, None, "advance_all", layout)["large_run"] is True
    assert cli.spark_config(None, None, "advance_movie_ticket_sales", layout)["large_run"] is False
    assert cli.spark_config("sc://h:1", None, "advance_payments", layout)["large_run"] is False
    assert cli.spark_config(None, None, "run_continuously", layout)["large_run"] is False
