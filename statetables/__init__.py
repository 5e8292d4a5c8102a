"""statetables: the Dagster code location (definitions) and the command line."""
