"""The embedded nats-server: one process, or a routed cluster of them."""
