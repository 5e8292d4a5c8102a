"""The project's own JVM functions (jvm/, `make jars`) made callable in a session's SQL and DataFrames."""

from __future__ import annotations

import weakref

from pyspark.sql import Column, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import DataType, LongType

from pipelines.errors import ConfigurationError


def register_jvm_function(spark: SparkSession, name: str, class_name: str, returns: DataType) -> None:
    """Make `name` call `class_name` in `spark` (a session's functions are its own; over Spark Connect this is one
    call to the server). Fails naming the fix when the engine lacks the project's jar."""
    try:
        spark.udf.registerJavaFunction(name, class_name, returns)
    except Exception as exc:
        if "ClassNotFound" in str(exc) or "CANNOT_LOAD_FUNCTION_CLASS" in str(exc) or class_name in str(exc):
            raise ConfigurationError(
                f"The Spark engine has no {class_name} (the project's own jar, .jars/statetables-jvm.jar). "
                f"Fix: run `make jars` once, and start the engine with every jar in .jars/ (`make connect-server`, "
                f"`make cluster` and the embedded engine do).") from exc
        raise


CONSTANT, CONSTANT_CLASS = "statetables_constant", "statetables.jvm.BatchConstant"
_HAS_CONSTANT: weakref.WeakSet = weakref.WeakSet()  # sessions `statetables_constant` is registered in


def batch_constant(spark: SparkSession, value: int) -> Column:
    """`value` as a BIGINT column that is not a literal (jvm/, BatchConstant): for a constant that changes with each
    micro-batch (its id, its time, a watermark), so that the Java source Spark generates for the batch's stages, and
    its compiled classes, stay the same from one batch to the next. A literal would be written into that source.
    Not for a bound that must skip files by their statistics: only literals do."""
    if spark not in _HAS_CONSTANT:
        register_jvm_function(spark, CONSTANT, CONSTANT_CLASS, LongType())
        _HAS_CONSTANT.add(spark)
    return F.call_function(CONSTANT, F.lit(value.to_bytes(8, "big", signed=True)))


def batch_timestamp(spark: SparkSession, micros: int) -> Column:
    """`batch_constant` of a TIMESTAMP, in microseconds since the epoch."""
    return F.timestamp_micros(batch_constant(spark, micros))
