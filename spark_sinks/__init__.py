"""The Spark sink: committed topic streams into Parquet tables, exactly once (DESIGN §9).

    source.py          the `txactors` streaming data source (offsets = stream sequences)
    jetstream_read.py  stream heads and sequence ranges from JetStream
    schema.py          msgspec Struct → Spark columns; messages → Arrow batches (and rejects)
    job.py             one streaming query per topic into its store; progress
    catalog.py         warehouse layout and the catalog views (`<topic>`, `_rejects`)
    session.py         a SparkSession that works: Java check, Python workers, Hive catalog
    cli.py             `txactors sink run|query|demo`

Modules import pyspark, which is the `spark` extra: `pip install 'txactors[spark]'`.
"""
