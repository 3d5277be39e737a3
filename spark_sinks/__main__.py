"""`python -m spark_sinks …` or `spark-submit spark_sinks/__main__.py …`: `txactors sink …`.

spark-submit runs a script, not an installed command; this is that script.
"""

import sys

from txactors.cli import app

if __name__ == "__main__":
    app(["sink", *sys.argv[1:]])
