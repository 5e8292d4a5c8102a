"""Dagster resources: the Spark session with Delta, the storage layout, which checks block."""

from resources.check_policy import CheckPolicyResource
from resources.spark import SparkSessionResource
from resources.storage import StorageResource

__all__ = ["CheckPolicyResource", "SparkSessionResource", "StorageResource"]
