"""Old import paths of modules that moved when the package was split by runtime.

``import vllm_deltasync.publisher`` (and the other flat paths of 0.1 listed in :data:`MOVED`) still works: the
finder below hands back the module at its new path, registered under the old name too, with a
:class:`DeprecationWarning` naming the new path. Nothing inside the package uses these names.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import ModuleType
from typing import Any

MOVED: dict[str, str] = {
    "vllm_deltasync.manifest": "vllm_deltasync.format.manifest",
    "vllm_deltasync.codec": "vllm_deltasync.format.codec",
    "vllm_deltasync.codec_v2": "vllm_deltasync.format.sparse_v2",
    "vllm_deltasync.reader": "vllm_deltasync.format.reader",
    "vllm_deltasync.writer": "vllm_deltasync.format.writer",
    "vllm_deltasync.publisher": "vllm_deltasync.trainer.publisher",
    "vllm_deltasync.trl_import": "vllm_deltasync.trainer.trl_import",
    "vllm_deltasync.discovery": "vllm_deltasync.server.worker.discovery",
    "vllm_deltasync.metrics": "vllm_deltasync.server.metrics",
    "vllm_deltasync.extension": "vllm_deltasync.server.extension",
    "vllm_deltasync.status_cli": "vllm_deltasync.cli.status",
}
"""old module path -> new module path (the documented 0.1 paths)."""


class _Alias(importlib.abc.Loader):
    def __init__(self, new: str) -> None:
        self.new = new
        self.spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(
            f"{spec.name} moved to {self.new}; import it from there "
            "(the old path will be removed in a future release)",
            DeprecationWarning,
            stacklevel=_caller_level(),
        )
        module = importlib.import_module(self.new)
        self.spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # The module already ran at its new path; importlib then stores it in sys.modules under
        # the old name too. It overwrote ``__spec__`` with the alias's: put the real one back,
        # so reload() and pickling by module name keep using the new path.
        module.__spec__ = self.spec
        module.__loader__ = self.spec.loader if self.spec is not None else None


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any = None,
                  target: Any = None) -> importlib.machinery.ModuleSpec | None:
        new = MOVED.get(fullname)
        if new is None:
            return None
        spec = importlib.util.find_spec(new)
        origin = spec.origin if spec is not None else None
        return importlib.machinery.ModuleSpec(fullname, _Alias(new), origin=origin)


def _caller_level() -> int:
    """Stack level of the first frame outside importlib, so the warning names the importer."""
    frame = sys._getframe(1)
    level = 1
    while frame is not None and (frame.f_code.co_filename.startswith("<frozen")
                                 or frame.f_code.co_filename == __file__):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level


def install() -> None:
    """Put the finder on ``sys.meta_path`` once."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.append(_Finder())
