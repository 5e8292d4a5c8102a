"""Spark + Delta streaming code for statetables, one folder a stage, in data-flow order.

declare/    → the project file, its SQL and the aggregate kinds, read into specs (no data touched)
ingest/     → landing files or a topic → validated lines → bronze (once each) and quarantine (with a reason)
state/      → bronze → all-time state tables by MERGE, TTL, the changelog table and topic
event_time/ → bronze → windowed, top-N and session tables behind a watermark, late events
storage/    → the storage root (local or S3), its layout, Delta SQL and the Delta log
runtime/    → the SparkSession, a stream's query and micro-batch, checkpoints, locks, always-on mode
operate/    → checks, status, refresh, savepoints, maintenance

errors.py and faults.py (named kill points) serve every stage. No Dagster import here: this package runs and tests
on its own.
"""
