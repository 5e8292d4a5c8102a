"""The Dagster instance under the storage root, and the real Dagster webserver + daemon (`dagster dev`) on 127.0.0.1,
started and stopped for the CLI, tests and scripts.

    with dagster_dev(StorageLayout.under("/tmp/st"), port=3111) as url:
        graphql(url, "{ version }")
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from pipelines.storage.layout import HOME_ENV, StorageLayout

REPO_ROOT = Path(__file__).resolve().parent.parent

# Run-granularity pools: the daemon's run queue never runs two runs that share a stream's pool.
INSTANCE_YAML = """\
# Written by `statetables instance`; edit freely, it is not overwritten.
concurrency:
  pools:
    granularity: run
    default_limit: 1
run_coordinator:
  module: dagster.core.run_coordinator
  class: QueuedRunCoordinator
  # A queued run starts within a second (default 5 s): the wait is part of a landing file's freshness.
  config:
    dequeue_interval_seconds: 1
# A run stuck starting or cancelling is marked failed (and recovered by the run-failure sensor). A run
# worker that dies (kill -9) is reported failed by the code server that launched it.
run_monitoring:
  enabled: true
  start_timeout_seconds: 300
  cancel_timeout_seconds: 600
  poll_interval_seconds: 30
telemetry:
  enabled: false
# The state tables' freshness policies (assets/keys.py) are only evaluated, and shown as fresh or stale, with this.
freshness:
  enabled: true
# No sign-up dialog over the UI on a fresh instance.
nux:
  enabled: false
"""


def prepare_instance(layout: StorageLayout) -> Path:
    """Point DAGSTER_HOME at the storage root's dagster/ folder (unless set) and give it a dagster.yaml."""
    home = Path(os.environ.get("DAGSTER_HOME") or layout.dagster_home).resolve()
    home.mkdir(parents=True, exist_ok=True)
    config = home / "dagster.yaml"
    if not config.exists():
        config.write_text(INSTANCE_YAML)
    os.environ["DAGSTER_HOME"] = str(home)
    return home


def graphql(url: str, query: str, variables: dict | None = None) -> dict:
    request = urllib.request.Request(f"{url}/graphql", data=json.dumps({"query": query, "variables": variables or {}})
                                     .encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        body = json.loads(response.read())
    if body.get("errors"):
        raise RuntimeError(f"GraphQL errors: {body['errors']}")
    return body["data"]


_RUNS = """{ runsOrError { ... on Runs { results { runId jobName status tags { key value } } } } }"""


def _require_free_port(port: int, what: str) -> None:
    """Refuse a port something already listens on: a server answering there would be taken for ours."""
    import socket

    with socket.socket() as sock:
        if sock.connect_ex(("127.0.0.1", port)) == 0:
            raise RuntimeError(f"127.0.0.1:{port} is already in use, so {what} cannot listen there. Fix: stop what "
                               f"listens on it (an earlier `make serve` or `make dev`?) or choose another port.")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a server a test or bench starts)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def list_runs(url: str) -> list[dict]:
    """Every run the webserver knows: runId, jobName, status, tags (as a dict)."""
    runs = graphql(url, _RUNS)["runsOrError"]["results"]
    for run in runs:
        run["tags"] = {t["key"]: t["value"] for t in run["tags"]}
    return runs


_LAUNCH = """mutation Launch($params: ExecutionParams!) { launchRun(executionParams: $params) { __typename
  ... on LaunchRunSuccess { run { runId } } ... on PythonError { message }
  ... on RunConfigValidationInvalid { errors { message } } ... on InvalidStepError { invalidStepKey } } }"""
_TERMINATE = """mutation Terminate($runId: String!) { terminateRun(runId: $runId) { __typename
  ... on TerminateRunFailure { message } ... on PythonError { message } } }"""
_RUN = """query Run($runId: ID!) { runOrError(runId: $runId) { __typename ... on Run { status } } }"""
_LOCATION = """{ repositoriesOrError { ... on RepositoryConnection { nodes { name location { name } } } } }"""


def repository(url: str) -> dict:
    """The code location's one repository as the webserver names it: {"name", "location": {"name"}}."""
    return graphql(url, _LOCATION)["repositoriesOrError"]["nodes"][0]


_SENSOR_TICKS = """query Ticks($selector: SensorSelector!, $limit: Int) { sensorOrError(sensorSelector: $selector) {
  ... on Sensor { sensorState { ticks(limit: $limit) { timestamp status } } } } }"""


def sensor_ticks(url: str, sensor: str, limit: int = 5) -> list[dict]:
    """The sensor's newest ticks, newest first: {"timestamp" (epoch seconds), "status"}."""
    located = repository(url)
    selector = {"repositoryLocationName": located["location"]["name"], "repositoryName": located["name"],
                "sensorName": sensor}
    return graphql(url, _SENSOR_TICKS, {"selector": selector, "limit": limit})["sensorOrError"]["sensorState"]["ticks"]


