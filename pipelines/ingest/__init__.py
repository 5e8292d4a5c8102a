"""Landing files and Kafka topics → validated lines → bronze and quarantine."""
