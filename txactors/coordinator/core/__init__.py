"""The coordinator's pure core: a transition table that takes events and `now`, and returns
effects. No I/O, no clocks, no tasks; `table.py` holds the table."""
