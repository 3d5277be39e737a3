"""`python -m spark_sinks …` or `spark-submit spark_sinks/__main__.py …`: `txactors sink …`.

spark-submit runs a script, not an installed command; this is that script.
"""

from spark_sinks.commands import app
from txactors.cli.flags import show_flags_without_a_type

if __name__ == "__main__":
    show_flags_without_a_type()  # as `txactors sink --help` shows them
    app(prog_name="txactors sink")
