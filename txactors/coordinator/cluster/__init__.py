"""Cluster membership: leases, each member's share, the count."""
