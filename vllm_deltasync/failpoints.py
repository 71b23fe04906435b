"""Every test-only failpoint of the package, in one place (issue 24, item 6).

Each is an environment variable read by the module named; none is a setting, none is read
unless set, and none may be set in production. Tests set them in the environment of the
process they start (engines, workers, trainers) to make one thing fail at one place, so the
failure paths run in real components rather than in mocks.
"""

from __future__ import annotations

FAIL_SWITCH_ENV = "DELTASYNC_TEST_FAIL_SWITCH"
"""``"<step>:<ticks>"`` (``server/engine/coordinator.py``): the switch to ``step`` raises after
every rank applied it and before the prefix-cache reset (once per process), then the next
``ticks`` ticks raise at their start (a fault that persists)."""

FAIL_APPLY_RPC_ENV = "DELTASYNC_TEST_FAIL_APPLY_RPC"
"""``"<rank>:<step>[:dirty]"``, several separated by commas, each firing once per process
(``server/extension.py``): that rank's ``deltasync_apply`` of that step raises out of the RPC
before writing anything, so the engine core's apply broadcast itself raises while the other
ranks wrote the step. ``dirty``: the rank also behaves as if it had failed mid-write without
putting back (its ``deltasync_revert`` then resets and answers False, so the engine holds). It
raises an ``Exception``: vLLM's worker turns that into a failed RPC, while any other
``BaseException`` ends the worker process. Use the last rank: vLLM's multiprocessing executor
stops reading answers at the first failed rank."""

SWITCH_EVERY_STEPS_ENV = "DELTASYNC_TEST_SWITCH_EVERY_STEPS"
"""``"<n>"`` (``server/engine/coordinator.py``): switches start only from a tick the engine runs
after every ``n`` model steps, never from the timer (which keeps reading status and finishing
drains), so a test knows a switch lands inside the batch it is generating. The engine calls
``Coordinator.after_model_step`` only through the test hook that wraps its step
(tests/engine/engine_hooks.py, run by :data:`ENGINE_HOOK_ENV`)."""

ENGINE_HOOK_ENV = "DELTASYNC_TEST_ENGINE_HOOK"
"""``"module:function"`` (``server/vllm/engine.py``): called as ``function(engine_core,
coordinator)`` once the coordinator of an engine core started, so that a test-only patch of
vLLM lives in the tests."""

FAIL_APPLY_ENV = "DELTASYNC_TEST_FAIL_APPLY"
"""``"<rank>:<step>:<pieces>"`` (``server/worker/rank.py``): that rank's apply of that step raises
after writing ``pieces`` pieces, once per process (a failed switch must be taken back on every
rank)."""

NO_LAYOUTS_ENV = "DELTASYNC_TEST_NO_LAYOUTS"
"""``1`` (``server/worker/rank.py``): skip learning runtime layouts, forcing the checkpoint
layout onto parameters a kernel rearranged (the startup proof must then refuse)."""

SURFACE_BREAK_ENV = "DELTASYNC_TEST_SURFACE_BREAK"
"""Comma-separated names of ``server/vllm/surface.py``'s ``SURFACE`` entries (``*``: the first)
that its check reports missing, to see the refusal path without a broken vLLM."""

FAIL_SHARD_ENV = "DELTASYNC_TEST_FAIL_SHARD"
"""``"<rank>:<step>"`` (``trainer/sharded.py``): that rank's upload of that step raises after its
data files are written and before its part record (a rank failing mid-step, staying alive)."""

__all__ = ["ENGINE_HOOK_ENV", "FAIL_APPLY_ENV", "FAIL_APPLY_RPC_ENV", "FAIL_SHARD_ENV",
           "FAIL_SWITCH_ENV", "NO_LAYOUTS_ENV", "SURFACE_BREAK_ENV", "SWITCH_EVERY_STEPS_ENV"]
