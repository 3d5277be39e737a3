"""Programs that tests run as separate OS processes (real peers, not mocks)."""
