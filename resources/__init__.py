"""Dagster resources: the Spark session with Delta, the storage layout, the state tables' TTL."""

from resources.spark import SparkSessionResource
from resources.state_policy import StatePolicyResource
from resources.storage import StorageResource

__all__ = ["SparkSessionResource", "StatePolicyResource", "StorageResource"]
