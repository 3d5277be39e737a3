"""The top-level package exports what its `__all__` promises, and nothing is missing from it."""

from __future__ import annotations

import importlib
import pkgutil
import types

import txactors
from txactors import errors
from txactors.actors import Escalated
from txactors.errors import TxActorsError


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


def _exception_classes() -> list[type[BaseException]]:
    """Every exception class defined in a txactors module."""
    found = []
    for info in pkgutil.walk_packages(txactors.__path__, "txactors."):
        module = importlib.import_module(info.name)
        for value in vars(module).values():
            if (
                isinstance(value, type)
                and issubclass(value, BaseException)
                and value.__module__ == info.name
            ):
                found.append(value)
    return found


def test_every_exception_of_txactors_is_a_txactors_error_named_in_the_tree() -> None:
    classes = _exception_classes()
    assert Escalated in classes
    assert [c for c in classes if not issubclass(c, TxActorsError)] == []
    assert [c.__name__ for c in classes if c.__name__ not in (errors.__doc__ or "")] == []