def launch_run(url: str, job: str, run_config: dict | None = None, tags: dict[str, str] | None = None) -> str:
    """Launch `job` through the webserver, as the launchpad does; returns the run id."""
    located = repository(url)
    params = {"selector": {"repositoryLocationName": located["location"]["name"],
                           "repositoryName": located["name"], "jobName": job},
              "runConfigData": run_config or {},
              "executionMetadata": {"tags": [{"key": k, "value": v} for k, v in (tags or {}).items()]}}
    answer = graphql(url, _LAUNCH, {"params": params})["launchRun"]
    if answer["__typename"] != "LaunchRunSuccess":
        raise RuntimeError(f"launching {job} failed: {answer}")
    return answer["run"]["runId"]


def terminate_run(url: str, run_id: str) -> None:
    """Cancel a run as the UI's Terminate button does (SAFE_TERMINATE: the run worker is interrupted)."""
    answer = graphql(url, _TERMINATE, {"runId": run_id})["terminateRun"]
    if answer["__typename"] != "TerminateRunSuccess":
        raise RuntimeError(f"terminating run {run_id} failed: {answer}")


def run_status(url: str, run_id: str) -> str:
    return graphql(url, _RUN, {"runId": run_id})["runOrError"]["status"]


RUN_ENDED = ("CANCELED", "FAILURE", "SUCCESS")


def wait_for_run_end(url: str, run_id: str, timeout_s: float) -> str:
    """Poll the run's status every 2 s until it has ended or `timeout_s` passed; returns the last status seen."""
    deadline = time.monotonic() + timeout_s
    while (status := run_status(url, run_id)) not in RUN_ENDED and time.monotonic() < deadline:
        time.sleep(2)
    return status


@contextmanager
def dagster_dev(layout: StorageLayout, *, port: int, engine_port: int | None = None,
                extra_env: dict[str, str] | None = None, log: Path | None = None,
                ready_timeout_s: float = 180, warm_up_batches: int = 0) -> Iterator[str]:
    """`dagster dev` (webserver, daemon, code server) in its own process group; stopped on exit. With
    `engine_port`, a supervised Spark Connect server on that port first, which every run uses
    ($STATETABLES_SPARK_REMOTE), stopped after Dagster; with `warm_up_batches`, warmed by that many micro-batches
    of each stream before Dagster starts (`statetables warm-up`)."""
    if engine_port is None:
        with _dagster_dev(layout, port=port, extra_env=extra_env, log=log, ready_timeout_s=ready_timeout_s) as url:
            yield url
        return
    from pipelines.runtime.spark import REMOTE_ENV

    _require_free_port(port, "dagster dev")
    engine_log = (log.parent if log else layout.home / "logs") / "spark-connect.log"
    with spark_connect_server(port=engine_port, log=engine_log, extra_env=extra_env, supervise=True) as remote:
        if warm_up_batches > 0:
            warm_up(remote, warm_up_batches, extra_env)
        with _dagster_dev(layout, port=port, extra_env={**(extra_env or {}), REMOTE_ENV: remote}, log=log,
                          ready_timeout_s=ready_timeout_s) as url:
            yield url


def warm_up(remote: str, batches: int, extra_env: dict[str, str] | None = None) -> None:
    """`statetables warm-up` against the engine at `remote`, its progress on this process's output. A warm-up that
    fails leaves the engine as it was, cold: the failure is printed and the engine serves on."""
    done = subprocess.run([sys.executable, "-m", "statetables.cli", "warm-up", "--remote", remote,
                           "--batches", str(batches)], cwd=REPO_ROOT, env={**os.environ, **(extra_env or {})})
    if done.returncode != 0:
        print(f"statetables: the engine's warm-up failed ({done.returncode}, its error above); the engine serves "
              f"cold: its first micro-batches are slower", file=sys.stderr, flush=True)


@contextmanager
def _dagster_dev(layout: StorageLayout, *, port: int, extra_env: dict[str, str] | None,
                 log: Path | None, ready_timeout_s: float) -> Iterator[str]:
    _require_free_port(port, "dagster dev")
    saved = os.environ.get("DAGSTER_HOME")
    os.environ.pop("DAGSTER_HOME", None)
    dagster_home = prepare_instance(layout)
    if saved is None:
        os.environ.pop("DAGSTER_HOME", None)
    else:
        os.environ["DAGSTER_HOME"] = saved
    env = {**os.environ, HOME_ENV: str(layout.home), "DAGSTER_HOME": str(dagster_home), **(extra_env or {})}
    url = f"http://127.0.0.1:{port}"
    log = log or layout.home / "dagster-dev.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    out = open(log, "ab")
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "dagster"), "dev", "-w", str(REPO_ROOT / "workspace.yaml"),
         "-h", "127.0.0.1", "-p", str(port)],
        cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        preexec_fn=_die_with_parent)
    try:
        deadline = time.monotonic() + ready_timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"dagster dev exited with {proc.returncode}; see {out.name}")
            try:
                with urllib.request.urlopen(f"{url}/server_info", timeout=5):
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"dagster dev did not answer on {url} within {ready_timeout_s:.0f}s") from None
                time.sleep(1)
        yield url
    finally:
        _stop(proc)
        out.close()


