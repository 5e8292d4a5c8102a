"""Landing files → raw lines with their file, line number and exact bytes.

Spark's line reader gives neither line numbers nor a way to tell invalid UTF-8 apart, so each
file is read whole (`wholetext`) and split here. The split goes through ISO-8859-1, which maps every
byte to one character and back, so the bytes of each line survive exactly as received.
"""

from __future__ import annotations

from pathlib import Path

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

# Files named `_x` or `.x` are still being written: Spark's file source already skips hidden
# names like these, and the glob keeps anything that is not a .jsonl file out.
LANDING_GLOB = "*.jsonl"


def read_landing_files(spark: SparkSession, landing_dir: Path, max_files_per_trigger: int) -> DataFrame:
    """A streaming DataFrame with one row per landing file: its text, path and modification time."""
    landing_dir.mkdir(parents=True, exist_ok=True)
    return (
        spark.readStream.format("text")
        .option("wholetext", "true")
        .option("pathGlobFilter", LANDING_GLOB)
        .option("maxFilesPerTrigger", str(max_files_per_trigger))
        .load(str(landing_dir))
        .select(
            F.col("value").cast("binary").alias("content"),
            F.col("_metadata.file_path").alias("source_file"),
            F.col("_metadata.file_modification_time").alias("file_modified_at"),
        )
    )


def split_lines(files: DataFrame) -> DataFrame:
    """One row per input line: source_file, file_modified_at, line_number (1-based), raw_bytes.

    The newline that ends a file is a terminator, not an empty last line; any other empty line is
    a line (and will be quarantined as not JSON).
    """
    # The array is built (and counted) below the explode, so each output row does not drag the
    # whole file along with it: Spark copies every column an explode's parent still needs per row.
    arrays = files.select(
        "source_file",
        "file_modified_at",
        F.split(F.decode("content", "ISO-8859-1"), "\n", -1).alias("_lines"),
    ).withColumn("_line_count", F.size("_lines"))
    exploded = arrays.select(
        "source_file", "file_modified_at", "_line_count", F.posexplode("_lines").alias("_pos", "_latin1")
    )
    is_final_terminator = (F.col("_pos") == F.col("_line_count") - 1) & (F.col("_latin1") == "")
    return exploded.where(~is_final_terminator).select(
        "source_file",
        "file_modified_at",
        (F.col("_pos") + 1).cast("bigint").alias("line_number"),
        F.encode("_latin1", "ISO-8859-1").alias("raw_bytes"),
    )


def arrival_order() -> list[Column]:
    """The order lines arrived in: file modification time, then file name, then line."""
    return [F.col("file_modified_at"), F.col("source_file"), F.col("line_number")]
