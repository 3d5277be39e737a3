"""Help that shows a flag as a flag.

typer 0.29's rich help prints a value type after every option, flags included (`--help <bool>`,
`--version <bool>`), which reads as if they took a value. A flag takes none, so it shows none;
every other option keeps its type.
"""

from __future__ import annotations

from typing import Any

from typer.core import TyperOption

_typed = TyperOption.display_type_rich


def _display_type(option: TyperOption, ctx: Any) -> str | None:
    if option.is_flag and option.metavar is None:
        return None
    return _typed(option, ctx)


def show_flags_without_a_type() -> None:
    """Applied by each entry point: on importing `txactors.cli` (`txactors`, the demos'
    commands) and by `python -m spark_sinks`."""
    setattr(TyperOption, "display_type_rich", _display_type)  # noqa: B010 (a method, patched)
