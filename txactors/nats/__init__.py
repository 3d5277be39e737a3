"""NATS plumbing: the client, the connection, streams, and JetStream writes."""
