"""What the plugin left out in this process, and whether an engine names the extension.

Shared by the plugin (``plugin.py``), the engine-core hooks (``engine.py``), the CPU dispatch
(``cpu_gemm.py``), the endpoint plugin (``http.py``) and the worker extension, so that none of
them imports another for it.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

EXTENSION_NAMES = ("DeltaSyncExtension",)
EXTENSION_MODULE = "vllm_deltasync.server.extension"

PLUGIN_REFUSALS: list[str] = []
"""Why a patch of this process's vLLM was left out by ``register_plugin`` (one line each)."""

PLUGIN_NAME = "deltasync"
"""Our entry point's name in ``vllm.general_plugins`` (what ``VLLM_PLUGINS`` must name)."""


def extension_configured(vllm_config: Any) -> bool:
    """True when ``--worker-extension-cls`` names DeltaSyncExtension or a subclass of it."""
    return extension_named(
        getattr(getattr(vllm_config, "parallel_config", None), "worker_extension_cls", "") or "")


def extension_named(qualname: str) -> bool:
    """True when ``qualname`` (``--worker-extension-cls``) names DeltaSyncExtension or a
    subclass of it (found by name in its method resolution order: nothing of ours is
    imported)."""
    if not qualname:
        return False
    module, _, attr = qualname.rpartition(".")
    if module.split(".")[0] == "vllm_deltasync" and attr in EXTENSION_NAMES:
        return True
    try:
        obj = getattr(importlib.import_module(module), attr)
    except Exception:  # noqa: BLE001 - a bad name is vLLM's error to report
        return False
    return isinstance(obj, type) and any(
        c.__name__ in EXTENSION_NAMES and c.__module__ == EXTENSION_MODULE for c in obj.__mro__)


def allowlist_excludes(environ: Mapping[str, str]) -> str | None:
    """The ``VLLM_PLUGINS`` allowlist when it is set and does not name :data:`PLUGIN_NAME`
    (vLLM then never runs this plugin: nothing follows), else None."""
    raw = environ.get("VLLM_PLUGINS")
    if raw is None:
        return None
    names = [n.strip() for n in raw.split(",")]
    return None if PLUGIN_NAME in names else raw


__all__ = ["EXTENSION_MODULE", "EXTENSION_NAMES", "PLUGIN_NAME", "PLUGIN_REFUSALS",
           "allowlist_excludes", "extension_configured", "extension_named"]
