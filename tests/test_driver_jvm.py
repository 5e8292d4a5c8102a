"""How the driver JVM starts: it maps the class archive (AppCDS, `make class-archive`), and a bad one never stops a
run; it writes local files through jvm/'s file systems, which start no process per file; a JVM that ends with its
command compiles with C1 only (with a tiered JVM's code cache), one that serves many runs (this worker's) with both
compilers."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

from pipelines.runtime.spark import (
    CLASS_ARCHIVE, ONE_COMMAND_JIT, SparkSettings, class_archive_options, session_confs,
)


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
    assert ONE_COMMAND_JIT in session_confs(SparkSettings(one_command=True))["spark.driver.extraJavaOptions"]
    assert ONE_COMMAND_JIT not in session_confs(SparkSettings())["spark.driver.extraJavaOptions"]
    drivers = _drivers()
    assert drivers and not any(ONE_COMMAND_JIT.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
                               for pid in drivers)


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
