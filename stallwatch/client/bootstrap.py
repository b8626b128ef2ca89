"""Zero-code start-up: what `stallwatch run` does inside each Python process of the command it runs.

`start()` has every DataLoader the process makes instrumented, once it has imported torch
(`stallwatch.client.torch.instrument_every_loader`), and so its reads captured where a loader's dataset
reads (in its workers, or during its epochs without workers; `capture`, unless `capture.CAPTURE_ENV` is
"0"). Opens anywhere else in the process stay the original's.
It runs from `startup/sitecustomize.py`, which Python imports at start-up when `stallwatch run` puts that
folder on PYTHONPATH and sets `INSTRUMENT_ENV`; loader workers started by spawn or forkserver inherit
both and start the same way, forked ones inherit the process.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any

INSTRUMENT_ENV = "STALLWATCH_INSTRUMENT"  # "1": instrument this process at start-up (`stallwatch run` sets it)
STARTUP_FOLDER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "startup")


def _instrument_loaders(torch: ModuleType) -> None:
    from stallwatch.client.torch import instrument_every_loader

    instrument_every_loader()


def start(env: Mapping[str, str] = os.environ) -> None:
    """Instrument this process if `INSTRUMENT_ENV` asks to; never raises (one line on stderr instead)."""
    if env.get(INSTRUMENT_ENV) != "1":
        return
    try:
        after_import("torch", _instrument_loaders)
    except Exception as error:
        print(f"stallwatch: this process runs uninstrumented: {error!r}", file=sys.stderr)


def after_import(name: str, then: Callable[[ModuleType], None]) -> importlib.abc.MetaPathFinder | None:
    """Call `then(module)` once the top-level module `name` is imported (now, if it already is); the finder
    that waits for it, which leaves `sys.meta_path` once it has found it (None: called now)."""
    module = sys.modules.get(name)
    if module is not None:
        then(module)
        return None
    finder = _AfterImport(name, then)
    sys.meta_path.insert(0, finder)
    return finder


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: lends the module's own loader a last step, `then`, the first time it is imported."""

    def __init__(self, name: str, then: Callable[[ModuleType], None]) -> None:
        self._name = name
        self._then = then

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None,
                  ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self._name:
            return None
        sys.meta_path.remove(self)  # once, and so that the finders below find the module's own spec
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _ThenLoader(spec.loader, self._then)
        return spec


class _ThenLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader, then: Callable[[ModuleType], None]) -> None:
        self._loader = loader
        self._then = then

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        # The module's own loader again, for whatever asks it later (source, resources).
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        try:
            self._then(module)
        except Exception as error:  # the import itself succeeded: it stays a success
            print(f"stallwatch: {module.__name__} imported uninstrumented: {error!r}", file=sys.stderr)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)
