"""The chunk store: snapshots kept deduplicated, compressed, encrypted, on or off the host."""
