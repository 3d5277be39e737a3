"""Loading the `txactors.testing` plugin in a pytest subprocess, installed or not."""

from __future__ import annotations

import importlib.metadata

PLUGIN = "txactors.testing"


def plugin_args() -> list[str]:
    """`-p txactors.testing` unless the installed package already registers it by its entry
    point (a checkout installed before the entry point existed does not; naming a plugin
    that is registered already would be an error)."""
    installed = importlib.metadata.entry_points(group="pytest11")
    if any(entry.value == PLUGIN for entry in installed):
        return []
    return ["-p", PLUGIN]
