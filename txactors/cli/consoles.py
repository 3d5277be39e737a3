"""How wide the commands' rich output is: a terminal's own width on a terminal (or `COLUMNS`
where it is set); into a pipe or a file (`| tee run.log`, a CI log) wide enough that no table
row wraps, where rich alone would wrap everything at 80 columns."""

from __future__ import annotations

import os
import sys
from typing import Any, Final

from rich.console import Console

OFF_TERMINAL_WIDTH: Final = 200
"""Columns of output that goes to no terminal: the widest table of ours fits."""


def console(*, stderr: bool = False, **options: Any) -> Console:
    """A rich Console for stdout (or stderr) of that width; `options` go to Console."""
    stream = sys.stderr if stderr else sys.stdout
    on_terminal = stream.isatty() or bool(os.environ.get("COLUMNS"))
    return Console(stderr=stderr, width=None if on_terminal else OFF_TERMINAL_WIDTH, **options)
