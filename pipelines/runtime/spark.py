"""The one place a SparkSession is built: Delta extension and catalog, local jars, small-machine defaults.

Three engines, one code path:
- embedded local JVM (default, `master="local[2]"`), Delta jars loaded from the local cache;
- a Spark standalone cluster (`master="spark://host:7077"`), same jars shipped to executors;
- a Spark Connect server (`remote="sc://host:15002"`), whose server must carry Delta itself.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from pyspark.sql import SparkSession

from pipelines.errors import ConfigurationError, EngineUnavailableError
from pipelines.storage.files import DEFAULT_REGION, ENDPOINT_ENV, REGION_ENV, is_object_store
from pipelines.storage.layout import DEFAULT_HOME, HOME_ENV

JARS_ENV = "STATETABLES_JARS_DIR"
# The warm engine every run of the code location connects to when set (`make dev`, `make serve` set it to the
# Spark Connect server they supervise); unset, a run starts its own embedded JVM.
REMOTE_ENV = "STATETABLES_SPARK_REMOTE"
DEFAULT_JARS_DIR = Path(__file__).resolve().parents[2] / ".jars"
DELTA_JAR_PREFIX = "delta-spark_"
# JVM class-data sharing (AppCDS): the classes a pipeline run loads, parsed and verified once by
# `make class-archive` (statetables/class_archive.py) and mapped from this file by every later JVM.
# The smallest Spark + Delta process started ~30% faster with it (docs/performance.md). The archive
# only holds what this JDK and these jars produced: when either changes, the JVM ignores it
# (-Xshare:auto) and starts as it would without.
CLASS_ARCHIVE = "statetables.jsa"
PARALLEL_GC = "-XX:+UseParallelGC"
# A driver JVM that lives for one command (`statetables run`, a savepoint, a restore) spends its first seconds
# compiling Spark's and Delta's code twice, C1 then C2, on the same 2 cores as the work: with C1 only the README's
# first run took 15.3 s instead of 19.1 s (medians of 3, alternated), a run of 20,000 events per stream the same,
# 200,000 per stream 63.4 s against 61.5 s. A JVM that serves many runs (an engine) keeps both; a test session is
# one command (tests/conftest.py).
# C1 only also shrinks the JVM's default code cache from 240 MB to 48 MB, which a run that reads a Kafka topic through
# several batches filled ("Out of space in CodeCache", the JVM's tasks then died): it keeps the tiered default.
ONE_COMMAND_JIT = "-XX:TieredStopAtLevel=1 -XX:ReservedCodeCacheSize=240m"
# ...unless the command has a large batch ahead: then C2's faster code pays for its compiling. A first load of 1M
# payments (125 MB) took 108.8 and 110.9 s with both compilers against 137.7 and 125.9 s with C1 only (alternated,
# the same day; the session step alone 27 s against 39-48 s), while +100k on that history (13 MB) took 69.3 and
# 72.2 s with both against 61.1 and 64.6 s. The threshold lies between the two. `statetables run` decides from the
# landing bytes its streams have waiting, before the JVM starts (statetables/cli.py).
LARGE_RUN_BYTES = 64 * 2**20
# ...and C2 compiles only what stays hot: after four times the calls and loop turns HotSpot's defaults ask. Such a run's
# JIT threads took over a third of its CPU (28-29 of 79-84 CPU-s for a first load of 1M payments, the 2 cores busy
# throughout), much of it C2 compiling code the run calls a few thousand times and leaves (the planner, Janino, ANTLR,
# Java serialization). That first load: 42.3, 41.4, 41.9, 44.2 s against 45.8, 43.4, 44.0, 46.7 s (alternated, the
# same hour), its JIT threads 23-24 CPU-s against 28-29. Ten times the thresholds gained no more; 25 times lost it
# again (C1's slower code ran longer).
LARGE_RUN_JIT = ("-XX:Tier4InvocationThreshold=20000 -XX:Tier4MinInvocationThreshold=2400 "
                 "-XX:Tier4CompileThreshold=60000 -XX:Tier4BackEdgeThreshold=160000")
# Where C2 compiles (a JVM that serves many runs, a large run), it may compile Spark's generated methods of more than
# 8,000 bytes of bytecode too, which HotSpot otherwise leaves interpreted: whole-stage code generation writes
# methods up to 64 KB (`spark.sql.codegen.hugeMethodLimit`), and a large batch's validation and session windows are
# such methods. A first load of 1M payments: 97.5 and 106.5 s against 112.6 and 110.0 s without it (130 and 141
# task-s against 142 and 148; alternated, the same day).
COMPILE_HUGE_METHODS = "-XX:-DontCompileHugeMethods"
# A one-command driver's young generation, fixed. The throughput collector otherwise grows it towards the whole heap
# under a large batch's allocation rate, and the heap's pages stay resident: a first load of 1M payments peaked at
# 2,361-2,471 MB of JVM RSS with it sized by the collector, 1,845-1,873 MB with it fixed; wall time within noise
# there and for cold runs of 300 payments (medians 16.03 and 16.11 s, six pairs alternated).
ONE_COMMAND_YOUNG = "-Xmn384m"
# More options for the JVM of a Spark Connect server the project starts (`statetables connect-server`, `dev`,
# `serve`, and the tests' servers), and for its executors when its master is a cluster: e.g. ONE_COMMAND_JIT for a
# server that lives a few runs (the test suite sets that: one thin-client run of 1,500 events per stream cost such a
# server 33-37 s of CPU instead of 61-65 s, measured).
ENGINE_JAVA_OPTIONS_ENV = "STATETABLES_ENGINE_JAVA_OPTIONS"
# The project's own JVM code (jvm/, `make jars`).
JVM_JAR = "statetables-jvm.jar"
# Without Hadoop's native library (Spark ships none), Hadoop's local file system starts a `chmod` process for every
# file and folder it creates and a `readlink` for each side of every rename (each Delta commit, each checkpoint
# file): ~250 processes in a micro-batch of 300 payments, spawned by a 2 GiB JVM (profiled). jvm/'s file systems
# answer both inside the JVM: a warm micro-batch 3.3-3.8 s -> 2.8-3.0 s (docs/performance.md).
LOCAL_FILE_SYSTEMS = {
    "spark.hadoop.fs.file.impl": "statetables.jvm.LocalFileSystemWithoutForks",
    "spark.hadoop.fs.AbstractFileSystem.file.impl": "statetables.jvm.LocalFsWithoutForks",
}
LOG4J_CONFIG = Path(__file__).with_name("log4j2.properties")  # Spark's logging: errors only

# What every engine's session needs for the tables to mean the same thing (local, cluster, Connect), and for a run to
# end.
# Parquet INT96 timestamps (Spark's default) cannot be read by other Delta readers (`deltalake`) for
# instants outside 1677-2262; INT64 micros can. Files written before keep INT96: Spark reads both.
# A commit that adds no file is still made: a batch's bronze commit carries its counts and ids even when every line
# was a duplicate, and a step's commit records the bronze version it has folded (Delta skips such commits by default).
SESSION_CONFS = {
    "spark.sql.session.timeZone": "UTC",
    "spark.sql.parquet.outputTimestampType": "TIMESTAMP_MICROS",
    "spark.databricks.delta.skipRecordingEmptyCommits": "false",
    # A streaming query's stop waits this long for the query's thread to end (Spark's default: forever), then fails
    # with that thread's stack. A stop that lands as a micro-batch starts can leave the thread waiting on its
    # foreachBatch worker for good (apache/spark SPARK-57963): a cancelled run must still end. Runs stop a query once
    # its running micro-batch has committed (pipelines/runtime/query.py).
    "spark.sql.streaming.stopTimeout": "60s",
}
# Sized for a 2-core, 24 GiB machine; any key can be overridden through `SparkSettings.conf`.
LOCAL_DEFAULTS = {
    "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
    "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
    # One partition per core: a small micro-batch then costs one task per stage instead of two waves.
    "spark.sql.shuffle.partitions": "2",
    "spark.default.parallelism": "2",
    # A join whose smaller side fits a hash map of a partition hashes it instead of sorting both sides: a state
    # table's MERGE joins the batch's keys with every row of the files they touch, and with 100k random keys that is
    # the whole table.
    "spark.sql.join.preferSortMergeJoin": "false",
    # Adaptive execution re-plans a query at each shuffle, as a Spark job of its own per stage, to size partitions
    # and pick joins from what it measured: with two shuffle partitions on two cores there is little to resize, and
    # a warm +100k run made 54 jobs instead of 97 and took 5% less time without it (runs 2-3 of four alternated warm
    # pairs, 8.26 s against 8.73 s); the 1M bulk run took the same (docs/performance.md).
    "spark.sql.adaptive.enabled": "false",
    # Spark keeps 100 compiled classes by default; one ingest batch generates ~124 distinct ones, so every
    # batch compiled all of them again (~178 compiles: a third of the JVM's Java samples, profiled).
    # Read once, when the JVM starts.
    "spark.sql.codegen.cache.maxEntries": "2000",
    # Delta reconstructs table state with 50 partitions by default: far too many for 2 cores.
    "spark.databricks.delta.snapshotPartitions": "2",
    # VACUUM lists a table's files in a job of this many tasks (Spark's default 10,000): 173–232 s a VACUUM of a
    # 4-file table on this machine, 4–6 s with 8 (measured, another run sharing the cores). Maintenance runs one
    # per table; a cluster listing very large tables may raise it.
    "spark.sql.sources.parallelPartitionDiscovery.parallelism": "8",
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    # A batch that is not small keeps its frames on local disk (storage.frames.kept), not in the heap: then 1M
    # payments ran as fast with 1 GiB as with 4 GiB. But 1M sales (files of 100k lines, each split in one task) ran
    # out of 1 GiB.
    "spark.driver.memory": "2g",
    "spark.sql.streaming.stopGracefullyOnShutdown": "true",
    # PySpark records the Python call site of every DataFrame and Column call in the JVM, for errors' query
    # context: about ten py4j round trips each, F.col 0.69 -> 0.31 ms without it. A micro-batch builds its plans
    # from hundreds of such calls (a warm 300-payment batch without event time, medians 1.35 and 1.43 s -> 1.30 and
    # 1.29 s, two pairs). Errors keep their message and Spark's stack; they lose the Python line in the query.
    "spark.python.sql.dataFrameDebugging.enabled": "false",
}
# S3A on an object-store root; measured and explained in docs/deploy.md.
OBJECT_STORE_DEFAULTS = {
    # Delta's S3 log store lists a table's whole log (a LIST page per 5,000 keys) each time it looks for new
    # commits, unless this is on: then the listing starts after the version it looks from (S3's StartAfter). A log
    # keeps 30 days of commits, and a run of 2,000 events looked 82 times (docs/deploy.md).
    "spark.hadoop.delta.enableFastS3AListFrom": "true",
}
# What a driver JVM prints at its start whatever it is asked: Spark's launcher always adds the Vector API's
# incubator module (JavaModuleOptions), and the JVM warns about it, with no flag to silence that; Spark, started as
# PySpark's shell, says it set the shell's log level even when log4j2.properties sets every level.
JVM_START_NOISE = (b"WARNING: Using incubator modules:", b'Setting default log level to "',
                   b"To adjust logging level use sc.setLogLevel(newLevel).")


@dataclass(frozen=True)
class SparkSettings:
    master: str = "local[2]"
    remote: str | None = None
    jars_dir: str | None = None
    app_name: str = "statetables"
    conf: dict[str, str] = field(default_factory=dict)
    one_command: bool = False  # the driver JVM ends with the command that starts it (ONE_COMMAND_JIT)
    large_run: bool = False  # a one-command JVM with LARGE_RUN_BYTES or more to read: it keeps C2 too


def default_remote() -> str | None:
    """The Spark Connect URL in $STATETABLES_SPARK_REMOTE, checked; None when unset (the embedded engine)."""
    remote = os.environ.get(REMOTE_ENV, "").strip()
    if remote:
        engine_address(remote)
    return remote or None


def engine_address(remote: str) -> tuple[str, int]:
    """(host, port) of a Spark Connect URL `sc://host:port[/;params]`; a malformed URL fails naming the fix."""
    url = urlparse(remote)
    try:
        port = url.port or 15002
    except ValueError:
        port = None
    if url.scheme != "sc" or not url.hostname or port is None:
        raise ConfigurationError(f"Spark Connect URL {remote!r} is not sc://HOST:PORT. Fix: e.g. sc://127.0.0.1:15002 "
                                 f"(the `spark` resource's `remote`, or ${REMOTE_ENV}).")
    return url.hostname, port


def engine_answers(remote: str, timeout_s: float = 2.0) -> bool:
    """Whether something accepts connections at the Connect server's address."""
    try:
        with socket.create_connection(engine_address(remote), timeout=timeout_s):
            return True
    except OSError:
        return False


