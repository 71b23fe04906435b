"""Test-only hooks run inside the engine core (``DELTASYNC_TEST_ENGINE_HOOK``), so that no
test-only patch of vLLM lives in the package.

``switch_every_steps``: the coordinator's switches start only from a tick the engine runs after
every ``n`` model steps (``SWITCH_EVERY_STEPS_ENV``), so a test knows a switch lands inside the
batch it is generating. It wraps ``_process_engine_step`` on the one engine core instance.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from vllm_deltasync.server.engine.coordinator import SWITCH_EVERY_STEPS_ENV
from vllm_deltasync.server.vllm.engine import ENGINE_HOOK_ENV

REPO = Path(__file__).resolve().parents[2]


def switch_every_steps_env(every: int) -> dict[str, str]:
    """The environment that makes an engine switch only every ``every`` model steps."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {SWITCH_EVERY_STEPS_ENV: str(every), "PYTHONPATH": path,
            ENGINE_HOOK_ENV: f"{__name__}:switch_every_steps"}


def switch_every_steps(engine: Any, coordinator: Any) -> None:
    step = engine._process_engine_step

    def process_engine_step() -> bool:
        executed = step()
        if executed:
            coordinator.after_model_step()
        return bool(executed)

    engine._process_engine_step = process_engine_step
