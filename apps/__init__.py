"""Demo applications built on txactors."""
