"""Where the data lives: the storage root's files (local or S3), its layout, Delta SQL and the log."""
