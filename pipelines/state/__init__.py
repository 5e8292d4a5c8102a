"""Bronze → all-time state tables: the aggregate kinds, the MERGE, TTL, the changelog table and topic."""