def wait_for_engine(remote: str, wait_s: float) -> None:
    """Return once the Connect server at `remote` accepts connections; wait up to `wait_s` for a supervisor
    (`make dev`, `make serve`) to bring a dead one back, then fail naming the fix."""
    deadline = time.monotonic() + wait_s
    while not engine_answers(remote):
        if time.monotonic() >= deadline:
            raise EngineUnavailableError(
                f"The Spark engine at {remote} does not answer (waited {wait_s:.0f}s); nothing was written. Fix: "
                f"start it (`make dev` and `make serve` start and restart it by themselves; alone: `make "
                f"connect-server`), or run on the embedded engine: unset {REMOTE_ENV}, or set the `spark` "
                f"resource's `remote` to null in the launchpad.")
        time.sleep(0.5)


def delta_jars(jars_dir: str | os.PathLike | None = None) -> list[Path]:
    """The cached Delta jars; fails with the command that fetches them when they are missing."""
    folder = Path(jars_dir or os.environ.get(JARS_ENV) or DEFAULT_JARS_DIR)
    jars = sorted(folder.glob("*.jar")) if folder.is_dir() else []
    if not any(j.name.startswith(DELTA_JAR_PREFIX) for j in jars):
        raise ConfigurationError(
            f"No Delta jars ({DELTA_JAR_PREFIX}*.jar) in {folder}. "
            f"Fix: run `make jars` once (resolves them with Maven into .jars/), "
            f"or point {JARS_ENV} at a folder that holds them."
        )
    return jars


