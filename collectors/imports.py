"""Run a collector's set-up right after a module is first imported, without importing it first.

`ImportWatcher(names, on_import)` sits at the front of `sys.meta_path`, finds nothing itself, and
wraps the loader of each module in `names` so that `on_import(name)` runs once the module has
executed: bootstrap installs the collectors after `torch`, the TorchRec source hooks FBGEMM's and
TorchRec's classes after theirs. A lookup that only probes (a `find_spec` with no import) does not
count. Once every name has loaded the watcher takes itself off `sys.meta_path`.

    watcher = ImportWatcher(("torch",), lambda name: activate())
    sys.meta_path.insert(0, watcher)
"""

from __future__ import annotations

import importlib.abc
import sys
from typing import Callable


class ImportWatcher(importlib.abc.MetaPathFinder):
    """Finds nothing itself; runs `on_import(name)` right after a module named in `names` loads."""

    def __init__(self, names: tuple[str, ...], on_import: Callable[[str], None]) -> None:
        self.pending = set(names)
        self.on_import = on_import

    def find_spec(self, name, path=None, target=None):
        if name not in self.pending:
            return None
        for finder in sys.meta_path:  # the finder that would have found it, had we not been asked
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            self.pending.discard(name)  # only now: a find_spec that imports nothing (a probe) must not count
            if not self.pending and self in sys.meta_path:
                sys.meta_path.remove(self)
            self.on_import(name)

        spec.loader.exec_module = exec_module
        return spec
