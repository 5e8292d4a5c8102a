"""The Spark session as a Dagster resource: one session, one JVM, per run."""

from __future__ import annotations

import dagster as dg
from pydantic import Field
from pyspark.sql import SparkSession

from pipelines.session import SparkSettings, build_spark_session


class SparkSessionResource(dg.ConfigurableResource):
    """Spark with Delta Lake. Local JVM by default; a standalone cluster with `master`,
    a Spark Connect server with `remote`. The session is built on first use, so runs and
    checks that never touch Spark do not start a JVM."""

    master: str = Field(default="local[2]", description="spark.master: local[N] or spark://host:7077.")
    remote: str | None = Field(default=None, description="Spark Connect URL (sc://host:15002); overrides master.")
    jars_dir: str | None = Field(default=None, description="Folder with the Delta jars; default .jars/ from `make jars`.")
    conf: dict[str, str] = Field(default_factory=dict, description="Extra Spark confs, e.g. spark.driver.memory.")

    def session(self) -> SparkSession:
        # getOrCreate inside: every asset and check of a run shares the one session.
        return build_spark_session(
            SparkSettings(master=self.master, remote=self.remote, jars_dir=self.jars_dir, conf=dict(self.conf))
        )
