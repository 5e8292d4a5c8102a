"""Bronze → windowed, top-N and session tables: the watermark, late events, the two operators."""
