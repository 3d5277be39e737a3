"""The top-level package exports what its `__all__` promises, and nothing is missing from it."""

from __future__ import annotations

import types

import txactors


def test_every_name_in_all_is_importable_from_the_package() -> None:
    missing = [name for name in txactors.__all__ if not hasattr(txactors, name)]
    assert missing == []
    assert len(set(txactors.__all__)) == len(txactors.__all__)


def test_every_public_name_of_the_package_is_in_all() -> None:
    public = {
        name
        for name, value in vars(txactors).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert public - set(txactors.__all__) == set()
