"""The wire: what travels on the bus, and its names. Pure: no I/O."""
