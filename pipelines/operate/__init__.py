"""What an operator runs beside the stream: checks, status, refresh, savepoints, maintenance."""