S3_JARS_SUBDIR = "s3"
S3_JAR = "hadoop-aws-"


def object_store_root() -> str | None:
    """The storage root when it is on an object store ($STATETABLES_HOME = s3a://...), else None."""
    home = os.environ.get(HOME_ENV, "").strip()
    return home if is_object_store(home) else None


def warehouse_dir() -> str:
    """Spark's warehouse folder (`spark.sql.warehouse.dir`), under the storage root: Spark's default is
    `./spark-warehouse` in the working folder, which it creates as soon as its catalog is used. No table of the
    project lives there (every table is a path), but nothing the project writes may land outside the root."""
    home = os.environ.get(HOME_ENV, "").strip() or DEFAULT_HOME
    if is_object_store(home):
        return home.rstrip("/") + "/spark-warehouse"
    return (Path(home).resolve() / "spark-warehouse").as_uri()


def object_store_jars(jars_dir: str | os.PathLike | None = None) -> list[Path]:
    """Hadoop's S3A connector and the AWS SDK modules it needs (`make jars-s3`), kept apart from the jars every run
    loads, so that a local-disk install never fetches them."""
    folder = Path(jars_dir or os.environ.get(JARS_ENV) or DEFAULT_JARS_DIR) / S3_JARS_SUBDIR
    jars = sorted(folder.glob("*.jar")) if folder.is_dir() else []
    if not any(j.name.startswith(S3_JAR) for j in jars):
        raise ConfigurationError(
            f"The storage root {object_store_root()} is on an object store, and Hadoop's S3 connector "
            f"({S3_JAR}*.jar) is not in {folder}. Fix: run `make jars-s3` once (resolves it with Maven), or set "
            f"{HOME_ENV} to a local folder.")
    return jars


