"""Operator tools: transactions, dead letters, leases and partitions by hand."""
