"""The Spark session as a Dagster resource: a thin client of a warm engine, or one embedded JVM per run."""

from __future__ import annotations

from typing import Any

import dagster as dg
from dagster_pyspark import LazyPySparkResource
from dagster_pyspark.resources import spark_session_from_config
from pydantic import Field

from pipelines.errors import ConfigurationError
from pipelines.runtime.spark import (
    REMOTE_ENV, SparkSettings, engine_address, jvm_start_noise_filtered,
    new_connect_session, session_confs, take_early_session, wait_for_engine,
)

# The run tag that shows, on every run in the UI, which engine the run used.
ENGINE_TAG = "statetables/spark_engine"


class SparkSessionResource(LazyPySparkResource):
    """Spark with Delta: dagster-pyspark's lazy session, built on first use of `spark_session`, so runs and
    checks that never touch Spark start nothing. Three engines:
    - `remote` (sc://host:15002): a thin client of a warm Spark Connect server; what `make dev` and `make serve`
      configure (statetables/definitions.py takes it from $STATETABLES_SPARK_REMOTE);
    - otherwise an embedded JVM of the run's own (`master` local[2]), or a standalone cluster (`master`
      spark://host:7077).

    dagster-pyspark builds the session from a flat dict of confs; pipelines/runtime/spark.py (the one place that knows
    them) supplies that dict after checking Java and the Delta jars, adds the class archive and Delta's extension,
    and turns `remote` into `spark.remote`, which pyspark's builder takes for a Connect session. Use
    `spark_session` only: the inherited `spark_context` does not exist over Spark Connect."""

    master: str = Field(default="local[2]", description="spark.master: local[N] or spark://host:7077.")
    remote: str | None = Field(default=None, description=(
        f"Spark Connect URL (sc://host:15002) of a warm engine; overrides master. Default: ${REMOTE_ENV}."))
    engine_wait_seconds: float = Field(default=45.0, description=(
        "Over Connect: how long a run waits for a server that does not answer (a supervisor restarting it) before "
        "it fails, naming the fix."))
    jars_dir: str | None = Field(default=None, description="Folder with the Delta jars; default .jars/ from `make jars`.")
    spark_config: dict[str, Any] = Field(default_factory=dict, description=(
        "Extra Spark confs, over the project's defaults (pipelines/runtime/spark.py), e.g. spark.driver.memory."))
    one_command: bool = Field(default=False, description=(
        "The embedded JVM ends with this run (`statetables run` sets it): it compiles with C1 only, which starts a "
        "short run ~20% faster. Leave it off where one JVM serves many runs or a run that does not end."))
    large_run: bool = Field(default=False, description=(
        "With `one_command`: the run has a large batch ahead (`statetables run` sets it from the landing bytes "
        "waiting), so the JVM keeps C2 as well, whose faster code pays for its compiling."))

    @classmethod
    def _is_dagster_maintained(cls) -> bool:
        return False  # a project resource built on dagster-pyspark's, not dagster-pyspark's own

    def engine(self) -> str:
        """What the run's Spark is, as the UI shows it: the Connect URL, or the embedded/cluster master."""
        if self.remote:
            return self.remote
        return f"embedded {self.master}" if self.master.startswith("local") else self.master

    def setup_for_execution(self, context: dg.InitResourceContext) -> None:
        if self.remote:
            engine_address(self.remote)  # a malformed URL fails the run before any step
        if context.instance is not None and context.run is not None:
            context.instance.add_run_tags(context.run.run_id, {ENGINE_TAG: self.engine()})

    def session_of_its_own(self) -> Any:
        """A session for one of several streams advanced side by side (the continuous job), with the run's confs
        and a SQL conf of its own. A stream's commits carry their metadata in a session conf
        (pipelines/storage/delta_log.py, `commit_confs`): two streams sharing one session could commit under each
        other's app id and bronze version, and a run reading that version would fold bronze again. Embedded or
        standalone, a new session of the run's JVM (its confs are the context's, which the run's were built into);
        over Connect, a new Connect session with the same confs, as foreachBatch runs in the session that started
        the query."""
        if not self.remote:
            return self.spark_session.newSession()
        return new_connect_session(SparkSettings(remote=self.remote,
                                                 conf={k: str(v) for k, v in self.spark_config.items()}))

    def _init_session(self) -> None:
        if self._spark_session is None:
            if self.remote:
                wait_for_engine(self.remote, self.engine_wait_seconds)
            settings = SparkSettings(master=self.master, remote=self.remote, jars_dir=self.jars_dir,
                                     conf={k: str(v) for k, v in self.spark_config.items()},
                                     one_command=self.one_command, large_run=self.large_run)
            early = take_early_session()
            if early is not None and early != settings:
                # A JVM's options and jars are fixed once it runs: the session started early would be used as is.
                raise ConfigurationError(
                    f"The Spark session started before the run ({early}) differs from the run's ({settings}): a "
                    f"statetables bug. Fix: report it; meanwhile set the spark resource's config only through "
                    f"`statetables run`'s options.")
            # getOrCreate inside: every asset and check of a run shares the one session.
            with jvm_start_noise_filtered():
                self._spark_session = spark_session_from_config(session_confs(settings))
