"""Observability: structured logs, Prometheus metrics, OpenTelemetry spans."""
