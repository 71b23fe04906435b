"""Test-only failpoints: one variable, one format, one function.

``DELTASYNC_FAILPOINTS`` holds ``name=arg/arg/...`` entries separated by ``;``. Tests set it in
the environment of the processes they start (engines, workers, trainers) so that one thing
fails at one place and the failure paths run in real components rather than in mocks. Nothing
reads it unless set; it is never a setting and is never set in production. No failpoint makes
the package import or run code it names.

Every failpoint the package knows, its arguments, and where it fires:

``switch=<step>/<ticks>`` (engine core): the policy's switch to ``step`` raises after every
rank applied it and before the engine core's part (requests' KV, weight version) (once per process), then the next ``ticks``
ticks raise at their start (a fault that persists).

``apply_rpc=<model>/<rank>/<step>[/dirty]`` (worker): that rank's ``deltasync_apply`` of that
step of target ``model`` raises out of the RPC before writing anything, so the engine core's
apply broadcast itself raises while the other ranks wrote. ``dirty``: as if it had failed
mid-write without putting back (its revert answers ``unknown``). Use the last rank: vLLM's
multiprocessing executor stops reading answers at the first failed rank.

``apply=<model>/<rank>/<step>/<pieces>`` (worker): that rank's apply of that step raises after
writing ``pieces`` pieces (it puts them back).

``commit=<model>/<rank>/<step>`` (worker): that rank's commit of that step raises (answered
``failed``; the switch stays pending there and is committed again at the next ticks).

``switch_every_steps=<n>`` (engine core): the policy's switches start only from a tick run
after every ``n`` model steps (tests/engine's test plugin calls it), never from the timer.

``no_layouts=1`` (worker): skip learning runtime layouts (the startup proof must refuse).

``surface_break=<symbol>[/<symbol>...]`` (any process): those rows of the vLLM surface are
reported missing (``*``: the first row), to see the refusal path without a broken vLLM.

``shard=<rank>/<step>`` (sharded trainer): that rank's upload of that step raises after its
data files are written and before its part record.

Each entry fires at most once per process unless its description says otherwise (:func:`once`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping

VARIABLE = "DELTASYNC_FAILPOINTS"

NAMES = frozenset({"switch", "apply_rpc", "apply", "commit", "switch_every_steps",
                   "no_layouts", "surface_break", "shard"})

_fired: set[tuple[str, tuple[str, ...]]] = set()
_lock = threading.Lock()


def armed(name: str, environ: Mapping[str, str] | None = None) -> list[tuple[str, ...]]:
    """The arguments of every ``name=...`` entry of :data:`VARIABLE` (none: ``[]``)."""
    if name not in NAMES:
        raise ValueError(f"failpoint {name!r} is not one of {sorted(NAMES)}")
    text = (os.environ if environ is None else environ).get(VARIABLE, "")
    out = []
    for entry in text.split(";"):
        key, sep, value = entry.strip().partition("=")
        if sep and key.strip() == name:
            out.append(tuple(a.strip() for a in value.split("/")))
    return out


def once(name: str, args: tuple[str, ...]) -> bool:
    """True the first time an entry fires in this process, False after."""
    with _lock:
        if (name, args) in _fired:
            return False
        _fired.add((name, args))
        return True


def spec(name: str, *args: object) -> str:
    """One entry, for tests building the variable: ``spec("apply", "policy", 1, 3, 2)``."""
    return f"{name}=" + "/".join(str(a) for a in args)


def env(*entries: str) -> dict[str, str]:
    """The environment setting these entries (``{VARIABLE: "a=...;b=..."}``)."""
    return {VARIABLE: ";".join(entries)}


__all__ = ["NAMES", "VARIABLE", "armed", "env", "once", "spec"]
