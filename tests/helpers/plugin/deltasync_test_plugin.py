"""A test-only vLLM general plugin (tests/helpers/engine_hooks.py puts this folder on the
engine's ``PYTHONPATH``; it is never installed, and the package knows nothing of it).

It makes the engine core call its deltasync coordinator's ``after_model_step`` after every
model step, so that with the failpoint ``switch_every_steps=<n>`` a test knows a switch lands
inside the batch it is generating.
"""

from __future__ import annotations

import functools
from typing import Any


def register() -> None:
    from vllm.v1.engine.core import EngineCoreProc

    step = EngineCoreProc._process_engine_step
    if getattr(step, "_deltasync_test", False):
        return

    @functools.wraps(step)
    def process_engine_step(self: Any) -> bool:
        executed = step(self)
        coord = self.__dict__.get("_deltasync_coord")
        if executed and coord is not None:
            coord.after_model_step()
        return bool(executed)

    process_engine_step._deltasync_test = True  # type: ignore[attr-defined]
    EngineCoreProc._process_engine_step = process_engine_step  # type: ignore[method-assign]
