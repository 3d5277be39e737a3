"""One partition's I/O: its actor, writers, checker, recovery."""