KAFKA_JARS_SUBDIR = "kafka"
KAFKA_JAR = "spark-sql-kafka-"


def kafka_jars(jars_dir: str | os.PathLike | None = None) -> list[Path]:
    """Spark's Kafka source and sink (format("kafka")) and what they need beyond pyspark (`make jars-kafka`), or [] when
    they were not fetched: in a subfolder of their own, so that an install without Kafka (`make demo`) never needs
    them, and every engine loads them whenever they are there."""
    folder = Path(jars_dir or os.environ.get(JARS_ENV) or DEFAULT_JARS_DIR) / KAFKA_JARS_SUBDIR
    jars = sorted(folder.glob("*.jar")) if folder.is_dir() else []
    return jars if any(j.name.startswith(KAFKA_JAR) for j in jars) else []


def require_kafka_jars(jars_dir: str | os.PathLike | None = None) -> list[Path]:
    """The Kafka jars, or a ConfigurationError naming the command that fetches them."""
    jars = kafka_jars(jars_dir)
    if not jars:
        folder = Path(jars_dir or os.environ.get(JARS_ENV) or DEFAULT_JARS_DIR) / KAFKA_JARS_SUBDIR
        raise ConfigurationError(
            f"Spark's Kafka connector ({KAFKA_JAR}*.jar) is not in {folder}, so Spark cannot read or write Kafka. "
            f"Fix: run `make jars-kafka` once (resolves it with Maven).")
    return jars


