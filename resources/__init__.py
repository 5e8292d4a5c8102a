"""Dagster resources: the Spark session with Delta, the storage layout, the state tables' TTL, which checks block."""

from resources.check_policy import CheckPolicyResource
from resources.spark import SparkSessionResource
from resources.state_policy import StatePolicyResource
from resources.storage import StorageResource

__all__ = ["CheckPolicyResource", "SparkSessionResource", "StatePolicyResource", "StorageResource"]
