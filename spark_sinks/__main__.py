"""`python -m spark_sinks …` or `spark-submit spark_sinks/__main__.py …`: `txactors sink …`.

spark-submit runs a script, not an installed command; this is that script.
"""

from spark_sinks.commands import app

if __name__ == "__main__":
    app(prog_name="txactors sink")