def object_store_confs() -> dict[str, str]:
    """Hadoop S3A's settings for the storage root's store, from the same environment boto3 reads
    (pipelines/storage/files.py): the endpoint, the region, the credentials. Passed as Spark confs so that executors on
    other hosts get them from the driver. Spark redacts the secret in its UI and logs (`spark.redaction.regex`)."""
    endpoint = os.environ.get(ENDPOINT_ENV, "").strip()
    conf = {"spark.hadoop.fs.s3a.endpoint.region": os.environ.get(REGION_ENV) or DEFAULT_REGION}
    if endpoint:
        conf.update({"spark.hadoop.fs.s3a.endpoint": endpoint, "spark.hadoop.fs.s3a.path.style.access": "true",
                     "spark.hadoop.fs.s3a.connection.ssl.enabled": str(endpoint.startswith("https")).lower()})
    for variable, key in (("AWS_ACCESS_KEY_ID", "access.key"), ("AWS_SECRET_ACCESS_KEY", "secret.key"),
                          ("AWS_SESSION_TOKEN", "session.token")):
        if os.environ.get(variable):
            conf[f"spark.hadoop.fs.s3a.{key}"] = os.environ[variable]
    if os.environ.get("AWS_SESSION_TOKEN"):
        conf["spark.hadoop.fs.s3a.aws.credentials.provider"] = \
            "org.apache.hadoop.fs.s3a.TemporaryAWSCredentialsProvider"
    return {**conf, **OBJECT_STORE_DEFAULTS}


def class_archive_options(jars_dir: str | os.PathLike | None = None) -> str | None:
    """Driver JVM options that map the class archive, if `make class-archive` built one."""
    archive = Path(jars_dir or os.environ.get(JARS_ENV) or DEFAULT_JARS_DIR) / CLASS_ARCHIVE
    if not archive.is_file():
        return None
    return f"-XX:SharedArchiveFile={archive} -Xshare:auto -Xlog:cds=off -Xlog:cds+dynamic=off"


def local_file_system_confs(jars_dir: str | os.PathLike | None = None) -> dict[str, str]:
    """The confs that give a driver JVM on this host jvm/'s local file systems (LOCAL_FILE_SYSTEMS), or none when the
    project's jar is missing (the validator's check then names the fix). The jar goes on the JVM's class path, not
    only on spark.jars: spark-submit reads local files before it loads those. Not for a cluster's executors, which
    may run where the jar is not: they keep Hadoop's own."""
    jar = Path(jars_dir or os.environ.get(JARS_ENV) or DEFAULT_JARS_DIR) / JVM_JAR
    return {"spark.driver.extraClassPath": str(jar), **LOCAL_FILE_SYSTEMS} if jar.is_file() else {}


def require_java() -> None:
    java_home = os.environ.get("JAVA_HOME")
    if java_home and (Path(java_home) / "bin" / "java").exists():
        return
    if shutil.which("java"):
        return
    raise ConfigurationError(
        "Java was not found (no JAVA_HOME/bin/java and no `java` on PATH); the embedded Spark "
        "engine needs Java 17. Fix: install it (`apt-get install openjdk-17-jdk-headless`) or set "
        "JAVA_HOME, or connect to a Spark Connect server with `remote`."
    )


