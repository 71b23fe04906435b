"""The ``vllm.general_plugins`` entry point: what vllm-deltasync installs in a vLLM process.

vLLM runs general plugins in *every* process it starts (API server, engine core, workers),
before anything is built and without a ``try``: an exception here would stop every vLLM process
of the environment, engines that never use deltasync included. So :func:`register_plugin`
never raises, and installs as little as it can:

- ``EngineCore.__init__`` and ``run_busy_loop`` of ``EngineCoreProc`` / ``DPEngineCoreProc``
  (every platform): call vLLM's own, and hand the engine core to :func:`.engine.on_engine_core`
  (or :func:`.engine.before_busy_loop`), which returns at once unless its config names the
  extension (``--worker-extension-cls``). An engine that does not is left exactly as vLLM built
  it: no instance hook, no thread, no extra call.
- ``dispatch_cpu_unquantized_gemm`` (the CPU platform only; :mod:`.cpu_gemm`): for a layer of
  an engine that does not name the extension it calls vLLM's own unchanged.

Each is installed whole or not at all (every symbol is read before anything is replaced). One
left out is recorded in :data:`PLUGIN_REFUSALS` with one warning line naming the symbol and the
vLLM version; vLLM then runs unchanged, and an engine naming the extension refuses to follow
with that line as the reason (``/synced`` 503, ``deltasync_refused``, the workers' status).
"""

from __future__ import annotations

import functools
import importlib
import logging
from typing import Any

from vllm_deltasync.server.vllm.surface import vllm_version

logger = logging.getLogger(__name__)

EXTENSION_NAMES = ("DeltaSyncExtension",)

PLUGIN_REFUSALS: list[str] = []
"""Why a patch of this process's vLLM was left out by :func:`register_plugin` (one line each)."""

_PATCHES: tuple[tuple[str, str], ...] = (
    ("_patch_engine_core", "vllm.v1.engine.core.EngineCore.__init__, "
                           "EngineCoreProc.run_busy_loop, DPEngineCoreProc.run_busy_loop"),
    ("_patch_cpu_gemm", "vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm"),
)


def register_plugin() -> None:
    """Install :data:`_PATCHES` (see the module doc). Idempotent; never raises."""
    for name, symbols in _PATCHES:
        try:
            globals()[name]()
        except Exception as exc:  # noqa: BLE001 - never break vLLM: refuse visibly instead
            line = (f"vllm-deltasync cannot patch {symbols} of vLLM {vllm_version()}: "
                    f"{type(exc).__name__}: {exc}; vLLM runs unchanged, the deltasync "
                    "extension will not follow. Install a vLLM version this release "
                    "supports (docs/extension.md)")
            if line not in PLUGIN_REFUSALS:
                PLUGIN_REFUSALS.append(line)
            logger.warning("%s", line)


def _patch_engine_core() -> None:
    """``EngineCore.__init__`` (an engine core built in a process where the plugin is loaded
    already: the in-process one) and ``run_busy_loop`` of ``EngineCoreProc`` and
    ``DPEngineCoreProc`` (in a fresh engine-core process vLLM loads the plugins inside
    ``EngineCore.__init__``, too late for that instance). Each calls vLLM's own first or last,
    unchanged; the hook returns at once for an engine not naming the extension."""
    from vllm.v1.engine.core import DPEngineCoreProc, EngineCore, EngineCoreProc

    init = EngineCore.__init__
    loops = {cls: cls.__dict__["run_busy_loop"] for cls in (EngineCoreProc, DPEngineCoreProc)}
    if getattr(init, "_deltasync_patched", False):
        return
    from vllm_deltasync.server.vllm.engine import before_busy_loop, on_engine_core

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        _guarded(on_engine_core, self)

    def busy_loop(run_busy_loop: Any) -> Any:
        @functools.wraps(run_busy_loop)
        def patched(self: Any) -> Any:
            _guarded(before_busy_loop, self)
            return run_busy_loop(self)

        patched._deltasync_patched = True  # type: ignore[attr-defined]
        return patched

    __init__._deltasync_patched = True  # type: ignore[attr-defined]
    for cls, run_busy_loop in loops.items():
        cls.run_busy_loop = busy_loop(run_busy_loop)  # type: ignore[method-assign]
    EngineCore.__init__ = __init__  # type: ignore[method-assign]


def _guarded(hook: Any, engine: Any) -> None:
    try:
        hook(engine)
    except Exception:  # noqa: BLE001 - the engine serves its checkpoint
        logger.exception("deltasync could not hook this engine core; it serves the loaded "
                         "weights and does not follow")


def _patch_cpu_gemm() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm_deltasync.server.vllm import cpu_gemm

    cpu_gemm.patch()


def extension_configured(vllm_config: Any) -> bool:
    """True when ``--worker-extension-cls`` names DeltaSyncExtension or a subclass of it."""
    qualname = getattr(getattr(vllm_config, "parallel_config", None), "worker_extension_cls", "")
    if not qualname:
        return False
    module, _, attr = qualname.rpartition(".")
    if module.split(".")[0] == "vllm_deltasync":
        return attr in EXTENSION_NAMES or _is_subclass(module, attr)
    return _is_subclass(module, attr)


def _is_subclass(module: str, attr: str) -> bool:
    from vllm_deltasync.server.extension import DeltaSyncExtension

    try:
        obj = getattr(importlib.import_module(module), attr)
    except Exception:  # noqa: BLE001 - a bad name is vLLM's error to report
        return False
    return isinstance(obj, type) and issubclass(obj, DeltaSyncExtension)


__all__ = ["PLUGIN_REFUSALS", "extension_configured", "register_plugin"]
