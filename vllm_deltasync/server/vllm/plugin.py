"""The ``vllm.general_plugins`` entry point: what vllm-deltasync installs in a vLLM process.

vLLM runs general plugins in *every* process it starts (API server, engine core, workers),
before anything is built and without a ``try``: an exception here would stop every vLLM process
of the environment, engines that never use deltasync included. So :func:`register_plugin`
never raises, and installs as little as it can:

- ``EngineCore.__init__`` and ``EngineCoreProc._process_input_queue`` (every platform; the
  latter is the first thing both busy loops, ``EngineCoreProc``'s and ``DPEngineCoreProc``'s,
  do in each iteration): call vLLM's own, and hand the engine core to
  :func:`.engine.on_engine_core` (or, once, :func:`.engine.before_busy_loop`), which returns at
  once unless its config names the extension (``--worker-extension-cls``). An engine that does
  not is left exactly as vLLM built it: no instance hook, no thread, no extra call.
- ``dispatch_cpu_unquantized_gemm`` (the CPU platform only; :mod:`.cpu_gemm`): for a layer of
  an engine that does not name the extension it calls vLLM's own unchanged.
- ``vllm.plugins.load_endpoint_plugins`` (used by the API server): vLLM's own list, plus our
  endpoint plugin (:mod:`.http`, the weight version of every HTTP response), which attaches
  nothing unless the server's ``--worker-extension-cls`` names the extension. Left out (one
  warning line, no refusal), responses carry no version; the weights follow as usual.

Not a patch, and equally never raising: weight-transfer backend ``deltasync`` is registered in
vLLM's ``WeightTransferEngineFactory`` and ``WeightTransferTrainerFactory`` by module path
(:func:`_register_weight_transfer`; loaded by vLLM only when an engine or a trainer picks it;
a registry already holding ``deltasync`` is left alone).

With ``WorkerProc._execute_worker_rpc`` (installed by a worker of an engine naming the
extension, ``worker.py``) these are the five class- or module-level patches of the package
(:data:`PATCHES`; tests/server/vllm/test_plugin_guard.py counts them).

``VLLM_PLUGINS``: vLLM runs this entry point only when that allowlist is unset or names
``deltasync``; the endpoint plugin is handed to vLLM's loader under the same condition. A
worker extension whose plugin an allowlist kept out says so in one log line
(:func:`allowlist_excludes`) and follows nothing.

Each patch is installed whole or not at all (every symbol is read before anything is replaced). One
left out is recorded in :data:`PLUGIN_REFUSALS` with one warning line naming the symbol and the
vLLM version; vLLM then runs unchanged, and an engine naming the extension refuses to follow
with that line as the reason (``/synced`` 503, ``deltasync_refused``, the workers' status).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from vllm_deltasync.server.vllm.guard import PLUGIN_REFUSALS
from vllm_deltasync.server.vllm.surface import vllm_version

logger = logging.getLogger(__name__)


_PATCHES: tuple[tuple[str, str], ...] = (
    ("_patch_engine_core", "vllm.v1.engine.core.EngineCore.__init__, "
                           "EngineCoreProc._process_input_queue"),
    ("_patch_cpu_gemm", "vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm"),
)

PATCHES: tuple[str, ...] = (
    "vllm.v1.engine.core:EngineCore.__init__",
    "vllm.v1.engine.core:EngineCoreProc._process_input_queue",
    "vllm.model_executor.layers.utils:dispatch_cpu_unquantized_gemm",
    "vllm.plugins:load_endpoint_plugins",
    "vllm.v1.executor.multiproc_executor:WorkerProc._execute_worker_rpc",
)
"""Every class- or module-level replacement the package makes in vLLM (at most five); each is
a ``patched`` row of :data:`.surface.SURFACE`."""


def register_plugin() -> None:
    """Install :data:`_PATCHES` and register the weight-transfer backend (see the module
    doc). Idempotent; never raises."""
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
    _register_weight_transfer()
    try:
        _hand_endpoint_plugin()
    except Exception as exc:  # noqa: BLE001 - never break vLLM; only the HTTP headers are off
        logger.warning("vllm-deltasync cannot wrap vllm.plugins.load_endpoint_plugins of vLLM "
                       "%s: %s: %s; responses carry no X-Weight-Version (the weights follow "
                       "as usual)", vllm_version(), type(exc).__name__, exc)


WEIGHT_TRANSFER_BACKEND = "deltasync"

_WEIGHT_TRANSFER: tuple[tuple[str, str, str], ...] = (
    ("WeightTransferEngineFactory", "vllm_deltasync.server.vllm.weight_transfer",
     "DeltaSyncWeightTransferEngine"),
    ("WeightTransferTrainerFactory", "vllm_deltasync.trainer.weight_transfer",
     "DeltaSyncTrainerWeightTransferEngine"),
)
"""vLLM's weight-transfer registries and what backend ``deltasync`` names in each (module and
class, loaded lazily by vLLM's own loader: only when an engine or a trainer picks the backend)."""


