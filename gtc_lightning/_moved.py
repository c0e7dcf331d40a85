"""The modules of 0.1.0 that moved in 0.2.0 stay importable, and runnable with ``python -m``, for one
release: each old module is an alias that warns (``DeprecationWarning``, naming the new module) and
hands out its new home's names, old private names under their new public ones included."""

import importlib
import runpy
import warnings
from collections.abc import Callable

REMOVED_IN = "0.3.0"


def _message(old: str, new: str) -> str:
    return f"{old} moved to {new} in gtc-lightning 0.2.0; the old path goes in {REMOVED_IN}: use {new}"


def alias(old: str, *new: str, renamed: dict[str, str] | None = None) -> tuple[Callable, Callable]:
    """Warn that ``old`` moved to ``new[0]`` and return the module ``__getattr__`` and ``__dir__`` of an
    alias that looks names up in ``new`` in order (``renamed``: old name -> new name)."""
    warnings.warn(_message(old, new[0]), DeprecationWarning, stacklevel=3)  # the importer's line
    modules = [importlib.import_module(name) for name in new]
    renamed = renamed or {}

    def __getattr__(name: str):
        target = renamed.get(name, name)
        for module in modules:
            if hasattr(module, target):
                return getattr(module, target)
        raise AttributeError(f"module {old!r} has no attribute {name!r} (it moved to {', '.join(new)})")

    def __dir__() -> list[str]:
        return sorted({name for module in modules for name in dir(module)} | set(renamed))

    return __getattr__, __dir__


def run_moved(old: str, new: str) -> None:
    """``python -m old``: warn, then run ``new`` as ``__main__``, as ``python -m new`` would."""
    warnings.warn(_message(old, new), DeprecationWarning, stacklevel=2)
    runpy.run_module(new, run_name="__main__", alter_sys=True)
