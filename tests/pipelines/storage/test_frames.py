"""Rows the driver holds, sent to the engine as a frame (pipelines/storage/frames.py)."""

from __future__ import annotations

import pyarrow as pa
from pyspark.sql.types import StructType

from pipelines.storage.frames import frame_of_arrow


def test_an_arrow_table_whose_chunks_include_an_empty_one_arrives_whole(spark):
    # A table read from several files, or collected from several partitions, has a chunk each, some of them empty:
    # pyspark 4.1's createDataFrame of such a table keeps only the rows before the first empty chunk.
    schema = pa.schema([("n", pa.int64())])
    chunks = [pa.record_batch([pa.array(values, pa.int64())], schema=schema) for values in ([1], [], [2, 3])]
    table = pa.Table.from_batches(chunks)
    assert sorted(r["n"] for r in frame_of_arrow(spark, table, StructType.fromDDL("n bigint")).collect()) == [1, 2, 3]