# ---- Spark engines beyond the embedded JVM: a Spark Connect server and a standalone master + worker ----
# pyspark's pip package ships bin/spark-class and bin/spark-submit and every server jar (the Connect
# server's included), but not the sbin/ start scripts: the servers are launched through them here.

def spark_home() -> Path:
    import pyspark

    return Path(pyspark.__file__).resolve().parent


def _wait_for_port(proc: subprocess.Popen, port: int, what: str, log: Path, timeout_s: float) -> None:
    import socket

    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before listening on 127.0.0.1:{port}; see {log}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not listen on 127.0.0.1:{port} within {timeout_s:.0f}s; see {log}") from None
            time.sleep(0.5)


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the process group, then SIGKILL to whatever of it is left after a grace period: what the leader
    leaves behind (dagster dev's code servers, an engine's Python workers) must not outlive it."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass
    deadline = time.monotonic() + 10
    try:
        while time.monotonic() < deadline:
            os.killpg(proc.pid, 0)  # raises once no process of the group is left
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _die_with_parent() -> None:
    """In the child, before exec: the kernel sends it SIGTERM when the process (thread) that started it dies, even by
    kill -9, so a killed `statetables dev` leaves no server behind (Linux prctl PR_SET_PDEATHSIG; kept across exec)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


PYTHON_WORKER = Path(__file__).with_name("python-worker")


def _engine_env() -> dict[str, str]:
    # The engine's Python workers (foreachBatch over Connect) import the project from this interpreter's
    # environment, and pyspark from there too, byte-compiled (`python-worker`); on loopback only.
    return {**os.environ, "PYSPARK_PYTHON": str(PYTHON_WORKER), "STATETABLES_WORKER_PYTHON": sys.executable,
            "SPARK_LOCAL_IP": "127.0.0.1", "SPARK_HOME": str(spark_home())}


def connect_server_command(port: int, *, jars_dir: str | None = None, conf: dict[str, str] | None = None) -> list[str]:
    """`spark-submit` of Spark's SparkConnectServer carrying Delta's jars, SQL extension and catalog,
    bound to 127.0.0.1 (Spark binds every interface unless told)."""
    from pipelines.runtime.spark import (
        ENGINE_JAVA_OPTIONS_ENV, LOCAL_DEFAULTS, LOG4J_CONFIG, PARALLEL_GC, SESSION_CONFS, class_archive_options,
        delta_jars, kafka_jars, local_file_system_confs, object_store_confs, object_store_jars, object_store_root,
        warehouse_dir,
    )

    jars = delta_jars(jars_dir)
    # An object-store root: the server reads and writes the bucket, with S3A and the environment's credentials.
    store = object_store_root() is not None
    if store:
        jars += object_store_jars(jars_dir)
    # Spark's Kafka connector when fetched (`make jars-kafka`): a client's format("kafka") runs in the server.
    jars += kafka_jars(jars_dir)
    engine_options = os.environ.get(ENGINE_JAVA_OPTIONS_ENV, "").strip()
    confs = {**SESSION_CONFS, **LOCAL_DEFAULTS, **(object_store_confs() if store else {}),
             "spark.sql.warehouse.dir": warehouse_dir(),
             # The class archive: the server's JVM shares the driver's class path (a start of 3.5 s took 2.0 s).
             "spark.driver.extraJavaOptions": " ".join(filter(None, (
                 PARALLEL_GC, f"-Dlog4j2.configurationFile=file:{LOG4J_CONFIG}", class_archive_options(jars_dir),
                 engine_options))),
             "spark.connect.grpc.binding.address": "127.0.0.1",
             "spark.connect.grpc.binding.port": str(port), "spark.driver.host": "127.0.0.1",
             "spark.driver.bindAddress": "127.0.0.1", **(conf or {})}
    if confs.get("spark.master", "local").startswith("local"):  # the tasks run in the server's JVM
        confs = {**local_file_system_confs(jars_dir), **confs}
    elif engine_options:
        confs = {"spark.executor.extraJavaOptions": engine_options, **confs}
    command = [str(spark_home() / "bin" / "spark-submit"), "--class",
               "org.apache.spark.sql.connect.service.SparkConnectServer", "--name", "statetables-connect",
               "--master", confs.pop("spark.master", "local[2]"),
               "--jars", ",".join(str(j) for j in jars)]
    for key, value in confs.items():
        command += ["--conf", f"{key}={value}"]
    return command + ["spark-internal"]


@contextmanager
def spark_connect_server(*, port: int, log: Path, jars_dir: str | None = None, conf: dict[str, str] | None = None,
                         extra_env: dict[str, str] | None = None, supervise: bool = False,
                         ready_timeout_s: float = 120) -> Iterator[str]:
    """A Spark Connect server with Delta on 127.0.0.1:`port`, in its own process group; yields its `sc://` URL and
    stops it on exit. With `supervise`, a server that dies (a crash, kill -9) is started again at once, on the same
    port: the runs that were using it fail and are recovered (assets/automation.py), the next ones wait for it
    (`SparkSessionResource.engine_wait_seconds`)."""
    _require_free_port(port, "the Spark Connect server")
    log.parent.mkdir(parents=True, exist_ok=True)
    out = open(log, "ab")
    command = connect_server_command(port, jars_dir=jars_dir, conf=conf)
    env = {**_engine_env(), **(extra_env or {})}

    def start() -> subprocess.Popen:
        return subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=_die_with_parent)

    server = {"proc": start(), "started": time.monotonic()}
    stopping = threading.Event()

    def restart_when_dead() -> None:
        while not stopping.wait(1.0):
            if server["proc"].poll() is None:
                continue
            code = server["proc"].returncode
            _stop(server["proc"])  # what is left of its process group: the engine's Python workers
            if time.monotonic() - server["started"] < 30 and stopping.wait(5):
                return  # it died young: do not restart it in a tight loop
            print(f"statetables: the Spark Connect server on 127.0.0.1:{port} exited ({code}); starting it again "
                  f"(log: {log})", file=sys.stderr, flush=True)
            server.update(proc=start(), started=time.monotonic())

    supervisor = threading.Thread(target=restart_when_dead, name="engine-supervisor", daemon=True)
    try:
        _wait_for_port(server["proc"], port, "the Spark Connect server", log, ready_timeout_s)
        if supervise:
            supervisor.start()
        yield f"sc://127.0.0.1:{port}"
    finally:
        stopping.set()
        if supervisor.is_alive():
            supervisor.join()
        _stop(server["proc"])
        out.close()


def _apart(user: str | None) -> tuple[list[str], dict[str, str]]:
    """How to start a worker that shares nothing with the driver but the network: the command prefix (another user,
    when this process may switch to one) and an environment of its own, with neither the storage root nor the
    object store's credentials (executors get those from the driver's confs), its home and working folder a new
    temporary folder, unreadable to others."""
    import pwd
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="statetables-worker-"))
    prefix = []
    account = None
    if user is not None and os.geteuid() == 0 and shutil.which("setpriv"):
        try:
            account = pwd.getpwnam(user)
        except KeyError:  # no such user on this host: apart by folder and environment only
            account = None
    if account is not None:
        os.chown(folder, account.pw_uid, account.pw_gid)
        prefix = ["setpriv", f"--reuid={account.pw_uid}", f"--regid={account.pw_gid}", "--clear-groups", "--"]
    folder.chmod(0o700)
    keep = ("PATH", "JAVA_HOME", "LANG", "LC_ALL")
    env = {key: os.environ[key] for key in keep if key in os.environ}
    env.update({"HOME": str(folder), "TMPDIR": str(folder), "SPARK_HOME": str(spark_home()),
                "SPARK_LOCAL_IP": "127.0.0.1", "PYSPARK_PYTHON": sys.executable, "SPARK_NO_DAEMONIZE": "1",
                # For executors given the Connect server's PYSPARK_PYTHON, `python-worker` (Python UDFs only).
                "STATETABLES_WORKER_PYTHON": sys.executable,
                "SPARK_WORKER_DIR": str(folder / "work"), "SPARK_LOCAL_DIRS": str(folder / "local")})
    return prefix, env


@contextmanager
def spark_standalone(*, port: int, log_dir: Path, worker_cores: int = 2, worker_memory: str = "6g",
                     ready_timeout_s: float = 120, worker_apart_as: str | None = None) -> Iterator[str]:
    """A standalone master on 127.0.0.1:`port` and one worker registered with it (web UIs off); yields
    the `spark://` URL and stops both on exit. `worker_apart_as`: the worker runs as that user (when this process is
    root), in a folder and an environment of its own (`_apart`): a second machine, as far as one host allows."""
    _require_free_port(port, "the standalone master")
    log_dir.mkdir(parents=True, exist_ok=True)
    spark_class = str(spark_home() / "bin" / "spark-class")
    env = {**_engine_env(), "SPARK_MASTER_OPTS": "-Dspark.ui.enabled=false", "SPARK_NO_DAEMONIZE": "1",
           "SPARK_WORKER_DIR": str(log_dir / "work")}
    worker_prefix, worker_env = ([], env) if worker_apart_as is None else _apart(worker_apart_as)
    url = f"spark://127.0.0.1:{port}"
    procs: list[subprocess.Popen] = []
    logs = [open(log_dir / "master.log", "ab"), open(log_dir / "worker.log", "ab")]
    try:
        procs.append(subprocess.Popen(
            [spark_class, "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1", "--port", str(port),
             "--webui-port", "0"], env=env, stdout=logs[0], stderr=subprocess.STDOUT, start_new_session=True))
        _wait_for_port(procs[0], port, "the standalone master", log_dir / "master.log", ready_timeout_s)
        procs.append(subprocess.Popen(
            [*worker_prefix, spark_class, "org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1",
             "--webui-port", "0", "--cores", str(worker_cores), "--memory", worker_memory, url],
            env=worker_env, cwd=worker_env.get("HOME"), stdout=logs[1], stderr=subprocess.STDOUT,
            start_new_session=True))
        deadline = time.monotonic() + ready_timeout_s
        while b"Successfully registered with master" not in (log_dir / "worker.log").read_bytes():
            if procs[1].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the standalone worker did not register with {url}; see {log_dir / 'worker.log'}")
            time.sleep(0.5)
        yield url
    finally:
        for proc in reversed(procs):
            _stop(proc)
        for handle in logs:
            handle.close()
        if worker_apart_as is not None:
            shutil.rmtree(worker_env["HOME"], ignore_errors=True)


# ---- A local S3 server: s3proxy (build/s3proxy.pom.xml, `make s3proxy`) over a folder, for the s3a:// root ----
# Each top-level folder of `data_dir` is a bucket, each object a file under it (keys with `/` are folders).
# Measured on s3proxy 4.1.0's filesystem backend: PUT If-None-Match: * is atomic (a hard link: one of 16
# concurrent writers wins, every time); PUT If-Match is checked, then written: refused when the ETag differs
# (412), but NOT atomic: of 16 concurrent writers holding the same ETag, up to 10 succeeded.

S3PROXY_DIR = REPO_ROOT / ".tools" / "s3proxy"
S3PROXY_MAIN = "org.gaul.s3proxy.Main"
# The dev server's credentials (`statetables s3-server`): loopback only, not a secret.
S3_DEV_ACCESS_KEY = "statetables"
S3_DEV_SECRET_KEY = "statetables-secret"

_S3PROXY_LOGBACK = """<configuration>
  <appender name="OUT" class="ch.qos.logback.core.ConsoleAppender">
    <encoder><pattern>%d{{yyyy-MM-dd HH:mm:ss.SSS}} %-5level %logger{{30}} %msg%n</pattern></encoder>
  </appender>
  <!-- DEBUG: one "request: ... {{METHOD@... URL HTTP/1.1}}" line per request (and each error response). -->
  <logger name="org.gaul.s3proxy.S3ProxyHandler" level="{handler_level}"/>
  <root level="INFO"><appender-ref ref="OUT"/></root>
