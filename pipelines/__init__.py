"""Spark + Delta streaming code for statetables, in data-flow order.

layout   → where every table, checkpoint and landing folder lives
streams  → the two event streams: fields, rules, state-table shape
session  → the one place a SparkSession is built
source   → landing files → raw lines (file, line number, bytes)
validate → raw lines → typed events or a quarantine reason
bronze   → dedup + idempotent append to bronze / quarantine
state    → idempotent MERGE of micro-batch aggregates into state tables

streaming (run a query to the end of its input, writer lock, txn app id), errors, and
generate (sample landing files) serve the steps above.

No Dagster import here: this package runs and tests on its own.
"""
