"""Helpers shared by the transaction tests."""
