"""Running a stream: the SparkSession, the streaming query, the micro-batch, checkpoints, locks, faults."""
