"""Dagster resources: the Spark session with Delta, and the storage layout."""

from resources.spark import SparkSessionResource
from resources.storage import StorageResource

__all__ = ["SparkSessionResource", "StorageResource"]