def session_confs(settings: SparkSettings | None = None) -> dict[str, str]:
    """Every conf the session is built with, `spark.master` or `spark.remote` included: what
    `SparkSession.builder.config(key, value)` takes, one key at a time. Checks Java and the Delta jars first
    (not needed over Connect: the server holds them)."""
    settings = settings or SparkSettings()
    if settings.remote:
        # Spark Connect: the server holds Delta's jars and extensions; no local JVM is started.
        return {"spark.remote": settings.remote, **SESSION_CONFS, **settings.conf}

    require_java()
    jars = delta_jars(settings.jars_dir)
    if object_store_root():
        jars += object_store_jars(settings.jars_dir)
    # Spark's Kafka connector when fetched: on spark.jars it reaches a cluster's executors too.
    jars += kafka_jars(settings.jars_dir)
    conf = {"spark.master": settings.master, "spark.app.name": settings.app_name,
            **SESSION_CONFS, **LOCAL_DEFAULTS, "spark.jars": ",".join(str(j) for j in jars),
            "spark.sql.warehouse.dir": warehouse_dir()}
    if settings.master.startswith(("local", "spark://127.0.0.1:", "spark://localhost:")):
        # The engine is on this host only: keep the driver on loopback.
        conf.update({"spark.driver.host": "127.0.0.1", "spark.driver.bindAddress": "127.0.0.1"})
        # Python workers (foreachBatch over Connect, Python UDFs) need this interpreter's packages (the
        # project, pyarrow); pyspark takes their interpreter from PYSPARK_PYTHON only, else `python3` on PATH.
        # On a cluster of other hosts, set `spark.pyspark.python` to the workers' interpreter (docs/deploy.md).
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    if settings.master.startswith("local"):  # the tasks run in the driver's JVM
        conf.update(local_file_system_confs(settings.jars_dir))
    # Applies when this call starts the driver JVM (spark-submit reads it before launching java).
    archive = class_archive_options(settings.jars_dir)
    # The throughput collector: short pauses do not matter to batches, and G1's concurrent work competes
    # for the 2 cores (8% less wall time on small runs, measured).
    c1_only = settings.one_command and not settings.large_run
    options = [archive, PARALLEL_GC, ONE_COMMAND_JIT if c1_only else None, None if c1_only else COMPILE_HUGE_METHODS,
               LARGE_RUN_JIT if settings.one_command and settings.large_run else None,
               ONE_COMMAND_YOUNG if settings.one_command else None,
               f"-Dlog4j2.configurationFile=file:{LOG4J_CONFIG}"]
    conf["spark.driver.extraJavaOptions"] = " ".join(o for o in options if o)
    if settings.one_command and not settings.large_run and not settings.master.startswith("local"):
        # A cluster's executors for this application end with it too: a run of 1,500 payments on a standalone
        # worker took 31.7 s instead of 35.5 s, its executor 13 s of CPU instead of 29 s (two runs each, alternated).
        conf["spark.executor.extraJavaOptions"] = ONE_COMMAND_JIT
    if object_store_root():
        conf.update(object_store_confs())
    conf.update(settings.conf)
    return conf


@contextmanager
def jvm_start_noise_filtered():
    """Start the driver JVM inside this block: its stderr passes through a filter that drops JVM_START_NOISE and
    forwards every other line, for the JVM's whole life; this process's own stderr is back when the block ends.
    Hand-written: pyspark starts the JVM with this process's stderr, and offers no hook for it."""
    read_fd, write_fd = os.pipe()
    target = os.dup(2)

    def forward() -> None:
        with os.fdopen(read_fd, "rb") as lines, os.fdopen(target, "wb", buffering=0) as out:
            for line in lines:
                if not line.startswith(JVM_START_NOISE):
                    out.write(line)

    threading.Thread(target=forward, name="jvm-stderr", daemon=True).start()
    sys.stderr.flush()
    saved = os.dup(2)
    os.dup2(write_fd, 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        os.close(write_fd)  # the JVM holds its own copy; the filter ends when the JVM does


def new_connect_session(settings: SparkSettings) -> SparkSession:
    """A new Spark Connect session to `settings.remote`, with the project's confs, beside the process's others: a
    session's confs are its own (resources/spark.py, `session_of_its_own`, says why that matters)."""
    builder = SparkSession.builder
    for key, value in session_confs(settings).items():
        builder = builder.config(key, value)
    return builder.create()


def build_spark_session(settings: SparkSettings | None = None) -> SparkSession:
    """Return the process's SparkSession with Delta, creating it (and its JVM) once. The Dagster resource
    (resources/spark.py) builds the same session from `session_confs` through dagster-pyspark.

    >>> spark = build_spark_session(SparkSettings(master="local[2]"))
    """
    builder = SparkSession.builder
    for key, value in session_confs(settings).items():
        builder = builder.config(key, value)
    with jvm_start_noise_filtered():
        return builder.getOrCreate()


_EARLY: dict = {}  # the settings of the session `start_session_early` builds, and its thread


def start_session_early(settings: SparkSettings) -> None:
    """Start building the process's embedded session for `settings` in a thread of its own, and return: the caller
    (`statetables run`) loads Dagster and its definitions meanwhile, single-threaded Python, while the JVM starts
    on the other core. The Dagster resource takes that session (`take_early_session`). An error here is not
    raised: the resource's own start meets it again and names the fix."""
    def start() -> None:
        try:
            build_spark_session(settings)
        except Exception:  # noqa: BLE001 - raised again, with its fix, by the run's own start
            pass

    thread = threading.Thread(target=start, name="spark-early-start", daemon=True)
    _EARLY.update(settings=settings, thread=thread)
    thread.start()


def take_early_session() -> SparkSettings | None:
    """Wait for the session `start_session_early` is building, and take it: the settings it was built for (None: none
    was, or another caller took it)."""
    thread = _EARLY.pop("thread", None)
    if thread is None:
        return None
    thread.join()
    return _EARLY.pop("settings")
