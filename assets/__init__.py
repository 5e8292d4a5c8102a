"""Dagster assets, checks, jobs, schedule and sensors of statetables (thin: they call pipelines/)."""
