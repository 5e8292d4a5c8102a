"""The JVM class archive (AppCDS, `make class-archive`): the driver JVM maps it, and a bad one never stops a run."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

from pipelines.runtime.spark import CLASS_ARCHIVE, class_archive_options


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


def test_a_damaged_archive_is_ignored_and_the_jvm_starts(tmp_path):
    (tmp_path / CLASS_ARCHIVE).write_bytes(os.urandom(4096))
    options = class_archive_options(tmp_path)
    started = subprocess.run(["java", *shlex.split(options), "-version"], capture_output=True, text=True, timeout=60)
    assert started.returncode == 0, started.stderr
    assert class_archive_options(tmp_path / "missing") is None  # no archive: no option at all
