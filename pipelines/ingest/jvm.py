"""The project's own JVM functions (jvm/, `make jars`) made callable in a session's SQL and DataFrames."""

from __future__ import annotations

from pyspark.sql import SparkSession
from pyspark.sql.types import DataType

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
