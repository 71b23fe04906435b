"""The engine tests' test-only vLLM plugin (``plugin/``), so that no test-only patch of vLLM
lives in the package.

``switch_every_steps_env(n)``: the coordinator's switches start only from a tick the engine
runs after every ``n`` model steps (the failpoint ``switch_every_steps``), so a test knows a
switch lands inside the batch it is generating; the plugin in ``plugin/`` (on the engine's
``PYTHONPATH``) calls the coordinator after each model step.

vLLM loads general plugins once per process, and an engine core forked from the test process
(``LLM(...)``) inherits that state rather than loading them again: the plugin is therefore
also registered here, in the test process (its patch is inert unless the failpoint is armed);
an engine in a fresh process (``vllm serve``, a spawned engine core) finds it through
``PYTHONPATH``.
"""

from __future__ import annotations

import os
from pathlib import Path

from vllm_deltasync import failpoints

REPO = Path(__file__).resolve().parents[2]
PLUGIN_DIR = Path(__file__).resolve().parent / "plugin"


def switch_every_steps_env(every: int) -> dict[str, str]:
    """The environment that makes an engine switch only every ``every`` model steps."""
    _register_here()
    path = os.pathsep.join(p for p in (str(PLUGIN_DIR), str(REPO), os.environ.get("PYTHONPATH", ""))
                           if p)
    return {**failpoints.env(failpoints.spec("switch_every_steps", every)), "PYTHONPATH": path}


def _register_here() -> None:
    import sys

    if str(PLUGIN_DIR) not in sys.path:
        sys.path.insert(0, str(PLUGIN_DIR))
    import deltasync_test_plugin

    deltasync_test_plugin.register()