def _register_weight_transfer() -> None:
    """Register backend ``deltasync`` in both weight-transfer factories (receiver and trainer
    side), by module path, so nothing is imported until someone picks it. Not a patch: one
    registry left out (symbol missing, ``deltasync`` taken by another package) is one warning
    line and the backend is missing there; the extension's following is unaffected. A
    registry that holds ``deltasync`` already is left as it is. Never raises."""
    try:
        from vllm.distributed.weight_transfer import factory
    except Exception as exc:  # noqa: BLE001 - an older vLLM without the weight-transfer API
        logger.warning("vllm-deltasync cannot register weight-transfer backend %r in vLLM %s: "
                       "%s: %s", WEIGHT_TRANSFER_BACKEND, vllm_version(), type(exc).__name__, exc)
        return
    for registry, module, cls in _WEIGHT_TRANSFER:
        try:
            getattr(factory, registry).register_engine(WEIGHT_TRANSFER_BACKEND, module, cls)
        except ValueError as exc:
            if "already registered" not in str(exc):
                logger.warning("vllm-deltasync cannot register weight-transfer backend %r in "
                               "%s: %s", WEIGHT_TRANSFER_BACKEND, registry, exc)
        except Exception as exc:  # noqa: BLE001 - never break vLLM
            logger.warning("vllm-deltasync cannot register weight-transfer backend %r in %s of "
                           "vLLM %s: %s: %s", WEIGHT_TRANSFER_BACKEND, registry, vllm_version(),
                           type(exc).__name__, exc)


def _patch_engine_core() -> None:
    """``EngineCore.__init__`` (an engine core built in a process where the plugin is loaded
    already: the in-process one) and ``EngineCoreProc._process_input_queue``, the first call of
    each iteration of both busy loops (in a fresh engine-core process vLLM loads the plugins
    inside ``EngineCore.__init__``, too late for that instance's own ``__init__`` patch): its
    first call on an instance hands it to :func:`.engine.before_busy_loop`, later calls cost one
    attribute read. Each calls vLLM's own, unchanged; the hook returns at once for an engine not
    naming the extension."""
    from vllm.v1.engine.core import EngineCore, EngineCoreProc

    init = EngineCore.__init__
    process = EngineCoreProc.__dict__["_process_input_queue"]
    if getattr(init, "_deltasync_patched", False):
        return
    from vllm_deltasync.server.vllm.engine import before_busy_loop, on_engine_core

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        _guarded(on_engine_core, self)

    @functools.wraps(process)
    def _process_input_queue(self: Any) -> Any:
        if not self.__dict__.get("_deltasync_loop_seen", False):
            self._deltasync_loop_seen = True
            _guarded(before_busy_loop, self)
        return process(self)

    __init__._deltasync_patched = True  # type: ignore[attr-defined]
    _process_input_queue._deltasync_patched = True  # type: ignore[attr-defined]
    EngineCoreProc._process_input_queue = _process_input_queue  # type: ignore[method-assign]
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


def _hand_endpoint_plugin() -> None:
    """``vllm.plugins.load_endpoint_plugins`` (the API server): vLLM loads endpoint plugins only
    when ``VLLM_PLUGINS`` names them; hand it ours (:class:`.http.DeltaSyncEndpoints`), which
    attaches nothing unless the server's arguments name the extension. Not a refusal when left
    out: the weights are unaffected, responses then carry no version (one warning line)."""
    import vllm.plugins as plugins

    load = plugins.load_endpoint_plugins
    if getattr(load, "_deltasync_patched", False):
        return

    @functools.wraps(load)
    def load_endpoint_plugins(supported_tasks: Any = None) -> Any:
        found: list[Any] = list(load(supported_tasks))
        try:
            from vllm_deltasync.server.vllm.http import DeltaSyncEndpoints

            if (supported_tasks is not None and "generate" in supported_tasks
                    and not any(getattr(p, "name", None) == DeltaSyncEndpoints.name
                                for p in found)):
                found = [*found, DeltaSyncEndpoints()]
        except Exception:  # noqa: BLE001 - vLLM's own list, unchanged
            logger.exception("deltasync: the HTTP version headers are off")
        return found

    load_endpoint_plugins._deltasync_patched = True  # type: ignore[attr-defined]
    plugins.load_endpoint_plugins = load_endpoint_plugins


__all__ = ["PATCHES", "register_plugin"]
