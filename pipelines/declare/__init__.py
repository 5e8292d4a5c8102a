"""What the user declares: the project file, its SQL, and the specs they become (no data touched)."""
