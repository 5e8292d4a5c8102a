"""Build the JVM class archive (AppCDS) that pipeline runs start from: `make class-archive`, once per machine.

    python -m statetables.class_archive            # writes .jars/statetables.jsa

A JVM started with `-XX:ArchiveClassesAtExit` records every class it loaded when it exits; a later JVM
started with `-XX:SharedArchiveFile` maps them instead of reading, parsing and verifying them from the
jars again (JDK 17 dynamic archives). The recording JVM runs one small pass of both streams (every table
of each stream's query) over generated data in a temporary storage root, so the archive holds what a run
loads. pipelines/runtime/spark.py adds the archive to every driver JVM it starts, when the file exists.

The JVM writes the archive as it exits, after the Python process that started it has gone, so the
pass runs in a child process and this one waits for the JVM to finish writing.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pipelines.runtime.spark import CLASS_ARCHIVE, DEFAULT_JARS_DIR, JARS_ENV, LOG4J_CONFIG, PARALLEL_GC

WRITE_TIMEOUT_S = 300


def record_one_pass(home: Path, archive: Path) -> None:
    """Child process: one pass of both streams in a JVM that records its classes into `archive`."""
    from pipelines.ingest.generate import generate
    from pipelines.storage.layout import StorageLayout
    from pipelines.runtime.spark import SparkSettings, build_spark_session
    from pipelines.runtime.micro_batch import advance_stream
    from pipelines.declare.project import streams

    layout = StorageLayout.under(home)
    spark = build_spark_session(SparkSettings(conf={
        "spark.driver.extraJavaOptions":
            # The runs' logging too: the same classes load, and set-up prints no Spark WARN lines.
            f"-XX:ArchiveClassesAtExit={archive} {PARALLEL_GC} -Xlog:cds=off -Xlog:cds+dynamic=off "
            f"-Dlog4j2.configurationFile=file:{LOG4J_CONFIG}"}))
    for spec in streams().values():
        generate(spec, layout.landing(spec.name), events=2_000, seed=7)
        for _ in range(2):  # the second pass takes the paths of a run with a checkpoint and history
            advance_stream(spark, layout, spec)
    spark.stop()


def _jvm_writing(archive: Path) -> bool:
    found = subprocess.run(["pgrep", "-f", f"ArchiveClassesAtExit={archive}"], capture_output=True, text=True)
    return bool(found.stdout.strip())


def build(jars_dir: Path) -> Path:
    target = jars_dir / CLASS_ARCHIVE
    partial = jars_dir / f".{CLASS_ARCHIVE}.{os.getpid()}"
    target.unlink(missing_ok=True)  # the recording JVM must start without the old archive
    partial.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(prefix="statetables-class-archive-") as home:
        subprocess.run([sys.executable, "-m", "statetables.class_archive", "--record", home, str(partial)], check=True)
        deadline = time.monotonic() + WRITE_TIMEOUT_S
        while _jvm_writing(partial):
            if time.monotonic() > deadline:
                raise SystemExit(f"The JVM did not finish writing {partial} within {WRITE_TIMEOUT_S}s.")
            time.sleep(0.5)
    if not partial.is_file():
        raise SystemExit(f"The JVM wrote no class archive ({partial}); runs start without one.")
    os.replace(partial, target)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", nargs=2, metavar=("HOME", "ARCHIVE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.record:
        record_one_pass(Path(args.record[0]), Path(args.record[1]))
        return
    jars_dir = Path(os.environ.get(JARS_ENV) or DEFAULT_JARS_DIR)
    archive = build(jars_dir)
    print(f"class archive: {archive} ({archive.stat().st_size // (1 << 20)} MiB)")


if __name__ == "__main__":
    main()
