"""The Spark session as a Dagster resource: one session, one JVM, per run."""

from __future__ import annotations

from typing import Any

from dagster_pyspark import LazyPySparkResource
from dagster_pyspark.resources import spark_session_from_config
from pydantic import Field

from pipelines.session import SparkSettings, jvm_start_noise_filtered, session_confs


class SparkSessionResource(LazyPySparkResource):
    """Spark with Delta Lake: dagster-pyspark's lazy session, built on first use of `spark_session`, so runs and
    checks that never touch Spark do not start a JVM. Local JVM by default; a standalone cluster with `master`,
    a Spark Connect server with `remote`.

    dagster-pyspark builds the session from a flat dict of confs; pipelines/session.py (the one place that knows
    them) supplies that dict after checking Java and the Delta jars, adds the class archive and Delta's extension,
    and turns `remote` into `spark.remote`, which pyspark's builder takes for a Connect session. Use
    `spark_session` only: the inherited `spark_context` does not exist over Spark Connect."""

    master: str = Field(default="local[2]", description="spark.master: local[N] or spark://host:7077.")
    remote: str | None = Field(default=None, description="Spark Connect URL (sc://host:15002); overrides master.")
    jars_dir: str | None = Field(default=None, description="Folder with the Delta jars; default .jars/ from `make jars`.")
    spark_config: dict[str, Any] = Field(default_factory=dict, description=(
        "Extra Spark confs, over the project's defaults (pipelines/session.py), e.g. spark.driver.memory."))

    @classmethod
    def _is_dagster_maintained(cls) -> bool:
        return False  # a project resource built on dagster-pyspark's, not dagster-pyspark's own

    def _init_session(self) -> None:
        if self._spark_session is None:
            settings = SparkSettings(master=self.master, remote=self.remote, jars_dir=self.jars_dir,
                                     conf={k: str(v) for k, v in self.spark_config.items()})
            # getOrCreate inside: every asset and check of a run shares the one session.
            with jvm_start_noise_filtered():
                self._spark_session = spark_session_from_config(session_confs(settings))
