"""How the driver JVM starts: it maps the class archive (AppCDS, `make class-archive`), and a bad one never stops a
run; it writes local files through jvm/'s file systems, which start no process per file; a JVM that ends with its
command compiles with C1 only (with a tiered JVM's code cache: this worker's, for the test session), one that serves
many runs with both compilers."""

from __future__ import annotations

import os
import shlex
import subprocess
from dataclasses import replace
from pathlib import Path

from pipelines.runtime.spark import (
    CLASS_ARCHIVE, ENGINE_JAVA_OPTIONS_ENV, LARGE_RUN_JIT, ONE_COMMAND_JIT, ONE_COMMAND_YOUNG, SparkSettings,
    class_archive_options, session_confs,
)
from statetables.servers import connect_server_command


def _descendants(pid: int) -> list[int]:
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        children = [child for child, p in parents.items() if p == parent]
        found += children
        todo += children
    return found


def test_the_driver_jvm_maps_the_class_archive(spark):
    options = class_archive_options()
    assert options, "no class archive in .jars/: `make test` builds it (make class-archive)"
    archive = options.split("-XX:SharedArchiveFile=", 1)[1].split()[0]
    drivers = [pid for pid in _descendants(os.getpid())
               if "-XX:SharedArchiveFile=" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")]
    assert drivers, "the session's driver JVM was started without the class archive"
    # The JVM maps an archive it accepted into its memory; one it rejected (another JDK, other jars) is not.
    assert any(archive in Path(f"/proc/{pid}/maps").read_text() for pid in drivers)


def _drivers() -> list[int]:
    return [pid for pid in _descendants(os.getpid())
            if b"pyspark-shell" in Path(f"/proc/{pid}/cmdline").read_bytes()]


def test_the_driver_writes_local_files_through_the_projects_file_systems(spark, tmp_path):
    """Hadoop's own would start a `chmod` per file and a `readlink` per rename side (pipelines/runtime/spark.py)."""
    spark.range(3).write.format("delta").save(str(tmp_path / "table"))  # data files, a commit (a rename)
    assert spark.read.format("delta").load(str(tmp_path / "table")).count() == 3
    drivers = _drivers()
    assert drivers
    loaded = subprocess.run(["jcmd", str(drivers[0]), "VM.class_hierarchy"], capture_output=True, text=True,
                            timeout=60).stdout
    # Loaded only when Hadoop resolved the `file:` scheme to them: one for files, one for renames (FileContext).
    assert "statetables.jvm.LocalFileSystemWithoutForks$Raw" in loaded
    assert "statetables.jvm.LocalFsWithoutForks$Raw" in loaded


def test_only_a_jvm_that_ends_with_its_command_compiles_with_c1_only(spark):
    """This worker's JVM ends with the test session, one command (tests/conftest.py): it runs C1 only, with a fixed
    young generation."""
    for option in (ONE_COMMAND_JIT, ONE_COMMAND_YOUNG):
        assert option in session_confs(SparkSettings(one_command=True))["spark.driver.extraJavaOptions"]
        assert option not in session_confs(SparkSettings())["spark.driver.extraJavaOptions"]
    # A large batch ahead: C2 as well, the young generation still fixed.
    large = session_confs(SparkSettings(one_command=True, large_run=True))["spark.driver.extraJavaOptions"]
    assert ONE_COMMAND_JIT not in large and ONE_COMMAND_YOUNG in large
    # Its C2 compiles only what stays hot; an engine keeps HotSpot's thresholds.
    assert LARGE_RUN_JIT in large
    assert LARGE_RUN_JIT not in session_confs(SparkSettings())["spark.driver.extraJavaOptions"]
    drivers = _drivers()
    options = f"{ONE_COMMAND_JIT} {ONE_COMMAND_YOUNG}".encode()
    assert drivers and all(options in Path(f"/proc/{pid}/cmdline").read_bytes() for pid in drivers)


def test_a_cluster_runs_executors_and_an_engine_takes_the_options_it_is_given(monkeypatch):
    """A one-command run's executors on a cluster end with it: C1 only. A Connect server maps the class archive and
    takes $STATETABLES_ENGINE_JAVA_OPTIONS (this suite sets C1 only), for its executors too when it fronts a cluster."""
    cluster = SparkSettings(master="spark://127.0.0.1:7077", one_command=True)
    assert session_confs(cluster)["spark.executor.extraJavaOptions"] == ONE_COMMAND_JIT
    assert "spark.executor.extraJavaOptions" not in session_confs(SparkSettings(master="spark://127.0.0.1:7077"))
    assert "spark.executor.extraJavaOptions" not in session_confs(replace(cluster, large_run=True))
    monkeypatch.setenv(ENGINE_JAVA_OPTIONS_ENV, "-XX:TieredStopAtLevel=1")

    def confs(command: list[str]) -> dict[str, str]:
        return dict(value.split("=", 1) for flag, value in zip(command, command[1:]) if flag == "--conf")
    local = confs(connect_server_command(15999))
    assert class_archive_options() in local["spark.driver.extraJavaOptions"]
    assert local["spark.driver.extraJavaOptions"].endswith(" -XX:TieredStopAtLevel=1")
    assert "spark.executor.extraJavaOptions" not in local  # its tasks run in its own JVM
    fronting = confs(connect_server_command(15999, conf={"spark.master": "spark://127.0.0.1:7077"}))
    assert fronting["spark.executor.extraJavaOptions"] == "-XX:TieredStopAtLevel=1"


def test_a_c1_only_jvm_keeps_the_code_cache_of_a_tiered_one():
    """C1 only would otherwise get 48 MB of code cache, which a long run fills: its tasks then die."""
    def code_cache(*options: str) -> int:
        flags = subprocess.run(["java", *options, "-XX:+PrintFlagsFinal", "-version"], capture_output=True, text=True,
                               timeout=60).stdout
        return int(next(line.split()[3] for line in flags.splitlines() if " ReservedCodeCacheSize " in line))

    assert code_cache(*shlex.split(ONE_COMMAND_JIT)) >= code_cache() >= 240 * 2**20


def test_a_damaged_archive_is_ignored_and_the_jvm_starts(tmp_path):
    (tmp_path / CLASS_ARCHIVE).write_bytes(os.urandom(4096))
    options = class_archive_options(tmp_path)
    started = subprocess.run(["java", *shlex.split(options), "-version"], capture_output=True, text=True, timeout=60)
    assert started.returncode == 0, started.stderr
    assert class_archive_options(tmp_path / "missing") is None  # no archive: no option at all
