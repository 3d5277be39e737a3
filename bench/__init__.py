"""Benchmarks: each measures txactors against raw nats-py/JetStream in the same run."""
