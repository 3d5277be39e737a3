"""The wire: what travels on the bus, its names, and a transaction's rules both ends keep.
Pure: no I/O."""
