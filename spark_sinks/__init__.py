"""The Spark sink: committed topic streams into Parquet tables, exactly once (DESIGN §9).

    source.py          the `txactors` streaming data source (offsets = stream sequences)
    offsets.py         startingOffsets and failOnDataLoss: where a query starts, what it lost
    jetstream_read.py  stream bounds and sequence ranges from JetStream
    schema.py          msgspec Struct → Spark columns; messages → Arrow batches (and rejects)
    checkpoint.py      what a query's checkpoint says, read without Spark
    planning.py        checks before Spark: schemas, streams, purged sequences, start points
    job.py             the run: one streaming query per topic
    progress.py        what a run reports, read off the queries as it polls
    catalog.py         warehouse layout and the metastore tables (`<topic>`, view `_rejects`)
    session.py         a SparkSession that works: Java check, Python workers, Hive catalog
    cli.py             what `txactors sink run|query` does
    commands.py        the `txactors sink` commands (mounted by txactors/cli), `python -m`

Modules import pyspark, which is the `spark` extra: `pip install 'txactors[spark]'`; all but
`commands.py`, which imports it inside each command so `txactors --help` works without it.
"""