</configuration>
"""


def _tool_java(tool: str, folder: Path, make_target: str) -> str:
    """The java that runs a server of the project's (s3proxy, the Kafka broker) from its jars in `folder`;
    ConfigurationErrors naming the fix when the jars or Java are missing."""
    from pipelines.errors import ConfigurationError

    if not (folder / ".resolved").is_file():
        raise ConfigurationError(f"{tool} is not installed in {folder}. Fix: run `make {make_target}` once (resolves "
                                 f"it with Maven).")
    java_home = os.environ.get("JAVA_HOME")
    if java_home and (Path(java_home) / "bin" / "java").exists():
        return str(Path(java_home) / "bin" / "java")
    if java := shutil.which("java"):
        return java
    raise ConfigurationError(f"Java was not found (no JAVA_HOME/bin/java and no `java` on PATH); {tool} needs Java 17. "
                             f"Fix: install it (`apt-get install openjdk-17-jdk-headless`) or set JAVA_HOME.")


def _s3proxy_java() -> str:
    return _tool_java("s3proxy, the local S3 server,", S3PROXY_DIR, "s3proxy")


def s3proxy_command(properties: Path, logback: Path) -> list[str]:
    """s3proxy's JVM, its jars from .tools/s3proxy/. A small heap and the serial collector: it streams objects to
    disk, and the machine's cores are Spark's."""
    return [_s3proxy_java(), "-Xmx512m", "-XX:+UseSerialGC", f"-Dlogback.configurationFile={logback}",
            "-cp", f"{S3PROXY_DIR}/*", S3PROXY_MAIN, "--properties", str(properties)]


def s3_server(*, port: int, data_dir: Path, log: Path, access_key: str, secret_key: str, bucket: str | None,
              log_requests: bool = False, ready_timeout_s: float = 60) -> subprocess.Popen:
    """s3proxy on http://127.0.0.1:`port`, storing under `data_dir` (each folder a bucket), signed requests only
    (AWS Signature V2 or V4 with `access_key`/`secret_key`), in its own process group; `bucket` is created if given.
    Returns once it listens; stop it with `_stop`. Request counts per operation and status:
    `s3_request_counts(endpoint)` (its Prometheus /metrics); `log_requests` also logs a line per request in `log`.
    `log` must be outside `data_dir`: s3proxy would list a file or folder there as a bucket."""
    import shutil
    import tempfile

    import re

    _s3proxy_java()
    if bucket and not re.fullmatch(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]", bucket):
        from pipelines.errors import ConfigurationError

        raise ConfigurationError(f"{bucket!r} is not a valid S3 bucket name. Fix: 3 to 63 lower-case letters, digits, "
                                 f"dots or hyphens, starting and ending with a letter or digit (e.g. statetables).")
    _require_free_port(port, "the S3 server (s3proxy)")
    data_dir = Path(data_dir).resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    if bucket and not (data_dir / bucket).is_dir():
        # The filesystem backend takes every top-level folder for a bucket: no request needed. Not readable by others:
        # it derives the bucket's ACL from the folder's mode, and a world-readable folder lists without a signature.
        (data_dir / bucket).mkdir()
        (data_dir / bucket).chmod(0o750)
    log.parent.mkdir(parents=True, exist_ok=True)
    # The configuration is read once at start: written to a private folder, removed once the server listens.
    config_dir = Path(tempfile.mkdtemp(prefix="statetables-s3proxy-"))
    properties, logback = config_dir / "s3proxy.properties", config_dir / "logback.xml"
    properties.write_text("\n".join(f"{key}={value}" for key, value in {
        "s3proxy.endpoint": f"http://127.0.0.1:{port}",
        "s3proxy.authorization": "aws-v2-or-v4",
        "s3proxy.identity": access_key,
        "s3proxy.credential": secret_key,
        "jclouds.provider": "filesystem",
        "jclouds.filesystem.basedir": str(data_dir),
        # GET /metrics on the same port (unsigned): a Prometheus histogram per S3 operation, method and status.
        "s3proxy.metrics.enabled": "true",
    }.items()) + "\n")
    logback.write_text(_S3PROXY_LOGBACK.format(handler_level="DEBUG" if log_requests else "INFO"))
    try:
        command = s3proxy_command(properties, logback)
        with open(log, "ab") as out:
            proc = subprocess.Popen(command, cwd=REPO_ROOT, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent)
        try:
            _wait_for_port(proc, port, "the S3 server (s3proxy)", log, ready_timeout_s)
        except BaseException:
            _stop(proc)
            raise
        return proc
    finally:
        shutil.rmtree(config_dir, ignore_errors=True)


def s3_request_counts(endpoint: str) -> dict[tuple[str, int], int]:
    """Requests the s3proxy at `endpoint` has served since it started, by (S3 operation, HTTP status), e.g.
    {("PutObject", 200): 12, ("ListObjectsV2", 200): 40}: its /metrics. Requests refused before s3proxy names the
    operation (a bad signature or access key, an invalid bucket name) are not counted."""
    import re

    with urllib.request.urlopen(f"{endpoint.rstrip('/')}/metrics", timeout=10) as response:
        text = response.read().decode()
    counts: dict[tuple[str, int], int] = {}
    for line in text.splitlines():
        if line.startswith("http_server_request_duration_seconds_count{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}", 1)[0]))
            key = (labels.get("s3_operation", "?"), int(labels.get("http_response_status_code", 0)))
            counts[key] = counts.get(key, 0) + int(float(line.rsplit(" ", 1)[1]))
    return counts


# ---- A local Kafka broker: Apache Kafka 4.4 (build/kafka-broker.pom.xml, `make kafka`), single-node KRaft ----
# One JVM that is both broker and controller, on 127.0.0.1 only, its topics and metadata under a data folder that a
# restart keeps. For development and the Kafka tests; every replication factor is 1 (there is one node).

KAFKA_DIR = REPO_ROOT / ".tools" / "kafka"
KAFKA_MAIN = "kafka.Kafka"
KAFKA_STORAGE_TOOL = "kafka.tools.StorageTool"
KAFKA_NODE_ID = 1

_KAFKA_LOG4J = """\
# Written by statetables (KafkaBroker) at every start. Everything to one file; nothing to the console.
status = warn
# Kafka's own shutdown hook logs its controlled shutdown: Log4j's would stop the logging first.
shutdownHook = disable
appender.file.type = File
appender.file.name = FILE
appender.file.fileName = {log}
appender.file.append = true
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.file.ref = FILE
# A line per client request at INFO and below: only its warnings.
logger.request.name = kafka.request.logger
logger.request.level = WARN
"""


def _kafka_java() -> str:
    return _tool_java("Apache Kafka, the local broker,", KAFKA_DIR, "kafka")


def _kafka_cluster_id() -> str:
    """A new cluster id as Kafka writes one (kafka-storage random-uuid: 16 random bytes, URL-safe base64 without
    padding), made here rather than by a JVM start of its own. Never one that starts with `-`: the tool would read it
    as an option."""
    import base64
    import uuid

    while True:
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
        if not cluster_id.startswith("-"):
            return cluster_id


def _quiet_admin(bootstrap: str, **conf):
    """A confluent-kafka AdminClient that does not print librdkafka's connection errors (a broker that is starting or
    was just killed refuses connections; the caller's timeout is what reports it)."""
    from confluent_kafka.admin import AdminClient

    return AdminClient({"bootstrap.servers": bootstrap, "log_level": 0, **conf})


