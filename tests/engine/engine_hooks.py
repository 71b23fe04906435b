"""The engine tests' test-only vLLM plugin (``plugin/``), so that no test-only patch of vLLM
lives in the package.

``switch_every_steps_env(n)``: the coordinator's switches start only from a tick the engine
runs after every ``n`` model steps (the failpoint ``switch_every_steps``), so a test knows a
switch lands inside the batch it is generating; the plugin in ``plugin/`` (on the engine's
``PYTHONPATH``) calls the coordinator after each model step.
"""

from __future__ import annotations

import os
from pathlib import Path

from vllm_deltasync import failpoints

REPO = Path(__file__).resolve().parents[2]
PLUGIN_DIR = Path(__file__).resolve().parent / "plugin"


def switch_every_steps_env(every: int) -> dict[str, str]:
    """The environment that makes an engine switch only every ``every`` model steps."""
    path = os.pathsep.join(p for p in (str(PLUGIN_DIR), str(REPO), os.environ.get("PYTHONPATH", ""))
                           if p)
    return {**failpoints.env(failpoints.spec("switch_every_steps", every)), "PYTHONPATH": path}