class KafkaBroker:
    """Apache Kafka 4.4 in KRaft mode, one node that is broker and controller, on 127.0.0.1:`port` (a free port when
    None), storing under `data_dir`: `kafka-logs/` (topics and the cluster metadata), `server.properties` and
    `log4j2.properties` (written at every start) and `broker.log`. The storage is formatted once, at the first start;
    later starts, after stop() or kill(), find the topics and their records again.

        broker = KafkaBroker(tmp_path / "kafka"); broker.start()
        ensure_topic(KafkaTopic("events", broker.bootstrap), partitions=2)   # pipelines/ingest/kafka_source.py
        ...
        broker.stop()

    Topics are created explicitly (`kafka_source.ensure_topic`): auto.create.topics.enable is off, so that a misspelt topic
    fails at the producer instead of becoming an empty topic of its own."""

    def __init__(self, data_dir: str | os.PathLike, port: int | None = None, *, heap: str = "512m",
                 ready_timeout_s: float = 60, sasl_users: dict[str, str] | None = None):
        self.data_dir = Path(data_dir).resolve()
        self.port = port or free_port()
        # With users: clients must log in (SASL/PLAIN over plain TCP) on `port`; the broker's own traffic takes a
        # PLAINTEXT listener of its own, on another loopback port.
        self.sasl_users = dict(sasl_users or {})
        self.internal_port: int | None = None
        self.controller_port: int | None = None
        self.heap = heap
        self.ready_timeout_s = ready_timeout_s
        self.proc: subprocess.Popen | None = None
        self._log_start = 0  # where the current start's lines begin in broker.log

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return self.data_dir / "broker.log"

    @property
    def log_dirs(self) -> Path:
        return self.data_dir / "kafka-logs"

    def _listeners(self) -> dict[str, str]:
        if not self.sasl_users:
            return {
                "listeners": f"PLAINTEXT://127.0.0.1:{self.port},CONTROLLER://127.0.0.1:{self.controller_port}",
                "advertised.listeners": f"PLAINTEXT://127.0.0.1:{self.port}",
                "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            }
        users = " ".join(f'user_{name}="{password}"' for name, password in self.sasl_users.items())
        return {
            "listeners": f"SASL_PLAINTEXT://127.0.0.1:{self.port},PLAINTEXT://127.0.0.1:{self.internal_port},"
                         f"CONTROLLER://127.0.0.1:{self.controller_port}",
            "advertised.listeners": f"SASL_PLAINTEXT://127.0.0.1:{self.port},PLAINTEXT://127.0.0.1:{self.internal_port}",
            "listener.security.protocol.map": "SASL_PLAINTEXT:SASL_PLAINTEXT,PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "sasl.enabled.mechanisms": "PLAIN",
            "listener.name.sasl_plaintext.plain.sasl.jaas.config":
                f"org.apache.kafka.common.security.plain.PlainLoginModule required {users};",
        }

    def _properties(self) -> dict[str, str]:
        return {
            "node.id": str(KAFKA_NODE_ID),
            "process.roles": "broker,controller",
            **self._listeners(),
            "inter.broker.listener.name": "PLAINTEXT",
            "controller.listener.names": "CONTROLLER",
            # A static quorum of this one node: the voters are read from here at every start, so the controller's
            # port may differ from one start to the next (a dynamic quorum, `format --standalone`, records the
            # controller's endpoint in the metadata log at format time, and a later start must find that port free).
            "controller.quorum.voters": f"{KAFKA_NODE_ID}@127.0.0.1:{self.controller_port}",
            "log.dirs": str(self.log_dirs),
            "auto.create.topics.enable": "false",
            "num.partitions": "1",
            "default.replication.factor": "1",
            "min.insync.replicas": "1",
            # The internal topics (consumer offsets, transactions, share groups), created at first use: Kafka's
            # defaults want 3 replicas, which one node cannot hold, and then every group or transaction fails.
            "offsets.topic.replication.factor": "1",
            "transaction.state.log.replication.factor": "1",
            "transaction.state.log.min.isr": "1",
            "share.coordinator.state.topic.replication.factor": "1",
            "share.coordinator.state.topic.min.isr": "1",
            # After a kill -9, the new start registers only once the controller has expired the previous one's
            # session: 9 s by default, 3 s here (heartbeats every 0.5 s over loopback).
            "broker.heartbeat.interval.ms": "500",
            "broker.session.timeout.ms": "3000",
            # A consumer group's first member starts at once, not after 3 s of waiting for others.
            "group.initial.rebalance.delay.ms": "0",
        }

    def _command(self, main: str, *args: str) -> list[str]:
        """A JVM on Kafka's jars (.tools/kafka/): a small heap and the serial collector (the machine's cores are
        Spark's), C1 only: a start took 3.6 s instead of 4.5 s (measured), and a broker of tests and development moves
        too little data for C2's code to matter."""
        return [_kafka_java(), f"-Xmx{self.heap}", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1",
                "-Djava.awt.headless=true", f"-Dlog4j2.configurationFile=file:{self.data_dir / 'log4j2.properties'}",
                "-cp", f"{KAFKA_DIR}/*", main, *args]

    def start(self) -> "KafkaBroker":
        """Start the broker (formatting its storage first, the first time) and return once it answers; raises with
        the log's tail when it exits or does not answer within `ready_timeout_s`."""
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"the Kafka broker on {self.bootstrap} is already running")
        _kafka_java()
        _require_free_port(self.port, "the Kafka broker")
        self._require_unused()
        self.controller_port = free_port()
        self.internal_port = free_port() if self.sasl_users else None
        self.data_dir.mkdir(parents=True, exist_ok=True)
        properties = self.data_dir / "server.properties"
        properties.write_text("# Written by statetables (KafkaBroker) at every start.\n" + "".join(
            f"{key}={value}\n" for key, value in self._properties().items()))
        (self.data_dir / "log4j2.properties").write_text(_KAFKA_LOG4J.format(log=self.log))
        began = time.monotonic()
        self._log_start = self.log.stat().st_size if self.log.exists() else 0
        with open(self.log, "ab") as out:
            if not (self.log_dirs / "meta.properties").is_file():
                # Once: a restart must keep the topics (the tool refuses a formatted folder anyway).
                formatted = subprocess.run(
                    self._command(KAFKA_STORAGE_TOOL, "format", "--config", str(properties),
                                  "--cluster-id", _kafka_cluster_id()),
                    cwd=self.data_dir, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, timeout=120)
                if formatted.returncode != 0:
                    raise RuntimeError(f"formatting the Kafka broker's storage {self.log_dirs} failed "
                                       f"({formatted.returncode}):\n{self.log_tail()}")
            self.proc = subprocess.Popen(self._command(KAFKA_MAIN, str(properties)), cwd=self.data_dir,
                                         stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True, preexec_fn=_die_with_parent)
        try:
            self._wait_until_ready(began)
        except BaseException:
            self.kill()
            raise
        return self

    def _wait_until_ready(self, began: float) -> None:
        """Until the broker lists topics with itself among the brokers: registered with its controller and
        unfenced, so that a topic can be created and written at once."""
        import socket

        from confluent_kafka import KafkaException

        deadline = began + self.ready_timeout_s
        admin = None
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the Kafka broker exited with {self.proc.returncode} before it answered on "
                                   f"{self.bootstrap}; {self.log}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Kafka broker did not answer on {self.bootstrap} within "
                                   f"{self.ready_timeout_s:.0f}s; {self.log}:\n{self.log_tail()}")
            try:
                # First the port (quiet and cheap), then the metadata.
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    pass
                # Readiness on the listener that needs no login (the broker's own, when clients must log in).
                admin = admin or _quiet_admin(f"127.0.0.1:{self.internal_port or self.port}")
                if admin.list_topics(timeout=2).brokers:
                    return
            except (OSError, KafkaException):
                pass
            time.sleep(0.2)

    def _require_unused(self) -> None:
        """Refuse a data folder that a running broker holds (Kafka's lock on kafka-logs/.lock, an fcntl lock), before
        its server.properties is written over: the new broker would only fail later, its error deep in the log."""
        import fcntl

        lock = self.log_dirs / ".lock"
        if not lock.is_file():
            return
        with open(lock, "rb+") as handle:
            try:
                fcntl.lockf(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                raise RuntimeError(f"{self.data_dir} is in use by another Kafka broker. Fix: stop it (an earlier "
                                   f"`make kafka-broker`?) or give this one another folder.") from None
            fcntl.lockf(handle, fcntl.LOCK_UN)

    def log_tail(self, lines: int = 40) -> str:
        """What this start logged that says why it failed: its ERROR lines and the line after each (the exception),
        else its last `lines` lines."""
        try:
            with open(self.log, "rb") as handle:
                handle.seek(self._log_start)
                logged = handle.read().decode(errors="replace").splitlines()
        except FileNotFoundError:
            return "(no log)"
        errors = [line for i, line in enumerate(logged) for line in logged[i:i + 2]
                  if " ERROR " in logged[i] or " FATAL " in logged[i]]
        return "\n".join(errors[:20] if errors else logged[-lines:])

    def stop(self) -> None:
        """SIGTERM (a controlled shutdown: logs flushed, clean-shutdown marker written), then SIGKILL to what is left
        after 30 s."""
        if self.proc is not None:
            _stop(self.proc)
            self.proc = None

    def kill(self) -> None:
        """kill -9, for chaos: the next start recovers the logs from what reached the disk."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.proc = None

    def restart(self) -> "KafkaBroker":
        """stop() and start() on the same data and port."""
        self.stop()
        return self.start()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@contextmanager
def kafka_broker(data_dir: str | os.PathLike, port: int | None = None, **options) -> Iterator[KafkaBroker]:
    """A started KafkaBroker over `data_dir`, stopped on exit."""
    broker = KafkaBroker(data_dir, port, **options)
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()
